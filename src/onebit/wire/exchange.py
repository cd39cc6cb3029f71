"""One collective for the same phase of many calls: a step's buckets sent together.

A compressed allreduce has two phases, each one collective: phase 1 sends row ``j`` of each
rank's message to rank ``j`` (an all-to-all), phase 2 sends each rank's row to every rank (an
all-gather; :func:`start_gather`). Started one bucket at a time, a step makes two collectives
per bucket, and on many nodes their latency, not their bytes, sets the step's time. When a step
starts every bucket at once (without ``overlap_backward``), an :class:`Exchange` holds the
messages of all of them in one buffer, each bucket writing its own part, and sends it in one
collective: two per step, whatever the number of buckets. The bytes each rank receives are the
same, in the same places of each bucket's rows, so the results are bit for bit those of one
collective per bucket.

The communicators take an exchange and a part where they would otherwise allocate and send
their own message (:class:`~onebit.wire.comm.CompressedAllreduce`,
:class:`~onebit.wire.quantized.QuantizedAllreduce`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..stats import count_collective

ALIGN = 16
"""Bytes each part's offset in a row is a multiple of: its scales can be read as fp32 in place."""

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def start_gather(out: Tensor, message: Tensor, group: dist.ProcessGroup | None) -> dist.Work:
    """Start phase 2: every rank's ``message`` into row ``r`` of ``out`` (``[n, bytes]``) on
    every rank, asynchronously.

    On gloo it is an all-to-all of the message to every rank. gloo sends a message once its
    receiver is ready for it, a round trip of the link each; its all-gather passes the rows round
    a ring, ``n - 1`` round trips, where its all-to-all sends them all at once, in one. Each rank
    sends the same ``n - 1`` rows either way, so a compressed exchange on gloo waits two round
    trips, not ``n``: what decides a step on a long link. Other backends keep their all-gather.
    """
    if _backend(group, message.device) != "gloo":
        return _all_gather_single(out, message, group=group, async_op=True)
    copies = message.reshape(1, -1).expand(out.shape[0], -1).contiguous()
    return dist.all_to_all_single(out.view(out.shape[0], -1), copies, group=group, async_op=True)


def _backend(group: dist.ProcessGroup | None, device: torch.device) -> str:
    """The backend that runs ``group``'s collectives on ``device``'s tensors."""
    backend = str(dist.get_backend(group))
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        return dict(part.split(":") for part in backend.split(",")).get(device.type, "")
    return backend


def part_offsets(widths: Sequence[int]) -> tuple[list[int], int]:
    """Where each part of an exchange of these ``widths`` starts in a row, and the row's bytes."""
    offsets, total = [], 0
    for width in widths:
        offsets.append(total)
        total += -(-width // ALIGN) * ALIGN
    return offsets, total


class Exchange:
    """The messages of one phase of several calls, sent as one collective.

    Args:
        widths: the bytes of each call's message row (part ``i`` of every row).
        world_size, group: the group the calls belong to (``world_size`` 1: nothing is sent).
        device: where the messages are.
        gather: phase 2, an all-gather of one row per rank; else phase 1, an all-to-all of
            ``world_size`` rows.

    Fill :meth:`part` ``i`` for every call inside ``with exchange.filling():``, which sends it
    once; :meth:`received` then gives call ``i``'s rows from every rank, ``[world_size,
    widths[i]]`` (rows strided).

    Attributes:
        message: every part, ``[rows, bytes]`` (one row per rank in phase 1, one in phase 2),
            part ``i`` at byte ``offsets[i]`` of each row, for a writer that fills all at once.
    """

    def __init__(
        self,
        widths: list[int],
        world_size: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        gather: bool,
    ) -> None:
        self.widths, self.world_size, self.group, self.gather = widths, world_size, group, gather
        self.offsets, total = part_offsets(widths)
        rows = 1 if gather else world_size
        self.message = torch.empty(rows, total, dtype=torch.uint8, device=device)
        self._received: Tensor | None = None
        self._work: dist.Work | None = None

    def part(self, i: int) -> Tensor:
        """Call ``i``'s message to fill: ``[world_size, widths[i]]`` bytes (phase 1; row ``j``
        goes to rank ``j``), or ``[widths[i]]`` (phase 2)."""
        part = self.message[:, self.offsets[i] : self.offsets[i] + self.widths[i]]
        return part[0] if self.gather else part

    def send(self, void: bool = False) -> None:
        """Start the one collective, once every part is filled. ``void``: send zeros instead,
        as a rank does that failed while filling its parts, so that the other ranks' collective
        completes and their step sees a header of zeros (a call that disagrees) and raises."""
        if self._received is not None:
            raise RuntimeError("this exchange was already sent")
        message, n = self.message, self.world_size
        if void:
            message.zero_()
        if n == 1:
            self._received = message
            return
        count_collective()
        if self.gather:
            received = message.new_empty(n, message.shape[1])
            self._work = start_gather(received, message, self.group)
            self._received = received
        else:
            received = torch.empty_like(message)
            self._work = dist.all_to_all_single(received, message, group=self.group,
                                                async_op=True)  # fmt: skip
            self._received = received

    @contextmanager
    def filling(self) -> Iterator[Exchange]:
        """Fill the parts inside the ``with`` block; :meth:`send` at its end, or, if it raises,
        ``send(void=True)`` before the exception goes on, so that no other rank waits."""
        try:
            yield self
        except BaseException:
            self.send(void=True)
            raise
        self.send()

    def received(self, i: int | None = None) -> Tensor:
        """Wait for the collective; call ``i``'s rows from every rank, in rank order (``None``:
        every part, ``[world_size, bytes]`` contiguous)."""
        if self._received is None:
            raise RuntimeError("the exchange was not sent")
        if self._work is not None:
            self._work.wait()
            self._work = None
        if i is None:
            return self._received
        return self._received[:, self.offsets[i] : self.offsets[i] + self.widths[i]]


def phase_exchange(comms: Sequence[Any], phase: int) -> Exchange:
    """The exchange of phase ``phase`` (1 or 2) of one call of each of ``comms``, communicators
    of one group and device (their ``phase1_width`` or ``phase2_width`` bytes a row)."""
    first = comms[0]
    widths = [c.phase1_width if phase == 1 else c.phase2_width for c in comms]
    return Exchange(widths, first.world_size, first.group, first.device, gather=phase == 2)
