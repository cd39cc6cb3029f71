"""A quantized allreduce with error feedback: 16, 8 or 4 bits per element instead of 32.

It averages gradients during the fp32 warmup of the optimizers. The exchange is the two-phase one
of :class:`~onebit.wire.comm.CompressedAllreduce` (SPEC section 2) with block-wise quantization
``Q`` in place of the 1-bit compressor: both are a :class:`~onebit.wire.protocol.Communicator`, so
:func:`onebit.wire.protocol.finish_compressed_` and the optimizers drive either one unchanged.

:class:`QuantizedAllreduce` owns the error buffers and the communication; the compressor it
runs (block geometry, and functions that quantize, dequantize and pack one tile of blocks) is
:mod:`onebit.wire.quantize`'s.

Speed: every phase runs tile by tile (:func:`~onebit.wire.quantize.tiles`: whole blocks, some tens
of thousands of elements), all its steps on one tile while it is in cache, in work space and views
made once and reused; there is no per-element index. Where the kernel backend has kernels of its own
for the phases (Triton, on CUDA: :mod:`onebit.kernels.triton_quantized`), they run instead, with the
same bits; an optimizer then runs every bucket's at once (:mod:`onebit.wire.model_quantized`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import kernels
from ..compress import padded_numel
from ..kernels.reference import QuantizedBucket
from ..stats import count_collective
from .exchange import Exchange, start_gather
from .protocol import TwoPhase, finish_compressed_, group_size_and_rank
from .quantize import (
    FLOAT_BYTES,
    ChunkPlan,
    Scratch,
    Tile,
    TileWork,
    check_bits,
    dequantize_,
    floats,
    pack_int4_into,
    payload_bytes,
    quantize_,
    tiles,
    unpack_int4_into,
)


@dataclass
class _Call:
    """One quantized allreduce in flight, between its phases."""

    # the input plus worker error, in the caller's buffer (at world size 1 serve() then puts
    # the result there)
    y: Tensor | None
    sent: Tensor  # phase 1: the row for each rank, [world_size, phase-1 bytes]
    received: Tensor  # phase 1: one row from each rank
    work: dist.Work | None
    gathered: Tensor | None = None  # phase 2: one row from each server, [world_size, bytes]
    exchange: tuple[Exchange, int] | None = None  # the phase in flight, sent with others


class QuantizedAllreduce(TwoPhase):
    """Two-phase quantized allreduce with worker and server error feedback.

    SPEC section 2 with block-wise quantization ``Q`` (bf16, int8 or int4) in place of the 1-bit
    compressor. Rank r sends ``Q(y_r)``, ``y_r = b_r + we_r``; rank j serves chunk j:
    ``z_j = (sum in rank order of deQ(Q(y_r)[chunk j])) / n + se_j`` and gathers ``Q(z_j)`` to
    every rank. The error buffers keep what quantization lost (``we_r = y_r - deQ(Q(y_r))``,
    ``se_j = z_j - deQ(Q(z_j))``) and add it back next call, so the running sum of outputs tracks
    the running sum of true means. The result is bit-for-bit the same on every rank.

    Args:
        numel: elements per call. Every rank must use the same value (and the same other args).
        segments: sizes of the consecutive tensors the buffer holds (they add up to ``numel``);
            ``None`` is one segment. Blocks never straddle a segment or chunk boundary.
        bits: ``"bf16"``, ``"int8"`` (default) or ``"int4"``.
        group: process group; ``None`` means the default group, or world size 1 if there is none.
        device: where the error buffers live; use the device of the tensors you will reduce.
        block_size: elements per scale (int8, int4); each piece (a segment's part of a chunk) is
            split into blocks of this size, the last one shorter.
        header_numel: fp32 values each rank may attach to a call (:meth:`start`'s ``header``);
            every rank receives every rank's header (:meth:`headers`).

    Messages, as bytes, with ``P`` the payload bytes of one chunk (:func:`payload_bytes`), ``S``
    the most blocks in any chunk (0 for bf16; a chunk with fewer blocks pads its scales with
    zeros) and ``h`` the header length:

    * phase 1 (all-to-all, the row for rank j): chunk j's payload ``P``, its ``S`` fp32 scales,
      one fp32 absmax of this rank's whole ``y_r``, the header ``h`` fp32.
    * phase 2 (all-gather, from server j): ``Q(z_j)``'s payload ``P`` and its ``S`` fp32 scales.

    The whole-buffer absmax is in every row because rank j only receives the scales of chunk j:
    it is what lets every rank see a non-finite value anywhere on any rank, and so all agree to
    return NaN and leave both errors untouched (:func:`~onebit.wire.protocol.finish_compressed_`).

    Memory: besides the error buffers, one fp32 per block (the blocks' absmax) and the tiles'
    bounds; the work space of a tile is shared by all communicators of a thread.

    Attributes:
        worker_error: this rank's error, ``padded_numel`` elements (``numel`` rounded up to a
            multiple of ``8 * world_size``).
        server_error: the error of the chunk this rank serves, ``chunk_numel`` elements.
        bytes_per_call: bytes this rank sends per call.

    Save the error buffers with :meth:`state_dict` on every rank, or resume will not be exact.
    """

    def __init__(
        self,
        numel: int,
        *,
        segments: Sequence[int] | None = None,
        bits: str = "int8",
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        block_size: int = 256,
        header_numel: int = 0,
    ) -> None:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        segments = [numel] if segments is None else list(segments)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in segments):
            raise ValueError(f"segments must be non-negative ints, got {segments!r}")
        if sum(segments) != numel:
            raise ValueError(f"segments add up to {sum(segments)}, not numel={numel}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if isinstance(header_numel, bool) or not isinstance(header_numel, int) or header_numel < 0:
            raise ValueError(f"header_numel must be a non-negative int, got {header_numel!r}")
        self.bits = check_bits(bits)
        self.segments = segments
        self.block_size = block_size
        self.header_numel = header_numel
        self.group = group
        self.world_size, self.rank = group_size_and_rank(group)
        self.numel = numel
        self.padded_numel = padded_numel(numel, self.world_size)
        self.chunk_numel = self.padded_numel // self.world_size
        device = self.device = torch.device("cpu") if device is None else torch.device(device)
        self.worker_error = torch.zeros(self.padded_numel, device=device)
        self.server_error = torch.zeros(self.chunk_numel, device=device)
        self._plans = self._tile_geometry(device)
        self._blocks_per_chunk = max(plan.blocks for plan in self._plans)
        every = [t for plan in self._plans for t in plan.tiles]
        self._max_tile = max((t.hi - t.lo for t in every), default=0)
        self._max_tile_blocks = max((t.b1 - t.b0 for t in every), default=0)
        # Each block's max |y| in a call (bf16: each tile's); slots a chunk lacks stay 0.
        per_chunk = self._blocks_per_chunk
        self._absmax = torch.zeros(self.world_size * per_chunk, device=device)
        self._absmax_tiles = [
            plan.per_block(self._absmax[j * per_chunk : (j + 1) * per_chunk])
            for j, plan in enumerate(self._plans)
        ]
        self._error_tiles()
        self._payload = payload_bytes(self.chunk_numel, bits)
        self._scale_count = 0 if bits == "bf16" else self._blocks_per_chunk
        self.kernel_layout = QuantizedBucket(
            tuple(map(tuple, self._chunk_pieces)), self.chunk_numel, numel, self._payload,
            self._scale_count, header_numel,
        )  # fmt: skip
        self.kernel_block_size = 4096 if bits == "bf16" else block_size

    @functools.cached_property
    def _kernels(self) -> Any | None:
        """The backend's kernels of this communicator's phases (made at first use), or ``None``
        where it runs its own torch tiles."""
        if not self.numel:
            return None
        return kernels.for_device(self.device).block_quantizer(
            [self.kernel_layout], self.kernel_block_size, self.bits, self.rank, self.device
        )

    def _error_tiles(self) -> None:
        """The error buffers' views per tile, for the torch path."""
        c = self.chunk_numel
        self._worker_error_tiles = [
            plan.elements(self.worker_error[j * c : (j + 1) * c])
            for j, plan in enumerate(self._plans)
        ]
        self._server_error_tiles = self._plans[self.rank].elements(self.server_error)

    def release(self) -> None:
        """Free the error buffers, which hold zeros until a call makes them anew: at the
        freeze, after which the optimizer no longer averages through this communicator."""
        self.worker_error = self.worker_error.new_empty(0)
        self.server_error = self.server_error.new_empty(0)
        self._worker_error_tiles, self._server_error_tiles = [], None  # views of the old ones

    def _ensure_errors(self) -> None:
        """Make the error buffers anew, as zeros, where :meth:`release` freed them."""
        if self.worker_error.numel() != self.padded_numel:
            self.worker_error = torch.zeros(self.padded_numel, device=self.device)
            self.server_error = torch.zeros(self.chunk_numel, device=self.device)
            self._error_tiles()

    def hold_errors(self, worker_error: Tensor, server_error: Tensor) -> None:
        """Keep the error buffers in these (views of a caller's buffers, of their sizes), their
        values copied there: the errors of many communicators in one buffer each, for kernels
        that run them all at once."""
        self._ensure_errors()
        worker_error.copy_(self.worker_error)
        server_error.copy_(self.server_error)
        self.worker_error, self.server_error = worker_error, server_error
        self._error_tiles()

    def _tile_geometry(self, device: torch.device) -> list[ChunkPlan]:
        """The tiles of each chunk, in chunk coordinates: its pieces' blocks (bf16: plain runs
        of elements), never straddling ``numel`` (the padding is a piece of its own)."""
        ends, start = [], 0
        for size in [*self.segments, self.padded_numel - self.numel]:
            start += size
            ends.append(start)
        if self.bits == "bf16":  # no scales: blocks only split the input from the padding
            ends = [self.numel]
        tile_numel = kernels.for_device(device).tile_numel
        block_size = tile_numel if self.bits == "bf16" else self.block_size
        plans, self._chunk_pieces = [], []
        for j in range(self.world_size):
            lo, hi = j * self.chunk_numel, (j + 1) * self.chunk_numel
            cuts = sorted({lo, hi, *(e for e in ends if lo < e < hi)})
            pieces = [b - a for a, b in zip(cuts, cuts[1:])]
            self._chunk_pieces.append(pieces)
            split = sum(1 for cut in cuts[1:] if cut <= self.numel)  # pieces below numel
            chunk = tiles(pieces[:split], block_size, tile_numel, device=device)
            below = len(chunk)
            last = chunk[-1] if chunk else Tile(0, 0, 0, 0, 0, None)
            chunk += tiles(
                pieces[split:], block_size, tile_numel, lo=last.hi, b0=last.b1, device=device
            )
            plans.append(ChunkPlan(chunk, below))
        return plans

    @property
    def phase1_width(self) -> int:
        """Bytes of each row of phase 1's message (an :class:`~onebit.wire.exchange.Exchange`
        part)."""
        return self._payload + FLOAT_BYTES * (self._scale_count + 1 + self.header_numel)

    @property
    def phase2_width(self) -> int:
        """Bytes of phase 2's message."""
        return self._payload + FLOAT_BYTES * self._scale_count

    @property
    def bytes_per_call(self) -> int:
        """Bytes this rank sends per call: ``(n-1) * (phase-1 row + phase-2 row)``."""
        if self.numel == 0:
            return 0
        return (self.world_size - 1) * (self.phase1_width + self.phase2_width)

    def __call__(self, tensor: Tensor) -> Tensor:
        """The quantized mean of ``tensor`` across the group, same shape and dtype; NaN
        everywhere (errors untouched) if any rank had a non-finite value."""
        if tensor.numel() != self.numel:
            raise ValueError(f"expected {self.numel} elements, got {tensor.numel()}")
        device = self.device
        source = tensor.reshape(-1).to(device=device, dtype=torch.float32)
        buffer = torch.empty(self.padded_numel, device=device)
        out = buffer[: self.numel]  # written once serve() is done with the buffer
        header = torch.zeros(self.header_numel, device=device) if self.header_numel else None
        if not finish_compressed_([self], [self._start(buffer, header, source)], [out]):
            out.fill_(float("nan"))
        return out.view(tensor.shape).to(tensor.dtype)

    # The phases, as CompressedAllreduce's, so finish_compressed_ can drive many buckets at once.

    def start(
        self,
        buffer: Tensor,
        header: Tensor | None = None,
        exchange: tuple[Exchange, int] | None = None,
    ) -> _Call:
        """Worker quantization of ``buffer`` (``padded_numel`` fp32, overwritten) and phase 1.

        ``header`` (``header_numel`` fp32 values) goes to every rank. The worker error is not yet
        updated: :meth:`serve` commits it once every rank's scales are known to be finite. With
        ``exchange`` (an :class:`~onebit.wire.exchange.Exchange` of :attr:`phase1_width` parts, and
        this call's part) the message goes into its part, to be sent with the others;
        otherwise it is sent now.
        """
        return self._start(buffer, header, None, exchange)

    def _start(
        self,
        buffer: Tensor,
        header: Tensor | None,
        source: Tensor | None,
        exchange: tuple[Exchange, int] | None = None,
    ) -> _Call:
        """:meth:`start`, reading the input from ``source`` (``numel`` fp32) if it is given."""
        if buffer.numel() != self.padded_numel:
            raise ValueError(f"start() needs {self.padded_numel} elements, got {buffer.numel()}")
        if buffer.dtype != torch.float32 or not buffer.is_contiguous():
            raise ValueError("start() needs a contiguous fp32 buffer")
        if self.header_numel and (header is None or header.numel() != self.header_numel):
            raise ValueError(f"start() needs a header of {self.header_numel} fp32 values")
        self._ensure_errors()
        n = self.world_size
        if exchange is None:
            message = torch.empty(n, self.phase1_width, dtype=torch.uint8, device=buffer.device)
        else:
            message = exchange[0].part(exchange[1])
        s = self._payload + FLOAT_BYTES * self._scale_count
        values = None
        if self.header_numel:
            values = header.to(device=buffer.device, dtype=torch.float32).reshape(1, -1)
        if self._kernels is not None:  # they take the padding as zeros
            self._kernels.start(message, message.stride(0), buffer, self.worker_error, source,
                                values)  # fmt: skip
        else:
            buffer[self.numel :].zero_()  # the padding is zeros, whatever a caller left there
            absmax = self._quantize_chunks(buffer, source, message)
            message[:, s : s + FLOAT_BYTES] = absmax.reshape(1, 1).view(torch.uint8)
            if values is not None:
                message[:, s + FLOAT_BYTES :] = values.view(torch.uint8)
        if exchange is not None:
            return _Call(buffer, message, message, None, exchange=exchange)
        if n == 1 or not self.numel:
            return _Call(buffer, message, message, None)
        received = torch.empty_like(message)
        count_collective()
        handle = dist.all_to_all_single(received, message, group=self.group, async_op=True)
        return _Call(buffer, message, received, handle)

    def _quantize_chunks(self, buffer: Tensor, source: Tensor | None, message: Tensor) -> Tensor:
        """:meth:`start`'s worker quantization in torch, tile by tile; returns ``max |y|``."""
        c, bits = self.chunk_numel, self.bits
        p, s = self._payload, self._payload + FLOAT_BYTES * self._scale_count
        scratch = self._scratch()
        for j, plan in enumerate(self._plans):
            ys = plan.elements(buffer[j * c : (j + 1) * c])
            inputs = ys
            if source is not None and plan.below:
                below = source[j * c : j * c + plan.below_numel]
                inputs = plan.elements(below, below=True) + ys[plan.below :]
            payload, scales = self._rows(message[j, :p], message[j, p:s], plan, True)
            errors, absmax = self._worker_error_tiles[j], self._absmax_tiles[j]
            for t, tile in enumerate(plan.tiles):
                y = torch.add(inputs[t], errors[t], out=ys[t])
                work = scratch.work(tile, bits)
                self._quantize(y, tile, t, payload, scales, absmax[t], work, scratch)
        return self._absmax.amax() if self.numel else buffer.new_zeros(())

    def _scratch(self) -> Scratch:
        return Scratch.get(self.device, self._max_tile, self._max_tile_blocks)

    def _rows(
        self, payload: Tensor, scales: Tensor, plan: ChunkPlan, outgoing: bool = False
    ) -> tuple[Tensor | list[Tensor], list[Tensor]]:
        """One chunk's payload and scale bytes, per tile: its values (bf16, int8; for int4 the
        whole packed row) and its fp32 scales (``outgoing``: zeroing the slots the chunk lacks)."""
        if self.bits == "bf16":
            return plan.elements(payload.view(torch.bfloat16)), []
        scales = scales.view(torch.float32)
        if outgoing:
            scales[plan.blocks :].zero_()
        scales = plan.per_block(scales)
        if self.bits == "int4":
            return payload, scales
        return plan.elements(payload.view(torch.int8)), scales

    def _quantize(
        self,
        y: Tensor,
        tile: Tile,
        t: int,
        payload: Tensor | list[Tensor] | None,
        scales: list[Tensor] | None,
        absmax: Tensor | None,
        work: TileWork,
        scratch: Scratch,
        dequantized: Tensor | None = None,
    ) -> None:
        """:func:`quantize_` of tile ``t`` of a chunk into the chunk's payload and scales
        (:meth:`_rows`; ``None``: into work space); int4 tiles must come in order, as they
        share bytes."""
        scale = None if self.bits == "bf16" else work.scales if scales is None else scales[t]
        if payload is None or self.bits != "int4":
            q = work.q if payload is None else payload[t]
            quantize_(y, tile, self.bits, q, scale, absmax, work, dequantized)
            return
        # q_out[0] holds the previous tile's last value if this tile starts mid-byte
        first, size, q_out = tile.lo & 1, tile.hi - tile.lo, scratch.q_out
        q = q_out[first : first + size]
        quantize_(y, tile, self.bits, q.view(work.q.shape), scale, absmax, work, dequantized)
        end = first + size
        even = end - (end & 1)
        start = (tile.lo - first) // 2
        pack_int4_into(q_out[:even], payload[start : start + even // 2])
        if end & 1:
            q_out[:1].copy_(q_out[even : even + 1])

    def _dequantize(
        self,
        payload: Tensor | list[Tensor],
        scales: list[Tensor],
        tile: Tile,
        t: int,
        out: Tensor,
        scratch: Scratch,
    ) -> None:
        """:func:`dequantize_` of tile ``t`` of a chunk's payload and scales (:meth:`_rows`)."""
        scale = scales[t] if scales else None
        if self.bits != "int4":
            dequantize_(payload[t], scale, tile, out)
            return
        first, last = tile.lo // 2, (tile.hi + 1) // 2
        unpack_int4_into(payload[first:last], scratch.q_in[: 2 * (last - first)])
        odd = tile.lo & 1
        q = scratch.q_in[odd : odd + tile.hi - tile.lo]
        dequantize_(q.view(out.shape), scale, tile, out)

    def worker_scales(self, call: _Call) -> Tensor:
        """Wait for phase 1; return every rank's block scales of this rank's chunk and its
        whole-buffer absmax, flattened in rank order: non-finite iff some rank's input was."""
        if call.exchange is not None:
            exchange, i = call.exchange
            call.received, call.exchange = exchange.received(i), None
        if call.work is not None:
            call.work.wait()
            call.work = None
        end = self._payload + FLOAT_BYTES * (self._scale_count + 1)
        return floats(call.received[:, self._payload : end]).reshape(-1)

    def headers(self, call: _Call) -> Tensor:
        """Every rank's header, ``[world_size, header_numel]`` fp32, after :meth:`worker_scales`."""
        start = self._payload + FLOAT_BYTES * (self._scale_count + 1)
        return floats(call.received[:, start:])

    def serve(self, call: _Call, exchange: tuple[Exchange, int] | None = None) -> None:
        """Commit the worker error, average and requantize this rank's chunk with server error,
        start phase 2 (``exchange``: as in :meth:`start`, of :attr:`phase2_width` parts).

        At world size 1 there is no phase 2: the result goes straight into :meth:`start`'s
        buffer, for :meth:`finish`.
        """
        if not self.numel:
            call.y = None
            call.gathered = call.received
            return
        n, c, rank, bits = self.world_size, self.chunk_numel, self.rank, self.bits
        p, s = self._payload, self._payload + FLOAT_BYTES * self._scale_count
        if self._kernels is not None:
            self._kernels.commit_workers(call.sent, call.sent.stride(0), call.y,
                                         self.worker_error)  # fmt: skip
            received, stride = call.received, call.received.stride(0)
            if n == 1:  # the result goes into the buffer, which y is done with
                self._kernels.serve(received, stride, self.server_error, None, call.y[:c])
                return
            call.y = None
            message = self._phase2_message(exchange)
            self._kernels.serve(received, stride, self.server_error, message, None)
            self._gather(call, message, exchange)
            return
        scratch = self._scratch()
        # The worker error of the chunks this rank does not serve: y - deQ(Q(y)).
        for j, plan in enumerate(self._plans):
            if j == rank:
                continue
            ys, errors = plan.elements(call.y[j * c : (j + 1) * c]), self._worker_error_tiles[j]
            payload, scales = self._rows(call.sent[j, :p], call.sent[j, p:s], plan)
            for t, tile in enumerate(plan.tiles):
                part = scratch.work(tile, bits).part
                self._dequantize(payload, scales, tile, t, part, scratch)
                torch.sub(ys[t], part, out=errors[t])
        plan = self._plans[rank]
        ys = plan.elements(call.y[rank * c : (rank + 1) * c])
        rows = [self._rows(row[:p], row[p:s], plan) for row in call.received]
        if n > 1:
            call.y = None
            message = self._phase2_message(exchange)
            payload, scales = self._rows(message[:p], message[p:], plan, True)
        else:  # Q(z) only in work space, deQ(Q(z)) into the buffer
            payload = scales = None
        absmax = self._absmax_tiles[rank]  # phase 1 is done with them
        errors = self._worker_error_tiles[rank]
        for t, tile in enumerate(plan.tiles):
            work = scratch.work(tile, bits)
            z = work.z
            for r, (payload_r, scales_r) in enumerate(rows):  # summed in rank order
                part = work.part if r else z
                self._dequantize(payload_r, scales_r, tile, t, part, scratch)
                if r == rank:  # this rank's own worker error, y - deQ(Q(y))
                    torch.sub(ys[t], part, out=errors[t])
                if r:
                    z.add_(part)
            if n > 1:
                z.div_(n)
            se = self._server_error_tiles[t]
            z.add_(se)
            result = ys[t] if n == 1 else work.ratio  # y is done with
            block_max = None if bits == "bf16" else absmax[t]
            self._quantize(z, tile, t, payload, scales, block_max, work, scratch, result)
            torch.sub(z, result, out=se)
        if n > 1:
            self._gather(call, message, exchange)

    def _phase2_message(self, exchange: tuple[Exchange, int] | None) -> Tensor:
        if exchange is None:
            return torch.empty(self.phase2_width, dtype=torch.uint8, device=self.device)
        return exchange[0].part(exchange[1])

    def _gather(self, call: _Call, message: Tensor, exchange: tuple[Exchange, int] | None) -> None:
        """Start phase 2: every rank gets every server's ``message`` (with ``exchange``: when
        it is sent)."""
        if exchange is not None:
            call.exchange = exchange
            return
        gathered = message.new_empty(self.world_size, message.numel())
        count_collective()
        call.work = start_gather(gathered, message, self.group)
        call.gathered = gathered

    def finish(self, call: _Call, out: Tensor) -> None:
        """Wait for phase 2 and write the result, ``numel`` elements, into ``out``."""
        if call.exchange is not None:
            exchange, i = call.exchange
            call.gathered, call.exchange = exchange.received(i), None
        if call.work is not None:
            call.work.wait()
            call.work = None
        if not self.numel:
            return
        if call.y is not None:  # world size 1: serve() left the result in the buffer
            result, call.y = call.y[: self.numel], None
            if out.data_ptr() != result.data_ptr() or not out.is_contiguous():
                out.copy_(result.view(out.shape))
            return
        p, c = self._payload, self.chunk_numel
        direct = out.is_contiguous() and out.dtype == torch.float32
        flat = out.view(-1) if direct else torch.empty(self.numel, device=out.device)
        if self._kernels is not None:
            self._kernels.finish(call.gathered, call.gathered.stride(0), flat)
            if not direct:
                out.copy_(flat.view(out.shape))
            return
        scratch = self._scratch()
        for j, plan in enumerate(self._plans):
            if not plan.below:
                continue
            outs = plan.elements(flat[j * c : j * c + plan.below_numel], below=True)
            payload, scales = self._rows(call.gathered[j, :p], call.gathered[j, p:], plan)
            for t in range(plan.below):
                self._dequantize(payload, scales, plan.tiles[t], t, outs[t], scratch)
        if not direct:
            out.copy_(flat.view(out.shape))

    def _geometry(self) -> dict:
        """What error buffers saved by :meth:`state_dict` must match to be loaded here."""
        return {
            "numel": self.numel,
            "world_size": self.world_size,
            "bits": self.bits,
            "block_size": self.block_size,
            "segments": list(self.segments),
        }

    def state_dict(self) -> dict:
        """The error buffers and the geometry they belong to (zeros where they were released)."""
        released = self.worker_error.numel() != self.padded_numel
        worker, server = (
            (torch.zeros(self.padded_numel), torch.zeros(self.chunk_numel))
            if released
            else (self.worker_error.clone(), self.server_error.clone())
        )
        return {**self._geometry(), "worker_error": worker, "server_error": server}

    def load_state_dict(self, state: dict) -> None:
        """Restore the error buffers saved by :meth:`state_dict` on this rank.

        Raises ``ValueError`` if they were saved for another geometry (size, world size, bits,
        block size or segments): errors cannot be carried across such a change.
        """
        for key, ours in self._geometry().items():
            if state.get(key) != ours:
                raise ValueError(
                    f"error buffers were saved for {key}={state.get(key)!r}; this communicator "
                    f"has {key}={ours!r}"
                )
        self._ensure_errors()
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])

    def reset(self) -> None:
        """Zero both error buffers (released ones are zeros already)."""
        self.worker_error.zero_()
        self.server_error.zero_()
