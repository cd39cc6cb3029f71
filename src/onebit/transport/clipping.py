"""Gradient clipping by the global norm (``max_grad_norm``), where each stage of a step can.

A full-precision step clips the averaged gradient, exactly as DDP + ``clip_grad_norm_``. A
1-bit step never forms the average, so each rank clips its own gradient before it is sent
(SPEC 6), or, when the buckets left during backward, the result by the mean of the ranks'
norms, which their headers carried.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import host
from ..functional import clip_coefficient, layer_norms
from ..state.layout import FlatLayout
from .header import OpenStep, gradient_factor
from .sharding import Replicated


class Clipping:
    """The optimizer's ``max_grad_norm`` (``None``: no clipping) and the norm it last clipped
    with (:attr:`norm`)."""

    def __init__(self, max_norm: float | None) -> None:
        self.max_norm = max_norm
        self._norm: float | Tensor | None = None

    @property
    def norm(self) -> float | None:
        """The gradient norm the last step clipped with (``None`` before one has); read from the
        device when asked for, not during the step."""
        if torch.is_tensor(self._norm):
            self._norm = float(host.read(self._norm))
        return self._norm

    @norm.setter
    def norm(self, value: float | Tensor | None) -> None:
        self._norm = value

    def clip_averaged_(self, g: Tensor, layout: FlatLayout, shards: Replicated) -> None:
        """Clip the flat averaged gradient ``g`` (laid out by ``layout``) in place by its global
        norm (whole layers across ``shards``), as ``torch.nn.utils.clip_grad_norm_`` does after
        DDP's allreduce."""
        if self.max_norm is None:
            return
        total = torch.linalg.vector_norm(layer_norms(layout.views(g)))
        total = shards.combine(total.reshape(1))[0]
        self._norm = total
        g.mul_(clip_coefficient(total, self.max_norm))

    def own(
        self, grads: list[Tensor], shards: Replicated, inv_scale: float | Tensor | None
    ) -> list[Tensor]:
        """This rank's gradient norm (``grads`` times ``inv_scale``, whole layers across
        ``shards``) and the coefficient that clips it to ``max_norm``, on the device."""
        norm = torch.linalg.vector_norm(layer_norms(grads))
        norm = shards.combine(norm.reshape(1))[0]
        norm = norm if inv_scale is None else norm * inv_scale
        return [norm, clip_coefficient(norm, self.max_norm)]

    def own_gradient(
        self, grads: list[Tensor | None], shards: Replicated, step: OpenStep, backend: str
    ) -> None:
        """Open a 1-bit gradient step: this rank clips its own gradient before anything is
        sent (SPEC 6), by folding the coefficient into ``step.inv_scale``, which every pass
        multiplies the gradient by. Clipping then costs one read of the gradients (the norm)
        and no pass. A norm that is not finite makes the gradient non-finite, and every rank
        skips the step."""
        if self.max_norm is None:
            return
        present = [g for g in grads if g is not None and not g.is_sparse]
        norm, coefficient = self.own(present, shards, step.inv_scale)
        self._norm = norm
        scaled = coefficient if step.inv_scale is None else coefficient * step.inv_scale
        step.inv_scale = gradient_factor(torch.where(norm.isfinite(), scaled, math.nan), backend)

    def of_mean(self) -> float:
        """The coefficient that clips a 1-bit result sent during backward: ``max_norm`` over
        the mean of the ranks' norms, which the buckets' headers carried (1 without
        clipping)."""
        if self.max_norm is None or self.norm is None:
            return 1.0
        return float(clip_coefficient(torch.tensor(self.norm), self.max_norm))
