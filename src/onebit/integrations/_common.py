"""What every framework adapter does with a DDP model: hand its gradient communication to the
onebit optimizer."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from ..ddp_hook import ddp_comm_hook
from ..optim.base import CompressedOptimizer


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
