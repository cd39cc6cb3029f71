"""The warmup's quantized allreduce (:class:`~onebit.quantized.QuantizedAllreduce`) in Triton
kernels: a few launches per phase over a whole bucket, whatever its tensors and chunks.

The buffer is cut as the torch path cuts it: each chunk into pieces (a tensor's part of the
chunk, the padding a piece of its own), each piece into blocks of ``block_size`` elements with
one scale each (bf16: no scales; blocks only split the finite check). Per-block kernels take the
blocks' maxima and scales; element-wise kernels, over tiles of :data:`~.triton_kernels.BLOCK`
elements, find each element's block through the pieces (:class:`~.triton_kernels.Tiling`) and
read its scale where the message holds it. The bytes of every message, the errors and the
results are bit for bit the torch path's: divisions round as IEEE's, ``round`` is half to even,
bf16 rounds to nearest even in integer arithmetic (so the interpreter, which truncates, agrees).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_kernels import BLOCK, Tiling, launched

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
def _where(offs, valid, starts, ends, columns, first, block, piece_starts, piece_blocks,
           block_size, chunk):  # fmt: skip
    """Per element: its chunk, its place in the chunk and its block's index."""
    piece = tl.zeros(offs.shape, dtype=tl.int64)
    for p in range(tl.load(first + block), tl.load(first + block + 1)):
        inside = (offs >= tl.load(starts + p)) & (offs < tl.load(ends + p))
        piece = tl.where(inside, tl.load(columns + p), piece)
    start = tl.load(piece_starts + piece, mask=valid, other=0)
    blocks = tl.load(piece_blocks + piece, mask=valid, other=0) + (offs - start) // block_size
    j = offs // chunk
    return j, offs - j * chunk, blocks


@triton.jit
def _elements(starts, ends, columns, first, piece_starts, piece_blocks, block_scales, block_size,
              chunk, n, BLOCK: tl.constexpr):  # fmt: skip
    """This program's elements of ``[0, n)``: their offsets, validity, chunk, place in the chunk
    and block scale's float in a message row."""
    block = tl.program_id(0).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    j, local, g = _where(offs, valid, starts, ends, columns, first, block, piece_starts,
                         piece_blocks, block_size, chunk)  # fmt: skip
    return offs, valid, j, local, tl.load(block_scales + g, mask=valid, other=0)


@launched()
@triton.jit(do_not_specialize=["numel"])
def _worker_blocks(
    source, numel, buffer, error, block_starts, block_lengths, block_rows, block_scales,
    absmax, f32, QMAX, SPAN: tl.constexpr, SCALES: tl.constexpr,
):  # fmt: skip
    """Per block: ``y = x + e`` into ``buffer`` (``x`` from ``source`` below ``numel``, zeros
    past it; ``source`` may be ``buffer``), its ``max |y|`` and its scale into the message."""
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
        tl.store(f32 + tl.load(block_rows + g) // 4 + tl.load(block_scales + g),
                 tl.math.div_rn(top_max, QMAX))  # fmt: skip


@launched(16)
@triton.jit(do_not_specialize=["row_bytes", "chunk", "n"])
def _worker_quantize(
    buffer, i8, u8, i16, f32, row_bytes, starts, ends, columns, first, piece_starts,
    piece_blocks, block_scales, block_size, chunk, n, QMAX, BLOCK: tl.constexpr,
    BITS: tl.constexpr,
):  # fmt: skip
    """Element-wise: ``Q(y)`` of the buffer into each chunk's row of the phase-1 message."""
    offs, valid, j, local, scale_at = _elements(starts, ends, columns, first, piece_starts,
                                                piece_blocks, block_scales, block_size, chunk,
                                                n, BLOCK)  # fmt: skip
    row = j * row_bytes
    s = tl.load(f32 + row // 4 + scale_at, mask=valid, other=0.0)
    y = tl.load(buffer + offs, mask=valid, other=0.0)
    _store_quantized(i8, u8, i16, row, local, y, s, valid, QMAX, BLOCK, BITS)


@launched(16)
@triton.jit(do_not_specialize=["row_bytes", "chunk", "n"])
def _worker_errors(
    buffer, error, i8, u8, i16, f32, row_bytes, starts, ends, columns, first, piece_starts,
    piece_blocks, block_scales, block_size, chunk, n, BLOCK: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Element-wise: ``e = y - deQ(Q(y))`` from what the phase-1 message sent."""
    offs, valid, j, local, scale_at = _elements(starts, ends, columns, first, piece_starts,
                                                piece_blocks, block_scales, block_size, chunk,
                                                n, BLOCK)  # fmt: skip
    sent = _dequantized(i8, u8, i16, f32, j * row_bytes, local, scale_at, valid, BITS)
    y = tl.load(buffer + offs, mask=valid, other=0.0)
    tl.store(error + offs, y - sent, mask=valid)


@launched()
@triton.jit(do_not_specialize=["row_bytes"])
def _server_blocks(
    i8, u8, i16, f32, row_bytes, ranks, block_starts, block_lengths, block_scales, chunk_start,
    server_error, z, scales, absmax, out_f32, QMAX, SPAN: tl.constexpr, BITS: tl.constexpr,
    OUT: tl.constexpr,
):  # fmt: skip
    """Per block of the served chunk: ``z = (sum of the ranks' deQ, in rank order) / n + se``
    into ``z``, its ``max |z|``, and its scale (into ``scales`` and, with ``OUT``, the phase-2
    message)."""
    g = tl.program_id(0)
    start, length = tl.load(block_starts + g) - chunk_start, tl.load(block_lengths + g)
    scale_at = tl.load(block_scales + g)
    top = tl.zeros([SPAN], dtype=tl.float32)
    for at in range(0, length, SPAN):
        local = start + at + tl.arange(0, SPAN)
        valid = local < start + length
        each = scale_at + tl.zeros_like(local)
        total = _dequantized(i8, u8, i16, f32, 0, local, each, valid, BITS)
        for r in range(1, ranks):
            total = total + _dequantized(i8, u8, i16, f32, r * row_bytes, local, each, valid,
                                         BITS)  # fmt: skip
        if ranks != 1:
            total = tl.math.div_rn(total, tl.zeros_like(total) + ranks)
        zz = total + tl.load(server_error + local, mask=valid, other=0.0)
        tl.store(z + local, zz, mask=valid)
        top = tl.maximum(top, tl.where(valid, tl.where(zz == zz, tl.abs(zz), float("inf")), 0.0))
    top_max = tl.max(top, axis=0)
    tl.store(absmax + g, top_max)
    s = tl.math.div_rn(top_max, QMAX)
    tl.store(scales + scale_at, s)
    if OUT:
        tl.store(out_f32 + scale_at, s)


@launched(16)
@triton.jit(do_not_specialize=["chunk", "chunk_start", "tile0"])
def _server_quantize(
    z, server_error, result, i8, u8, i16, scales, starts, ends, columns, first, piece_starts,
    piece_blocks, block_scales, block_size, chunk, chunk_start, tile0, QMAX, BLOCK: tl.constexpr,
    BITS: tl.constexpr, OUT: tl.constexpr, RESULT: tl.constexpr,
):  # fmt: skip
    """Element-wise over the served chunk (the buffer's tiles from ``tile0``): ``Q(z)`` into the
    phase-2 message (``OUT``), ``se = z - deQ(Q(z))``, and ``deQ(Q(z))`` into ``result``
    (``RESULT``: world size 1)."""
    block = tile0 + tl.program_id(0).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    valid = (offs >= chunk_start) & (offs < chunk_start + chunk)
    _, local, g = _where(offs, valid, starts, ends, columns, first, block, piece_starts,
                         piece_blocks, block_size, chunk)  # fmt: skip
    s = tl.load(scales + tl.load(block_scales + g, mask=valid, other=0), mask=valid, other=0.0)
    zz = tl.load(z + local, mask=valid, other=0.0)
    if OUT:
        deq = _store_quantized(i8, u8, i16, 0, local, zz, s, valid, QMAX, BLOCK, BITS)
    elif BITS == 0:
        deq = (_bf16_bits(zz) << 16).to(tl.float32, bitcast=True)
    else:
        step = _step(s)
        deq = tl.minimum(tl.maximum(_rint(tl.math.div_rn(zz, step)), -QMAX), QMAX) * step
    tl.store(server_error + local, zz - deq, mask=valid)
    if RESULT:
        tl.store(result + local, deq, mask=valid)


@launched()
@triton.jit(do_not_specialize=["row_bytes", "chunk", "n"])
def _results(
    out, i8, u8, i16, f32, row_bytes, starts, ends, columns, first, piece_starts, piece_blocks,
    block_scales, block_size, chunk, n, BLOCK: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Element-wise below numel: the result, ``deQ`` of each server's phase-2 row."""
    offs, valid, j, local, scale_at = _elements(starts, ends, columns, first, piece_starts,
                                                piece_blocks, block_scales, block_size, chunk,
                                                n, BLOCK)  # fmt: skip
    tl.store(out + offs, _dequantized(i8, u8, i16, f32, j * row_bytes, local, scale_at, valid,
                                      BITS), mask=valid)  # fmt: skip


def _views(message: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A message's bytes from its first to its last (its rows may be strided: the kernels take
    the row stride), as int8, uint8, int16 and fp32 (the extent rounded up to whole floats)."""
    rows = message.reshape(1, -1) if message.dim() == 1 else message
    extent = (rows.shape[0] - 1) * rows.stride(0) + rows.shape[1]
    flat = rows.as_strided((-(-extent // 4) * 4,), (1,))
    return flat.view(torch.int8), flat, flat.view(torch.int16), flat.view(torch.float32)


class BlockQuantizer:
    """The phases of one :class:`~onebit.quantized.QuantizedAllreduce` as Triton kernels.

    Args:
        chunk_pieces: per chunk, the sizes of its pieces in order (they cover the chunk).
        block_size: elements per scale (int8, int4); bf16 blocks only split the finite check.
        chunk_numel, numel: elements per chunk, and below the padding.
        bits: ``"bf16"``, ``"int8"`` or ``"int4"``.
        payload: bytes of one chunk's values in a message row; scales follow them.
        device: where the buffers are.
    """

    def __init__(
        self,
        chunk_pieces: list[list[int]],
        block_size: int,
        chunk_numel: int,
        numel: int,
        bits: str,
        payload: int,
        device: torch.device,
    ) -> None:
        self.bits, self.code, self.qmax = bits, _BITS[bits], _QMAX[bits]
        self.block_size, self.chunk, self.numel, self.payload = (
            block_size, chunk_numel, numel, payload,
        )  # fmt: skip
        sizes = torch.tensor([size for pieces in chunk_pieces for size in pieces])
        piece_chunks = torch.repeat_interleave(
            torch.arange(len(chunk_pieces)), torch.tensor([len(p) for p in chunk_pieces])
        )
        edges = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
        counts = -(-sizes // block_size)  # blocks per piece
        piece_blocks = counts.cumsum(0) - counts
        piece = torch.repeat_interleave(torch.arange(len(sizes)), counts)  # of each block
        within = (torch.arange(len(piece)) - piece_blocks[piece]) * block_size
        chunks = piece_chunks[piece]
        per_chunk = torch.bincount(chunks, minlength=len(chunk_pieces))
        chunk_first = per_chunk.cumsum(0) - per_chunk
        self.chunk_blocks = list(zip(chunk_first.tolist(), (chunk_first + per_chunk).tolist()))
        on = dict(dtype=torch.int64, device=device)
        self.tiling = Tiling(edges, torch.arange(len(sizes)), int(edges[-1]), device)
        self.piece_starts = edges[:-1].to(**on)
        self.piece_blocks = piece_blocks.to(**on)
        self.block_starts = (edges[piece] + within).to(**on)
        self.block_lengths = torch.minimum(sizes[piece] - within, torch.tensor(block_size)).to(**on)
        self.block_chunks = chunks.to(**on)
        local = torch.arange(len(piece)) - chunk_first[chunks]
        self.scale_at = (local + payload // 4).to(**on)  # floats into a row
        self.blocks = len(piece)
        self.span = 1024 if block_size > 1024 else max(16, triton.next_power_of_2(block_size))
        self.absmax = torch.zeros(max(self.blocks, 1), device=device)
        self._rows: tuple[int, Tensor] | None = None  # each block's row, in bytes, by row width

    def _pieces(self) -> tuple:
        t = self.tiling
        return (*t.table(), self.piece_starts, self.piece_blocks, self.scale_at)

    def start(self, message: Tensor, row_bytes: int, buffer: Tensor, error: Tensor,
              source: Tensor | None) -> Tensor:  # fmt: skip
        """Phase 1's payload and scales of ``y = x + e`` (into ``buffer``; ``x`` from
        ``source`` if given, zeros past ``numel``); returns the whole buffer's ``max |y|`` (+inf
        where there is a NaN)."""
        i8, u8, i16, f32 = _views(message)
        if self._rows is None or self._rows[0] != row_bytes:
            self._rows = (row_bytes, self.block_chunks * row_bytes)
        rows = self._rows[1]
        _worker_blocks[(self.blocks,)](
            buffer if source is None else source, self.numel, buffer, error, self.block_starts,
            self.block_lengths, rows, self.scale_at, self.absmax, f32, self.qmax,
            SPAN=self.span, SCALES=self.code != 0,
        )  # fmt: skip
        _worker_quantize[(self.tiling.blocks,)](
            buffer, i8, u8, i16, f32, row_bytes, *self._pieces(), self.block_size, self.chunk,
            buffer.numel(), self.qmax, BLOCK=BLOCK, BITS=self.code,
        )  # fmt: skip
        return self.absmax[: self.blocks].amax()

    def commit_workers(self, sent: Tensor, row_bytes: int, buffer: Tensor,
                       error: Tensor) -> None:  # fmt: skip
        """Every chunk's worker error, ``y - deQ(Q(y))``, from the phase-1 message it sent."""
        i8, u8, i16, f32 = _views(sent)
        _worker_errors[(self.tiling.blocks,)](
            buffer, error, i8, u8, i16, f32, row_bytes, *self._pieces(), self.block_size,
            self.chunk, buffer.numel(), BLOCK=BLOCK, BITS=self.code,
        )  # fmt: skip

    def serve(self, rank: int, received: Tensor, row_bytes: int, server_error: Tensor,
              message: Tensor | None, result: Tensor | None) -> None:  # fmt: skip
        """Chunk ``rank``'s average of ``received`` plus the server error, quantized into the
        phase-2 ``message`` (``None`` at world size 1, where ``deQ(Q(z))`` goes into
        ``result``); the server error becomes ``z - deQ(Q(z))``."""
        g0, g1 = self.chunk_blocks[rank]
        device = server_error.device
        z = torch.empty(self.chunk, device=device)
        scales = torch.empty(self.payload // 4 + g1 - g0, device=device)  # the blocks' written
        i8, u8, i16, f32 = _views(received)
        out = scales if message is None else _views(message)[3]
        start = rank * self.chunk
        _server_blocks[(g1 - g0,)](
            i8, u8, i16, f32, row_bytes, received.shape[0], self.block_starts[g0:],
            self.block_lengths[g0:], self.scale_at[g0:], start, server_error, z, scales,
            self.absmax[g0:], out, self.qmax, SPAN=self.span, BITS=self.code,
            OUT=message is not None and self.code != 0,
        )  # fmt: skip
        q8, qu, q16, _ = _views(received if message is None else message)
        tile0, tile1 = start // BLOCK, -(-(start + self.chunk) // BLOCK)
        _server_quantize[(tile1 - tile0,)](
            z, server_error, z if result is None else result, q8, qu, q16, scales,
            *self._pieces(), self.block_size, self.chunk, start, tile0, self.qmax, BLOCK=BLOCK,
            BITS=self.code, OUT=message is not None, RESULT=result is not None,
        )  # fmt: skip

    def finish(self, gathered: Tensor, row_bytes: int, out: Tensor) -> None:
        """The result below numel from every server's phase-2 row."""
        i8, u8, i16, f32 = _views(gathered)
        blocks = -(-self.numel // BLOCK)
        _results[(blocks,)](
            out, i8, u8, i16, f32, row_bytes, *self._pieces(), self.block_size, self.chunk,
            self.numel, BLOCK=BLOCK, BITS=self.code,
        )  # fmt: skip
