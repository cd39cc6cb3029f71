"""Block-wise quantization for the quantized allreduce (:mod:`onebit.wire.quantized`): bf16, int8
or int4 with a scale per block, the tiles a chunk is cut into (whole blocks, some tens of
thousands of elements, processed while in cache), int4 packing, and the work space the tiles
share.

A tile is a ``[rows, width]`` view: one row per block where the blocks have one length (block
maxima are one ``amax``, scales broadcast per row), and for the blocks of small pieces, gathered
into one tile, rows of the lengths' common divisor (row maxima, then a ``segment_reduce`` over
each block's rows), so many small tensors cost few operations.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

BITS = ("bf16", "int8", "int4")
QMAX = {"int8": 127, "int4": 7}
FLOAT_BYTES = 4
MIN_RUN_NUMEL = 8192
"""Blocks of one length get tiles of their own (one row per block) when there are this many
elements of them in a row; shorter runs are gathered into tiles of mixed block lengths."""


def check_bits(bits: str) -> str:
    """``bits`` if it is one of :data:`BITS`, else ``ValueError`` naming the choices."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {', '.join(map(repr, BITS))}; got {bits!r}")
    return bits


def payload_bytes(numel: int, bits: str) -> int:
    """Bytes of ``numel`` quantized values: 2 each in bf16, 1 in int8, a half in int4."""
    return {"bf16": 2 * numel, "int8": numel, "int4": numel // 2}[bits]


def block_lengths(pieces: Sequence[int], block_size: int) -> list[int]:
    """Split each piece into blocks of ``block_size`` elements, the last block of a piece shorter.

    A block never crosses from one piece into the next, so no tensor's (or chunk's) magnitude
    sets another's quantization step.
    """
    lengths = []
    for size in pieces:
        full, rest = divmod(size, block_size)
        lengths += [block_size] * full + ([rest] if rest else [])
    return lengths


class Tile(NamedTuple):
    """Consecutive whole blocks, processed together while they are in cache, as a
    ``[rows, width]`` view of elements ``lo:hi`` (blocks ``b0:b1``).

    With ``rows`` ``None`` each block is one row (all ``width`` long) and per-block values are
    ``[blocks, 1]``; otherwise the blocks' lengths differ, block i is ``rows[i]`` rows (int64;
    ``width`` is the lengths' greatest common divisor) and per-block values are ``[blocks]``.
    """

    lo: int
    hi: int
    b0: int
    b1: int
    width: int
    rows: Tensor | None


def tiles(
    pieces: Sequence[int],
    block_size: int,
    tile_numel: int,
    *,
    lo: int = 0,
    b0: int = 0,
    device: torch.device | str | None = None,
) -> list[Tile]:
    """The blocks of consecutive pieces (:func:`block_lengths`), in tiles of about
    ``tile_numel`` elements (at least one block).

    A long run of blocks of one length (the full blocks of large pieces, even across pieces)
    makes tiles of one row per block; the blocks of small pieces are gathered into tiles of
    mixed lengths. ``lo`` and ``b0`` are the first element and block.
    """
    runs: list[list[int]] = []  # [count, length] of consecutive blocks of one length
    for length in block_lengths(pieces, block_size):
        if runs and runs[-1][1] == length:
            runs[-1][0] += 1
        else:
            runs.append([1, length])
    out: list[Tile] = []
    pending: list[int] = []  # the block lengths of a mixed tile being gathered

    def flush() -> None:
        nonlocal lo, b0
        if not pending:
            return
        size, count = sum(pending), len(pending)
        if len(set(pending)) == 1:
            out.append(Tile(lo, lo + size, b0, b0 + count, pending[0], None))
        else:
            width = math.gcd(*pending)
            rows = torch.tensor([n // width for n in pending], dtype=torch.long, device=device)
            out.append(Tile(lo, lo + size, b0, b0 + count, width, rows))
        lo, b0 = lo + size, b0 + count
        pending.clear()

    for count, length in runs:
        if count * length >= MIN_RUN_NUMEL:
            flush()
            per_tile = max(1, tile_numel // length)
            for first in range(0, count, per_tile):
                blocks = min(per_tile, count - first)
                out.append(Tile(lo, lo + blocks * length, b0, b0 + blocks, length, None))
                lo, b0 = lo + blocks * length, b0 + blocks
            continue
        for _ in range(count):
            if pending and sum(pending) + length > tile_numel:
                flush()
            pending.append(length)
    flush()
    return out


class TileWork(NamedTuple):
    """Work space for tiles of one shape (elements, blocks, width, mixed or not), in that shape,
    and 0-d fp32 constants (cheaper than Python numbers in an op)."""

    ratio: Tensor  # fp32, the tile's shape
    part: Tensor  # fp32, the tile's shape
    z: Tensor  # fp32, the tile's shape
    q: Tensor  # int8 (bf16: bfloat16), the tile's shape
    row_max: Tensor  # fp32, per row (mixed tiles)
    scales: Tensor  # fp32, per block
    step: Tensor  # fp32, per block
    mask: Tensor  # bool, per block
    zero: Tensor
    one: Tensor
    qmax: Tensor


def _per_row(values: Tensor, tile: Tile) -> Tensor:
    """Per-block ``values`` of ``tile``, broadcastable against its ``[rows, width]`` elements."""
    if tile.rows is None:
        return values
    rows = (tile.hi - tile.lo) // tile.width
    return torch.repeat_interleave(values, tile.rows, output_size=rows).unsqueeze(1)


def quantize_(
    y: Tensor,
    tile: Tile,
    bits: str,
    q: Tensor,
    scales: Tensor | None,
    absmax: Tensor | None,
    work: TileWork,
    dequantized: Tensor | None = None,
) -> None:
    """Quantize one tile's fp32 values ``y`` (``[rows, width]``, see :class:`Tile`): the values
    into ``q`` (int8, or bfloat16 for ``"bf16"``), the block scales into ``scales`` (``None``
    for bf16) and the blocks' ``max |y|`` into ``absmax`` (``None``: not wanted; bf16 only);
    and ``deQ(Q(y))`` into ``dequantized`` if it is given.

    int8 and int4 are symmetric: ``scale = absmax(block) / qmax`` with qmax 127 or 7, and
    ``q = round(y / scale)`` (half to even), clamped to ``[-qmax, qmax]``, as int8; a block whose
    scale is 0 (or NaN) gets ``q = 0``, and ``deQ`` is ``q * scale``. bf16 is ``y`` rounded to
    nearest even bfloat16, with no scales; ``deQ`` is the value as fp32. (For bf16 a tile's
    blocks only split ``absmax``.)
    """
    ratio = work.ratio
    if absmax is not None:  # NaN in a block makes its absmax NaN: amax and segment_reduce agree
        torch.abs(y, out=ratio)
        if tile.rows is None:
            torch.amax(ratio, dim=1, keepdim=True, out=absmax)
        else:
            row_max = ratio.view(-1) if tile.width == 1 else torch.amax(ratio, 1, out=work.row_max)
            absmax.copy_(torch.segment_reduce(row_max, "max", lengths=tile.rows, unsafe=True))
    if bits == "bf16":
        q.copy_(y)
        if dequantized is not None:
            dequantized.copy_(q)
        return
    torch.div(absmax, work.qmax, out=scales)
    # Dividing by 1 where the scale is not positive gives q = 0 there (those blocks are zeros,
    # or subnormal enough that the scale underflows), as ``where(scale > 0, y / scale, 0)``.
    torch.gt(scales, work.zero, out=work.mask)
    torch.where(work.mask, scales, work.one, out=work.step)
    step = _per_row(work.step, tile)
    torch.div(y, step, out=ratio)
    qmax = QMAX[bits]
    ratio.round_().clamp_(-qmax, qmax)
    q.copy_(ratio)
    if dequantized is not None:
        dequantized.copy_(q)  # as q.float(): no -0
        dequantized.mul_(step)  # q * step is q * scale: q is 0 where they differ


def dequantize_(q: Tensor, scales: Tensor | None, tile: Tile, out: Tensor) -> None:
    """The fp32 values that one tile's ``q`` (int8 or bfloat16, ``[rows, width]``) and block
    ``scales`` (``None`` for bf16) stand for, into ``out``."""
    out.copy_(q)
    if scales is not None:
        out.mul_(_per_row(scales, tile))


def pack_int4(q: Tensor) -> Tensor:
    """Two int4 values (in ``[-8, 7]``) per byte, the first in the low nibble. ``q`` has an even
    number of elements."""
    out = torch.empty(q.numel() // 2, dtype=torch.uint8, device=q.device)
    pack_int4_into(q.to(torch.int8, copy=True).reshape(-1), out)
    return out


def unpack_int4(packed: Tensor) -> Tensor:
    """The int8 values that :func:`pack_int4` packed, in order."""
    out = torch.empty(2 * packed.numel(), dtype=torch.int8, device=packed.device)
    unpack_int4_into(packed.reshape(-1), out)
    return out


def pack_int4_into(q: Tensor, out: Tensor) -> None:
    """:func:`pack_int4` of ``q`` (int8, flat) into ``out``; ``q`` is overwritten."""
    nibbles = q.view(torch.uint8).add_(8)  # wraps around: -8..7 become 0..15
    torch.bitwise_left_shift(nibbles[1::2], 4, out=out)
    out.bitwise_or_(nibbles[0::2])


def unpack_int4_into(packed: Tensor, out: Tensor) -> None:
    """:func:`unpack_int4` of ``packed`` into ``out`` (int8, flat, twice as long)."""
    nibbles = out.view(torch.uint8)
    torch.bitwise_and(packed, 15, out=nibbles[0::2])
    torch.bitwise_right_shift(packed, 4, out=nibbles[1::2])
    nibbles.sub_(8)


def floats(raw: Tensor) -> Tensor:
    """uint8 bytes read as fp32 values along the last dimension (copied, so any alignment works)."""
    if raw.numel() == 0:
        return torch.zeros(*raw.shape[:-1], raw.shape[-1] // 4, device=raw.device)
    return raw.clone(memory_format=torch.contiguous_format).view(torch.float32)


class ChunkPlan:
    """The tiles of one chunk (:func:`tiles`, in chunk coordinates), and how to cut a chunk's
    elements or blocks into per-tile views in few operations."""

    def __init__(self, chunk: list[Tile], below: int) -> None:
        self.tiles = chunk
        self.below = below  # the tiles below the buffer's numel (the rest are padding)
        self.below_numel = chunk[below - 1].hi if below else 0
        self.blocks = chunk[-1].b1 if chunk else 0
        # Runs of consecutive tiles of one row per block and one width (never across `below`),
        # and mixed tiles on their own: (first tile, lo, hi, b0, b1, width, blocks per tile).
        self.runs: list[tuple[int, int, int, int, int, int, list[int] | None]] = []
        for t, tile in enumerate(chunk):
            run = self.runs[-1] if self.runs else None
            if run and run[6] and tile.rows is None and run[5] == tile.width and t != below:
                counts = run[6] + [tile.b1 - tile.b0]
                self.runs[-1] = (run[0], run[1], tile.hi, run[3], tile.b1, run[5], counts)
            else:
                counts = [tile.b1 - tile.b0] if tile.rows is None else None
                self.runs.append((t, tile.lo, tile.hi, tile.b0, tile.b1, tile.width, counts))

    def elements(self, x: Tensor, below: bool = False) -> list[Tensor]:
        """Each tile's ``[rows, width]`` view of ``x``, one chunk's elements (with ``below``,
        its tiles below numel only: ``x`` holds ``below_numel``)."""
        views: list[Tensor] = []
        for t, lo, hi, _, _, width, counts in self.runs:
            if below and t >= self.below:
                break
            if counts:
                views += x[lo:hi].view(-1, width).split(counts)
            else:
                views.append(x[lo:hi].view(-1, width))
        return views

    def per_block(self, x: Tensor) -> list[Tensor]:
        """Each tile's view of ``x``, one value per block of the chunk (see :class:`Tile`)."""
        views: list[Tensor] = []
        for _, _, _, b0, b1, _, counts in self.runs:
            views += x[b0:b1].view(-1, 1).split(counts) if counts else [x[b0:b1]]
        return views


class Scratch:
    """Work space for the tiles of a call (:class:`TileWork` by tile shape, and flat int8
    ``q_in`` and ``q_out`` for int4's packing), shared by the communicators of a thread and
    device: nothing in it outlives a phase method."""

    _local = threading.local()

    def __init__(self, device: torch.device, numel: int, blocks: int) -> None:
        self.numel, self.blocks = numel, blocks
        self._ratio = torch.empty(numel, device=device)
        self._part = torch.empty(numel, device=device)
        self._z = torch.empty(numel, device=device)
        self._q = torch.empty(numel, dtype=torch.int8, device=device)
        self._q16 = torch.empty(numel, dtype=torch.bfloat16, device=device)
        self.q_in = torch.empty(numel + 2, dtype=torch.int8, device=device)
        self.q_out = torch.empty(numel + 2, dtype=torch.int8, device=device)
        self._row_max = torch.empty(numel, device=device)
        self._scales = torch.empty(blocks, device=device)
        self._step = torch.empty(blocks, device=device)
        self._mask = torch.empty(blocks, dtype=torch.bool, device=device)
        self._zero = torch.zeros((), device=device)
        self._one = torch.ones((), device=device)
        self._qmax = {b: torch.tensor(float(m), device=device) for b, m in QMAX.items()}
        self._works: dict[tuple[int, int, int, bool, str], TileWork] = {}

    @classmethod
    def get(cls, device: torch.device, numel: int, blocks: int) -> Scratch:
        """This thread's work space on ``device``, grown to at least ``numel`` and ``blocks``."""
        cache = cls._local.__dict__.setdefault("by_device", {})
        scratch = cache.get(device)
        if scratch is None or scratch.numel < numel or scratch.blocks < blocks:
            if scratch is not None:
                numel, blocks = max(numel, scratch.numel), max(blocks, scratch.blocks)
            scratch = cache[device] = cls(device, numel, blocks)
        return scratch

    def work(self, tile: Tile, bits: str) -> TileWork:
        """The :class:`TileWork` for tiles of ``tile``'s shape."""
        key = (tile.hi - tile.lo, tile.b1 - tile.b0, tile.width, tile.rows is None, bits)
        work = self._works.get(key)
        if work is None:
            numel, blocks, width, uniform, _ = key

            def shaped(x: Tensor) -> Tensor:
                return x[:numel].view(-1, width)

            def per_block(x: Tensor) -> Tensor:
                return x[:blocks].view(-1, 1) if uniform else x[:blocks]

            work = self._works[key] = TileWork(
                shaped(self._ratio),
                shaped(self._part),
                shaped(self._z),
                shaped(self._q16 if bits == "bf16" else self._q),
                self._row_max[: numel // width],
                per_block(self._scales),
                per_block(self._step),
                per_block(self._mask),
                self._zero,
                self._one,
                self._qmax.get(bits, self._one),
            )
        return work
