"""The Triton kernels: the backend of CUDA tensors (and of CPU tensors under ``TRITON_INTERPRET=1``,
which is how a machine without a GPU tests them).

Each op is one or two launches over a whole buffer, whatever the number of tensors in it. The
buffer is cut into blocks of :data:`BLOCK` elements, one program each, and its segments (a
tensor's part of a bucket, with a scale of its own) into *pieces*: a segment's part of a block.
The piece table (:class:`Tiling`) is built once per segment layout on the host and cached on
the device, so per-tensor scales are read from it, never expanded per element. Sums of squares
(or of absolute values) are reduced per piece in fp32 inside the block, then per segment in fp64
by a second launch that also turns them into scales: no atomics, so the result is the same at
every run.

Signs, packing, error updates and the server's average are bit for bit those of the torch
reference (no multiplication is fused into an addition; the average divides with IEEE rounding).
Each op takes contiguous fp32 buffers (signs: uint8 rows with a unit inner stride) on the
backend's device and falls back to :class:`~onebit.kernels.reference.TorchKernels` otherwise.

Importing this module compiles nothing; :mod:`onebit.kernels` imports it only when the Triton
backend is first used, so that ``TRITON_INTERPRET`` may be set until then and a CPU install does
not need Triton.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import TorchKernels

BLOCK = 4096
"""Elements per program (a multiple of 8, so that no byte of signs straddles two programs)."""

INTERPRETED = triton.knobs.runtime.interpret if hasattr(triton, "knobs") else False
"""Whether ``TRITON_INTERPRET=1`` was set when this module was imported: the kernels then run
on CPU tensors, in numpy."""


@triton.jit
def _piece_columns(offs, starts, ends, columns, p0, p1):
    """Each element's scale column: that of the piece of ``[p0, p1)`` that holds it."""
    column = tl.zeros(offs.shape, dtype=tl.int64)
    for p in range(p0, p1):
        inside = (offs >= tl.load(starts + p)) & (offs < tl.load(ends + p))
        column = tl.where(inside, tl.load(columns + p), column)
    return column


@triton.jit
def _signed(bit, s):
    return tl.where(bit, s, -s)


@triton.jit
def _row_term(row, row_scales, offs, column, valid):
    """``±scale`` of each element from one packed row and its scales (indexed by column)."""
    byte = tl.load(row + offs // 8, mask=valid, other=0)
    bit = ((byte >> (offs % 8).to(tl.uint8)) & 1) != 0
    return _signed(bit, tl.load(row_scales + column, mask=valid, other=0.0))


@triton.jit
def _y_pass(
    x, nx, error, y_out, rows, row_stride, k, row_scales, scale_stride, last,
    starts, ends, columns, first, signs, partials, scales, out, n,
    BLOCK: tl.constexpr, HAS_X: tl.constexpr, HAS_ERROR: tl.constexpr, AVERAGE: tl.constexpr,
    LAST: tl.constexpr, STORE_Y: tl.constexpr, SIGNS: tl.constexpr, SUMS: tl.constexpr,
    MEAN_ABS: tl.constexpr, COMMIT: tl.constexpr,
):  # fmt: skip
    """One pass over a block: ``y = x + e`` (``x`` zero past ``nx``), or ``y = average + e``
    (the ``k`` packed ``rows`` with the pieces' scales), where ``e`` is the error or, with
    ``LAST``, the error ``e - ±last`` derived from a kept ``z``. Then, as asked: store ``y``,
    pack its signs, sum its squares (absolute values) per piece, or write ``y - ±scales``."""
    block = tl.program_id(0).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    p0, p1 = tl.load(first + block), tl.load(first + block + 1)
    column = _piece_columns(offs, starts, ends, columns, p0, p1)
    y = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_X:
        y = tl.load(x + offs, mask=offs < nx, other=0.0).to(tl.float32)
    if AVERAGE:
        y = _row_term(rows, row_scales, offs, column, valid)
        for r in range(1, k):
            y = y + _row_term(rows + r * row_stride, row_scales + r * scale_stride, offs, column,
                              valid)  # fmt: skip
        if k != 1:
            y = tl.math.div_rn(y, tl.zeros_like(y) + k)
    if HAS_ERROR:
        e = tl.load(error + offs, mask=valid, other=0.0)
        if LAST:
            e = e - _signed(e >= 0, tl.load(last + column, mask=valid, other=0.0))
        y = y + e
    if STORE_Y:
        tl.store(y_out + offs, y, mask=valid)
    if SIGNS:
        weights = (tl.arange(0, BLOCK) % 8).to(tl.uint8)
        bits = (y >= 0).to(tl.uint8) << weights
        packed = tl.sum(tl.reshape(bits, [BLOCK // 8, 8]), axis=1).to(tl.uint8)
        bytes_ = block * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(signs + bytes_, packed, mask=bytes_ < n // 8)
    if SUMS:
        term = tl.abs(y) if MEAN_ABS else y * y
        for p in range(p0, p1):
            inside = (offs >= tl.load(starts + p)) & (offs < tl.load(ends + p))
            tl.store(partials + p, tl.sum(tl.where(inside, term, 0.0)))
    if COMMIT:
        s = tl.load(scales + column, mask=valid, other=0.0)
        tl.store(out + offs, y - _signed(y >= 0, s), mask=valid)


@triton.jit
def _segment_scales(
    partials, first, lengths, scales, CHUNK: tl.constexpr, MEAN_ABS: tl.constexpr
):  # fmt: skip
    """Segment ``q``'s scale from the fp32 sums of its pieces, added in fp64."""
    q = tl.program_id(0)
    p0, p1 = tl.load(first + q), tl.load(first + q + 1)
    total = tl.zeros([CHUNK], dtype=tl.float64)
    for p in range(p0, p1, CHUNK):
        at = p + tl.arange(0, CHUNK)
        total += tl.load(partials + at, mask=at < p1, other=0.0).to(tl.float64)
    total = tl.sum(total, axis=0)
    length = tl.load(lengths + q).to(tl.float64)
    divisor = tl.maximum(length, 1.0)
    if MEAN_ABS:
        value = total / divisor
    else:
        value = tl.sqrt(total) / tl.sqrt(divisor)
    tl.store(scales + q, tl.where(length > 0, value, 0.0).to(tl.float32))


@triton.jit
def _decompress(
    rows, row_stride, row_numel, row_scales, scale_stride, starts, ends, columns, first, out, n,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """``out[i] = ±scale`` of its row's piece, from packed rows of ``row_numel`` elements."""
    block = tl.program_id(0).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    column = _piece_columns(offs, starts, ends, columns, tl.load(first + block),
                            tl.load(first + block + 1))  # fmt: skip
    row = offs // row_numel
    at = offs - row * row_numel
    byte = tl.load(rows + row * row_stride + at // 8, mask=valid, other=0)
    bit = ((byte >> (at % 8).to(tl.uint8)) & 1) != 0
    s = tl.load(row_scales + row * scale_stride + column, mask=valid, other=0.0)
    tl.store(out + offs, _signed(bit, s), mask=valid)


class Tiling:
    """A buffer of ``numel`` elements cut into :data:`BLOCK`-element blocks and its intervals
    (``edges``: increasing, from 0 to at least ``numel``; interval ``q`` is
    ``[edges[q], edges[q+1])``) into pieces, an interval's part of a block, on ``device``.

    Attributes:
        starts, ends, columns: per piece, its elements and its scale column (``columns[q]`` of
            its interval), in order.
        first: ``[blocks + 1]``, the pieces of block ``b`` are ``first[b]:first[b+1]``.
        segment_first: ``[intervals + 1]``, the pieces of interval ``q``.
        lengths: each interval's length (int64).
        interval_columns: each interval's scale column.
    """

    def __init__(self, edges: Tensor, columns: Tensor, numel: int, device: torch.device):
        edges = edges.to(torch.int64).clamp(max=numel)
        blocks = -(-numel // BLOCK)
        cuts = torch.cat([edges, torch.arange(0, numel, BLOCK), torch.tensor([numel])]).unique()
        cuts = cuts[cuts <= numel]
        starts, ends = cuts[:-1], cuts[1:]
        interval = torch.searchsorted(edges, starts, right=True) - 1
        ranges = torch.arange(blocks + 1) * BLOCK
        self.blocks = blocks
        on = dict(device=device)
        self.starts, self.ends = starts.to(**on), ends.to(**on)
        self.columns = columns.to(torch.int64)[interval].to(**on)
        self.first = torch.searchsorted(starts, ranges).to(**on)
        count = len(edges) - 1
        self.segment_first = torch.searchsorted(interval, torch.arange(count + 1)).to(**on)
        self.lengths = edges.diff().to(**on)
        self.interval_columns = columns.to(torch.int64).to(**on)
        self.count = count

    def table(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.starts, self.ends, self.columns, self.first


_TILINGS: OrderedDict[tuple, Tiling] = OrderedDict()
_CACHED = 256


def _tiling(edges: Tensor, columns: Tensor | None, numel: int, device: torch.device) -> Tiling:
    """The :class:`Tiling` of these intervals, from a small cache (the tables of a bucket stay
    the same from step to step); ``columns`` ``None`` is each interval's own index."""
    if columns is None:
        columns = torch.arange(len(edges) - 1)
    key = (edges.numpy().tobytes(), columns.numpy().tobytes(), numel, device)
    tiling = _TILINGS.get(key)
    if tiling is None:
        tiling = _TILINGS[key] = Tiling(edges, columns, numel, device)
        if len(_TILINGS) > _CACHED:
            _TILINGS.popitem(last=False)
    else:
        _TILINGS.move_to_end(key)
    return tiling


def _whole(numel: int) -> Tensor:
    return torch.tensor([0, numel], dtype=torch.int64)


class TritonKernels(TorchKernels):
    """:class:`TorchKernels` with the buffer ops as Triton kernels (see the module docstring)."""

    name = "triton"
    tile_numel = 1 << 24

    def unavailable(self) -> str | None:
        if INTERPRETED or torch.cuda.is_available():
            return None
        return "there is no CUDA GPU (set TRITON_INTERPRET=1 to run the kernels on the CPU)"

    def runs_on(self, device: torch.device) -> bool:
        return device.type == ("cpu" if INTERPRETED else "cuda")

    def _fits(self, *tensors: Tensor) -> bool:
        return all(
            self.runs_on(t.device) and t.is_contiguous() and t.dtype == torch.float32
            for t in tensors
        )

    def _rows_fit(self, packed: Tensor) -> bool:
        return self.runs_on(packed.device) and packed.dim() == 2 and packed.stride(-1) == 1

    def _pass(
        self,
        tiling: Tiling,
        n: int,
        *,
        x: Tensor | None = None,
        error: Tensor | None = None,
        y_out: Tensor | None = None,
        rows: Tensor | None = None,
        row_scales: Tensor | None = None,
        last: Tensor | None = None,
        signs: bool = False,
        sums: str | None = None,
        scales: Tensor | None = None,
        out: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Launch :func:`_y_pass` (see it) and, for ``sums``, :func:`_segment_scales`; return the
        packed signs and the intervals' scales, as asked."""
        device = (x if x is not None else error if error is not None else rows).device
        any_ = x if x is not None else error if error is not None else out
        packed = torch.empty(n // 8, dtype=torch.uint8, device=device) if signs else None
        partials = torch.empty(len(tiling.starts), dtype=torch.float32, device=device)
        k = 1 if rows is None else rows.shape[0]
        _y_pass[(tiling.blocks,)](
            any_ if x is None else x, 0 if x is None else x.numel(),
            any_ if error is None else error, any_ if y_out is None else y_out,
            any_ if rows is None else rows, 0 if rows is None else rows.stride(0), k,
            any_ if row_scales is None else row_scales,
            0 if row_scales is None else row_scales.stride(0),
            any_ if last is None else last, *tiling.table(),
            any_ if packed is None else packed, partials, any_ if scales is None else scales,
            any_ if out is None else out, n,
            BLOCK=BLOCK, HAS_X=x is not None, HAS_ERROR=error is not None,
            AVERAGE=rows is not None, LAST=last is not None, STORE_Y=y_out is not None,
            SIGNS=signs, SUMS=sums is not None, MEAN_ABS=sums == "mean_abs",
            COMMIT=scales is not None,
        )  # fmt: skip
        if sums is None:
            return packed, None
        result = torch.empty(tiling.count, dtype=torch.float32, device=device)
        _segment_scales[(tiling.count,)](
            partials, tiling.segment_first, tiling.lengths, result, CHUNK=1024,
            MEAN_ABS=sums == "mean_abs",
        )  # fmt: skip
        return packed, result

    # SPEC 1 on whole buffers.

    def compute_scale(self, x: Tensor, scale: str) -> Tensor:
        n = x.numel()
        if not self._fits(x):
            return super().compute_scale(x, scale)
        return self._pass(_tiling(_whole(n), None, n, x.device), n, x=x, sums=scale)[1].reshape(())

    def pack_signs(self, x: Tensor) -> Tensor:
        n = x.numel()
        if not (self._fits(x) and n):
            return super().pack_signs(x)
        return self._pass(_tiling(_whole(n), None, n, x.device), n, x=x, signs=True)[0]

    def subtract_compressed_(
        self, y: Tensor, s: Tensor, out: Tensor, signs: Tensor | None = None
    ) -> Tensor:
        if not (self._fits(y, out) and y.shape == out.shape and y.numel()):
            return super().subtract_compressed_(y, s, out, signs)
        scales = s.to(device=y.device, dtype=torch.float32).reshape(1)
        return self.subtract_compressed_segments_(y, scales, _whole(y.numel()), out)

    def compress_(self, buffer: Tensor, error: Tensor, scale: str) -> tuple[Tensor, Tensor]:
        n = buffer.numel()
        if not (self._fits(buffer, error) and n):
            return super().compress_(buffer, error, scale)
        tiling = _tiling(_whole(n), None, n, buffer.device)
        packed, s = self._pass(tiling, n, x=buffer, error=error, y_out=buffer, signs=True,
                               sums=scale)  # fmt: skip
        return packed, s.reshape(())

    def compress_input(
        self, x: Tensor, error: Tensor, scale: str, bounds: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        n = error.numel()
        if not (self._fits(x, error) and n):
            return super().compress_input(x, error, scale, bounds)
        tiling = _tiling(_whole(n) if bounds is None else bounds, None, n, error.device)
        packed, s = self._pass(tiling, n, x=x, error=error, signs=True, sums=scale)
        return packed, s.reshape(()) if bounds is None else s

    def commit_input_(
        self, x: Tensor, error: Tensor, scales: Tensor, bounds: Tensor | None
    ) -> Tensor:
        n = error.numel()
        if not (self._fits(x, error) and n):
            return super().commit_input_(x, error, scales, bounds)
        tiling = _tiling(_whole(n) if bounds is None else bounds, None, n, error.device)
        scales = scales.to(device=error.device, dtype=torch.float32).reshape(-1)
        self._pass(tiling, n, x=x, error=error, scales=scales, out=error)
        return error

    # SPEC 2: the server and the result.

    def decompress_(self, packed: Tensor, scales: Tensor, out: Tensor) -> Tensor:
        k, m = packed.shape
        if not (self._fits(out) and self._rows_fit(packed) and m):
            return super().decompress_(packed, scales, out)
        pieces = torch.zeros(k, 4, dtype=torch.int64)
        pieces[:, 0] = torch.arange(k)
        pieces[:, 2] = 8 * m
        return self.decompress_pieces_(packed, scales.reshape(k, 1), pieces, out)

    def average_signs_(self, packed: Tensor, scales: Tensor, out: Tensor) -> Tensor:
        k, m = packed.shape
        pieces = torch.tensor([[0, 8 * m, 0]], dtype=torch.int64)
        return self.average_signs_pieces_(packed, scales.reshape(k, 1), pieces, out)

    def serve_chunk_(
        self, packed: Tensor, scales: Tensor, error: Tensor, scale: str, z: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        k, m = packed.shape
        if not (self._fits(error) and self._rows_fit(packed) and m):
            return super().serve_chunk_(packed, scales, error, scale, z)
        n, row_scales = 8 * m, self._row_scales(scales.reshape(k, 1), error.device)
        tiling = _tiling(_whole(n), None, n, error.device)
        signs, sigma = self._pass(tiling, n, error=error, y_out=error, rows=packed,
                                  row_scales=row_scales, signs=True, sums=scale)  # fmt: skip
        self._pass(tiling, n, x=error, scales=sigma, out=error)
        return signs, sigma.reshape(())

    # Scales per segment.

    def segment_scales(self, y: Tensor, bounds: Tensor, scale: str) -> Tensor:
        n = y.numel()
        if not (self._fits(y) and n):
            return super().segment_scales(y, bounds, scale)
        return self._pass(_tiling(bounds, None, n, y.device), n, x=y, sums=scale)[1]

    def subtract_compressed_segments_(
        self, y: Tensor, scales: Tensor, bounds: Tensor, out: Tensor
    ) -> Tensor:
        n = y.numel()
        if not (self._fits(y, out) and n and out.numel() == n):
            return super().subtract_compressed_segments_(y, scales, bounds, out)
        scales = scales.to(device=y.device, dtype=torch.float32).reshape(-1)
        self._pass(_tiling(bounds, None, n, y.device), n, x=y, scales=scales, out=out)
        return out

    def average_signs_pieces_(
        self, packed: Tensor, scales: Tensor, pieces: Tensor, out: Tensor
    ) -> Tensor:
        k, m = packed.shape
        if not (self._fits(out) and self._rows_fit(packed) and m):
            return super().average_signs_pieces_(packed, scales, pieces, out)
        tiling = self._served(pieces, 8 * m, out.device)
        row_scales = self._row_scales(scales, out.device)
        self._pass(tiling, 8 * m, y_out=out, rows=packed, row_scales=row_scales)
        return out

    def serve_pieces_(
        self,
        packed: Tensor,
        scales: Tensor,
        pieces: Tensor,
        bounds: Tensor,
        store: Tensor,
        last: Tensor | None,
        scale: str,
    ) -> tuple[Tensor, Tensor]:
        k, m = packed.shape
        if not (self._fits(store) and self._rows_fit(packed) and m):
            return super().serve_pieces_(packed, scales, pieces, bounds, store, last, scale)
        n, device = 8 * m, store.device
        tiling = self._served(pieces, n, device)
        if last is not None:  # each piece's scale, indexed by the piece's column, as the rows'
            spread = torch.zeros(scales.shape[1], dtype=torch.float32, device=device)
            last = spread.index_copy_(0, tiling.interval_columns, last.to(spread))
        return self._pass(tiling, n, error=store, last=last, y_out=store, rows=packed,
                          row_scales=self._row_scales(scales, device), signs=True,
                          sums=scale)  # fmt: skip

    def decompress_pieces_(
        self, packed: Tensor, scales: Tensor, pieces: Tensor, out: Tensor
    ) -> Tensor:
        k, m = packed.shape
        n = out.numel()
        if not (self._fits(out) and self._rows_fit(packed) and m and n):
            return super().decompress_pieces_(packed, scales, pieces, out)
        starts = pieces[:, 0] * 8 * m + pieces[:, 1]
        edges = torch.cat([starts, (pieces[-1, 0] * 8 * m + pieces[-1, 2]).reshape(1)])
        tiling = _tiling(edges, pieces[:, 3], n, out.device)
        row_scales = self._row_scales(scales, out.device)
        _decompress[(tiling.blocks,)](
            packed, packed.stride(0), 8 * m, row_scales, row_scales.stride(0), *tiling.table(),
            out, n, BLOCK=BLOCK,
        )  # fmt: skip
        return out

    @staticmethod
    def _row_scales(scales: Tensor, device: torch.device) -> Tensor:
        return scales.to(device=device, dtype=torch.float32).contiguous()

    @staticmethod
    def _served(pieces: Tensor, numel: int, device: torch.device) -> Tiling:
        edges = torch.cat([pieces[:, 0], pieces[-1:, 1]])
        return _tiling(edges, pieces[:, 2], numel, device)
