"""The settings every onebit optimizer takes beside its own hyperparameters, their defaults, and
the checks of them and of the parameters it is given."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..kernels.errors import check_error_dtype
from ..state.layout import FlatLayout

DEFAULT_BUCKET_SIZE = 2**22
"""Elements per compressed bucket (16 MiB of fp32). Smaller buckets overlap better, larger ones
send fewer messages."""

MAX_BUCKET_SIZE = 2**30
"""The largest ``bucket_size`` (4 GiB of fp32): the GPU kernels index a bucket with 32 bits."""

WARMUP_COMPRESSION = ("fp32", "bf16", "int8", "int4")
"""How the warmup averages gradients: ``"fp32"`` is an fp32 allreduce, exactly DDP; the others
go through :class:`~onebit.wire.quantized.QuantizedAllreduce` with error feedback."""

DEFAULT_WARMUP_COMPRESSION = "int4"
"""1-bit Adam's and 1-bit LAMB's warmup: int4 gradients with error feedback, 8 times fewer
bytes than fp32. With ``freeze_step="auto"`` it is what keeps whole runs at 15x and more fewer
bytes than an fp32 allreduce within 1% of AdamW's (and LAMB's) loss on the convergence tasks of
``BENCHMARKS.md``, where int8 sends twice the warmup's bytes."""

SCALE_PER = ("tensor", "bucket")
"""What gets its own 1-bit scale: ``"tensor"`` (default), each parameter's part of a bucket, so
that no tensor's magnitude sets another's step; ``"bucket"``, one scale per bucket as SPEC 2."""


SHARED_OPTIONS = (
    "process_group",
    "bucket_size",
    "scale_per",
    "exp_avg_mask",
    "max_grad_norm",
    "overlap_backward",
    "warmup_compression",
    "error_dtype",
    "allow_edited_grads",
)
"""The settings that :class:`~onebit.optim.base.CompressedOptimizer`'s constructor takes from every
optimizer that has them (each documents its own): see :func:`shared_options`."""


def shared_options(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """Those of :data:`SHARED_OPTIONS` among ``arguments``, an optimizer constructor's
    ``locals()``: each optimizer lists in its signature the settings it takes, and passes them
    on to the base in one line, ``super().__init__(..., **shared_options(locals()))``."""
    return {name: arguments[name] for name in SHARED_OPTIONS if name in arguments}


SHARED_DOCS = {
    "process_group": """the data-parallel group; ``None`` is the default group, or a single
    process if ``torch.distributed`` is not initialised.""",
    "bucket_size": """elements per communication bucket, rounded down to a multiple of
    ``8 * world_size``.""",
    "scale_per": """``"tensor"`` (default) gives each parameter's part of a bucket its own 1-bit
    scale, so that a large tensor (an embedding, say) does not set the steps of the small
    ones sharing its bucket; ``"bucket"`` is one scale per bucket (SPEC 2, the reference
    implementation). Each scale costs 4 bytes per message.""",
    "allow_edited_grads": """``False`` (default): ``step()`` raises on every rank if a
    ``.grad`` was changed between the last backward and ``step()`` by anything but the
    optimizer: ``clip_grad_norm_``, ``clip_grad_value_``, ``scaler.unscale_`` or an in-place
    edit would change each rank's gradient before the ranks' gradients are averaged or
    compressed, not the average as under DDP (use ``max_grad_norm``, and let the optimizer
    unscale). The check reads version counters: no pass over the data. ``True`` says the edit
    is meant, and the same on every rank (a fixed rescaling, say).""",
}  # fmt: skip
"""What the argument list says of the settings that every optimizer documents alike, by name
(continued lines indented by four): a docstring line ``{name}`` stands for the entry
(:func:`with_shared_docs`)."""


def with_shared_docs(cls: type) -> type:
    """Write each line of ``cls``'s docstring that is only ``{name}``, a name of
    :data:`SHARED_DOCS`, as that setting's entry, indented as the line (torch composes its
    optimizers' shared argument docs the same way)."""

    def entry(match: re.Match) -> str:
        indent, name = match.groups()
        lines = f"{name}: {SHARED_DOCS[name]}".splitlines()
        return "\n".join(indent + line for line in lines)

    if cls.__doc__:  # None under python -OO
        cls.__doc__ = re.sub(r"^( *)\{(\w+)\}$", entry, cls.__doc__, flags=re.M)
    return cls


def check_step_count(name: str, value: Any, minimum: int = 1) -> int:
    """Return ``value`` if it is an int ``>= minimum``, else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_options(
    bucket_size: int,
    scale_per: str,
    warmup_compression: str,
    error_dtype: torch.dtype,
    max_grad_norm: float | None,
) -> float | None:
    """Check the settings that do not depend on the parameters; return ``max_grad_norm`` as a
    float (or ``None``)."""
    check_step_count("bucket_size", bucket_size)
    if bucket_size > MAX_BUCKET_SIZE:
        raise ValueError(f"bucket_size must be at most 2**30, got {bucket_size}")
    if scale_per not in SCALE_PER:
        raise ValueError(f"scale_per must be one of {SCALE_PER}, got {scale_per!r}")
    check_error_dtype(error_dtype)
    if warmup_compression not in WARMUP_COMPRESSION:
        raise ValueError(
            f"warmup_compression must be one of {WARMUP_COMPRESSION}, got {warmup_compression!r}"
        )
    if max_grad_norm is not None and not (
        isinstance(max_grad_norm, (int, float)) and 0 < max_grad_norm < math.inf
    ):
        raise ValueError(f"max_grad_norm must be None or a number > 0, got {max_grad_norm!r}")
    return None if max_grad_norm is None else float(max_grad_norm)


def check_same_in_every_group(groups: list[dict[str, Any]], keys: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless each of ``keys`` is the same in every param group (what acts
    on whole buckets)."""
    for key in keys:
        values = {repr(g[key]) for g in groups}
        if len(values) > 1:
            raise ValueError(f"{key} must be the same in every param group, got {values}")


def check_parameters(params: list[Tensor]) -> None:
    """Raise ``ValueError`` for parameters the flat fp32 layout cannot hold."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    if any(p.is_meta for p in params):
        raise ValueError(
            "parameters are on the meta device (no data yet): materialise the model "
            "(model.to_empty(device=...) and load or initialise the weights) before building "
            "the optimizer"
        )
    if any(not p.is_floating_point() for p in params):
        raise ValueError("all parameters must be floating point")


def check_masks(masks: Mapping[Tensor, Tensor], layout: FlatLayout) -> list[tuple[int, Tensor]]:
    """Validate ``exp_avg_mask``; return ``(offset in the flat buffers, flat uint8 mask)``, each
    mask in the flat buffers' order (a byte per entry: multiplying by it is multiplying by 0.0
    or 1.0)."""
    where = {id(p): i for i, p in enumerate(layout.params)}
    checked = []
    for p, mask in masks.items():
        if id(p) not in where:
            raise ValueError("exp_avg_mask has a tensor that is not one of the optimizer's params")
        if not torch.is_tensor(mask) or mask.shape != p.shape:
            raise ValueError(
                f"exp_avg_mask of shape {tuple(getattr(mask, 'shape', ()))} for a parameter of "
                f"shape {tuple(p.shape)}"
            )
        mask = mask.detach()
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("exp_avg_mask must hold only 0s and 1s: each momentum entry is kept "
                             "or zeroed")  # fmt: skip
        i = where[id(p)]
        flat = layout.flat(i, mask.to(device=p.device, dtype=torch.uint8))
        checked.append((layout.offsets[i], flat))
    return sorted(checked, key=lambda item: item[0])


def apply_masks_(flat: Tensor, masks: list[tuple[int, Tensor]]) -> None:
    """Zero the masked-out entries of the flat momentum ``flat``: ``masks`` as
    :func:`check_masks` returns them (``exp_avg_mask``)."""
    for offset, mask in masks:
        flat[offset : offset + mask.numel()].mul_(mask)
