"""onebit: communication-compressed optimizers of the 1-bit Adam family for torch.distributed.

Layers, each depending only on those before it:

* :mod:`onebit.compress`: sign, scale and 8-per-byte packing;
* :mod:`onebit.comm`: :class:`CompressedAllreduce`, the error-compensated 1-bit allreduce;
* the optimizers: :class:`OnebitAdam`.
"""

from .adam import OnebitAdam
from .comm import CompressedAllreduce
from .stats import CommStats

__all__ = ["CommStats", "CompressedAllreduce", "OnebitAdam"]
__version__ = "0.1.0"
