"""What every framework adapter does: find the onebit optimizer inside the framework's wrapper,
and hand the gradient communication of the framework's DDP model to it."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..base import CompressedOptimizer
from ..ddp_hook import ddp_comm_hook


def onebit_optimizer(optimizer: Any, where: str) -> CompressedOptimizer:
    """The onebit optimizer that ``optimizer`` is or wraps (Accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``); ``TypeError`` naming ``where`` if there is none."""
    inner = optimizer
    for attribute in ("optimizer", "_optimizer"):  # Accelerate, Lightning
        if not isinstance(inner, CompressedOptimizer) and hasattr(inner, attribute):
            inner = getattr(inner, attribute)
    if not isinstance(inner, CompressedOptimizer):
        raise TypeError(
            f"{where} needs a onebit optimizer (OnebitAdam, ZeroOneAdam or OnebitLamb), "
            f"got {type(optimizer).__name__}"
        )
    return inner


def hand_gradients_to(model: torch.nn.Module, optimizer: CompressedOptimizer) -> None:
    """Register :func:`onebit.ddp_comm_hook` on ``model`` if it is a DDP model, once.

    Without it DDP averages every gradient in fp32 during backward and the optimizer then
    compresses an average: the run trains, but it is not 1-bit Adam and saves no bytes.
    """
    if not isinstance(model, DistributedDataParallel):
        return
    for hook, state in model._comm_hooks:
        if hook is ddp_comm_hook and state is optimizer:
            return
        raise RuntimeError(
            f"the DDP model already has the communication hook {hook.__qualname__}; a onebit "
            "optimizer does all gradient communication itself, so remove that hook"
        )
    model.register_comm_hook(optimizer, ddp_comm_hook)
