"""A DDP communication hook for models that a framework wraps in ``DistributedDataParallel``.

HF Trainer, Accelerate and Lightning wrap the model in DDP themselves. Left alone, DDP averages
the gradients during backward and the onebit optimizer then averages them again, compressing
an already-averaged momentum: training runs, but it is no longer 1-bit Adam and sends the full
fp32 traffic as well. Registering :func:`ddp_comm_hook` hands all gradient communication to
the optimizer.
"""

import torch
import torch.distributed as dist
from torch import Tensor

from .optim.base import CompressedOptimizer

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.


def ddp_comm_hook(
    state: CompressedOptimizer, bucket: dist.GradBucket
) -> torch.futures.Future[Tensor]:
    """DDP communication hook that leaves every gradient local, for the onebit optimizer.

    Register it with the optimizer as its state::

        ddp_model.register_comm_hook(optimizer, onebit.ddp_comm_hook)

    DDP then sends nothing: each rank keeps its own gradient, and ``optimizer.step()``
    averages it (fp32 in warmup, 1 bit after), exactly as on the bare model. Training is
    bitwise the same as the optimizer on the unwrapped model, with gradient accumulation under
    ``ddp_model.no_sync()`` and with ``find_unused_parameters=True``. DDP still broadcasts the
    parameters and buffers from rank 0 as usual.

    With ``overlap_backward=True`` DDP's hook calls tell the optimizer when gradients are
    final, so its buckets start during backward and ``ddp_model.no_sync()`` defers them, as
    DDP's own allreduce would be.
    """
    if not isinstance(state, CompressedOptimizer):
        raise TypeError(
            "onebit.ddp_comm_hook needs the onebit optimizer as its state: "
            f"ddp_model.register_comm_hook(optimizer, onebit.ddp_comm_hook), got {type(state)}"
        )
    state.bucketer.ddp_bucket_ready(bucket.parameters())
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
