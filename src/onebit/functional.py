"""Optimizer math on flat fp32 buffers, kept apart from communication and parameter plumbing.

The forms mirror ``torch.optim.AdamW`` operation for operation, so that the warmup stage gives
AdamW's numbers to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def adam_moments_(m: Tensor, v: Tensor | None, g: Tensor, beta1: float, beta2: float) -> None:
    """``m = β1·m + (1-β1)·g`` and, unless ``v`` is None, ``v = β2·v + (1-β2)·g²``."""
    m.lerp_(g, 1 - beta1)
    if v is not None:
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)


def bias_correction(beta: float, step: int, enabled: bool = True) -> float:
    """``1 - β^step``, or 1 when bias correction is off."""
    return 1 - beta**step if enabled else 1.0


def adam_denominator(v: Tensor, bias_correction2: float, eps: float, out: Tensor) -> Tensor:
    """``sqrt(v / bias_correction2) + eps`` into ``out``, as AdamW computes it."""
    torch.sqrt(v, out=out)
    return out.div_(math.sqrt(bias_correction2)).add_(eps)


def adamw_update_(
    params: list[Tensor],
    numerators: list[Tensor],
    denominators: list[Tensor],
    lr: float,
    weight_decay: float,
    step_scale: float = 1.0,
) -> None:
    """``p = p - lr·(step_scale·numerator/denominator + weight_decay·p)`` for each parameter.

    Decoupled weight decay as AdamW; ``step_scale`` carries ``1/bias_correction1``.
    """
    if not params:
        return
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_addcdiv_(params, numerators, denominators, value=-lr * step_scale)
