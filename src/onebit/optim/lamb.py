"""1-bit LAMB (Li et al., 2021; SPEC section 5)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from ..freeze import AutoFreeze, FreezeSchedule, told_auto_freeze
from ..functional import adam_moments_, scaled_sub_, trust_ratio
from ..wire.momentum import PacksMomentum
from .adam_step import MOMENTS, AdamShaped, AdamWarmup, check_adam_hyperparameters
from .base import CompressedOptimizer
from .checkpoint import NoState, StatePart
from .lamb_compression import LambCompression, TrustRatios
from .options import (
    DEFAULT_BUCKET_SIZE,
    DEFAULT_WARMUP_COMPRESSION,
    shared_options,
    with_shared_docs,
)
from .stage import Stage, Taken


class _Warmup(Stage):
    """LAMB on gradients averaged at full precision, keeping a moving average of each layer's
    trust ratio for the freeze."""

    name = "warmup"
    shows = MOMENTS

    def enter(self) -> None:
        opt = self.optimizer
        opt.bucketer.grads_as_views = True
        opt.exp_avg_sq_fresh = None

    def step(self, t: int) -> Taken:
        opt = self.optimizer
        m, v = opt.exp_avg[: opt.layout.numel], opt.exp_avg_sq
        applied, nbytes = opt.engine.average_gradients()
        if applied:
            hyper = opt.hyper
            adam_moments_(m, v, opt.engine.grads, hyper.beta1, hyper.beta2)
            bc1 = hyper.bc1(t)
            params, ms = opt.layout.params, opt.layout.views(m)
            norms = []
            for group, part, denoms in opt._adam.denominators(v, t, hyper):  # a chunk at a time
                updates = torch._foreach_div(ms[part], denoms)  # Adam's update, m̂ / denom
                del denoms
                torch._foreach_div_(updates, bc1)
                if group["weight_decay"]:
                    torch._foreach_add_(updates, params[part], alpha=group["weight_decay"])
                weight_norms = opt.shards.layer_norms(params[part])
                update_norms = opt.shards.layer_norms(updates)
                coeffs = trust_ratio(weight_norms, update_norms, opt.min_coeff, opt.max_coeff)
                scaled_sub_(params[part], updates, [group["lr"] * c for c in coeffs.tolist()])
                norms.append((weight_norms, update_norms, coeffs))
            weight_norms, update_norms, coeffs = (torch.cat(x) for x in zip(*norms))
            # Only defined ratios (no zero norm) enter the average that will be frozen.
            defined = (weight_norms > 0) & (update_norms > 0)
            ratios = opt.trust_ratios
            ema = ratios.ema * opt.coeff_beta + coeffs * (1 - opt.coeff_beta)
            ratios.ema = torch.where(defined, ema, ratios.ema)
            ratios.updates += defined
            ratios.last = coeffs
        return Taken(applied, nbytes)


@with_shared_docs
class OnebitLamb(AdamShaped, PacksMomentum, CompressedOptimizer):
    """LAMB whose gradient communication drops to 1 bit per element after a warmup.

    LAMB (You et al., 2020) is Adam with a per-layer trust ratio: each parameter ("layer")
    moves by ``lr · coeff · update`` with ``update = m̂ / (sqrt(v̂) + eps) + weight_decay · p``
    and ``coeff = clip(||p|| / ||update||, min_coeff, max_coeff)``, which keeps large-batch
    training stable. As with :class:`~onebit.OnebitAdam`, do not wrap the model in DDP: this
    optimizer owns the communication and broadcasts the parameters from rank 0 at construction.

    Warmup, steps ``1..freeze_step``: exactly LAMB on gradients averaged by an fp32 allreduce,
    keeping an exponential moving average of each layer's trust ratio.

    Compression stage: the variance ``v_T`` is frozen, and so are each layer's trust ratio
    (its moving average) and a momentum scaling coefficient ``mean(s) / s_l`` with
    ``s_l = ||m_l|| / sqrt(numel_l)``, which brings every layer's momentum to a common scale so that
    one 1-bit scale fits the whole model. Each step updates the momentum with the local
    gradient, scales it, averages it with one compressed allreduce and scales it back. From the
    change of momentum it rebuilds the averaged gradient and keeps a fresh variance; the trust
    ratio is the frozen one times ``factor = max((sqrt(v_T)+eps) / (sqrt(v_fresh)+eps))`` over
    the layer, which corrects for the variance having moved since the freeze.

    Args:
        params: parameters or param groups. ``lr`` and ``weight_decay`` may differ per group;
            ``betas`` and ``eps`` are read from the groups at every step and must be the same in
            every group.
        lr, betas, eps, weight_decay: as LAMB (decoupled weight decay inside the update).
        freeze_step: warmup length, or ``"auto"`` (default) to freeze once the variance is
            stable, as :class:`~onebit.OnebitAdam`'s (see :class:`~onebit.freeze.AutoFreeze`).
            The paper warms up for about 15% of the run.
        total_steps: the run's length, if known: it caps ``"auto"``'s warmup at a fifth of it.
        max_coeff, min_coeff: bounds of the trust ratio (defaults 10 and 0.01). BERT recipes
            lower ``max_coeff`` (e.g. 0.3) when early steps are too large.
        coeff_beta: decay of the trust ratios' moving average (default 0.9). Closer to 1 gives
            a smoother frozen ratio that reflects more of the warmup.
        factor_max, factor_min: bounds of the fresh-variance factor (defaults 4.0 and 0.5).
        factor_threshold: the factor may move by at most this fraction of its previous value per
            step (default 0.1), so that one noisy gradient does not jolt the step size.
        bias_correction: Adam's bias correction of ``m`` and ``v``, and of the trust ratios'
            moving average. ``False`` gives the reference implementation's numbers.
        {process_group}
        {bucket_size}
        {scale_per}
        auto_freeze: knobs of ``freeze_step="auto"``.
        exp_avg_mask: optional ``{parameter: mask}`` of 0/1 tensors shaped like the parameter,
            applied to the averaged momentum in the compression stage.
        max_grad_norm: clip gradients to this norm (``None``: no clipping); as
            :class:`~onebit.OnebitAdam` (``docs/SPEC.md``).
        warmup_compression: ``"int4"`` (default), ``"int8"``, ``"bf16"`` or ``"fp32"``
            (exactly LAMB on fp32-averaged gradients): as :class:`~onebit.OnebitAdam`'s.
        error_dtype: ``torch.float32`` (default) or ``torch.bfloat16``: as
            :class:`~onebit.OnebitAdam`'s (half the error buffers' memory: 0.5 + 0.5/n model
            sizes fewer).
        {allow_edited_grads}

    Entries whose variance is (about) 0 at the freeze take their tensor's mean variance, as in
    :class:`~onebit.OnebitAdam`.

    The frozen variance makes the compression stage less tolerant of too large a learning rate
    than LAMB: in the runs of ``BENCHMARKS.md`` it ended at or below LAMB's loss at LAMB's best
    rate and below, but at four times that rate it diverged where LAMB merely stopped learning.
    If the loss climbs after the freeze, lower ``lr`` or freeze later.

    With weight decay the factor is blended towards 1 by the share of the update that does not
    depend on the variance, ``min(1, ||m̂/(sqrt(v_T)+eps)|| / ||update||)``, as the reference
    implementation does (SPEC section 5 leaves this out).

    A parameter whose ``.grad`` is ``None`` counts as a zero gradient. All state is fp32 (the
    error buffers: ``error_dtype``). If any rank has a non-finite gradient, every rank skips the
    step and changes nothing (``skipped_steps``). Parameters are identical on every rank after
    every step.

    State per parameter: ``exp_avg`` and ``exp_avg_sq``; at the freeze ``exp_avg_sq`` becomes
    ``frozen_denom`` (``sqrt(v̂_T) + eps``) and ``exp_avg_sq_fresh`` appears. Per-layer scalars
    (trust ratios, scaling coefficients, factors) are in ``state_dict()["onebit"]``. Memory in the
    warmup: AdamW's (momentum and variance), as the fp32 ``.grad`` live in the bucket buffer as
    in :class:`~onebit.OnebitAdam`'s warmup. In the compression stage, with the C kernels on the
    CPU or Triton on CUDA (parameters all fp32, bf16 or fp16, contiguous or ``channels_last``,
    ``scale_per="tensor"``, with or without ``exp_avg_mask``):
    three model-sized fp32 buffers (frozen denominator, fresh variance, worker error), the server
    error and the momentum packed to 1 bit (:mod:`onebit.wire.momentum`); ``exp_avg`` then leaves
    ``optimizer.state`` and appears, fp32 and exact, in ``state_dict()``. Elsewhere also the
    fp32 momentum and a gradient buffer. ``freeze`` is the
    :class:`~onebit.freeze.FreezeSchedule`; ``freeze_step``, ``in_warmup`` and ``stage`` say
    where the warmup stands.
    """

    _rehearsal_options = {"freeze_step": 1, "auto_freeze": None, "total_steps": None}
    _stage_types = (_Warmup, LambCompression)

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
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        bias_correction: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        scale_per: str = "tensor",
        auto_freeze: AutoFreeze | None = None,
        exp_avg_mask: Mapping[Tensor, Tensor] | None = None,
        max_grad_norm: float | None = None,
        warmup_compression: str = DEFAULT_WARMUP_COMPRESSION,
        error_dtype: torch.dtype = torch.float32,
        allow_edited_grads: bool = False,
    ) -> None:
        def check() -> FreezeSchedule:
            check_adam_hyperparameters(lr, betas, eps, weight_decay, self.param_groups)
            _check_range("min_coeff", min_coeff, "max_coeff", max_coeff)
            if not 0.0 <= coeff_beta < 1.0:
                raise ValueError(f"Invalid coeff_beta: {coeff_beta}")
            _check_range("factor_min", factor_min, "factor_max", factor_max)
            if not 0.0 <= factor_threshold < 1.0:
                raise ValueError(f"Invalid factor_threshold: {factor_threshold}")
            auto = told_auto_freeze(freeze_step, auto_freeze, total_steps)
            return FreezeSchedule(freeze_step, auto, process_group, beta2=betas[1])

        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.factor_max, self.factor_min = factor_max, factor_min
        self.factor_threshold, self.bias_correction = factor_threshold, bias_correction
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, check=check, **shared_options(locals()))
        self.trust_ratios = TrustRatios(len(self.layout.params))

    def _allocate_state(self) -> None:
        self._adam = AdamWarmup.of(self)
        self.exp_avg = self.flat.zeros(padded=True)  # padded: it can hold the worker errors
        self.flat.expose("exp_avg", self.exp_avg)
        self.exp_avg_sq = self.flat.zeros("exp_avg_sq")
        self.exp_avg_sq_fresh: Tensor | None = None  # the compression stage's
        self.set_frozen(False)
        self._pack_momentum(self.exp_avg, keeps_last=True)

    def _settings(self) -> dict[str, Any]:
        knobs = ("max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min")
        return {
            **super()._settings(),
            "lamb": tuple(getattr(self, k) for k in (*knobs, "factor_threshold")),
        }

    def get_lamb_coeffs(self) -> list[float]:
        """Each parameter's trust ratio in the last step, in parameter order (a copy)."""
        return self.trust_ratios.last.tolist()

    def _stage_state(self) -> StatePart:
        return _TrustRatioState(self)


class _TrustRatioState(NoState):
    """1-bit LAMB's part of a checkpoint: the per-layer trust ratios, scaling coefficients and
    factors, and the fresh variance that the freeze makes (kept if a load fails)."""

    def __init__(self, optimizer: OnebitLamb) -> None:
        self.optimizer = optimizer

    def extra_state(self) -> dict[str, Any]:
        return self.optimizer.trust_ratios.state_dict()

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.optimizer.trust_ratios.load_state_dict(state)

    def before_load(self, saved: dict[str, Any]) -> Callable[[], None]:
        fresh = self.optimizer.exp_avg_sq_fresh

        def undo() -> None:
            self.optimizer.exp_avg_sq_fresh = fresh  # what the stages' enter() keeps

        return undo


def _check_range(low_name: str, low: float, high_name: str, high: float) -> None:
    """Raise ``ValueError`` unless ``0 < low <= high < inf``."""
    if not 0.0 < low <= high < math.inf:
        raise ValueError(
            f"need 0 < {low_name} <= {high_name}, got {low_name}={low}, {high_name}={high}"
        )
