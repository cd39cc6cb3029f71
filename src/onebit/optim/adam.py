"""1-bit Adam (Tang et al., ICML 2021; SPEC section 3)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from ..freeze import AutoFreeze, FreezeSchedule, told_auto_freeze
from ..functional import adam_denominator, adam_moments_, bias_correction, fill_zero_variance_
from ..transport.engine import Sender
from ..wire.momentum import PacksMomentum
from .adam_step import MOMENTS, AdamShaped, AdamWarmup, check_adam_hyperparameters
from .base import CompressedOptimizer
from .checkpoint import NoState, StatePart
from .options import (
    DEFAULT_BUCKET_SIZE,
    DEFAULT_WARMUP_COMPRESSION,
    apply_masks_,
    shared_options,
    with_shared_docs,
)
from .stage import Stage, Taken


class _Warmup(Stage):
    """AdamW on gradients averaged at full precision (an fp32 or quantized allreduce). Its
    last step, ``freeze_step``, freezes the variance: it keeps ``sqrt(v̂) + eps`` in its place
    for the compression stage."""

    name = "warmup"
    shows = MOMENTS

    def enter(self) -> None:
        opt = self.optimizer
        opt.bucketer.grads_as_views = not opt.overlap_backward

    def sends(self) -> Sender:
        engine = self.optimizer.engine
        return engine.sender(engine.full_precision)

    def step(self, t: int) -> Taken:
        opt, hyper = self.optimizer, self.optimizer.hyper
        m, v = opt.exp_avg[: opt.layout.numel], opt.exp_avg_sq
        fused = opt._adam.fused_applies(t, hyper)
        applied, nbytes = opt.engine.average_gradients()
        if applied and fused:
            opt._adam.fused_step_(opt.engine.grads, m, v, t, hyper)
        elif applied:
            adam_moments_(m, v, opt.engine.grads, hyper.beta1, hyper.beta2)
            opt._adam.step_from_moments_(m, v, t, hyper)
        if applied and t == opt.freeze_step:
            self._freeze_variance_(t)
        return Taken(applied, nbytes)

    def _freeze_variance_(self, t: int) -> None:
        """At the end of the last warmup step: fill the zero variances, then keep
        ``sqrt(v̂) + eps`` in place of ``v`` for the compression stage."""
        opt = self.optimizer
        v = opt.exp_avg_sq
        fill_zero_variance_(opt.layout.views(v), opt.hyper.zero_variance_floor(t))
        opt.hyper.denominator(v, t, out=v)
        opt.set_frozen(True)
        opt.engine.end_warmup()
        opt.bucketer.release()  # the .grad views keep it; the fused stage needs no other


class _Compression(Stage):
    """The 1-bit steps: each rank's momentum ``lerp(m, g, 1 - β1)`` goes through the compressed
    allreduce, and AdamW's update takes it over the frozen denominator. Where the packed
    momentum applies (:class:`~onebit.wire.momentum.PackedMomentumStage`) its fused passes
    read ``.grad`` and keep the momentum 1 bit an element."""

    name = "compression"
    frozen = True
    shows = {"exp_avg": "exp_avg", "frozen_denom": "exp_avg_sq"}

    def enter(self) -> None:
        self.optimizer.bucketer.grads_as_views = False

    def sends(self) -> Sender:
        """The packed momentum's fused passes where they run (checked again at its first
        bucket), else the 1-bit sender of the gathered gradients, through :meth:`prepare`."""
        engine, packed = self.optimizer.engine, self.optimizer.packed_momentum
        unpacked = engine.sender(engine.comms, prepare=self.prepare, clip_norms=True)
        return unpacked if packed is None else engine.packed_sender(packed, unpacked)

    def prepare(self, k: int, grads: Tensor) -> None:
        """A compressed step sends the local momentum ``lerp(m, g, 1 - β1)``, written over
        bucket ``k``'s gathered gradients ``grads``."""
        opt = self.optimizer
        opt.check_packed()  # the packed sender's fallback: unpack first
        start, end = opt.layout.buckets[k]
        torch.lerp(opt.exp_avg[start:end], grads, 1 - opt.hyper.beta1, out=grads)

    def step(self, t: int) -> Taken:
        opt = self.optimizer
        if not opt.overlap_backward:
            opt.engine.clip_own_gradient()
        if opt.check_packed() is not None:
            return self._packed_step(t)
        m, hyper = opt.exp_avg[: opt.layout.numel], opt.hyper
        g = opt.engine.grads
        clip_result = opt.bucketer.clip  # sent during backward: SPEC 6
        if opt.engine.at_once():
            applied, nbytes = self._momentum_at_once(m, g)
            if applied:
                m.copy_(g)
        else:
            out = g if clip_result else m
            applied, nbytes = opt.engine.communicate(
                opt.engine.comms, out, prepare=self.prepare, clip_norms=True
            )
        if applied and clip_result:  # m = β1·m + c·(compressed - β1·m)
            m.mul_(hyper.beta1).lerp_(g, opt.clipping.of_mean())
        if applied:
            apply_masks_(m, opt.masks)
            opt._adam.adamw_update_(m, opt.exp_avg_sq, t, hyper)
        return Taken(applied, nbytes)

    def _momentum_at_once(self, m: Tensor, g: Tensor) -> tuple[bool, int]:
        """The compressed allreduce of the local momentum ``lerp(m, g, 1 - β1)``, every bucket
        at once, in place over the gradient buffer ``g`` (the bucketer's ``prepare`` and
        ``_communicate``, bit for bit, in a number of kernels that does not grow with the
        buckets). Without the packed momentum: ``exp_avg_mask`` or one scale per bucket."""
        engine = self.optimizer.engine
        engine.gather_grads()
        torch.lerp(m, g, 1 - self.optimizer.hyper.beta1, out=g)
        return engine.compressed_allreduce()

    def _packed_step(self, t: int) -> Taken:
        """A compression step by the fused passes of :class:`~onebit.wire.momentum.
        PackedMomentumStage`: the gradients are read from ``.grad``, the momentum stays packed,
        and AdamW's update reads it packed."""
        opt = self.optimizer
        packed = opt.packed_momentum
        sender = self.sends() if opt.overlap_backward else None
        applied, nbytes, calls = opt.engine.packed_allreduce(packed, sender=sender)
        if not applied:
            return Taken(applied, nbytes)
        if calls is not None:
            packed.finish(calls)
        opt.flat.expose("exp_avg", None)  # packed now: see state_dict()
        groups = [(g["lr"], g["weight_decay"]) for g in opt.param_groups for _ in g["params"]]
        lrs, decays = zip(*groups)
        step_scale = 1 / opt.hyper.bc1(t)
        packed.update_(opt.exp_avg_sq, [float(lr) for lr in lrs], decays, step_scale)
        torch.autograd.graph.increment_version(opt.layout.params)  # written through C
        return Taken(applied, nbytes)


@with_shared_docs
class OnebitAdam(AdamShaped, PacksMomentum, CompressedOptimizer):
    """AdamW whose gradient communication drops to 1 bit per element after a warmup.

    A drop-in replacement for ``torch.optim.AdamW`` plus ``DistributedDataParallel``: do not
    wrap the model in DDP, this optimizer owns all communication. At construction it broadcasts
    the parameters from rank 0. For the first ``freeze_step`` steps it is AdamW on gradients
    averaged at full precision: by default in int4 with error feedback, 7.8x fewer bytes than
    DDP's fp32 allreduce (with ``warmup_compression="fp32"``, exactly AdamW + DDP). Then Adam's
    variance is frozen and each step sends only the momentum, through an error-compensated 1-bit
    compressed allreduce (about 32x fewer bytes than an fp32 allreduce).
    :meth:`from_optimizer` builds it from a torch ``AdamW``'s param groups.

    Args:
        params: parameters or param groups. ``lr`` and ``weight_decay`` may differ per group;
            ``betas`` and ``eps`` are read from the groups at every step (so schedulers that
            change them work) and must be the same in every group. ``beta2`` and ``eps`` act
            until the freeze only: the denominator is computed once, then.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        freeze_step: warmup length T, or ``"auto"`` (default): freeze once the variance is
            stable, by a fifth of ``total_steps`` at the latest, or without it once the
            learning rate has fallen 5% below its peak (:class:`~onebit.freeze.AutoFreeze`
            says how); the step it chose is then ``freeze_step`` and ``comm_stats.freeze_step``.
            A fixed T goes where Adam's variance has stopped moving; the paper uses 15-25% of
            training. Longer is safer and sends more bytes.
        total_steps: the run's length in optimizer steps, if known: it caps ``"auto"``'s
            warmup at a fifth of it (``AutoFreeze(total_steps=...)``).
        bias_correction: Adam's bias correction (the reference implementation had none).
        {process_group}
        {bucket_size}
        {scale_per}
        exp_avg_mask: optional ``{parameter: mask}`` of 0/1 tensors shaped like the parameter.
            1-bit compression cannot send exact zeros; the mask keeps known-zero momentum entries
            (unused embedding rows, say) at zero in the compression stage. Masks other than
            0s and 1s raise ``ValueError``; they are kept as bytes, and the packed momentum
            below applies with them (the passes read each entry's mask).
        max_grad_norm: clip gradients to this global norm (``None``: no clipping). Use it
            instead of ``torch.nn.utils.clip_grad_norm_``, which would clip each rank's local
            gradient. In warmup it clips the averaged gradient exactly as DDP +
            ``clip_grad_norm_`` + AdamW; in the compression stage, where the average is never
            formed, each rank clips its own gradient before it is sent (with
            ``overlap_backward``: the result, by the mean of the ranks' norms; see
            ``docs/SPEC.md``).
        auto_freeze: knobs of ``freeze_step="auto"``.
        overlap_backward: start each bucket's communication during ``backward()``, as soon as
            its gradients are final, as DDP does. Results are bitwise the same as without it,
            but for ``max_grad_norm`` in the compression stage (see above), where the momentum
            is then kept in fp32; without clipping, backward's hooks start each bucket's fused
            pass from ``.grad`` and the momentum stays packed.
            It needs the same parameters to receive gradients in the same order on every rank;
            with gradient accumulation, run every backward but the last inside
            :meth:`no_sync`. It cannot honour a ``GradScaler`` or an edit of ``.grad`` after
            backward (clipping, say): both raise a clear error.
        warmup_compression: how the warmup averages gradients. ``"fp32"`` is an fp32
            allreduce, exactly AdamW + DDP (DeepSpeed's warmup). ``"bf16"``, ``"int8"`` and
            ``"int4"`` (default) send 2, 4 and 8 times fewer bytes through the same two-phase
            exchange as the 1-bit stage, with block-wise scales (256 elements, never straddling
            tensors) and error feedback of their own, zeroed at the freeze
            (:class:`~onebit.wire.quantized.QuantizedAllreduce`).
            Every rank still gets the same averaged gradient, bit for bit.
        error_dtype: what the compression stage keeps its error-feedback buffers (the worker's
            and the server's) in: ``torch.float32`` (default) or ``torch.bfloat16``, half their
            memory. The kernels still compute in fp32 and round each error they write to bf16.
            With the packed momentum the state is then ``1.5 + 0.5/n + 1/32`` model sizes, below
            AdamW's 2 (``2 + 1/n + 1/32`` in fp32). Measured (``BENCHMARKS.md``): final
            validation losses within -0.45..+0.09% of fp32 errors' over 3 seeds of three
            600-step tasks (none worse by more than 0.09%); the step takes as long as with
            fp32 errors (the C kernels and Triton's passes read and write bf16 in place), and
            the first compression step holds the fp32 momentum beside the new errors once. A
            checkpoint loads across the two dtypes, with a warning.
        {allow_edited_grads}

    A parameter whose ``.grad`` is ``None`` counts as a zero gradient: its momentum decays and
    weight decay applies, the same on every rank. All state is fp32 whatever the parameter
    dtype (the error buffers: ``error_dtype``). If any rank has a non-finite gradient, every
    rank skips the step and changes nothing (``skipped_steps`` counts it; no extra collective
    is needed).

    Entries whose variance is (about) 0 at the freeze, ``sqrt(v̂) <= eps`` (no gradient reached
    them), take their tensor's mean variance, so that 1-bit momentum, never exactly 0, cannot
    make them step by ``lr/eps`` (:func:`~onebit.functional.fill_zero_variance_`).

    What ``optimizer.state[p]`` holds (views into flat fp32 buffers):

    * in the warmup, ``exp_avg`` and ``exp_avg_sq``, as AdamW. The gradients live in the
      optimizer's bucket buffer, as DDP's ``gradient_as_bucket_view``: backward accumulates
      each fp32 ``.grad`` into its view of the buffer, so they cost no memory beyond AdamW's
      own ``.grad`` and are sent with no copy (without ``overlap_backward``). After ``step()``
      ``.grad`` holds the averaged gradient, as under DDP. At the freeze the buffer is left to
      the ``.grad`` views, and the compression stage works on its own;
    * from the freeze, ``frozen_denom`` (``sqrt(v̂) + eps``, kept instead of ``v`` and computed
      once) and ``exp_avg``;
    * on the fused path (parameters all fp32, bf16 or fp16, contiguous or not
      (``channels_last``: the flat buffers follow each parameter's memory order), with the C
      kernels on the CPU or the Triton kernels on CUDA, a scale per tensor, not
      ``overlap_backward`` with ``max_grad_norm``),
      from the first applied compression step, only ``frozen_denom``: the momentum is kept packed, 1
      bit per element plus the scales, since each element is ``±σ`` of its piece, and the fp32
      buffer holds the worker error (:class:`~onebit.wire.momentum.PackedMomentumStage`). The state
      then takes ``2 + 1/n + 1/32`` model sizes at ``n`` ranks, against AdamW's 2.
      :meth:`state_dict` still gives an fp32 ``exp_avg``, unpacked when it is called, and resume is
      exact.

    ``comm_stats`` reports the bytes this rank sent. ``freeze`` is the
    :class:`~onebit.freeze.FreezeSchedule`; ``freeze_step``, ``in_warmup`` and ``stage`` say
    where the warmup stands.
    """

    _rehearsal_options = {"freeze_step": 1, "auto_freeze": None, "total_steps": None}
    _stage_types = (_Warmup, _Compression)

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        freeze_step: int | Literal["auto"] = "auto",
        total_steps: int | None = None,
        bias_correction: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        scale_per: str = "tensor",
        exp_avg_mask: Mapping[Tensor, Tensor] | None = None,
        auto_freeze: AutoFreeze | None = None,
        max_grad_norm: float | None = None,
        overlap_backward: bool = False,
        warmup_compression: str = DEFAULT_WARMUP_COMPRESSION,
        error_dtype: torch.dtype = torch.float32,
        allow_edited_grads: bool = False,
    ) -> None:
        def check() -> FreezeSchedule:
            check_adam_hyperparameters(lr, betas, eps, weight_decay, self.param_groups)
            auto = told_auto_freeze(freeze_step, auto_freeze, total_steps)
            return FreezeSchedule(freeze_step, auto, process_group, beta2=betas[1])

        self.bias_correction = bias_correction
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, check=check, **shared_options(locals()))

    def _allocate_state(self) -> None:
        self._adam = AdamWarmup.of(self)
        self.exp_avg = self.flat.zeros(padded=True)
        self.exp_avg_sq = self.flat.zeros()
        self.set_frozen(False)
        clips_result = self.overlap_backward and self.max_grad_norm is not None  # SPEC 6
        self._pack_momentum(self.exp_avg, clips_result=clips_result)

    def _stage_state(self) -> StatePart:
        return _FreezeState(self)


class _FreezeState(NoState):
    """1-bit Adam's part of a checkpoint: a state saved past its freeze loads only into an
    optimizer that froze by then, and one saved by onebit <= 0.1 past the freeze is frozen."""

    def __init__(self, optimizer: OnebitAdam) -> None:
        self.optimizer = optimizer

    def before_load(self, saved: dict[str, Any]) -> Callable[[], None]:
        freeze = self.optimizer.freeze
        fixed = freeze.freeze_step if freeze.monitor is None else None
        if saved.get("frozen") and fixed is not None and saved["num_steps"] < fixed:
            raise ValueError(
                f"the state was saved after its freeze, at step {saved['num_steps']}, but this "
                f"optimizer's freeze_step is {fixed}: its variance is gone, so the warmup "
                "cannot go on. Build the optimizer with the run's freeze_step"
            )
        return super().before_load(saved)

    def load_extra_state(self, state: dict[str, Any]) -> None:
        opt = self.optimizer
        t, v = opt.num_steps, opt.exp_avg_sq
        if not opt.frozen and opt.freeze_step is not None and t >= opt.freeze_step:
            (_, beta2), eps = opt.param_groups[0]["betas"], opt.param_groups[0]["eps"]
            bc2 = bias_correction(beta2, opt.freeze_step, opt.bias_correction)
            adam_denominator(v, bc2, eps, out=v)  # saved by onebit <= 0.1: v past the freeze
            opt.set_frozen(True)
