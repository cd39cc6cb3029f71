"""The fp32 wire format: a full-precision allreduce that averages a bucket in place, as DDP's.

It has no error feedback and no phases: one ``all_reduce`` per bucket. A step's headers ride in
slots of their own after the gradient buffer (see :class:`~onebit.transport.bucketer.Bucketer`),
so the mean of every bucket but that one carries none.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from .protocol import allreduce_bytes, group_size_and_rank


class MeanAllreduce:
    """A full-precision allreduce that averages ``buffer`` in place, started at construction.

    Call :meth:`wait` to complete it. ``bytes_sent`` is what this rank sends. With ``average``
    (a view of the front of ``buffer``) only that part is divided by the world size; the rest is
    left summed, which lets each rank contribute a slot of its own (a sum of one value and zeros
    is exact).
    """

    def __init__(
        self,
        buffer: Tensor,
        group: dist.ProcessGroup | None = None,
        average: Tensor | None = None,
    ) -> None:
        self.buffer = buffer
        self.average = buffer if average is None else average
        self.world_size, _ = group_size_and_rank(group)
        self.bytes_sent = allreduce_bytes(buffer.numel() * buffer.element_size(), self.world_size)
        self._work = None
        if self.world_size > 1:
            self._work = dist.all_reduce(buffer, group=group, async_op=True)

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self.average.div_(self.world_size)
        return self.buffer
