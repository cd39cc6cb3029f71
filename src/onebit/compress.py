"""The 1-bit compressor: scale, sign and 8-per-byte packing (SPEC section 1).

Everything here is pure tensor math on one device: no communication, no state.
The communicator (:mod:`onebit.comm`) builds the error-feedback allreduce on it.

Conventions shared with the SPEC:

* ``sign(x)`` is ``+1`` where ``x >= 0`` and ``-1`` elsewhere, so zero maps to ``+1``.
* Bit ``i`` of byte ``k`` holds the sign of element ``8 * k + i`` (1 means ``+1``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

SCALES = ("rms", "mean_abs")
"""Scale rules: ``"rms"`` keeps the norm (the reference's choice); ``"mean_abs"`` minimises
the L2 error."""

_SHIFTS: dict[torch.device, Tensor] = {}


def _shifts(device: torch.device) -> Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return shifts


def check_scale(scale: str) -> str:
    """Return ``scale`` if it names a known scale rule, else raise ``ValueError``."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    return scale


def compute_scale(x: Tensor, scale: str = "rms") -> Tensor:
    """The fp32 scale ``s`` of ``C(x) = s * sign(x)``, as a 0-d tensor on ``x``'s device.

    ``"rms"`` is ``||x||_2 / sqrt(d)``; ``"mean_abs"`` is ``||x||_1 / d``. A non-finite ``x``
    gives a non-finite scale, which is how callers detect overflow without another pass.
    """
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if scale == "rms":
        return torch.linalg.vector_norm(x, dtype=torch.float32) / math.sqrt(x.numel())
    if scale == "mean_abs":
        return torch.linalg.vector_norm(x, 1, dtype=torch.float32) / x.numel()
    raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")


def pack_signs(x: Tensor) -> Tensor:
    """Pack ``sign(x)`` 8 per byte into a ``uint8`` tensor of ``x.numel() // 8`` elements.

    ``x.numel()`` must be a multiple of 8: callers pad (see :func:`padded_numel`).
    """
    if x.numel() % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {x.numel()}")
    bits = (x.reshape(-1, 8) >= 0).to(torch.uint8)
    return (bits << _shifts(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_signs`: ``uint8 [..., k]`` to fp32 ``±1`` of shape ``[..., 8k]``."""
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8).to(torch.float32).mul_(2).sub_(1)


def subtract_compressed_(y: Tensor, s: Tensor, out: Tensor) -> Tensor:
    """``out = y - s * sign(y)``: what compression lost, i.e. the new error-feedback buffer."""
    return torch.where(y >= 0, y - s, y + s, out=out)


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``8 * world_size``, so every chunk is whole bytes."""
    quantum = 8 * world_size
    return -(-numel // quantum) * quantum
