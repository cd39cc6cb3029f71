"""1-bit Adam (Tang et al., ICML 2021; SPEC section 3)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from .base import (
    DEFAULT_BUCKET_SIZE,
    CompressedOptimizer,
    check_adam_hyperparameters,
    closes_step_on_error,
    problem_of,
)
from .freeze import AutoFreeze, VarianceFreezeMixin
from .functional import (
    adam_denominator,
    adam_moments_,
    adamw_update_,
    bias_correction,
    fill_zero_variance_,
)


class OnebitAdam(VarianceFreezeMixin, CompressedOptimizer):
    """AdamW whose gradient communication drops to 1 bit per element after a warmup.

    A drop-in replacement for ``torch.optim.AdamW`` plus ``DistributedDataParallel``: do not
    wrap the model in DDP, this optimizer owns all communication. At construction it broadcasts
    the parameters from rank 0. For the first ``freeze_step`` steps it is exactly AdamW on
    gradients averaged by a bucketed fp32 allreduce. Then Adam's variance is frozen and each step
    sends only the momentum, through an error-compensated 1-bit compressed allreduce (about 32x
    fewer bytes than an fp32 allreduce).

    Args:
        params: parameters or param groups. ``lr`` and ``weight_decay`` may differ per group;
            ``betas`` and ``eps`` are read from the groups at every step (so schedulers that
            change them work) and must be the same in every group.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        freeze_step: warmup length T. Choose it where Adam's variance has stopped moving;
            the paper uses 15-25% of training. Longer is safer and sends more bytes.
            ``"auto"`` freezes once the variance is stable (:class:`~onebit.freeze.AutoFreeze`
            says how); the step it chose is then ``freeze_step`` and ``comm_stats.freeze_step``.
        bias_correction: Adam's bias correction (the reference implementation had none).
        process_group: the data-parallel group; ``None`` is the default group, or a single
            process if ``torch.distributed`` is not initialised.
        bucket_size: elements per communication bucket, rounded down to a multiple of
            ``8 * world_size``.
        scale_per: ``"tensor"`` (default) gives each parameter's part of a bucket its own 1-bit
            scale, so that a large tensor (an embedding, say) does not set the steps of the small
            ones sharing its bucket; ``"bucket"`` is one scale per bucket (SPEC 2, the reference
            implementation). Each scale costs 4 bytes per message.
        exp_avg_mask: optional ``{parameter: mask}`` of 0/1 tensors shaped like the parameter.
            1-bit compression cannot send exact zeros; the mask keeps known-zero momentum entries
            (unused embedding rows, say) at zero in the compression stage.
        max_grad_norm: clip gradients to this global norm (``None``: no clipping). Use it
            instead of ``torch.nn.utils.clip_grad_norm_``, which would clip each rank's local
            gradient. In warmup it clips the averaged gradient exactly as DDP +
            ``clip_grad_norm_`` + AdamW; in the compression stage see ``docs/SPEC.md``.
        auto_freeze: knobs of ``freeze_step="auto"``.
        overlap_backward: start each bucket's communication during ``backward()``, as soon as
            its gradients are final, as DDP does. Results are bitwise the same as without it.
            It needs the same parameters to receive gradients in the same order on every rank;
            with gradient accumulation, run every backward but the last inside
            :meth:`no_sync`. It cannot honour a ``GradScaler`` or an edit of ``.grad`` after
            backward (clipping, say): both raise a clear error.
        warmup_compression: how the warmup averages gradients. ``"fp32"`` (default) is an fp32
            allreduce, exactly AdamW + DDP. ``"bf16"``, ``"int8"`` and ``"int4"`` send 2, 4 and
            8 times fewer bytes through the same two-phase exchange as the 1-bit stage, with
            block-wise scales (256 elements, never straddling tensors) and error feedback of
            their own, zeroed at the freeze (:class:`~onebit.quantized.QuantizedAllreduce`).
            Every rank still gets the same averaged gradient, bit for bit.

    A parameter whose ``.grad`` is ``None`` counts as a zero gradient: its momentum decays and
    weight decay applies, the same on every rank. All state is fp32 whatever the parameter
    dtype. If any rank has a non-finite gradient, every rank skips the step and changes nothing
    (``skipped_steps`` counts it; no extra collective is needed).

    Entries whose variance is (about) 0 at the freeze, ``sqrt(v̂) <= eps`` (no gradient reached
    them), take their tensor's mean variance, so that 1-bit momentum, never exactly 0, cannot
    make them step by ``lr/eps`` (:func:`~onebit.functional.fill_zero_variance_`).

    State per parameter: ``exp_avg`` and ``exp_avg_sq``, views into flat buffers.
    ``comm_stats`` reports the bytes this rank sent.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        freeze_step: int | Literal["auto"],
        bias_correction: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        scale_per: str = "tensor",
        exp_avg_mask: Mapping[Tensor, Tensor] | None = None,
        auto_freeze: AutoFreeze | None = None,
        max_grad_norm: float | None = None,
        overlap_backward: bool = False,
        warmup_compression: str = "fp32",
    ) -> None:
        def check() -> None:
            check_adam_hyperparameters(lr, betas, eps, weight_decay)
            self._init_freeze_step(freeze_step, auto_freeze)

        problem = problem_of(check)
        self.bias_correction = bias_correction
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(
            params,
            defaults,
            process_group=process_group,
            bucket_size=bucket_size,
            scale_per=scale_per,
            max_grad_norm=max_grad_norm,
            exp_avg_mask=exp_avg_mask,
            overlap_backward=overlap_backward,
            warmup_compression=warmup_compression,
            problem=problem,
        )
        self._start_freeze_monitor()
        self._exp_avg = self._new_state_buffer("exp_avg")
        self._exp_avg_sq = self._new_state_buffer("exp_avg_sq")

    @property
    def stage(self) -> str:
        """``"warmup"`` until ``freeze_step`` steps are done, then ``"compression"``."""
        return "warmup" if self.in_warmup else "compression"

    def _next_communication(self) -> str:
        return self._warmup_kind if self.stage == "warmup" else "compressed"

    def _prepare_bucket_(self, k: int, kind: str, grads: Tensor) -> None:
        if kind == "compressed":
            start, end = self.layout.buckets[k]
            torch.lerp(self._exp_avg[start:end], grads, 1 - self._beta1, out=grads)

    @closes_step_on_error
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step on every rank. Call it on all ranks of the group."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._start_step()
        beta1, beta2 = self._beta1, self._beta2
        m, v = self._exp_avg, self._exp_avg_sq
        stage = self.stage
        g = self._grads[: self.layout.numel]
        if stage == "warmup":
            applied, nbytes = self._communicate(self._warmup_kind, out=g)
            if applied:
                self._clip_averaged_(g)
                adam_moments_(m, v, g, beta1, beta2)
        else:
            clip = self.max_grad_norm is not None
            applied, nbytes = self._communicate("compressed", out=g if clip else m)
            if applied and clip:  # m = β1·m + c·(compressed - β1·m), SPEC 3
                m.mul_(beta1).lerp_(g, self._compressed_clip_coefficient())
            if applied:
                self._apply_mask_(m)
        if applied:
            t = self.num_steps + 1
            frozen_t = self._variance_step(t)
            bc2 = bias_correction(beta2, frozen_t, self.bias_correction)
            denom = adam_denominator(v, bc2, self._eps, out=g)
            if stage == "warmup":
                self._observe_variance(t, denom)
            step_scale = 1 / bias_correction(beta1, t, self.bias_correction)
            for group, params, ms, denoms in self._per_group(m, denom):
                adamw_update_(params, ms, denoms, group["lr"], group["weight_decay"], step_scale)
            if t == self.freeze_step:  # the variance is frozen from here on
                fill_zero_variance_(self.layout.views(v), self._eps**2 * bc2)
                self._end_warmup_compression()
        self._end_step(stage, nbytes, applied)
        return loss

    def _extra_state(self) -> dict[str, Any]:
        return self._freeze_state()

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._load_freeze_state(state)
