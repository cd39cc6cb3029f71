"""Adam's math on an optimizer's flat state: the full-precision AdamW step that every warmup
runs (0/1 Adam's variance steps too), and the pieces the later stages reuse (the denominator,
the floor of a variance that is about 0, AdamW's update).

:class:`AdamHyper` is one step's hyperparameters, read from the param groups when the step
opens; :class:`AdamWarmup` applies the step to an optimizer's flat buffers with them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..freeze import FreezeSchedule
from ..functional import adam_denominator, adamw_update_, bias_correction
from ..state.flat_state import FlatState
from ..stats import CommStats
from ..transport.sharding import Replicated
from .options import check_same_in_every_group

GROUP_KEYS = ("lr", "weight_decay", "betas", "eps")
"""What every rank must agree on in each param group; ``betas`` and ``eps`` act on whole
buckets, so they must also be the same in every group."""

MOMENTS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
"""What a stage before the freeze shows: Adam's moments, by the attributes that hold them (see
:attr:`~onebit.optim.stage.Stage.shows`)."""

FUSED_ADAM_DEVICES = ("cuda",)
"""Where a warmup step runs torch's fused AdamW kernel (see :meth:`AdamWarmup.fused_applies`).
Elsewhere it runs torch's multi-tensor ops, which round as ``AdamW``'s default (foreach)
implementation."""


MIN_CHUNK = 2**22
"""Elements of parameters whose denominators :meth:`AdamWarmup.denominators` makes at once, at
least (the default bucket size)."""


def check_adam_hyperparameters(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    groups: list[dict[str, Any]],
) -> None:
    """Raise ``ValueError`` for hyperparameters ``torch.optim.AdamW`` would also reject, or
    param ``groups`` whose ``betas`` or ``eps`` differ (they act on whole buckets)."""
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    check_same_in_every_group(groups, ("betas", "eps"))


class AdamHyper(NamedTuple):
    """One step's ``betas`` and ``eps`` (the first param group's), and whether Adam's bias
    correction is on."""

    beta1: float
    beta2: float
    eps: float
    bias_correction: bool = True

    @classmethod
    def of(cls, groups: list[dict[str, Any]], bias_correction: bool) -> tuple[AdamHyper, bool]:
        """The hyperparameters of ``groups``, and whether every group has the same ``betas``
        and ``eps`` (they act on whole buckets)."""
        first = groups[0]
        uniform = all(g["betas"] == first["betas"] and g["eps"] == first["eps"] for g in groups)
        (beta1, beta2), eps = first["betas"], first["eps"]
        return cls(beta1, beta2, eps, bias_correction), uniform

    def bc1(self, step: int) -> float:
        """``1 - β1^step``, or 1 without bias correction."""
        return bias_correction(self.beta1, step, self.bias_correction)

    def bc2(self, step: int) -> float:
        """``1 - β2^step``, or 1 without bias correction."""
        return bias_correction(self.beta2, step, self.bias_correction)

    def denominator(self, v: Tensor, variance_step: int, out: Tensor) -> Tensor:
        """``sqrt(v̂) + eps``, ``v`` bias-corrected for ``variance_step`` updates, into ``out``."""
        return adam_denominator(v, self.bc2(variance_step), self.eps, out=out)

    def zero_variance_floor(self, variance_step: int) -> float:
        """``eps² · (1 - β2^variance_step)``: a variance at most this has ``sqrt(v̂) <= eps``, and
        :func:`~onebit.functional.fill_zero_variance_` gives it its tensor's mean."""
        return self.eps**2 * self.bc2(variance_step)


class AdamShaped:
    """What the three Adam-family optimizers add alike to
    :class:`~onebit.optim.base.CompressedOptimizer`: what each step reads from the param groups
    (an :class:`AdamHyper`, which ``bias_correction`` bias-corrects) and what every rank must
    agree on (:data:`GROUP_KEYS` in each group, and ``bias_correction``)."""

    bias_correction: bool
    _group_keys = GROUP_KEYS
    _agreed = ("bias_correction",)

    def _step_hyperparameters(self, groups: list[dict[str, Any]]) -> tuple[AdamHyper, bool]:
        return AdamHyper.of(groups, self.bias_correction)


class AdamWarmup:
    """AdamW's full-precision step on an optimizer's flat state, from the averaged gradient.

    Args:
        flat: the optimizer's flat state (its layout and param groups).
        shards: where the parameters are sharded (each rank holds the same parts).
        freeze: the freeze schedule; a step that ``freeze_step="auto"`` measures observes the
            denominators.
        comm_stats: where the step ``"auto"`` chooses is recorded.
        chunk: elements of the temporaries of :meth:`denominators` (a bucket's worth, at least).
    """

    def __init__(
        self,
        flat: FlatState,
        shards: Replicated,
        freeze: FreezeSchedule,
        comm_stats: CommStats,
        chunk: int,
    ) -> None:
        self.flat, self.shards, self.freeze = flat, shards, freeze
        self.comm_stats, self.chunk = comm_stats, chunk

    @classmethod
    def of(cls, optimizer: Any) -> AdamWarmup:
        """The step on a onebit optimizer's flat state as it is laid out now (its ``flat``,
        ``shards``, ``freeze`` and ``comm_stats``), in chunks of a bucket, or of
        :data:`MIN_CHUNK` if that is more."""
        chunk = max(optimizer.layout.bucket_size, MIN_CHUNK)
        return cls(optimizer.flat, optimizer.shards, optimizer.freeze, optimizer.comm_stats, chunk)

    def fused_applies(self, step: int, hyper: AdamHyper) -> bool:
        """Whether warmup step ``step`` runs in one pass of torch's fused AdamW kernel
        (:meth:`fused_step_`): on CUDA, with fp32 parameters and bias correction, unless
        ``freeze_step="auto"`` measures the step (it observes the denominators)."""
        return (
            self.flat.device.type in FUSED_ADAM_DEVICES
            and hyper.bias_correction
            and not self.freeze.measures(step)
            and all(p.dtype == torch.float32 for p in self.flat.layout.params)
        )

    def fused_step_(self, grads: Tensor, m: Tensor, v: Tensor, step: int, hyper: AdamHyper) -> None:
        """Adam's moments and AdamW's update of warmup step ``step`` from the averaged (clipped)
        gradient ``grads``, in torch's fused AdamW kernel: one pass over the parameters, rounded
        as ``AdamW(fused=True)`` rounds them (with bias correction)."""
        device = self.flat.device
        steps = [torch.full((), float(step), device=device)] * len(self.flat.layout.params)
        start = 0
        for group, params, gs, ms, vs in self.flat.per_group(grads, m, v):
            end = start + len(params)
            if params:
                torch._fused_adamw_(
                    params, gs, ms, vs, [], steps[start:end], lr=group["lr"],
                    beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=group["weight_decay"],
                    eps=hyper.eps, amsgrad=False, maximize=False,
                )  # fmt: skip
            start = end

    def observe(self, step: int, denom: Tensor) -> None:
        """Feed ``freeze_step="auto"`` the flat denominators of applied warmup step ``step``;
        record the step it chooses in ``comm_stats``."""
        views = self.flat.layout.views(denom)
        if self.freeze.measures(step) and self.freeze.observe(step, views):
            self.comm_stats.freeze_step = step

    def adamw_update_(self, m: Tensor, denom: Tensor, step: int, hyper: AdamHyper) -> None:
        """AdamW's update of every param group: ``p -= lr·(m̂/denom + weight_decay·p)`` with
        ``m̂`` bias-corrected for ``step``."""
        step_scale = 1 / hyper.bc1(step)
        for group, params, ms, denoms in self.flat.per_group(m, denom):
            adamw_update_(params, ms, denoms, group["lr"], group["weight_decay"], step_scale)

    def denominators(
        self, v: Tensor, step: int, hyper: AdamHyper
    ) -> Iterator[tuple[dict[str, Any], slice, list[Tensor]]]:
        """Adam's denominators ``sqrt(v̂) + eps`` of warmup step ``step``, as temporaries of
        :attr:`chunk` elements of parameters at a time (so that the ops do not grow with the
        buckets): ``(group, slice of layout.params, one denominator per parameter)``. A
        measuring step of ``freeze_step="auto"`` makes them all at once, to observe them
        first."""
        layout, bc2 = self.flat.layout, hyper.bc2(step)
        whole = None
        if self.freeze.measures(step):
            whole = adam_denominator(v, bc2, hyper.eps, out=torch.empty_like(v))
            self.observe(step, whole)
            whole = layout.views(whole)
        vs, start = layout.views(v), 0
        for group in self.flat.param_groups:
            end = start + len(group["params"])
            numels = self.shards.numels()[start:end]  # the same parts on every shard
            for part in _parts(numels, self.chunk):
                part = slice(start + part.start, start + part.stop)
                if whole is not None:
                    yield group, part, whole[part]
                    continue
                denoms = torch._foreach_sqrt(vs[part])
                torch._foreach_div_(denoms, math.sqrt(bc2))
                torch._foreach_add_(denoms, hyper.eps)
                yield group, part, denoms
            start = end

    def step_from_moments_(self, m: Tensor, v: Tensor, step: int, hyper: AdamHyper) -> None:
        """AdamW's update of warmup step ``step`` from Adam's moments, by :meth:`denominators`
        (no buffer of the model's size)."""
        step_scale = 1 / hyper.bc1(step)
        params, ms = self.flat.layout.params, self.flat.layout.views(m)
        for group, part, denoms in self.denominators(v, step, hyper):
            lr, decay = group["lr"], group["weight_decay"]
            adamw_update_(params[part], ms[part], denoms, lr, decay, step_scale)


def _parts(numels: list[int], limit: int) -> Iterator[slice]:
    """Consecutive slices of ``numels`` holding at most ``limit`` elements, or one tensor."""
    start, total = 0, 0
    for i, n in enumerate(numels):
        if total and total + n > limit:
            yield slice(start, i)
            start, total = i, 0
        total += n
    if start < len(numels):
        yield slice(start, len(numels))
