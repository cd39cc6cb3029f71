"""The warmup's quantized allreduce of every bucket of a flat layout at once, where the backend
runs each phase over all of them (the Triton kernels:
:class:`~onebit.kernels.triton_quantized.BlockQuantizer` of every bucket).

A bucket at a time (:class:`~onebit.wire.quantized.QuantizedAllreduce`), a warmup step makes a few
launches and torch ops per bucket; here each pass is one launch over the buckets laid end to
end, and each phase one collective (:class:`~onebit.wire.exchange.Exchange`) whose messages the
kernels write and read in place. The bits are those of a bucket at a time: the communicators
keep their error buffers, as slices of one buffer each, and their state as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from .. import kernels
from ..state.layout import FlatLayout
from .exchange import Exchange, part_offsets, phase_exchange
from .quantized import QuantizedAllreduce


class ModelQuantized:
    """Every bucket's quantized allreduce at once, for the warmup communicators of a flat layout
    (one per bucket). Make it with :meth:`build`.

    Args:
        layout: the optimizer's flat layout.
        comms: its warmup communicators, one per bucket, of one group, device and format.
        quantizer: the backend's kernels of every bucket at once.
    """

    def __init__(self, layout: FlatLayout, comms: list[QuantizedAllreduce], quantizer: Any) -> None:
        self.layout, self.comms, self.quantizer = layout, comms, quantizer
        self.world_size = n = comms[0].world_size
        self.device = comms[0].device
        self._errors: tuple[Tensor, Tensor, list[Tensor], list[Tensor]] | None = None
        # Where each rank's largest |y| of each bucket, then its header (the last bucket's: a
        # step's are all the same), lie in the phase-1 message, as fp32; and a last slot.
        parts, width = part_offsets([c.phase1_width for c in comms])
        largest = [(r * width + p + c.phase1_width - 4 * (1 + c.header_numel)) // 4
                   for r in range(n) for c, p in zip(comms, parts)]  # fmt: skip
        header = [(r * width + parts[-1] + comms[-1].phase1_width) // 4 - comms[-1].header_numel + i
                  for r in range(n) for i in range(comms[-1].header_numel)]  # fmt: skip
        self._read = torch.tensor(largest + header + [0], device=self.device)
        self._largest = len(largest)

    @classmethod
    def build(cls, layout: FlatLayout, comms: list[QuantizedAllreduce]) -> ModelQuantized | None:
        """The allreduce of every bucket of ``layout`` through ``comms`` at once, or ``None``
        where the backend runs them a bucket at a time (or a bucket is empty)."""
        if not comms or not all(c.numel for c in comms):
            return None
        first = comms[0]
        parts1, _ = part_offsets([c.phase1_width for c in comms])
        parts2, _ = part_offsets([c.phase2_width for c in comms])
        buckets = [
            dataclasses.replace(c.kernel_layout, origin=start, part1=p1, part2=p2)
            for c, (start, _), p1, p2 in zip(comms, layout.buckets, parts1, parts2)
        ]
        quantizer = kernels.for_device(first.device).block_quantizer(
            buckets, first.kernel_block_size, first.bits, first.rank, first.device
        )
        return None if quantizer is None else cls(layout, comms, quantizer)

    def start(self, flat: Tensor, headers: Tensor) -> Exchange:
        """Worker quantization of ``flat`` (``layout.padded_numel`` fp32: every bucket end to
        end, its padding taken as zeros; overwritten with ``y``) and phase 1, each bucket's
        message with its row of ``headers`` (``[buckets, header_numel]``)."""
        worker, _ = self._error_buffers()
        exchange = phase_exchange(self.comms, 1)
        with exchange.filling():
            message = exchange.message
            self.quantizer.start(message, message.stride(0), flat, worker, None, headers)
        return exchange

    def received(self, exchange: Exchange) -> tuple[Tensor, Tensor]:
        """Wait for phase 1 of ``exchange``; every rank's header, ``[world_size,
        header_numel]``, and the largest ``max |y|`` of every rank's buckets, finite if every
        rank's input was (it lies right after the headers: a step reads both at once)."""
        values = exchange.received().view(torch.float32).view(-1)[self._read]
        largest = torch.amax(values[: self._largest], dim=0, out=values[-1])
        return values[self._largest : -1].view(self.world_size, -1), largest

    def commit(self, exchange: Exchange, flat: Tensor) -> None:
        """After :meth:`received` found every value finite: commit the worker errors, serve and
        send phase 2, and write the result over ``flat``'s buckets (not its padding)."""
        worker, server = self._error_buffers()
        sent = exchange.message
        self.quantizer.commit_workers(sent, sent.stride(0), flat, worker)
        received = exchange.received()
        if self.world_size == 1:  # the served chunks are the buffer: the result goes there
            self.quantizer.serve(received, received.stride(0), server, None, flat)
            return
        with phase_exchange(self.comms, 2).filling() as phase2:
            self.quantizer.serve(received, received.stride(0), server, phase2.message, None)
        gathered = phase2.received()
        self.quantizer.finish(gathered, gathered.stride(0), flat)

    def _error_buffers(self) -> tuple[Tensor, Tensor]:
        """Every communicator's worker error as a slice of one buffer, and its server error of
        another (moved there at first)."""
        if self._errors is not None:
            worker, server, workers, servers = self._errors
            if all(c.worker_error is w and c.server_error is s
                   for c, w, s in zip(self.comms, workers, servers)):  # fmt: skip
                return worker, server
        worker = torch.empty(self.layout.padded_numel, device=self.device)
        server = torch.empty(sum(c.chunk_numel for c in self.comms), device=self.device)
        workers = self.layout.bucket_views(worker, padded=True)
        servers = list(server.split([c.chunk_numel for c in self.comms]))
        for comm, w, s in zip(self.comms, workers, servers):
            comm.hold_errors(w, s)
        self._errors = (worker, server, workers, servers)
        return worker, server
