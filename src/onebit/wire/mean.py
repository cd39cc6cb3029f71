"""The fp32 wire format: a full-precision allreduce that averages a bucket in place, as DDP's.

It has no error feedback and one phase: one ``all_reduce`` per bucket. A step's headers ride with
the bucket sent first (the last), in slots of their own after the gradient buffer (see
:class:`~onebit.transport.bucketer.Bucketer`), so the mean of every other bucket carries none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .. import host
from ..stats import count_collective
from .exchange import Exchange
from .protocol import allreduce_bytes, group_size_and_rank


@dataclass
class MeanCall:
    """One bucket's mean in flight: what :meth:`MeanAllreduce.start` returns."""

    average: Tensor  # the bucket's values, averaged in place
    work: dist.Work | None
    slots: Tensor | None = None  # every rank's header, on the bucket that carries them
    verdict: Tensor | None = None  # the 0-d value read with the slots


class MeanAllreduce:
    """The fp32 mean of one bucket across ``group``, in place: a
    :class:`~onebit.wire.protocol.Communicator` with no compression, no error and no phase 2.

    Args:
        numel: the bucket's elements, the ones averaged.
        padded_numel: the bucket as the buffer holds it (the last bucket with its padding);
            ``numel`` if not given.
        group: process group; ``None`` means the default group, or world size 1 if there is none.
        device: the device of the buffers it averages.
        header_numel: fp32 values each rank attaches to a call (0: the bucket carries no
            headers). The buffer a call averages then holds, after the bucket, one slot of
            ``header_numel`` values per rank and one more value, which the step's check writes
            (:meth:`received`); its :attr:`padded_numel` counts them. A slot sums one rank's
            header with the other ranks' zeros, exactly.
    """

    batches = False
    phase1_width = phase2_width = 0  # no Exchange part: each call is an all_reduce of its own

    def __init__(
        self,
        numel: int,
        *,
        padded_numel: int | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        header_numel: int = 0,
    ) -> None:
        self.numel, self.group, self.header_numel = numel, group, header_numel
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.world_size, self.rank = group_size_and_rank(group)
        self.bucket_numel = numel if padded_numel is None else padded_numel
        self.slots_numel = header_numel * self.world_size
        self.padded_numel = self.bucket_numel + (self.slots_numel + 1 if header_numel else 0)
        self._no_headers: Tensor | None = None

    @property
    def bytes_per_call(self) -> int:
        sent = self.bucket_numel + self.slots_numel
        return allreduce_bytes(sent * 4, self.world_size)

    def start(
        self,
        buffer: Tensor,
        header: Tensor | None = None,
        exchange: tuple[Exchange, int] | None = None,
    ) -> MeanCall:
        """Start the sum of ``buffer`` (:attr:`padded_numel` fp32: the bucket, then where it
        carries headers the slots, into which this rank's ``header`` goes, and the verdict
        value). It is a collective of its own: ``exchange`` must be ``None``."""
        if exchange is not None:
            raise ValueError("an fp32 mean is an all_reduce of its own: it takes no exchange")
        if buffer.numel() != self.padded_numel:
            raise ValueError(f"expected {self.padded_numel} values, got {buffer.numel()}")
        slots = verdict = None
        sent = buffer
        if self.header_numel:
            sent, verdict = buffer[:-1], buffer[-1]
            slots = sent[self.bucket_numel :].view(self.world_size, self.header_numel)
            slots.zero_()
            if header is not None:
                slots[self.rank] = header
        work = None
        if self.world_size > 1:
            count_collective()
            work = dist.all_reduce(sent, group=self.group, async_op=True)
        return MeanCall(buffer[: self.numel], work, slots, verdict)

    def _wait(self, call: MeanCall) -> None:
        if call.work is not None:
            call.work.wait()
            call.work = None
            call.average.div_(self.world_size)

    def worker_scales(self, call: MeanCall) -> Tensor:
        """Wait for the sum; the largest magnitude of the mean (finite if every rank's values
        were)."""
        self._wait(call)
        return torch.linalg.vector_norm(call.average, math.inf)

    def headers(self, call: MeanCall) -> Tensor:
        """Every rank's header (none where this bucket carries no headers)."""
        if call.slots is not None:
            return call.slots
        if self._no_headers is None:
            self._no_headers = torch.zeros(self.world_size, 0, device=self.device)
        return self._no_headers

    @classmethod
    def received(
        cls, comms: Sequence[MeanAllreduce], calls: Sequence[MeanCall]
    ) -> tuple[Tensor, Tensor]:
        """Wait for every bucket's sum; the headers the last bucket carries, and the largest
        magnitude of the whole mean, written in the value after them so that the step reads
        both at once. Where the buckets lie end to end (the gradient buffer's) one max-norm
        covers them: not ``isfinite(grads).all()``, which makes model-sized temporaries."""
        for comm, call in zip(comms, calls):
            comm._wait(call)
        carrier = calls[-1]
        if carrier.slots is None or carrier.verdict is None:
            raise ValueError("the last bucket's mean carries the step's headers")
        whole = host.span([call.average for call in calls])
        if whole is None:
            largest = torch.stack([c.worker_scales(call) for c, call in zip(comms, calls)])
            torch.amax(largest, 0, out=carrier.verdict)
        else:
            torch.linalg.vector_norm(whole, math.inf, out=carrier.verdict)
        return carrier.slots, carrier.verdict

    def serve(self, call: MeanCall, *, exchange: tuple[Exchange, int] | None = None) -> None:
        """Nothing: the mean has no phase 2."""

    def finish(self, call: MeanCall, out: Tensor | None) -> None:
        """Write the mean into ``out``, unless it is the buffer the mean is in."""
        if out is not None and out.data_ptr() != call.average.data_ptr():
            out.copy_(call.average)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to load: the mean keeps no error."""

    def reset(self) -> None:
        """Nothing to zero: the mean keeps no error."""
