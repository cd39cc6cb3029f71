"""Optimizer math on flat fp32 buffers, kept apart from communication and parameter plumbing.

The forms mirror ``torch.optim.AdamW`` operation for operation, so that the warmup stage gives
AdamW's numbers to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .state.layout import memory_strides


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


def fill_zero_variance_(
    variances: list[Tensor], floor: float = 0.0, out: list[Tensor] | None = None
) -> None:
    """Give each entry whose variance is at most ``floor`` the mean variance of its tensor's other
    entries (of every tensor's, for a tensor with none); write into ``out`` (default: in place).
    Where no entry is that small, the values are copied unchanged.

    Such a variance means no gradient reached the entry (a bias that softmax ignores, an
    embedding row no batch used, a dead unit), so Adam's own update there is about 0/eps. Once
    the momentum is sent in 1 bit it is never 0 there, and ``±scale / (sqrt(v) + eps)`` would be
    a step of about ``lr·scale/eps``. With its tensor's typical variance the entry instead moves
    as far as its neighbours do, which error feedback cancels over the next steps (it tracks a
    momentum of zero), and which is the right size should a gradient arrive later. Taking the
    mean of ``v``, not of ``sqrt(v)``, errs towards larger denominators: smaller steps.
    The optimizers pass ``floor = eps² · (1 - β2^t)``: entries whose ``sqrt(v̂)`` is at most
    ``eps``, where Adam's denominator is mostly ``eps`` (float rounding leaves such tiny
    gradients where the exact one is 0, as in a key bias).
    """
    out = variances if out is None else out
    sums, counts = zip(*(_sum_above(v, floor) for v in variances)) if variances else ((), ())
    total = sum(counts)
    overall = sum(sums) / total if total else 0.0
    for v, o, sum_, count in zip(variances, out, sums, counts):
        if count == v.numel() or total == 0:
            if o is not v:
                o.copy_(v)
            continue
        fill = torch.tensor(sum_ / count if count else overall, dtype=v.dtype, device=v.device)
        for part, into in zip(_elements(v).split(_BLOCK), _elements(o).split(_BLOCK)):
            torch.where(part <= floor, fill, part, out=into)


_BLOCK = 1 << 20
"""Elements :func:`fill_zero_variance_` takes at a time: its temporaries are a few of these, not
a few of the largest tensor (an embedding can be a tenth of a model)."""


def _elements(t: Tensor) -> Tensor:
    """``t``'s elements as a 1-D view in memory order: ``t`` is contiguous or fills its memory
    (``channels_last``, as the flat layout's views of such a parameter)."""
    if t.is_contiguous():
        return t.view(-1)
    if memory_strides(t) != t.stride():
        raise ValueError(f"a tensor of strides {t.stride()} does not fill its memory")
    return t.as_strided((t.numel(),), (1,))


def _sum_above(v: Tensor, floor: float) -> tuple[float, int]:
    """The fp64 sum of ``v``'s entries that are not at most ``floor``, and their number, a block
    at a time, read once."""
    total = torch.zeros((), dtype=torch.float64, device=v.device)
    count = torch.zeros((), dtype=torch.int64, device=v.device)
    for part in _elements(v).split(_BLOCK):
        small = part <= floor
        total += torch.where(small, 0.0, part).sum(dtype=torch.float64)
        count += part.numel() - small.sum()
    return float(total), int(count)


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


def layer_norms(tensors: list[Tensor], ord: float = 2.0) -> Tensor:
    """Each tensor's ``ord``-norm (accumulated in fp32) as one fp32 vector, one entry per layer.

    Empty tensors have norm 0. Used for LAMB's trust ratios and the ``"auto"`` freeze statistic.
    """
    if not tensors:
        return torch.zeros(0)
    present = [t for t in tensors if t.numel()]
    if all(t.dtype == torch.float32 for t in present):
        norms = list(torch._foreach_norm(present, ord)) if present else []
    else:  # fp16/bf16 accumulate in fp32; fp64 in fp64, then rounds
        norms = [
            torch.linalg.vector_norm(
                t, ord, dtype=torch.promote_types(t.dtype, torch.float32)
            ).float()
            for t in present
        ]
    if len(present) < len(tensors):
        zero = torch.zeros((), device=tensors[0].device)
        it = iter(norms)
        norms = [next(it) if t.numel() else zero for t in tensors]
    return torch.stack(norms)


def clip_coefficient(total_norm: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``."""
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)


def momentum_from_grads_(
    exp_avgs: list[Tensor], grads: list[Tensor | None], beta1: float, scale: float | None = None
) -> None:
    """``m = β1·m + (1-β1)·scale·g`` per parameter, reading ``.grad`` as it is.

    ``grads`` may be any floating dtype (promoted to fp32); ``None`` is a zero gradient.
    ``scale`` (an inverse loss scale, a clipping coefficient) multiplies each gradient in fp32
    first, one parameter at a time.
    """
    zero = None
    same = [(m, g) for m, g in zip(exp_avgs, grads) if g is not None and g.dtype == m.dtype]
    if same and scale is None:
        torch._foreach_lerp_([m for m, _ in same], [g for _, g in same], 1 - beta1)
    for m, g in zip(exp_avgs, grads):
        if g is None:
            if zero is None:
                zero = torch.zeros((), dtype=m.dtype, device=m.device)
            m.lerp_(zero, 1 - beta1)
        elif scale is not None:
            m.lerp_(g.to(m.dtype).mul(scale), 1 - beta1)
        elif g.dtype != m.dtype:
            m.lerp_(g.to(m.dtype), 1 - beta1)


def trust_ratio(
    weight_norms: Tensor, update_norms: Tensor, min_coeff: float, max_coeff: float
) -> Tensor:
    """LAMB's per-layer ``clip(||p|| / ||update||, min_coeff, max_coeff)``; 1 where a norm is 0."""
    valid = (weight_norms > 0) & (update_norms > 0)
    ratio = (weight_norms / torch.where(valid, update_norms, 1.0)).clamp_(min_coeff, max_coeff)
    return torch.where(valid, ratio, torch.ones_like(ratio))


def momentum_scaling(norms: Tensor, numels: list[int]) -> Tensor:
    """1-bit LAMB's per-layer momentum scaling ``mean(s) / s_l`` with ``s_l = ||m_l|| / sqrt(d_l)``,
    from each layer's momentum norm ``||m_l||`` (a CPU vector) and size ``d_l``.

    Scaling every layer's momentum to a common RMS lets one 1-bit scale fit the whole model.
    Layers with zero momentum (or no elements) get 1 and do not enter the mean.
    """
    rms = norms / torch.tensor([float(n) for n in numels]).clamp(min=1).sqrt()
    valid = rms > 0
    if not bool(valid.any()):
        return torch.ones(len(numels))
    mean = rms[valid].mean()
    return torch.where(valid, mean / torch.where(valid, rms, 1.0), torch.ones_like(rms))


def lamb_factor(
    raw: Tensor,
    last: Tensor,
    factor_min: float,
    factor_max: float,
    threshold: float,
    update_ratio: Tensor | None = None,
) -> Tensor:
    """1-bit LAMB's per-layer correction of the frozen trust ratio.

    ``raw`` is ``max((sqrt(v_T)+eps) / (sqrt(v_fresh)+eps))`` over each layer. With weight decay,
    ``update_ratio = min(1, ||adaptive part|| / ||update||)`` blends it towards 1 in proportion to
    the part of the update that does not depend on the variance (as the reference does). The
    result is clipped to ``[factor_min, factor_max]``, then to within ``last·(1 ± threshold)``.
    """
    factor = raw
    if update_ratio is not None:
        factor = factor * update_ratio + (1 - update_ratio)
    factor = factor.clamp(factor_min, factor_max)
    return torch.minimum(torch.maximum(factor, last * (1 - threshold)), last * (1 + threshold))


def scaled_sub_(params: list[Tensor], updates: list[Tensor], step_sizes: list[float]) -> None:
    """``p = p - step_size·update`` per parameter, scaling ``updates`` in place."""
    if params:
        torch._foreach_mul_(updates, step_sizes)
        torch._foreach_sub_(params, updates)
