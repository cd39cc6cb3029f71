"""0/1 Adam (Lu et al., 2022; SPEC section 4): adaptive variance freezing and local steps."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import host
from ..freeze import FreezeSchedule
from ..functional import (
    adam_moments_,
    fill_zero_variance_,
    layer_norms,
    momentum_from_grads_,
)
from ..kernels.fused import gradient_addresses
from ..transport.header import STATUS
from ..wire.momentum import fused_parameters
from .adam_step import MOMENTS, AdamShaped, AdamWarmup, check_adam_hyperparameters
from .base import CompressedOptimizer, closes_step_on_error
from .checkpoint import NoState, StatePart
from .options import (
    DEFAULT_BUCKET_SIZE,
    DEFAULT_WARMUP_COMPRESSION,
    apply_masks_,
    check_step_count,
    shared_options,
    with_shared_docs,
)
from .stage import Stage, Taken
from .zero_one_schedule import PAPER_SCHEDULE, Schedule, run_freeze_step, run_schedule


class _PhaseA(Stage):
    """A phase-A step: the gradients averaged (by the subclass's :meth:`_average`), then AdamW's
    update from the momentum and the variance so far. Once 1-bit steps have made the momentum
    nonzero where the variance is 0, those entries take their tensor's mean variance."""

    shows = MOMENTS

    def step(self, t: int) -> Taken:
        opt = self.optimizer
        m, v, hyper = opt.exp_avg[: opt.layout.numel], opt.exp_avg_sq, opt.hyper
        applied, nbytes = self._average(m, v)
        if applied:
            if opt.var_interval > 1:  # compressed steps have made m nonzero where v is 0
                floor = hyper.zero_variance_floor(opt._var_updates)
                filled = opt.engine.grads
                fill_zero_variance_(opt.layout.views(v), floor, out=opt.layout.views(filled))
                v = filled
            denom = hyper.denominator(v, opt._var_updates, out=opt.engine.grads)
            opt._adam.adamw_update_(m, denom, t, hyper)
        return Taken(applied, nbytes)

    def _average(self, m: Tensor, v: Tensor) -> tuple[bool, int]:
        """Average the gradients and update the moments ``m`` and ``v`` with them; return
        (applied, bytes sent)."""
        raise NotImplementedError


class _Variance(_PhaseA):
    """Phase A's steps ``t`` with ``t % var_interval == 0``: an fp32 allreduce, and Adam's
    momentum and variance from it. ``var_interval`` doubles every ``var_update_scaler`` of
    them."""

    name = "variance"

    def _average(self, m: Tensor, v: Tensor) -> tuple[bool, int]:
        opt, hyper = self.optimizer, self.optimizer.hyper
        applied, nbytes = opt.engine.average_gradients()
        if applied:
            adam_moments_(m, v, opt.engine.grads, hyper.beta1, hyper.beta2)
            opt._var_updates += 1
            opt._var_counter += 1
            if opt._var_counter == opt.var_update_scaler:
                opt._var_counter = 0
                opt.var_interval *= 2
        return applied, nbytes


class _OnebitGradient(_PhaseA):
    """Phase A's other steps: the gradients through the 1-bit compressed allreduce (each
    rank's own clipped first), and only the momentum from them."""

    name = "compression"

    def _average(self, m: Tensor, v: Tensor) -> tuple[bool, int]:
        opt, hyper = self.optimizer, self.optimizer.hyper
        opt.engine.clip_own_gradient()
        g = opt.engine.gather_grads()
        applied, nbytes = opt.engine.compressed_allreduce()  # in place: g is now the estimate
        if applied:
            adam_moments_(m, None, g, hyper.beta1, hyper.beta2)
            apply_masks_(m, opt.masks)
        return applied, nbytes


class _Local(Stage):
    """Phase B's local steps: each rank steps with its own gradient and momentum over the
    frozen denominator and sends nothing (a rank whose gradient is not finite drops it). The
    first step of phase B freezes the denominator and remembers the parameters."""

    name = "local"
    frozen = True
    shows = {"exp_avg": "exp_avg", "frozen_denom": "exp_avg_sq", "sync_params": "sync_params"}

    def step(self, t: int) -> Taken:
        opt = self.optimizer
        if not opt.frozen:
            self._freeze()
        hyper = opt.hyper
        m, denom = opt.exp_avg[: opt.layout.numel], opt.exp_avg_sq
        grads = [p.grad for p in opt.layout.params]
        step = opt.engine.step
        if step.status:
            step.close()
            problem = STATUS[step.status] + step.detail()
            raise RuntimeError(f"{type(opt).__name__}.step(): {problem}")
        finite, scale = self._verdict(grads)
        passes = self.passes(grads)
        if finite and passes is None:
            momentum_from_grads_(opt.layout.views(m), grads, hyper.beta1, scale)
            apply_masks_(m, opt.masks)
            opt._adam.adamw_update_(m, denom, t, hyper)
        elif not finite:
            opt.local_skipped_steps += 1
        step_scale = 1 / hyper.bc1(t)
        local = (step_scale, scale) if finite and passes is not None else None
        for i, group in enumerate(opt.param_groups):
            opt._lrs[i] += group["lr"] * step_scale
            opt._decay[i] *= 1 - group["lr"] * group["weight_decay"]
        synced, nbytes = self.average(passes, local)
        opt._local_step_counter += 1
        if opt._local_step_counter == opt.local_step_scaler:
            opt._local_step_counter = 0
            opt.local_step_interval = min(opt.local_step_clipper, 2 * opt.local_step_interval)
        opt.skipped_steps += not synced
        return Taken(True, nbytes, round_skipped=self.name == "local")

    def passes(self, grads: list[Tensor | None]) -> Any | None:
        """The passes that take the step and its sync together (none for a local step)."""
        return None

    def average(
        self, passes: Any | None = None, local: tuple[float, float | None] | None = None
    ) -> tuple[bool, int]:
        """The step's communication: (whether it synced, bytes sent); a local step has none."""
        return True, 0

    def _verdict(self, grads: list[Tensor | None]) -> tuple[bool, float | None]:
        """Whether a local step's gradients are finite on every shard, and what multiplies
        this rank's gradient: the inverse loss scale, times the coefficient that clips the
        unscaled local gradient to ``max_grad_norm``. One read of the device."""
        opt = self.optimizer
        inv = opt.engine.step.inv_scale
        present = [g for g in grads if g is not None]
        largest = layer_norms(present, ord=math.inf).to(opt.device)  # each gradient's
        values = [largest]
        if torch.is_tensor(inv):  # a GradScaler's, left on the device
            values.append(inv.reshape(1))
        if opt.max_grad_norm is not None:
            values += opt.clipping.own(present, opt.shards, inv)
        read = host.read_all(values).tolist()
        # Each value is at most 3.4e38, so their sum (in fp64) is finite exactly when they are.
        finite = opt.shards.all_(math.isfinite(sum(read[: len(largest)])))
        scale = read[len(largest)] if torch.is_tensor(inv) else inv
        if finite and opt.max_grad_norm is not None:
            opt.grad_norm = read[-2]
            scale = (scale or 1.0) * read[-1]
        return finite, None if scale == 1.0 else scale

    def _freeze(self) -> None:
        """Enter phase B: freeze the denominator, reset the errors, remember the parameters."""
        opt = self.optimizer
        v = opt.exp_avg_sq
        floor = opt.hyper.zero_variance_floor(opt._var_updates)
        fill_zero_variance_(opt.layout.views(v), floor)
        opt.hyper.denominator(v, opt._var_updates, out=v)
        for comm in opt.comms:
            comm.reset()  # they tracked the gradient; from now on they track the local progress
        opt.engine.end_warmup()
        anchor = opt.engine.grads
        torch._foreach_copy_(opt.layout.views(anchor), opt.layout.params)
        opt._lrs = [0.0] * len(opt.param_groups)
        opt._decay = [1.0] * len(opt.param_groups)
        opt.set_frozen(True)


class _Sync(_Local):
    """Phase B's sync steps: the local step, then SPEC 4's sync, which averages through the
    compressed allreduce how far each rank moved since the last sync and moves every rank to
    the same place."""

    name = "sync"

    def __init__(self, optimizer: ZeroOneAdam) -> None:
        super().__init__(optimizer)
        self._param_bases = host.Uploaded(torch.int64)
        self._grad_bases = host.Uploaded(torch.int64)

    def passes(self, grads: list[Tensor | None]) -> Any | None:
        """The Triton passes that take a sync step in two launches around its allreduce
        (:meth:`_fused_sync`), where they apply: every bucket at once, fp32 contiguous
        parameters, no sparse gradient and no ``exp_avg_mask``; else ``None`` (torch ops)."""
        opt = self.optimizer
        model = opt.engine.model_allreduce()
        if model is None or opt.masks or not fused_parameters(opt.layout):
            return None
        if any(g is not None and g.is_sparse for g in grads):
            return None
        return model.passes()

    def average(
        self, passes: Any | None = None, local: tuple[float, float | None] | None = None
    ) -> tuple[bool, int]:
        """SPEC 4's sync: average the preconditioned local progress, apply it on every rank.

        The progress of a rank is ``p - decay·anchor``: where it is, less where weight decay alone
        would have taken the last synced parameters ``anchor``. The new parameters are computed
        from the anchor and the averaged progress only, so they are identical on every rank.
        With ``passes`` (:meth:`passes`) it runs as :meth:`_fused_sync`, which also takes
        the local step ``local`` of this step first.
        """
        if passes is not None:
            return self._fused_sync(passes, local)
        opt = self.optimizer
        n = opt.layout.numel
        params = opt.layout.params
        progress, anchor, denom = opt.exp_avg[:n], opt.engine.grads, opt.exp_avg_sq
        anchors = opt.layout.views(anchor)
        torch._foreach_copy_(opt.layout.views(progress), params)
        for (start, end), decay in zip(opt._ranges, opt._decay):
            progress[start:end].sub_(anchor[start:end], alpha=decay)
        synced, nbytes = opt.engine.reduce_compressed(opt.exp_avg, post=denom)
        if synced:
            for (start, end), decay in zip(opt._ranges, opt._decay):
                if decay != 1.0:
                    anchor[start:end].mul_(decay)
            anchor.addcdiv_(progress, denom)
            for (start, end), lrs in zip(opt._ranges, opt._lrs):
                progress[start:end].mul_(-1 / lrs if lrs > 0 else 0.0)  # m = -average / lrs
            apply_masks_(progress, opt.masks)
        else:
            progress.zero_()
        torch._foreach_copy_(params, anchors)
        low_precision = [(a, p) for a, p in zip(anchors, params) if p.dtype != torch.float32]
        if low_precision:
            torch._foreach_copy_([a for a, _ in low_precision], [p for _, p in low_precision])
        opt._lrs = [0.0] * len(opt.param_groups)
        opt._decay = [1.0] * len(opt.param_groups)
        return synced, nbytes

    def _fused_sync(
        self, passes: Any, local: tuple[float, float | None] | None
    ) -> tuple[bool, int]:
        """:meth:`average` with the local step ``local`` (``(1/bias_correction1, gradient
        scale)``, ``None``: none) in the Triton passes of ``passes``: the allreduce's worker
        pass takes the local step, the progress and its preconditioning (reading each
        ``.grad`` and parameter in place), and one pass after it the anchor, the momentum and
        the parameters (reading the average as it arrived), with the bits of the torch ops."""
        opt = self.optimizer
        params, device = opt.layout.params, opt.device
        rows: list[list[float]] = [[], [], [], []]
        step_scale = 1.0 if local is None else local[0]
        for group, lrs, decay in zip(opt.param_groups, opt._lrs, opt._decay):
            lr, wd, count = group["lr"], group["weight_decay"], len(group["params"])
            rows[0] += [1 - lr * wd if wd else 1.0] * count
            rows[1] += [-lr * step_scale] * count
            rows[2] += [decay] * count
            rows[3] += [-1 / lrs if lrs > 0 else 0.0] * count
        step_decay, value, since, factor = host.upload_rows(rows, device, torch.float32)
        bases = self._param_bases([p.data_ptr() for p in params], device)
        step, keep = None, []
        if local is not None:
            addresses, keep, _ = gradient_addresses(params, opt.layout.strides)
            grads = self._grad_bases(addresses, device)
            step = (grads, local[1], 1 - opt.hyper.beta1, step_decay, value)
        m, denom, anchor = opt.exp_avg, opt.exp_avg_sq, opt.engine.grads
        model, scale = opt.engine.model_allreduce(), opt.comms[0].scale

        def progress(errors: Tensor, headers: Tensor, message: Tensor) -> Tensor:
            return passes.sync_progress(bases, m, denom, anchor, since, step, errors, scale,
                                        headers, message)  # fmt: skip

        synced, call = opt.engine.phase1_at_once(
            model, lambda headers: model.start_from(m, headers, progress)
        )
        del keep
        result = model.commit(call, decompress=False) if synced else None
        passes.sync_apply(bases, result, m, denom, anchor, since, factor)
        nbytes = sum(c.bytes_per_call for c in opt.comms)
        opt._lrs = [0.0] * len(opt.param_groups)
        opt._decay = [1.0] * len(opt.param_groups)
        return synced, nbytes


@with_shared_docs
class ZeroOneAdam(AdamShaped, CompressedOptimizer):
    """AdamW that needs no full-precision warmup and skips whole communication rounds.

    Like :class:`~onebit.OnebitAdam` it replaces ``torch.optim.AdamW`` plus
    ``DistributedDataParallel`` (do not wrap the model in DDP) and broadcasts the parameters from
    rank 0 at construction. Training runs in two phases.

    Phase A, steps ``1..var_freeze_step``: Adam's variance is updated only on steps ``t`` with
    ``t % var_interval == 0``; those steps average the gradients at full precision, by default
    in int4 with error feedback (``warmup_compression``). Every other step averages them with
    the 1-bit compressed allreduce (error feedback included) and updates only the momentum.
    ``var_interval`` starts at 1 and doubles after every ``var_update_scaler`` variance
    updates, so full-precision steps become exponentially rare.

    Phase B, after ``var_freeze_step``: the variance is frozen and each rank takes *local* steps
    with its own gradient and momentum, sending nothing. Every ``local_step_interval`` steps a
    sync step averages, through the compressed allreduce, how far each rank moved since the last
    sync (preconditioned back by the frozen denominator), moves every rank to the same place and
    rebuilds the momentum from that average. ``local_step_interval`` starts at 1 and doubles every
    ``local_step_scaler`` phase-B steps, up to ``local_step_clipper``.

    **Between sync steps the parameters differ across ranks**: that is the point of local steps.
    Right after each sync step they are identical, bit for bit, on every rank. To evaluate or
    export a consistent model mid-phase-B, call :meth:`synchronize` on every rank. In phase B
    :meth:`state_dict` also holds this rank's parameters, and :meth:`load_state_dict` restores
    them, so that one :meth:`consolidated_state_dict` file resumes exactly: load it after the
    model's own state.

    Args:
        params: parameters or param groups. ``lr`` and ``weight_decay`` may differ per group;
            ``betas`` and ``eps`` are read from the groups at every step and must be the same in
            every group.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        var_freeze_step: last step of phase A. Like 1-bit Adam's ``freeze_step`` but much less
            critical, since phase A already compresses most steps; the paper freezes after
            10-20% of training (e.g. 23k of 118k steps for BERT-Base). Default: a fifth of
            ``total_steps`` (:func:`run_freeze_step`); one of the two must be given.
        var_update_scaler: variance updates between two doublings of ``var_interval``, and so
            the full-precision steps phase A starts with. Larger keeps ``v`` fresher at the cost
            of more fp32 allreduces. Default: scaled to ``total_steps`` by
            :func:`run_schedule`, or the paper's 16 without it.
        local_step_scaler: phase-B steps between two doublings of ``local_step_interval``.
            Lower it to skip rounds sooner when gradients are not very noisy. Default: scaled
            to ``total_steps`` by :func:`run_schedule`, or the paper's 32768 without it
            (a run shorter than that then syncs every step).
        local_step_clipper: the largest ``local_step_interval``. At most one step in this many
            communicates; larger intervals save more rounds but let replicas drift further
            apart. Default: scaled to ``total_steps`` by :func:`run_schedule`, or the
            paper's 16 without it.
        total_steps: the run's length in optimizer steps, when known. It sizes phase A and the
            three schedule knobs' defaults to the run (:func:`run_freeze_step`,
            :func:`run_schedule`); knobs given explicitly win. A ``local_step_scaler`` given
            without a ``local_step_clipper`` keeps the paper's 16, so that the local steps it
            asks for happen; a ``local_step_clipper`` given sizes the default
            ``local_step_scaler`` to reach it.
        bias_correction: Adam's bias correction. The variance's correction counts variance
            updates, not steps, so that with ``var_interval == 1`` throughout this is AdamW.
        {process_group}
        {bucket_size}
        {scale_per}
        exp_avg_mask: optional ``{parameter: mask}`` of 0/1 tensors shaped like the parameter,
            applied to the momentum after every compressed or local update (1-bit compression
            cannot send exact zeros).
        max_grad_norm: clip gradients to this norm (``None``: no clipping): the averaged
            gradient on variance steps, as DDP + ``clip_grad_norm_``; each rank's own gradient,
            before it is sent, on 1-bit and local steps (``docs/SPEC.md``).
        warmup_compression: how phase A's variance steps average the gradients, as
            :class:`~onebit.OnebitAdam`'s warmup: ``"int4"`` (default), ``"int8"`` or ``"bf16"``
            through a quantized allreduce with error feedback of its own, freed at
            ``var_freeze_step``, or ``"fp32"``, an fp32 allreduce (the paper's and DeepSpeed's,
            and exactly AdamW + DDP while ``var_interval`` is 1).
        error_dtype: ``torch.float32`` (default) or ``torch.bfloat16``: the dtype of the 1-bit
            steps' error buffers, as :class:`~onebit.OnebitAdam`'s (0.5 + 0.5/n model sizes
            fewer).
        {allow_edited_grads}

    Entries whose variance is (about) 0, ``sqrt(v̂) <= eps``, take their tensor's mean variance
    in the denominator once compressed steps have begun and in the frozen one
    (:func:`~onebit.functional.fill_zero_variance_`): 1-bit momentum is never exactly 0, and
    ``±scale/eps`` would be a step of about ``lr·scale/eps``.

    Weight decay in phase B is applied to the parameters every local step exactly as AdamW does
    and is kept out of the momentum that a sync rebuilds (the reference folded
    ``wd·p·(sqrt(v)+eps)`` into the momentum, which compounds into up to ``1/(1-β1)`` times the
    asked-for decay).

    Non-finite gradients: in phase A, if any rank has one, every rank skips the step and changes
    nothing (``skipped_steps``). In phase B a rank with a non-finite gradient drops it: that
    rank's parameters and momentum stay as they were for the step, while the step count and both
    schedules advance on every rank (``local_skipped_steps`` counts these per rank). Because a
    sync computes the new parameters only from values every rank shares, replicas are identical
    again after it. Should a sync itself see a non-finite value, every rank returns to the
    parameters of the previous sync and restarts its momentum (``skipped_steps`` counts it).

    Memory: four model-sized fp32 buffers (momentum, variance or frozen denominator, a scratch
    buffer that holds the averaged gradient in phase A and the last synced parameters in phase
    B, and the worker error) plus the server error, ``1/world_size`` of the model; in phase A a
    quantized ``warmup_compression`` adds its own worker and server errors (``1 + 1/n`` model
    sizes), freed at the freeze.

    State per parameter: ``exp_avg`` and ``exp_avg_sq``; in phase B ``exp_avg`` is the rank's
    local momentum, ``exp_avg_sq`` is replaced by ``frozen_denom`` (``sqrt(v̂) + eps``), and
    ``sync_params`` holds the parameters of the last sync. ``comm_stats`` counts bytes per stage
    (``"variance"``, ``"compression"``, ``"sync"``, ``"local"``), the rounds (collectives) each
    waited on, and ``rounds_skipped``.
    ``freeze`` is a :class:`~onebit.freeze.FreezeSchedule` fixed at ``var_freeze_step``, which
    ``freeze_step`` and ``in_warmup`` (phase A) also give.
    """

    _keeps_gradient_buffer = True  # phase B's sync parameters live there
    _stage_types = (_Variance, _OnebitGradient, _Local, _Sync)

    _rehearsal_options = {
        "var_freeze_step": 3,
        "var_update_scaler": 1,
        "local_step_scaler": 1,
        "local_step_clipper": 2,
        "total_steps": None,
    }

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        var_freeze_step: int | None = None,
        var_update_scaler: int | None = None,
        local_step_scaler: int | None = None,
        local_step_clipper: int | None = None,
        total_steps: int | None = None,
        bias_correction: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        scale_per: str = "tensor",
        exp_avg_mask: Mapping[Tensor, Tensor] | None = None,
        max_grad_norm: float | None = None,
        warmup_compression: str = DEFAULT_WARMUP_COMPRESSION,
        error_dtype: torch.dtype = torch.float32,
        allow_edited_grads: bool = False,
    ) -> None:
        def check() -> FreezeSchedule:
            check_adam_hyperparameters(lr, betas, eps, weight_decay, self.param_groups)
            if total_steps is not None:
                check_step_count("total_steps", total_steps)
            freeze_step = var_freeze_step
            if freeze_step is None:
                if total_steps is None:
                    raise ValueError(
                        "ZeroOneAdam needs var_freeze_step=N (the last step of phase A) or "
                        "total_steps=N (the run's length, which sizes phase A)"
                    )
                freeze_step = run_freeze_step(total_steps)
            self.var_freeze_step = check_step_count("var_freeze_step", freeze_step)
            given = Schedule(var_update_scaler, local_step_scaler, local_step_clipper)
            for name, value in zip(Schedule._fields, given):
                if value is not None:
                    check_step_count(name, value)
            schedule = PAPER_SCHEDULE
            if total_steps is not None:
                clipper = given.local_step_clipper
                if clipper is None and given.local_step_scaler is not None:
                    clipper = PAPER_SCHEDULE.local_step_clipper  # a scaler asks for local steps
                schedule = run_schedule(total_steps, self.var_freeze_step, clipper)
            for name, value, default in zip(Schedule._fields, given, schedule):
                setattr(self, name, default if value is None else value)
            return FreezeSchedule(self.var_freeze_step)

        self.bias_correction = bias_correction
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, check=check, **shared_options(locals()))
        self._ranges = _group_ranges(self.param_groups)
        self.var_interval = 1
        self._var_counter = 0
        self._var_updates = 0
        self.local_step_interval = 1
        self._local_step_counter = 0
        self._lrs = [0.0] * len(self.param_groups)
        self._decay = [1.0] * len(self.param_groups)
        self.local_skipped_steps = 0

    def _allocate_state(self) -> None:
        self._adam = AdamWarmup.of(self)
        # Padded: in phase B the momentum buffer is also the compressor's input at a sync.
        self.exp_avg = self.flat.zeros(padded=True)
        self.flat.expose("exp_avg", self.exp_avg)
        self.exp_avg_sq = self.flat.zeros("exp_avg_sq")
        self.set_frozen(False)

    @property
    def sync_params(self) -> Tensor:
        """The parameters of the last sync, phase B's: kept in the gradient buffer."""
        return self.engine.grads

    def _settings(self) -> dict[str, Any]:
        return {
            **super()._settings(),
            "schedules": (
                self.var_freeze_step,
                self.var_update_scaler,
                self.local_step_scaler,
                self.local_step_clipper,
            ),
        }

    @property
    def stage(self) -> str:
        """What the next step does: ``"variance"`` (fp32 allreduce, phase A), ``"compression"``
        (1-bit allreduce of the gradient, phase A), ``"local"`` or ``"sync"`` (phase B)."""
        t = self.num_steps + 1
        if self.in_warmup:
            return "variance" if t % self.var_interval == 0 else "compression"
        return "sync" if t % self.local_step_interval == 0 else "local"

    @closes_step_on_error
    @torch.no_grad()
    def synchronize(self) -> None:
        """Make the parameters identical on every rank now (a collective; phase B only).

        Averages the local progress since the last sync as a scheduled sync step would, without
        taking a step; ``comm_stats`` books it as stage ``"synchronize"``. Does nothing in
        phase A, or if no step was taken since the last sync.
        """
        if self.frozen and any(lrs > 0 for lrs in self._lrs):
            sync = self._stages["sync"]
            self._begin_step()
            synced, nbytes = sync.average(sync.passes([]))
            self._close_step()
            self.comm_stats.record("synchronize", nbytes)
            self.skipped_steps += not synced

    def _stage_state(self) -> StatePart:
        return _ScheduleState(self)


class _ScheduleState(NoState):
    """0/1 Adam's part of a checkpoint: the variance and local-step schedules and, in phase B,
    each rank's local momentum and parameters, which differ between ranks until the next
    sync."""

    def __init__(self, optimizer: ZeroOneAdam) -> None:
        self.optimizer = optimizer

    def extra_state(self) -> dict[str, Any]:
        opt = self.optimizer
        return {
            "var_interval": opt.var_interval,
            "var_counter": opt._var_counter,
            "var_updates": opt._var_updates,
            "local_step_interval": opt.local_step_interval,
            "local_step_counter": opt._local_step_counter,
            "lrs": list(opt._lrs),
            "decay": list(opt._decay),
        }

    def rank_state(self) -> dict[str, Any]:
        opt = self.optimizer
        state: dict[str, Any] = {"local_skipped_steps": opt.local_skipped_steps}
        if opt.frozen:
            state["exp_avg"] = opt.exp_avg[: opt.layout.numel].clone()
            params = enumerate(p.detach() for p in opt.layout.params)
            state["params"] = torch.cat([opt.layout.flat(i, p).float() for i, p in params])
        return state

    def load_rank_state(self, state: dict[str, Any]) -> None:
        opt = self.optimizer
        opt.local_skipped_steps = state.get("local_skipped_steps", 0)
        if "exp_avg" in state:
            opt.exp_avg[: opt.layout.numel].copy_(state["exp_avg"])
        if "params" in state:
            flat = state["params"].to(opt.device)
            with torch.no_grad():
                torch._foreach_copy_(opt.layout.params, opt.layout.views(flat))

    def load_extra_state(self, state: dict[str, Any]) -> None:
        opt = self.optimizer
        opt.var_interval = state["var_interval"]
        opt._var_counter = state["var_counter"]
        opt._var_updates = state["var_updates"]
        opt.local_step_interval = state["local_step_interval"]
        opt._local_step_counter = state["local_step_counter"]
        opt._lrs = list(state["lrs"])
        opt._decay = list(state["decay"])


def _group_ranges(param_groups: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Each param group's ``[start, end)`` in the flat buffers (groups are laid out in order)."""
    ranges, start = [], 0
    for group in param_groups:
        end = start + sum(p.numel() for p in group["params"])
        ranges.append((start, end))
        start = end
    return ranges
