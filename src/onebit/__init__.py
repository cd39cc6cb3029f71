"""onebit: communication-compressed optimizers of the 1-bit Adam family for torch.distributed.

Layers, each depending only on those before it:

* :mod:`onebit.compress`: sign, scale and 8-per-byte packing;
* :mod:`onebit.wire.comm`: :class:`CompressedAllreduce`, the error-compensated 1-bit allreduce;
* the optimizers: :class:`OnebitAdam`, :class:`ZeroOneAdam`, :class:`OnebitLamb`
  (``freeze_step="auto"``: :class:`AutoFreeze`);
* :func:`ddp_comm_hook`, for models a framework wraps in ``DistributedDataParallel``;
* :mod:`onebit.fsdp`, for models FSDP2 shards inside a node (``onebit.fsdp.attach``).
"""

from . import fsdp
from .ddp_hook import ddp_comm_hook
from .freeze import AutoFreeze
from .optim.adam import OnebitAdam
from .optim.lamb import OnebitLamb
from .optim.zero_one_adam import ZeroOneAdam
from .stats import CommStats
from .wire.comm import CompressedAllreduce

__all__ = [
    "AutoFreeze",
    "CommStats",
    "CompressedAllreduce",
    "OnebitAdam",
    "OnebitLamb",
    "ZeroOneAdam",
    "ddp_comm_hook",
    "fsdp",
]
__version__ = "0.1.0"
