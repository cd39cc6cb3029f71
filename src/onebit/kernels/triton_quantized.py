"""The warmup's quantized allreduce (:class:`~onebit.wire.quantized.QuantizedAllreduce`) in Triton
kernels: a few launches per phase over one bucket, or over every bucket of a step at once,
whatever their tensors and chunks.

Each buffer is cut as the torch path cuts it: each chunk into pieces (a tensor's part of the
chunk, the padding a piece of its own), each piece into blocks of ``block_size`` elements with
one scale each (bf16: no scales; blocks only split the finite check). Per-block kernels take the
blocks' maxima and scales; element-wise kernels, over tiles of :data:`~.triton_common.BLOCK`
elements, find each element's piece (:class:`~.triton_common.Tiling`), and from its piece's
row of a table its chunk, its bucket's part of a message and its block's scale, with no
division by a run-time value. The bytes of every message, the errors and the
results are bit for bit the torch path's: divisions round as IEEE's, ``round`` is half to even,
bf16 rounds to nearest even in integer arithmetic (so the interpreter, which truncates, agrees).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import QuantizedBucket
from .triton_common import BLOCK, Tiling, launched, piece_columns

_BITS = {"bf16": 0, "int8": 1, "int4": 2}
_QMAX = {"bf16": 1.0, "int8": 127.0, "int4": 7.0}


@triton.jit
def _rint(r):
    """``r`` rounded half to even, as ``torch.round`` (exact for ``|r| < 2**23``)."""
    f = tl.floor(r)
    d = r - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _bf16_bits(y):
    """The bfloat16 nearest ``y`` (ties to even), as its 16 bits in an int32."""
    bits = y.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def _step(s):
    return tl.where(s > 0.0, s, 1.0)


@triton.jit
def _dequantized(i8, u8, i16, f32, row, local, scale_at, valid, BITS: tl.constexpr):
    """The fp32 values of elements ``local`` of a message row starting at byte ``row``, whose
    block scales are floats ``scale_at`` of the row."""
    if BITS == 0:
        bits = tl.load(i16 + row // 2 + local, mask=valid, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    if BITS == 1:
        q = tl.load(i8 + row + local, mask=valid, other=0).to(tl.float32)
    else:
        byte = tl.load(u8 + row + local // 2, mask=valid, other=0).to(tl.int32)
        q = (((byte >> (4 * (local % 2))) & 15) - 8).to(tl.float32)
    return q * tl.load(f32 + row // 4 + scale_at, mask=valid, other=0.0)


@triton.jit
def _store_quantized(i8, u8, i16, row, local, y, s, valid, QMAX, BLOCK: tl.constexpr,
                     BITS: tl.constexpr):  # fmt: skip
    """Write ``Q(y)`` (scale ``s`` per element) at elements ``local`` of the row at byte
    ``row``; return ``deQ(Q(y))``. int4 writes whole bytes: ``local`` starts even and runs on."""
    if BITS == 0:
        bits = _bf16_bits(y)
        tl.store(i16 + row // 2 + local, bits.to(tl.int16), mask=valid)
        return (bits << 16).to(tl.float32, bitcast=True)
    step = _step(s)
    q = tl.minimum(tl.maximum(_rint(tl.math.div_rn(y, step)), -QMAX), QMAX)
    if BITS == 1:
        tl.store(i8 + row + local, q.to(tl.int8), mask=valid)
    else:
        nibble = (q.to(tl.int32) + 8) << (4 * (local % 2))
        byte = tl.sum(tl.reshape(nibble, [BLOCK // 2, 2]), axis=1).to(tl.uint8)
        at = tl.max(tl.reshape(row + local // 2, [BLOCK // 2, 2]), axis=1)
        keep = tl.max(tl.reshape(valid.to(tl.int32), [BLOCK // 2, 2]), axis=1) != 0
        tl.store(u8 + at, byte, mask=keep)
    return q * step


@triton.jit
def _elements(starts, ends, columns, first, piece_starts, piece_locals, piece_rows, piece_parts,
              piece_blocks, row_bytes, n, QBLOCK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """This program's elements of ``[0, n)``: their offsets, validity, the first byte of their
    message row (their chunk's row, their bucket's part), their place in their chunk, and
    their block (its scale's float in that row, or its index: ``piece_blocks``' choice)."""
    block = tl.program_id(0)
    start, local = block.to(tl.int64) * BLOCK, tl.arange(0, BLOCK)
    offs = start + local
    valid = offs < n
    piece = piece_columns(local, start, starts, ends, columns, tl.load(first + block),
                          tl.load(first + block + 1))  # fmt: skip
    d = offs - tl.load(piece_starts + piece, mask=valid, other=0)
    local = tl.load(piece_locals + piece, mask=valid, other=0) + d
    row = tl.load(piece_rows + piece, mask=valid, other=0).to(tl.int64) * row_bytes + tl.load(
        piece_parts + piece, mask=valid, other=0
    )
    at = tl.load(piece_blocks + piece, mask=valid, other=0) + d // QBLOCK
    return offs, valid, row, local, at


@launched()
@triton.jit(do_not_specialize=["numel", "row_bytes"])
def _worker_blocks(
    source, numel, buffer, error, block_starts, block_lengths, block_rows, block_buckets,
    block_scales, parts, absmax, f32, row_bytes, QMAX, SPAN: tl.constexpr, SCALES: tl.constexpr,
):  # fmt: skip
    """Per block: ``y = x + e`` into ``buffer`` (``x`` from ``source`` below ``numel``, zeros
    past it; ``source`` may be ``buffer``), its ``max |y|`` and its scale into the message (a
    block of no elements: a scale slot its chunk lacks, 0)."""
    g = tl.program_id(0)
    start, length = tl.load(block_starts + g), tl.load(block_lengths + g)
    top = tl.zeros([SPAN], dtype=tl.float32)
    for at in range(0, length, SPAN):
        offs = start + at + tl.arange(0, SPAN)
        valid = offs < start + length
        x = tl.load(source + offs, mask=valid & (offs < numel), other=0.0)
        y = x + tl.load(error + offs, mask=valid, other=0.0)
        tl.store(buffer + offs, y, mask=valid)
        top = tl.maximum(top, tl.where(valid, tl.where(y == y, tl.abs(y), float("inf")), 0.0))
    top_max = tl.max(top, axis=0)
    tl.store(absmax + g, top_max)
    if SCALES:
        part = tl.load(parts + tl.load(block_buckets + g))
        row = tl.load(block_rows + g).to(tl.int64) * row_bytes + part
        tl.store(f32 + row // 4 + tl.load(block_scales + g), tl.math.div_rn(top_max, QMAX))


@launched(1)
@triton.jit(do_not_specialize=["row_bytes", "ranks"])
def _bucket_slots(
    absmax, bucket_blocks, slots, parts, headers, f32, row_bytes, ranks,
    HEADER: tl.constexpr, WIDTH: tl.constexpr, SPAN: tl.constexpr,
):  # fmt: skip
    """Per bucket: the largest of its blocks' ``max |y|``, then its ``HEADER`` header values,
    into every row of the phase-1 message, from float ``slots`` of its part."""
    k = tl.program_id(0)
    b0, b1 = tl.load(bucket_blocks + k), tl.load(bucket_blocks + k + 1)
    top = tl.zeros([SPAN], dtype=tl.float32)
    for at in range(b0, b1, SPAN):
        offs = at + tl.arange(0, SPAN)
        top = tl.maximum(top, tl.load(absmax + offs, mask=offs < b1, other=0.0))
    i = tl.arange(0, WIDTH)
    values = tl.load(headers + k * HEADER + i - 1, mask=(i >= 1) & (i <= HEADER), other=0.0)
    values = tl.where(i == 0, tl.max(top, axis=0), values)
    part, slot = tl.load(parts + k), tl.load(slots + k)
    row = part  # int64: a message may pass 2**31 bytes
    for _ in range(ranks):
        tl.store(f32 + row // 4 + slot + i, values, mask=i <= HEADER)
        row += row_bytes


@launched(8)
@triton.jit(do_not_specialize=["row_bytes", "n"])
def _worker_quantize(
    buffer, i8, u8, i16, f32, row_bytes, starts, ends, columns, first, piece_starts,
    piece_locals, piece_rows, piece_parts, piece_scales, n, QMAX, QBLOCK: tl.constexpr,
    BLOCK: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Element-wise: ``Q(y)`` of the buffer into its chunk's row of the phase-1 message."""
    offs, valid, row, local, scale_at = _elements(
        starts, ends, columns, first, piece_starts, piece_locals, piece_rows, piece_parts,
        piece_scales, row_bytes, n, QBLOCK, BLOCK,
    )  # fmt: skip
    s = tl.load(f32 + row // 4 + scale_at, mask=valid, other=0.0)
    y = tl.load(buffer + offs, mask=valid, other=0.0)
    _store_quantized(i8, u8, i16, row, local, y, s, valid, QMAX, BLOCK, BITS)


@launched(8)
@triton.jit(do_not_specialize=["row_bytes", "n"])
def _worker_errors(
    buffer, error, i8, u8, i16, f32, row_bytes, starts, ends, columns, first, piece_starts,
    piece_locals, piece_rows, piece_parts, piece_scales, n, QBLOCK: tl.constexpr,
    BLOCK: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Element-wise: ``e = y - deQ(Q(y))`` from what the phase-1 message sent."""
    offs, valid, row, local, scale_at = _elements(
        starts, ends, columns, first, piece_starts, piece_locals, piece_rows, piece_parts,
        piece_scales, row_bytes, n, QBLOCK, BLOCK,
    )  # fmt: skip
    sent = _dequantized(i8, u8, i16, f32, row, local, scale_at, valid, BITS)
    y = tl.load(buffer + offs, mask=valid, other=0.0)
    tl.store(error + offs, y - sent, mask=valid)


@launched()
@triton.jit(do_not_specialize=["row_bytes", "ranks"])
def _server_blocks(
    i8, u8, i16, f32, row_bytes, ranks, block_locals, block_lengths, block_scales,
    block_buckets, stores, parts1, parts2, server_error, scales, out_f32, QMAX,
    SPAN: tl.constexpr, BITS: tl.constexpr, OUT: tl.constexpr,
):  # fmt: skip
    """Per served block: ``z = (sum of the ranks' deQ, in rank order) / n + se`` over the server
    error, and its scale into ``scales`` (and, with ``OUT``, the phase-2 message)."""
    g = tl.program_id(0)
    bucket, first = tl.load(block_buckets + g), tl.load(block_locals + g)
    start, length = tl.load(stores + bucket) + first, tl.load(block_lengths + g)
    scale_at, part = tl.load(block_scales + g), tl.load(parts1 + bucket)
    top = tl.zeros([SPAN], dtype=tl.float32)
    for at in range(0, length, SPAN):
        i = at + tl.arange(0, SPAN)
        valid = i < length
        local = first + i
        each = scale_at + tl.zeros_like(local)
        total = _dequantized(i8, u8, i16, f32, part, local, each, valid, BITS)
        row = part  # int64: a message may pass 2**31 bytes
        for _ in range(1, ranks):
            row += row_bytes
            total = total + _dequantized(i8, u8, i16, f32, row, local, each, valid, BITS)
        if ranks != 1:
            total = tl.math.div_rn(total, tl.zeros_like(total) + ranks)
        zz = total + tl.load(server_error + start + i, mask=valid, other=0.0)
        tl.store(server_error + start + i, zz, mask=valid)
        top = tl.maximum(top, tl.where(valid, tl.where(zz == zz, tl.abs(zz), float("inf")), 0.0))
    s = tl.math.div_rn(tl.max(top, axis=0), QMAX)
    tl.store(scales + g, s)
    if OUT:
        tl.store(out_f32 + tl.load(parts2 + bucket) // 4 + scale_at, s)


@launched(4)
@triton.jit(do_not_specialize=["n"])
def _server_quantize(
    server_error, result, i8, u8, i16, scales, starts, ends, columns, first, piece_starts,
    piece_locals, piece_rows, piece_parts, piece_blocks, n, QMAX, QBLOCK: tl.constexpr,
    BLOCK: tl.constexpr, BITS: tl.constexpr, OUT: tl.constexpr, RESULT: tl.constexpr,
):  # fmt: skip
    """Element-wise over the served chunks end to end, whose ``z`` the server error holds:
    ``Q(z)`` into the phase-2 message (``OUT``), ``se = z - deQ(Q(z))``, and ``deQ(Q(z))`` into
    ``result`` (``RESULT``: world size 1, where the served chunks are the buffer)."""
    offs, valid, row, local, g = _elements(
        starts, ends, columns, first, piece_starts, piece_locals, piece_rows, piece_parts,
        piece_blocks, 0, n, QBLOCK, BLOCK,
    )  # fmt: skip
    s = tl.load(scales + g, mask=valid, other=0.0)
    zz = tl.load(server_error + offs, mask=valid, other=0.0)
    if OUT:
        deq = _store_quantized(i8, u8, i16, row, local, zz, s, valid, QMAX, BLOCK, BITS)
    elif BITS == 0:
        deq = (_bf16_bits(zz) << 16).to(tl.float32, bitcast=True)
    else:
        step = _step(s)
        deq = tl.minimum(tl.maximum(_rint(tl.math.div_rn(zz, step)), -QMAX), QMAX) * step
    tl.store(server_error + offs, zz - deq, mask=valid)
    if RESULT:
        tl.store(result + offs, deq, mask=valid)


@launched()
@triton.jit(do_not_specialize=["row_bytes", "n"])
def _results(
    out, i8, u8, i16, f32, row_bytes, starts, ends, columns, first, piece_starts, piece_locals,
    piece_rows, piece_parts, piece_scales, n, QBLOCK: tl.constexpr, BLOCK: tl.constexpr,
    BITS: tl.constexpr,
):  # fmt: skip
    """Element-wise below ``n``: the result, ``deQ`` of each server's phase-2 row."""
    offs, valid, row, local, scale_at = _elements(
        starts, ends, columns, first, piece_starts, piece_locals, piece_rows, piece_parts,
        piece_scales, row_bytes, n, QBLOCK, BLOCK,
    )  # fmt: skip
    tl.store(out + offs, _dequantized(i8, u8, i16, f32, row, local, scale_at, valid, BITS),
             mask=valid)  # fmt: skip


def _views(message: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A message's bytes from its first to its last (its rows may be strided: the kernels take
    the row stride), as int8, uint8, int16 and fp32 (the extent rounded up to whole floats)."""
    rows = message.reshape(1, -1) if message.dim() == 1 else message
    extent = (rows.shape[0] - 1) * rows.stride(0) + rows.shape[1]
    flat = rows.as_strided((-(-extent // 4) * 4,), (1,))
    return flat.view(torch.int8), flat, flat.view(torch.int16), flat.view(torch.float32)


_COLUMNS = ("start", "size", "row", "local", "bucket", "slot")
"""A piece's (or block's) table row: its first element (in the buffer, or in the served chunks),
its elements, its chunk's message row, its place in the chunk, its bucket, and the float of its
(first block's) scale in its bucket's part of a message row."""


class _Table:
    """Rows of :data:`_COLUMNS` (pieces or blocks), as one int64 tensor on the CPU, and its
    columns on a device."""

    def __init__(self, rows: Tensor | list[list[int]]) -> None:
        self.rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1, len(_COLUMNS))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, name: str) -> Tensor:
        return self.rows[:, _COLUMNS.index(name)]

    def __setitem__(self, name: str, value: Tensor) -> None:
        self.rows[:, _COLUMNS.index(name)] = value

    def on(self, device: torch.device, *names: str) -> tuple[Tensor, ...]:
        """Columns ``names`` on ``device``: int64 for ``start`` (it may pass 2**31), else
        int32."""
        return tuple(
            self[c].to(device, torch.int64 if c == "start" else torch.int32, copy=True)
            for c in names
        )

    def blocks(self, block_size: int) -> tuple[_Table, Tensor]:
        """Its pieces cut into blocks of ``block_size`` elements, the last of a piece shorter
        (a block's row is its piece's, at the block's start, length and slot), and each
        piece's first block."""
        counts = -(-self["size"] // block_size)
        first = counts.cumsum(0) - counts
        piece = torch.repeat_interleave(torch.arange(len(self.rows)), counts)
        skip = (torch.arange(len(piece)) - first[piece]) * block_size
        blocks = _Table(self.rows[piece])
        for name, add in (("start", skip), ("local", skip), ("slot", skip // block_size)):
            blocks[name] += add
        blocks["size"] = torch.clamp(blocks["size"] - skip, max=block_size)
        return blocks, first

    def __add__(self, other: _Table) -> _Table:
        return _Table(torch.cat([self.rows, other.rows]))


class BlockQuantizer:
    """The phases of the quantized allreduce of one or more buckets as Triton kernels: a few
    launches per phase, whatever the number of buckets, tensors and chunks.

    A bucket is one :class:`~onebit.wire.quantized.QuantizedAllreduce`. Several lie end to end in
    one buffer, each from its ``origin``, their worker errors in another, their server errors (the
    chunks this rank serves) end to end in a third, and their messages are the parts of each phase's
    :class:`~onebit.wire.exchange.Exchange`. What a kernel needs per piece, block or bucket (where
    it lies, its chunk's row, its part of a message, its scale's slot) comes from tables made here.

    Args:
        buckets: each bucket's layout, in order, laid end to end.
        block_size: elements per scale (bf16: per block of the finite check).
        bits: ``"bf16"``, ``"int8"`` or ``"int4"``.
        rank: the chunk this rank serves.
        device: where the buffers are.
    """

    def __init__(
        self,
        buckets: list[QuantizedBucket],
        block_size: int,
        bits: str,
        rank: int,
        device: torch.device,
    ) -> None:
        self.bits, self.code, self.qmax = bits, _BITS[bits], _QMAX[bits]
        self.block_size, self.world_size = block_size, len(buckets[0].chunk_pieces)
        self.header_numel = buckets[0].header_numel
        self.numel = buckets[-1].origin + buckets[-1].numel  # the padding is the last bucket's
        self.span = 1024 if block_size > 1024 else max(16, triton.next_power_of_2(block_size))
        pieces, served, lacking, served_lacking, bucket_pieces = [], [], [], [], []
        end = store = 0  # the buffer's elements, and the served chunks'
        stores = []  # where each bucket's served chunk starts among them
        for k, b in enumerate(buckets):
            bucket_pieces.append(len(pieces))
            stores.append(store)
            for j, sizes in enumerate(b.chunk_pieces):
                local, slot = 0, b.payload // 4
                for size in sizes:
                    pieces.append([b.origin + j * b.chunk_numel + local, size, j, local, k, slot])
                    if j == rank:
                        served.append([store + local, size, 0, local, k, slot])
                    local, slot = local + size, slot + -(-size // block_size)
                if bits != "bf16":  # the scale slots this chunk lacks: blocks of no elements
                    top = b.payload // 4 + b.scale_count
                    none = [[0, 0, j, 0, k, s] for s in range(slot, top)]
                    lacking += none
                    served_lacking += none if j == rank else []
            end, store = b.origin + len(b.chunk_pieces) * b.chunk_numel, store + b.chunk_numel
        self.padded_numel, self.served_numel = end, store
        parts1 = torch.tensor([b.part1 for b in buckets])
        parts2 = torch.tensor([b.part2 for b in buckets])
        on = dict(device=device, dtype=torch.int64)
        parts1_on, parts2_on = parts1.to(**on), parts2.to(**on)

        pieces, served = _Table(pieces), _Table(served)
        blocks, first = pieces.blocks(block_size)
        self.bucket_table = (
            torch.tensor(first[bucket_pieces].tolist() + [len(blocks)], **on),
            torch.tensor([b.payload // 4 + b.scale_count for b in buckets], **on),
            parts1_on,
        )
        blocks = blocks + _Table(lacking)  # after every bucket's own: their max |y| is 0
        self.blocks = len(blocks)
        self.block_table = (*blocks.on(device, "start", "size", "row", "bucket", "slot"),
                            parts1_on)  # fmt: skip
        self.absmax = torch.zeros(max(self.blocks, 1), device=device)
        self.tiling = cached_tiling(pieces, self.padded_numel, device)
        starts, locals_, rows = pieces.on(device, "start", "local", "row")
        slots = pieces.on(device, "slot")[0]
        self.phase1, self.phase2 = (
            (*self.tiling.table(), starts, locals_, rows, parts[pieces["bucket"]].to(**on), slots)
            for parts in (parts1, parts2)
        )

        served_blocks, first = served.blocks(block_size)
        self.served_tiling = cached_tiling(served, store, device)
        self.served_pieces = (
            *self.served_tiling.table(), *served.on(device, "start", "local", "row"),
            parts2[served["bucket"]].to(**on), first.to(**on),
        )  # fmt: skip
        served_blocks = served_blocks + _Table(served_lacking)
        self.served_blocks = len(served_blocks)
        self.served_table = (
            *served_blocks.on(device, "local", "size", "slot", "bucket"),
            torch.tensor(stores, **on), parts1_on, parts2_on,
        )  # fmt: skip
        self._scales = torch.empty(max(self.served_blocks, 1), device=device)

    def start(self, message: Tensor, row_bytes: int, buffer: Tensor, error: Tensor,
              source: Tensor | None, headers: Tensor | None) -> None:  # fmt: skip
        """Phase 1: ``y = x + e`` into ``buffer`` (``x`` from ``source`` if given, zeros past
        ``numel``), its payload and scales into ``message`` (rows ``row_bytes`` apart), and
        after each bucket's scales the largest ``max |y|`` of its blocks (+inf where there is
        a NaN) and its row of ``headers`` (``[buckets, header_numel]``)."""
        i8, u8, i16, f32 = _views(message)
        _worker_blocks[(self.blocks,)](
            buffer if source is None else source, self.numel, buffer, error, *self.block_table,
            self.absmax, f32, row_bytes, self.qmax, SPAN=self.span, SCALES=self.code != 0,
        )  # fmt: skip
        h = self.header_numel
        _bucket_slots[(len(self.bucket_table[1]),)](
            self.absmax, *self.bucket_table, self.absmax if headers is None else headers, f32,
            row_bytes, self.world_size, HEADER=h, WIDTH=triton.next_power_of_2(h + 1), SPAN=1024,
        )  # fmt: skip
        _worker_quantize[(self.tiling.blocks,)](
            buffer, i8, u8, i16, f32, row_bytes, *self.phase1, self.padded_numel, self.qmax,
            QBLOCK=self.block_size, BLOCK=BLOCK, BITS=self.code,
        )  # fmt: skip

    def commit_workers(self, sent: Tensor, row_bytes: int, buffer: Tensor,
                       error: Tensor) -> None:  # fmt: skip
        """Every chunk's worker error, ``y - deQ(Q(y))``, from the phase-1 message it sent."""
        i8, u8, i16, f32 = _views(sent)
        _worker_errors[(self.tiling.blocks,)](
            buffer, error, i8, u8, i16, f32, row_bytes, *self.phase1, self.padded_numel,
            QBLOCK=self.block_size, BLOCK=BLOCK, BITS=self.code,
        )  # fmt: skip

    def serve(self, received: Tensor, row_bytes: int, server_error: Tensor,
              message: Tensor | None, result: Tensor | None) -> None:  # fmt: skip
        """The average of this rank's chunks in ``received`` (the phase-1 message, rows
        ``row_bytes`` apart) plus the server error, quantized into the phase-2 ``message``
        (``None`` at world size 1, where ``deQ(Q(z))`` goes into ``result``, the buffer); the
        server error becomes ``z - deQ(Q(z))``."""
        i8, u8, i16, f32 = _views(received)
        out = self._scales if message is None else _views(message)[3]
        _server_blocks[(self.served_blocks,)](
            i8, u8, i16, f32, row_bytes, self.world_size, *self.served_table, server_error,
            self._scales, out, self.qmax, SPAN=self.span, BITS=self.code,
            OUT=message is not None and self.code != 0,
        )  # fmt: skip
        q8, qu, q16, _ = _views(received if message is None else message)
        _server_quantize[(self.served_tiling.blocks,)](
            server_error, server_error if result is None else result, q8, qu, q16, self._scales,
            *self.served_pieces, self.served_numel, self.qmax, QBLOCK=self.block_size,
            BLOCK=BLOCK, BITS=self.code, OUT=message is not None, RESULT=result is not None,
        )  # fmt: skip

    def finish(self, gathered: Tensor, row_bytes: int, out: Tensor) -> None:
        """The result below ``numel`` from every server's phase-2 row (rows ``row_bytes``
        apart)."""
        i8, u8, i16, f32 = _views(gathered)
        _results[(-(-self.numel // BLOCK),)](
            out, i8, u8, i16, f32, row_bytes, *self.phase2, self.numel, QBLOCK=self.block_size,
            BLOCK=BLOCK, BITS=self.code,
        )  # fmt: skip


def cached_tiling(pieces: _Table, numel: int, device: torch.device) -> Tiling:
    """:class:`~.triton_common.Tiling` of ``numel`` elements cut by ``pieces`` (which start at
    0 and cover them), each piece's column its index."""
    edges = torch.cat([pieces.rows[:, 0], torch.tensor([numel])])
    return Tiling(edges, torch.arange(len(pieces)), numel, device, wide=True)
