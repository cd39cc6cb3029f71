"""The optimizers ``onebit train`` can run, and how each one communicates.

``adamw`` is the baseline everybody uses: ``torch.optim.AdamW`` with the model wrapped in
``DistributedDataParallel``. ``lamb`` is plain LAMB on fp32-averaged gradients: a
:class:`onebit.OnebitLamb` that never leaves its warmup, where it is exactly LAMB. The three
1-bit optimizers own their communication and wrap nothing.

Bytes are counted on one convention for all: what a bandwidth-optimal collective sends from each
rank (``2(n-1)/n`` of the buffer for an allreduce).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import onebit
from onebit.comm import allreduce_bytes

OPTIMIZERS = ("adamw", "onebit-adam", "zero-one-adam", "lamb", "onebit-lamb")

REFERENCE = {"onebit-adam": "adamw", "zero-one-adam": "adamw", "onebit-lamb": "lamb"}
"""The uncompressed optimizer each 1-bit optimizer is measured against."""

_CLASSES = {
    "onebit-adam": "OnebitAdam",
    "zero-one-adam": "ZeroOneAdam",
    "lamb": "OnebitLamb",
    "onebit-lamb": "OnebitLamb",
}

NEVER = 2**62
"""A freeze step no run reaches: keeps OnebitLamb in its exact-LAMB warmup."""


class OptimizerUnavailable(ValueError):
    """The optimizer is not in this installation of onebit. Its message is user-facing."""


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class behind ``name``, or :class:`OptimizerUnavailable` if onebit lacks it."""
    if name == "adamw":
        return torch.optim.AdamW
    cls = getattr(onebit, _CLASSES[name], None)
    if cls is None:
        raise OptimizerUnavailable(
            f"optimizer {name!r} needs onebit.{_CLASSES[name]}, which this version of onebit "
            "does not have"
        )
    return cls


def is_compressed(name: str) -> bool:
    """Whether ``name`` sends 1-bit compressed messages (and so has error feedback)."""
    return name in REFERENCE


def default_lr(name: str) -> float:
    """A learning rate that suits the built-in models: LAMB's trust ratio wants a larger one."""
    return 1e-2 if name in ("lamb", "onebit-lamb") else 2e-3


def default_freeze_step(name: str, steps: int) -> int | str:
    """Warmup length of the 1-bit optimizers: 20% of the run, as the papers suggest (15-25%)."""
    return max(1, steps // 5)


@dataclass
class Trainer:
    """What the training loop needs from an optimizer.

    Attributes:
        model: the module to run forward and backward (the DDP wrapper for ``adamw``).
        optimizer: the optimizer; call ``step()`` on every rank.
        stage: returns the stage the last step ran in (``"fp32"`` for uncompressed optimizers).
        last_step_bytes: returns the bytes this rank sent in the last step.
        freeze_step: the 1-bit optimizer's warmup length as passed to it (None if it has none).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    stage: Callable[[], str]
    last_step_bytes: Callable[[], int]
    freeze_step: int | str | None = None


def build(
    name: str,
    model: nn.Module,
    param_groups: list[dict],
    *,
    lr: float,
    freeze_step: int | str | None,
    steps: int,
) -> Trainer:
    """Make optimizer ``name`` for ``model`` on the initialised default process group.

    ``freeze_step`` is the 1-bit optimizers' warmup (``var_freeze_step`` for 0/1 Adam);
    ``None`` picks :func:`default_freeze_step`. Every rank must call this with the same arguments.
    """
    cls = optimizer_class(name)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if freeze_step is None:
        freeze_step = default_freeze_step(name, steps)
    if name == "adamw":
        optimizer = torch.optim.AdamW(param_groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
        numel = sum(p.numel() for p in model.parameters())
        per_step = allreduce_bytes(4 * numel, world_size)
        if world_size > 1:
            model = nn.parallel.DistributedDataParallel(model)
        return Trainer(model, optimizer, lambda: "fp32", lambda: per_step)
    if name == "lamb":
        optimizer = cls(param_groups, lr=lr, freeze_step=NEVER)
        return Trainer(model, optimizer, lambda: "fp32", lambda: _last_bytes(optimizer))
    if name == "zero-one-adam":
        optimizer = cls(param_groups, lr=lr, var_freeze_step=freeze_step)
    else:
        optimizer = cls(param_groups, lr=lr, freeze_step=freeze_step)
    return Trainer(
        model,
        optimizer,
        lambda: optimizer.comm_stats.last_step_stage,
        lambda: _last_bytes(optimizer),
        freeze_step,
    )


def _last_bytes(optimizer: torch.optim.Optimizer) -> int:
    return optimizer.comm_stats.last_step_bytes


def drop_error_feedback(optimizer: torch.optim.Optimizer) -> None:
    """Zero every error buffer of a 1-bit optimizer (call after each step).

    With the errors zeroed before every call, each compressed allreduce is plain 1-bit
    compression: what it loses is lost for good. A research ablation, not for real runs.
    """
    for comm in getattr(optimizer, "comms", ()):
        comm.reset()
