"""What the Triton kernel modules share: the launcher, the tiling of a buffer into blocks and
pieces, and the ``@triton.jit`` helpers that the kernels of a buffer (:mod:`.triton_kernels`), of
the whole model (:mod:`.triton_model`) and of the quantized warmup (:mod:`.triton_quantized`)
inline: a program's block and runs, signs and bits, reading and storing elements of any dtype,
Adam's lerp as torch rounds it, and segment scales from per-piece sums.

Importing this module compiles nothing.
"""

from __future__ import annotations

import contextlib
import struct
from collections import OrderedDict

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024
"""Elements per program (a multiple of 8, so that no byte of signs straddles two programs). On
an H100 the passes over the whole model ran 1.2x-1.9x faster at 1024 than at 4096: an SM then
holds several programs at once, and one's loads overlap another's table lookups."""


class Launched:
    """A Triton kernel that launches on its first tensor argument's device (Triton launches on
    the current CUDA device, which need not be the tensors') with its :attr:`options`: its
    number of warps, and no multiply-add fused into one rounding, so that each op rounds as
    torch's kernels do."""

    def __init__(self, kernel: triton.JITFunction, num_warps: int) -> None:
        self.kernel = kernel
        self.options = {"num_warps": num_warps, "enable_fp_fusion": False}
        LAUNCHED.append(self)

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args, **kwargs):
            device = next(a.device for a in args if isinstance(a, Tensor))
            on = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
            with on:
                return self.kernel[grid](*args, **kwargs, **self.options)

        return launch


LAUNCHED: list[Launched] = []
"""Every kernel launched from the host, in the order its module defined it (once
:mod:`.triton_kernels`, which imports the others, is imported)."""


def launched(num_warps: int = 4):
    """Decorate a ``@triton.jit`` kernel launched from the host (see :class:`Launched`), with
    its warps: those that ran it fastest on an H100 (4, 8 elements a thread, for most; 8 for
    the heaviest passes), within at most 128 registers a thread and no spills, as
    ``benchmarks/registers.py`` measures for sm_90. The threads of a block share its elements,
    so more warps hold fewer elements each."""
    return lambda kernel: Launched(kernel, num_warps)


@triton.jit
def program_block(n, BLOCK: tl.constexpr):
    """This program's block of ``[0, n)``: its first element (int64), its elements' offsets
    from there (int32: a buffer holds fewer than 2**31 elements) and their validity."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    local = tl.arange(0, BLOCK)
    return start, local, local < tl.minimum(n - start, BLOCK).to(tl.int32)


@triton.jit
def piece_columns(local, start, starts, ends, columns, p0, p1):
    """Each element's scale column (int32): that of the piece of ``[p0, p1)`` that holds it."""
    column = tl.zeros(local.shape, dtype=tl.int32)
    for p in range(p0, p1):
        lo = (tl.load(starts + p) - start).to(tl.int32)
        hi = (tl.load(ends + p) - start).to(tl.int32)
        column = tl.where((local >= lo) & (local < hi), tl.load(columns + p).to(tl.int32), column)
    return column


@triton.jit
def program_runs(local, start, valid, starts, ends, columns, first, run_columns, run_params):
    """This program's pieces ``[p0, p1)`` (parts of runs), and per element its run, its
    momentum column (< 0: padding), whether it has a parameter's element (``present``) and that
    parameter (int32)."""
    block = tl.program_id(0)
    p0, p1 = tl.load(first + block), tl.load(first + block + 1)
    run = piece_columns(local, start, starts, ends, columns, p0, p1)
    column = tl.load(run_columns + run, mask=valid, other=-1).to(tl.int32)
    present = valid & (column >= 0)
    param = tl.load(run_params + run, mask=present, other=0).to(tl.int32)
    return p0, p1, run, column, present, param


@triton.jit
def signed(bit, s):
    return tl.where(bit, s, -s)


@triton.jit
def as_stored(value, pointer):
    """fp32 ``value`` as ``pointer`` keeps it: rounded to nearest, ties to even, where that is
    bf16 (an error kept compact), as torch's ``copy_`` rounds; Triton's interpreter would
    truncate."""
    if pointer.dtype.element_ty == tl.bfloat16:  # the fp32 of that bf16: any cast keeps it
        value = element_round(value, 1)
    return value


@triton.jit
def bit_at(byte, at):
    """Bit ``at % 8`` of each ``byte``."""
    return ((byte >> (at % 8).to(tl.uint8)) & 1) != 0


@triton.jit
def emit(
    y, start, local, valid, p0, p1, starts, ends, scale_index, signs, partials, scales, out, n,
    BLOCK: tl.constexpr, SIGNS: tl.constexpr, SUMS: tl.constexpr, MEAN_ABS: tl.constexpr,
    COMMIT: tl.constexpr,
):  # fmt: skip
    """What a pass makes of its ``y``, as asked: the packed signs, the sums of squares (absolute
    values) per piece, and ``out = y - ±scales[scale_index]``."""
    if SIGNS:
        weights = (local % 8).to(tl.uint8)
        bits = (y >= 0).to(tl.uint8) << weights
        packed = tl.sum(tl.reshape(bits, [BLOCK // 8, 8]), axis=1).to(tl.uint8)
        bytes_ = tl.arange(0, BLOCK // 8)
        limit = tl.minimum(n // 8 - start // 8, BLOCK // 8).to(tl.int32)
        tl.store(signs + start // 8 + bytes_, packed, mask=bytes_ < limit)
    if SUMS:
        term = tl.abs(y) if MEAN_ABS else y * y
        for p in range(p0, p1):
            lo = (tl.load(starts + p) - start).to(tl.int32)
            hi = (tl.load(ends + p) - start).to(tl.int32)
            tl.store(partials + p, tl.sum(tl.where((local >= lo) & (local < hi), term, 0.0)))
    if COMMIT:
        s = tl.load(scales + scale_index, mask=valid, other=0.0)
        tl.store(out + start + local, as_stored(y - signed(y >= 0, s), out), mask=valid)


@triton.jit
def row_and_place(start, local, row_numel, BLOCK: tl.constexpr):
    """Each element's row (int64) and place in it (int32), in rows of ``row_numel`` elements.
    Where a row holds a block or more, a block spans at most two rows, found without a division
    per element."""
    row = start // row_numel
    within = (start - row * row_numel).to(tl.int32) + local  # from the first row's start
    if row_numel >= BLOCK:
        wrap = within >= row_numel
        return row + wrap.to(tl.int64), tl.where(wrap, within - row_numel.to(tl.int32), within)
    step = within // row_numel.to(tl.int32)
    return row + step.to(tl.int64), within - step * row_numel.to(tl.int32)


@triton.jit
def packed_momentum(bits, stride, chunk, scales, column, start, local, present,
                    BLOCK: tl.constexpr):  # fmt: skip
    """``±σ`` of each element from the packed momentum (rows of ``chunk`` elements, a multiple
    of 8)."""
    row, at = row_and_place(start, local, chunk, BLOCK)
    byte = tl.load(bits + row * stride + at // 8, mask=present, other=0)
    return signed(bit_at(byte, local), tl.load(scales + column, mask=present, other=0.0))


@triton.jit
def run_pointers(bases, param, run_offsets, run_starts, run, start, local, present):
    """Each element's address in its run's fp32 tensor (``bases[param]`` plus the run's offset),
    and whether it has one (a base of 0 is a tensor without data: zeros)."""
    return element_pointers(bases, param, run_offsets, run_starts, run, start, local, present, 0)


@triton.jit
def element_pointers(bases, param, run_offsets, run_starts, run, start, local, present,
                     ELEMENT: tl.constexpr):  # fmt: skip
    """:func:`run_pointers` for tensors of ``ELEMENT``, the index of their dtype in
    :data:`~onebit.kernels.fused.DTYPES`: fp32, or bf16 and fp16 as 16-bit words (read and
    written with :func:`element_load` and :func:`element_store`)."""
    base = tl.load(bases + param, mask=present, other=0)
    offset = tl.load(run_offsets + run, mask=present, other=0)  # in bytes of fp32
    into = (start - tl.load(run_starts + run, mask=present, other=0)).to(tl.int32) + local
    if ELEMENT == 0:
        at = (base + offset).to(tl.pointer_type(tl.float32)) + into
    else:
        at = (base + offset // 2).to(tl.pointer_type(tl.uint16)) + into
    return at, present & (base != 0)


@triton.jit
def _widened(word, ELEMENT: tl.constexpr):
    """The fp32 value of a bf16 (``ELEMENT`` 1) or fp16 (2) 16-bit ``word``, exactly."""
    if ELEMENT == 1:
        value = (word.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        value = word.to(tl.float16, bitcast=True).to(tl.float32)
    return value


@triton.jit
def _narrowed(value, ELEMENT: tl.constexpr):
    """fp32 ``value`` rounded to bf16 (``ELEMENT`` 1) or fp16 (2) as torch rounds a result it
    stores, to nearest, ties to even (a bf16 NaN as 0x7FC0), as a 16-bit word; in integer ops
    for bf16, which Triton's interpreter would truncate."""
    if ELEMENT == 1:
        bits = value.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        word = tl.where(value != value, 0x7FC0, bits).to(tl.uint16)
    else:
        word = value.to(tl.float16).to(tl.uint16, bitcast=True)
    return word


@triton.jit
def element_load(at, mask, ELEMENT: tl.constexpr):
    """The values at ``at`` (:func:`element_pointers`) as fp32, exactly; 0 where masked."""
    if ELEMENT == 0:
        value = tl.load(at, mask=mask, other=0.0)
    else:
        value = _widened(tl.load(at, mask=mask, other=0), ELEMENT)
    return value


@triton.jit
def element_round(value, ELEMENT: tl.constexpr):
    """fp32 ``value`` as a tensor of ``ELEMENT`` stores it, back in fp32."""
    if ELEMENT != 0:
        value = _widened(_narrowed(value, ELEMENT), ELEMENT)
    return value


@triton.jit
def element_store(at, value, mask, ELEMENT: tl.constexpr):
    """Store fp32 ``value`` at ``at`` (:func:`element_pointers`), rounded as torch rounds it."""
    if ELEMENT == 0:
        tl.store(at, value, mask=mask)
    else:
        tl.store(at, _narrowed(value, ELEMENT), mask=mask)


@triton.jit
def times_mask(m, masks, param, run_offsets, run_starts, run, start, local, present,
               MASKED: tl.constexpr):  # fmt: skip
    """``m`` times each element's ``exp_avg_mask`` where ``MASKED``, read in place through its
    run's mask of 0/1 bytes (as :func:`run_pointers` reads fp32: ``masks[param]`` is its
    address, 0 for a parameter without one, whose elements take 1)."""
    if MASKED:
        base = tl.load(masks + param, mask=present, other=0)
        first = base + tl.load(run_offsets + run, mask=present, other=0) // 4
        into = (start - tl.load(run_starts + run, mask=present, other=0)).to(tl.int32) + local
        at = first.to(tl.pointer_type(tl.uint8)) + into
        m = m * tl.load(at, mask=present & (base != 0), other=1).to(tl.float32)
    return m


@triton.jit
def read_gradient(grads, inv, param, run_offsets, run_starts, run, start, local, present,
                  USE_INV: tl.constexpr, INV_PTR: tl.constexpr, ELEMENT: tl.constexpr):  # fmt: skip
    """Each element's gradient in fp32, read in place through its run's tensor of ``ELEMENT``
    (:func:`element_pointers`; zeros without one), times ``inv`` where ``USE_INV`` (a
    GradScaler's inverse scale, times the coefficient that clips the rank's gradient): a number,
    or with ``INV_PTR`` a pointer to it on the device, so that clipping needs no read of the
    device."""
    at, readable = element_pointers(grads, param, run_offsets, run_starts, run, start, local,
                                    present, ELEMENT)  # fmt: skip
    g = element_load(at, readable, ELEMENT)
    if USE_INV:
        if INV_PTR:
            g = g * tl.load(inv)
        else:
            g = g * inv
    return g


@triton.jit
def lerp_rounded(m, g, coeff, SMALL: tl.constexpr):
    """``torch.lerp(m, g, w)`` as torch rounds it, one FMA: ``coeff`` and ``SMALL`` are
    :func:`lerp_coefficient`'s."""
    if SMALL:
        y = tl.fma(tl.zeros_like(g) + coeff, g - m, m)
    else:
        y = tl.fma(tl.zeros_like(g) + coeff, g - m, g)
    return y


def lerp_coefficient(weight: float) -> tuple[float, bool]:
    """A lerp weight ``w`` as :func:`lerp_rounded` takes it, rounded to fp32 as torch's ``lerp``
    does: ``(w, True)`` where ``|w| < 0.5``, else ``(w - 1, False)``."""
    w = struct.unpack("f", struct.pack("f", weight))[0]
    if abs(w) < 0.5:
        return w, True
    return struct.unpack("f", struct.pack("f", w - 1.0))[0], False


@launched()
@triton.jit
def segments_to_scales(
    partials, first, lengths, scales, CHUNK: tl.constexpr, MEAN_ABS: tl.constexpr
):  # fmt: skip
    """Segment ``q``'s scale from the fp32 sums of its pieces, added in fp64."""
    q = tl.program_id(0)
    tl.store(scales + q, segment_scale(partials, first, lengths, q, CHUNK, MEAN_ABS))


@triton.jit
def segment_scale(partials, first, lengths, q, CHUNK: tl.constexpr, MEAN_ABS: tl.constexpr):
    """Segment ``q``'s scale (fp32) from the fp32 sums of its pieces, added in fp64; 0 for an
    empty segment."""
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
    return tl.where(length > 0, value, 0.0).to(tl.float32)


class Tiling:
    """A buffer of ``numel`` elements cut into :data:`BLOCK`-element blocks and its intervals
    (``edges``: increasing, from 0 to at least ``numel``; interval ``i`` is
    ``[edges[i], edges[i+1])``) into pieces, an interval's part of a block, on ``device``.

    ``columns`` gives each interval's scale column, ``segments`` the segment its sums go to
    (nondecreasing; default: each interval is its own). Fewer than 2**31 elements, unless
    ``wide`` (for kernels whose offsets are int64).

    Attributes:
        starts, ends, columns: per piece, its elements and its interval's column, in order.
        first: ``[blocks + 1]``, the pieces of block ``b`` are ``first[b]:first[b+1]``.
        segment_first: ``[count + 1]``, the pieces of segment ``q``.
        lengths: each segment's length (int64).
        interval_columns: each interval's column.
    """

    def __init__(
        self,
        edges: Tensor,
        columns: Tensor,
        numel: int,
        device: torch.device,
        segments: Tensor | None = None,
        wide: bool = False,
    ) -> None:
        if numel >= 2**31 and not wide:
            raise ValueError(
                f"the Triton kernels take buffers of fewer than 2**31 elements, got {numel}: "
                "split it (an optimizer's bucket_size)"
            )
        edges = edges.to(torch.int64).clamp(max=numel)
        self.blocks = -(-numel // BLOCK)
        cuts = torch.cat([edges, torch.arange(0, numel, BLOCK), torch.tensor([numel])]).unique()
        cuts = cuts[cuts <= numel]
        starts, ends = cuts[:-1], cuts[1:]
        interval = torch.searchsorted(edges, starts, right=True) - 1
        if segments is None:
            segments = torch.arange(len(edges) - 1)
        self.count = int(segments.max()) + 1 if len(segments) else 0
        lengths = torch.zeros(self.count, dtype=torch.int64).index_add_(0, segments, edges.diff())
        piece_segments = segments[interval]
        on = dict(device=device, copy=True)  # tables of their own, aligned as allocations are
        self.starts, self.ends = starts.to(**on), ends.to(**on)
        self.columns = columns.to(torch.int64)[interval].to(**on)
        self.first = torch.searchsorted(starts, torch.arange(self.blocks + 1) * BLOCK).to(**on)
        self.segment_first = torch.searchsorted(piece_segments, torch.arange(self.count + 1))
        self.segment_first = self.segment_first.to(**on)
        self.lengths = lengths.to(**on)
        self.interval_columns = columns.to(torch.int64).to(**on)

    def table(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.starts, self.ends, self.columns, self.first


_TILINGS: OrderedDict[tuple, Tiling] = OrderedDict()


_CACHED = 4096  # a few per bucket


def cached_tiling(
    edges: Tensor | np.ndarray, columns: Tensor | np.ndarray | None, numel: int,
    device: torch.device,
) -> Tiling:  # fmt: skip
    """The :class:`Tiling` of these intervals (host integers), from a small cache (the tables
    of a bucket stay the same from step to step); ``columns`` ``None`` is each interval's own
    index. A hit costs no torch op: the key is made in numpy."""
    edges = np.asarray(edges, dtype=np.int64)
    columns = np.arange(len(edges) - 1) if columns is None else np.asarray(columns, np.int64)
    key = (edges.tobytes(), columns.tobytes(), numel, device)
    tiling = _TILINGS.get(key)
    if tiling is None:
        tiling = Tiling(torch.from_numpy(edges), torch.from_numpy(columns), numel, device)
        _TILINGS[key] = tiling
        if len(_TILINGS) > _CACHED:
            _TILINGS.popitem(last=False)
    else:
        _TILINGS.move_to_end(key)
    return tiling
