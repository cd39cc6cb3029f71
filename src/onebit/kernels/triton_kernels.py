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

import contextlib
import os
import struct
from collections import OrderedDict

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import host
from .fused import DTYPES, BucketRuns, PackedMomentum
from .reference import QuantizedBucket, TorchKernels

BLOCK = 1024
"""Elements per program (a multiple of 8, so that no byte of signs straddles two programs). On
an H100 the passes over the whole model ran 1.2x-1.9x faster at 1024 than at 4096: an SM then
holds several programs at once, and one's loads overlap another's table lookups."""

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether ``TRITON_INTERPRET=1`` was set when this module was imported (as ``triton.jit``
reads it): the kernels then run on CPU tensors, in numpy."""


class _Launched:
    """A Triton kernel that launches on its first tensor argument's device (Triton launches on
    the current CUDA device, which need not be the tensors') with its :attr:`options`: its
    number of warps, and no multiply-add fused into one rounding, so that each op rounds as
    torch's kernels do."""

    def __init__(self, kernel: triton.JITFunction, num_warps: int) -> None:
        self.kernel = kernel
        self.options = {"num_warps": num_warps, "enable_fp_fusion": False}

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args, **kwargs):
            device = next(a.device for a in args if isinstance(a, Tensor))
            on = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
            with on:
                return self.kernel[grid](*args, **kwargs, **self.options)

        return launch


def launched(num_warps: int = 4):
    """Decorate a ``@triton.jit`` kernel launched from the host (see :class:`_Launched`), with
    its warps: those that ran it fastest on an H100 (4, 8 elements a thread, for most; 8 for
    the heaviest passes), within at most 128 registers a thread and no spills, as
    ``benchmarks/registers.py`` measures for sm_90. The threads of a block share its elements,
    so more warps hold fewer elements each."""
    return lambda kernel: _Launched(kernel, num_warps)


@triton.jit
def _block(n, BLOCK: tl.constexpr):
    """This program's block of ``[0, n)``: its first element (int64), its elements' offsets
    from there (int32: a buffer holds fewer than 2**31 elements) and their validity."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    local = tl.arange(0, BLOCK)
    return start, local, local < tl.minimum(n - start, BLOCK).to(tl.int32)


@triton.jit
def _piece_columns(local, start, starts, ends, columns, p0, p1):
    """Each element's scale column (int32): that of the piece of ``[p0, p1)`` that holds it."""
    column = tl.zeros(local.shape, dtype=tl.int32)
    for p in range(p0, p1):
        lo = (tl.load(starts + p) - start).to(tl.int32)
        hi = (tl.load(ends + p) - start).to(tl.int32)
        column = tl.where((local >= lo) & (local < hi), tl.load(columns + p).to(tl.int32), column)
    return column


@triton.jit
def _runs(local, start, valid, starts, ends, columns, first, run_columns, run_params):
    """This program's pieces ``[p0, p1)`` (parts of runs), and per element its run, its
    momentum column (< 0: padding), whether it has a parameter's element (``present``) and that
    parameter (int32)."""
    block = tl.program_id(0)
    p0, p1 = tl.load(first + block), tl.load(first + block + 1)
    run = _piece_columns(local, start, starts, ends, columns, p0, p1)
    column = tl.load(run_columns + run, mask=valid, other=-1).to(tl.int32)
    present = valid & (column >= 0)
    param = tl.load(run_params + run, mask=present, other=0).to(tl.int32)
    return p0, p1, run, column, present, param


@triton.jit
def _signed(bit, s):
    return tl.where(bit, s, -s)


@triton.jit
def _as_stored(value, pointer):
    """fp32 ``value`` as ``pointer`` keeps it: rounded to nearest, ties to even, where that is
    bf16 (an error kept compact), as torch's ``copy_`` rounds; Triton's interpreter would
    truncate."""
    if pointer.dtype.element_ty == tl.bfloat16:  # the fp32 of that bf16: any cast keeps it
        value = _element_round(value, 1)
    return value


@triton.jit
def _bit(byte, at):
    """Bit ``at % 8`` of each ``byte``."""
    return ((byte >> (at % 8).to(tl.uint8)) & 1) != 0


@triton.jit
def _row_term(row, row_scales, start, local, column, valid):
    """``±scale`` of each element from one packed row and its scales (indexed by column)."""
    byte = tl.load(row + start // 8 + local // 8, mask=valid, other=0)
    return _signed(_bit(byte, local), tl.load(row_scales + column, mask=valid, other=0.0))


@launched(4)
@triton.jit(do_not_specialize=["nx", "row_stride", "k", "scale_stride", "n"])
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
    start, local, valid = _block(n, BLOCK)
    block = tl.program_id(0)
    p0, p1 = tl.load(first + block), tl.load(first + block + 1)
    column = _piece_columns(local, start, starts, ends, columns, p0, p1)
    y = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_X:
        in_x = local < tl.minimum(tl.maximum(nx - start, 0), BLOCK).to(tl.int32)
        y = tl.load(x + start + local, mask=in_x, other=0.0).to(tl.float32)
    if AVERAGE:
        y = _row_term(rows, row_scales, start, local, column, valid)
        for r in range(1, k):
            y = y + _row_term(rows + r * row_stride, row_scales + r * scale_stride, start, local,
                              column, valid)  # fmt: skip
        if k != 1:
            y = tl.math.div_rn(y, tl.zeros_like(y) + k)
    if HAS_ERROR:
        e = tl.load(error + start + local, mask=valid, other=0.0)
        if LAST:
            e = e - _signed(e >= 0, tl.load(last + column, mask=valid, other=0.0))
        y = y + e
    if STORE_Y:
        tl.store(y_out + start + local, y, mask=valid)
    _emit(y, start, local, valid, p0, p1, starts, ends, column, signs, partials, scales, out, n,
          BLOCK, SIGNS, SUMS, MEAN_ABS, COMMIT)  # fmt: skip


@triton.jit
def _emit(
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
        tl.store(out + start + local, _as_stored(y - _signed(y >= 0, s), out), mask=valid)


@triton.jit
def _rows(start, local, row_numel, BLOCK: tl.constexpr):
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
def _packed_momentum(bits, stride, chunk, scales, column, start, local, present,
                     BLOCK: tl.constexpr):  # fmt: skip
    """``±σ`` of each element from the packed momentum (rows of ``chunk`` elements, a multiple
    of 8)."""
    row, at = _rows(start, local, chunk, BLOCK)
    byte = tl.load(bits + row * stride + at // 8, mask=present, other=0)
    return _signed(_bit(byte, local), tl.load(scales + column, mask=present, other=0.0))


@triton.jit
def _run_pointers(bases, param, run_offsets, run_starts, run, start, local, present):
    """Each element's address in its run's fp32 tensor (``bases[param]`` plus the run's offset),
    and whether it has one (a base of 0 is a tensor without data: zeros)."""
    return _element_pointers(bases, param, run_offsets, run_starts, run, start, local, present, 0)


@triton.jit
def _element_pointers(bases, param, run_offsets, run_starts, run, start, local, present,
                      ELEMENT: tl.constexpr):  # fmt: skip
    """:func:`_run_pointers` for tensors of ``ELEMENT``, the index of their dtype in
    :data:`~onebit.kernels.fused.DTYPES`: fp32, or bf16 and fp16 as 16-bit words (read and
    written with :func:`_element_load` and :func:`_element_store`)."""
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
def _element_load(at, mask, ELEMENT: tl.constexpr):
    """The values at ``at`` (:func:`_element_pointers`) as fp32, exactly; 0 where masked."""
    if ELEMENT == 0:
        value = tl.load(at, mask=mask, other=0.0)
    else:
        value = _widened(tl.load(at, mask=mask, other=0), ELEMENT)
    return value


@triton.jit
def _element_round(value, ELEMENT: tl.constexpr):
    """fp32 ``value`` as a tensor of ``ELEMENT`` stores it, back in fp32."""
    if ELEMENT != 0:
        value = _widened(_narrowed(value, ELEMENT), ELEMENT)
    return value


@triton.jit
def _element_store(at, value, mask, ELEMENT: tl.constexpr):
    """Store fp32 ``value`` at ``at`` (:func:`_element_pointers`), rounded as torch rounds it."""
    if ELEMENT == 0:
        tl.store(at, value, mask=mask)
    else:
        tl.store(at, _narrowed(value, ELEMENT), mask=mask)


@triton.jit
def _masked(m, masks, param, run_offsets, run_starts, run, start, local, present,
            MASKED: tl.constexpr):  # fmt: skip
    """``m`` times each element's ``exp_avg_mask`` where ``MASKED``, read in place through its
    run's mask of 0/1 bytes (as :func:`_run_pointers` reads fp32: ``masks[param]`` is its
    address, 0 for a parameter without one, whose elements take 1)."""
    if MASKED:
        base = tl.load(masks + param, mask=present, other=0)
        first = base + tl.load(run_offsets + run, mask=present, other=0) // 4
        into = (start - tl.load(run_starts + run, mask=present, other=0)).to(tl.int32) + local
        at = first.to(tl.pointer_type(tl.uint8)) + into
        m = m * tl.load(at, mask=present & (base != 0), other=1).to(tl.float32)
    return m


@triton.jit
def _gradient(grads, inv, param, run_offsets, run_starts, run, start, local, present,
              USE_INV: tl.constexpr, INV_PTR: tl.constexpr, ELEMENT: tl.constexpr):  # fmt: skip
    """Each element's gradient in fp32, read in place through its run's tensor of ``ELEMENT``
    (:func:`_element_pointers`; zeros without one), times ``inv`` where ``USE_INV`` (a
    GradScaler's inverse scale, times the coefficient that clips the rank's gradient): a number,
    or with ``INV_PTR`` a pointer to it on the device, so that clipping needs no read of the
    device."""
    at, readable = _element_pointers(grads, param, run_offsets, run_starts, run, start, local,
                                     present, ELEMENT)  # fmt: skip
    g = _element_load(at, readable, ELEMENT)
    if USE_INV:
        if INV_PTR:
            g = g * tl.load(inv)
        else:
            g = g * inv
    return g


@triton.jit
def _lerp(m, g, coeff, SMALL: tl.constexpr):
    """``torch.lerp(m, g, w)`` as torch rounds it, one FMA: ``coeff`` and ``SMALL`` are
    :func:`lerp_coefficient`'s."""
    if SMALL:
        y = tl.fma(tl.zeros_like(g) + coeff, g - m, m)
    else:
        y = tl.fma(tl.zeros_like(g) + coeff, g - m, g)
    return y


def lerp_coefficient(weight: float) -> tuple[float, bool]:
    """A lerp weight ``w`` as :func:`_lerp` takes it, rounded to fp32 as torch's ``lerp`` does:
    ``(w, True)`` where ``|w| < 0.5``, else ``(w - 1, False)``."""
    w = struct.unpack("f", struct.pack("f", weight))[0]
    if abs(w) < 0.5:
        return w, True
    return struct.unpack("f", struct.pack("f", w - 1.0))[0], False


@launched(4)
@triton.jit(do_not_specialize=["stride", "chunk", "n"])
def _momentum_pass(
    grads, inv, dense, bits, stride, chunk, momentum_scales, masks, coeff, post, error,
    run_starts, run_columns, run_segments, run_params, run_offsets, starts, ends, columns, first,
    signs, partials, scales, out, n,
    BLOCK: tl.constexpr, USE_INV: tl.constexpr, INV_PTR: tl.constexpr, DENSE: tl.constexpr,
    MASKED: tl.constexpr, SMALL: tl.constexpr, HAS_POST: tl.constexpr, HAS_ERROR: tl.constexpr,
    SIGNS: tl.constexpr, SUMS: tl.constexpr, MEAN_ABS: tl.constexpr, COMMIT: tl.constexpr,
    ELEMENT: tl.constexpr,
):  # fmt: skip
    """Passes 1 and 2 of :mod:`onebit.kernels.fused` on a block of a bucket:
    ``y = lerp(m, g·inv, w)·post + e`` as ``torch.lerp`` rounds it (``coeff`` is ``w``, or
    ``w - 1`` where ``SMALL`` is false), then :func:`_emit`. Pieces are runs' parts: each run has
    its parameter (its gradient's address is ``grads[param]``, 0: zeros; its factor
    ``post[param]``; the packed ``m``'s mask, ``masks[param]`` where ``MASKED``), momentum column
    (< 0: padding, ``y = e``) and segment; gradients are of ``ELEMENT`` (:func:`_gradient`). A
    bucket's length ``n`` is a multiple of 8."""
    start, local, valid = _block(tl.multiple_of(n, 8), BLOCK)
    p0, p1, run, column, present, param = _runs(local, start, valid, starts, ends, columns, first,
                                                run_columns, run_params)  # fmt: skip
    g = _gradient(grads, inv, param, run_offsets, run_starts, run, start, local, present, USE_INV,
                  INV_PTR, ELEMENT)  # fmt: skip
    if DENSE:
        m = tl.load(dense + start + local, mask=valid, other=0.0)
    else:
        m = _packed_momentum(bits, stride, chunk, momentum_scales, column, start, local, present,
                             BLOCK)  # fmt: skip
        m = _masked(m, masks, param, run_offsets, run_starts, run, start, local, present, MASKED)
    y = _lerp(m, g, coeff, SMALL)
    if HAS_POST:
        y = y * tl.load(post + param, mask=present, other=1.0)
    y = tl.where(present, y, 0.0)
    if HAS_ERROR:
        y = y + tl.load(error + start + local, mask=valid, other=0.0)
    segment = tl.load(run_segments + run, mask=valid, other=0).to(tl.int32)
    _emit(y, start, local, valid, p0, p1, starts, ends, segment, signs, partials, scales, out, n,
          BLOCK, SIGNS, SUMS, MEAN_ABS, COMMIT)  # fmt: skip


@launched(8)
@triton.jit(do_not_specialize=["stride", "chunk", "n"])
def _momentum_update(
    bases, bits, stride, chunk, momentum_scales, masks, denominator, decay, value, run_starts,
    run_columns, run_params, run_offsets, starts, ends, columns, first, n, BLOCK: tl.constexpr,
    MASKED: tl.constexpr, ELEMENT: tl.constexpr,
):  # fmt: skip
    """Pass 3 of :mod:`onebit.kernels.fused` on a block of a bucket:
    ``p = p·decay + (value·m) / denominator`` per parameter, as ``torch._foreach_mul_`` and
    ``torch._foreach_addcdiv_`` round it on the CPU (no step where ``decay`` is 1), each result
    rounded to the parameters' ``ELEMENT``. A bucket's length ``n`` is a multiple of 8."""
    start, local, valid = _block(tl.multiple_of(n, 8), BLOCK)
    _, _, run, column, present, param = _runs(local, start, valid, starts, ends, columns, first,
                                              run_columns, run_params)  # fmt: skip
    at, present = _element_pointers(bases, param, run_offsets, run_starts, run, start, local,
                                    present, ELEMENT)  # fmt: skip
    p = _element_load(at, present, ELEMENT)
    d = tl.load(decay + param, mask=present, other=1.0)
    p = tl.where(d != 1.0, _element_round(p * d, ELEMENT), p)
    m = _packed_momentum(bits, stride, chunk, momentum_scales, column, start, local, present,
                         BLOCK)  # fmt: skip
    m = _masked(m, masks, param, run_offsets, run_starts, run, start, local, present, MASKED)
    v = tl.load(value + param, mask=present, other=0.0)
    u = tl.math.div_rn(v * m, tl.load(denominator + start + local, mask=present, other=1.0))
    _element_store(at, p + u, present, ELEMENT)


@launched()
@triton.jit
def _segment_scales(
    partials, first, lengths, scales, CHUNK: tl.constexpr, MEAN_ABS: tl.constexpr
):  # fmt: skip
    """Segment ``q``'s scale from the fp32 sums of its pieces, added in fp64."""
    q = tl.program_id(0)
    tl.store(scales + q, _segment_scale(partials, first, lengths, q, CHUNK, MEAN_ABS))


@triton.jit
def _segment_scale(partials, first, lengths, q, CHUNK: tl.constexpr, MEAN_ABS: tl.constexpr):
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


@launched(4)
@triton.jit(do_not_specialize=["row_stride", "row_numel", "scales_from", "scale_stride", "n"])
def _decompress(
    rows, row_stride, row_numel, row_scales, scales_from, scale_stride, starts, ends, columns,
    first, out, n, BLOCK: tl.constexpr,
):  # fmt: skip
    """``out[i] = ±scale`` of its row's piece, from packed rows of ``row_numel`` elements (a
    multiple of 8); the scales' rows start ``scales_from`` floats into ``row_scales``, so that
    scales anywhere in a buffer take the kernel variant of an aligned one."""
    start, local, valid = _block(n, BLOCK)
    block = tl.program_id(0)
    column = _piece_columns(local, start, starts, ends, columns, tl.load(first + block),
                            tl.load(first + block + 1))  # fmt: skip
    row, at = _rows(start, local, row_numel, BLOCK)
    byte = tl.load(rows + row * row_stride + at // 8, mask=valid, other=0)
    s = tl.load(row_scales + scales_from + row * scale_stride + column, mask=valid, other=0.0)
    tl.store(out + start + local, _signed(_bit(byte, local), s), mask=valid)


@launched(4)
@triton.jit(do_not_specialize=["nx", "n"])
def _solo_pass(
    x, nx, error, server_error, partials, sums, scales, out, n,
    BLOCK: tl.constexpr, PASS: tl.constexpr, MEAN_ABS: tl.constexpr,
):  # fmt: skip
    """The compressed allreduce at world size 1 on a block: ``y = x + e`` (``x`` zero past
    ``nx``), the worker's scale ``s``, ``z = ±s + e_s`` (``e_s``: the server error), the server's
    scale ``σ``. ``PASS`` 0: the block's sum of ``y²`` (``|y|``) as :func:`_emit` sums it, and for
    the rms scale the fp64 sums of ``±e_s`` (``y``'s sign) and of ``e_s²``, from which
    ``sum(z²) = n·s² + 2s·sum(±e_s) + sum(e_s²)`` (:func:`_solo_scales`). 1: the block's sum of
    ``|z|`` (``scales``: ``[s]``). 2: the worker error ``y - ±s``, the server error
    ``z - ±σ`` and ``out = ±σ`` (``scales``: ``[s, σ]``)."""
    start, local, valid = _block(n, BLOCK)
    in_x = local < tl.minimum(tl.maximum(nx - start, 0), BLOCK).to(tl.int32)
    y = tl.load(x + start + local, mask=in_x, other=0.0).to(tl.float32)
    y = y + tl.load(error + start + local, mask=valid, other=0.0)
    block = tl.program_id(0)
    if PASS == 0:
        term = tl.abs(y) if MEAN_ABS else y * y
        tl.store(partials + block, tl.sum(tl.where(valid, term, 0.0)))
        if not MEAN_ABS:
            e_s = tl.load(server_error + start + local, mask=valid, other=0.0).to(tl.float64)
            tl.store(sums + 2 * block, tl.sum(tl.where(y >= 0, e_s, -e_s)))
            tl.store(sums + 2 * block + 1, tl.sum(e_s * e_s))
    else:
        e_s = tl.load(server_error + start + local, mask=valid, other=0.0)
        s = tl.load(scales)
        z = _signed(y >= 0, s) + e_s
        if PASS == 1:
            tl.store(partials + block, tl.sum(tl.where(valid, tl.abs(z), 0.0)))
        else:
            tl.store(error + start + local, y - _signed(y >= 0, s), mask=valid)
            result = _signed(z >= 0, tl.load(scales + 1))
            tl.store(server_error + start + local, z - result, mask=valid)
            tl.store(out + start + local, result, mask=in_x)


@launched()
@triton.jit(do_not_specialize=["n"])
def _solo_scales(
    partials, sums, first, lengths, scales, n, CHUNK: tl.constexpr, MEAN_ABS: tl.constexpr,
    SERVER: tl.constexpr,
):  # fmt: skip
    """:func:`_solo_pass`'s scales from its blocks' sums: without ``SERVER`` the worker's
    ``scales[0]`` (and for the rms scale the server's ``scales[1]``, from the identity there);
    with it the server's mean absolute value, ``scales[1]``."""
    scale = _segment_scale(partials, first, lengths, 0, CHUNK, MEAN_ABS)
    if SERVER:
        tl.store(scales + 1, scale)
    else:
        tl.store(scales, scale)
        if not MEAN_ABS:
            blocks = tl.load(first + 1)
            cross = tl.zeros([CHUNK // 4], dtype=tl.float64)  # a quarter: no spills at 4 warps
            square = tl.zeros([CHUNK // 4], dtype=tl.float64)
            for b in range(0, blocks, CHUNK // 4):
                at = b + tl.arange(0, CHUNK // 4)
                cross += tl.load(sums + 2 * at, mask=at < blocks, other=0.0)
                square += tl.load(sums + 2 * at + 1, mask=at < blocks, other=0.0)
            s = scale.to(tl.float64)
            total = n * s * s + 2 * s * tl.sum(cross, axis=0) + tl.sum(square, axis=0)
            sigma = tl.sqrt(tl.maximum(total, 0.0)) / tl.sqrt(tl.maximum(n, 1).to(tl.float64))
            tl.store(scales + 1, sigma.to(tl.float32))


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


def _tiling(
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


class _RunTables:
    """A bucket's runs (:class:`~onebit.kernels.fused.BucketRuns`) on the device: their tiling
    (a run's column is its index; its segment is where its sums go) and per-run tables."""

    def __init__(self, runs: BucketRuns, device: torch.device) -> None:
        table = runs.runs
        edges = torch.cat([table[:, 0], table[-1:, 1]])
        self.numel = int(edges[-1])
        self.tiling = Tiling(edges, torch.arange(len(table)), self.numel, device, table[:, 2])
        self.starts, self.segments, self.columns = (
            table[:, i].to(device, copy=True, memory_format=torch.contiguous_format)
            for i in (0, 2, 3)
        )
        self.params = runs.run_params.clamp(min=0).to(device)
        self.offsets = runs.run_offsets.to(device, copy=True)  # bytes


def _whole(numel: int) -> np.ndarray:
    return np.array([0, numel], dtype=np.int64)


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

    def block_quantizer(
        self,
        buckets: list[QuantizedBucket],
        block_size: int,
        bits: str,
        rank: int,
        device: torch.device,
    ) -> object | None:
        if not self.runs_on(device):
            return None
        from .triton_quantized import BlockQuantizer  # it imports this module

        return BlockQuantizer(buckets, block_size, bits, rank, device)

    def model_passes(self, geometry: object, device: torch.device) -> object | None:
        if not self.runs_on(device):
            return None
        from .triton_model import ModelPasses  # it imports this module

        return ModelPasses(geometry, device)

    def reads_input(self, *tensors: Tensor) -> bool:
        return self._fits(*tensors)

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
        return packed, None if sums is None else self._scales(tiling, partials, sums)

    @staticmethod
    def _scales(tiling: Tiling, partials: Tensor, scale: str) -> Tensor:
        """Each segment's scale from its pieces' sums (:func:`_segment_scales`)."""
        result = torch.empty(tiling.count, dtype=torch.float32, device=partials.device)
        _segment_scales[(tiling.count,)](
            partials, tiling.segment_first, tiling.lengths, result, CHUNK=1024,
            MEAN_ABS=scale == "mean_abs",
        )  # fmt: skip
        return result

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

    unpack_signs = TorchKernels.unpack_signs  # the reference's: no step unpacks signs alone

    def subtract_compressed_(
        self, y: Tensor, s: Tensor, out: Tensor, signs: Tensor | None = None
    ) -> Tensor:
        if not (self._fits(y, out) and y.shape == out.shape and y.numel()):
            return super().subtract_compressed_(y, s, out, signs)
        scales = s.to(device=y.device, dtype=torch.float32).reshape(1)
        bounds = torch.from_numpy(_whole(y.numel()))
        return self.subtract_compressed_segments_(y, scales, bounds, out)

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

    def allreduce_one_(
        self, x: Tensor, error: Tensor, server_error: Tensor, out: Tensor, scale: str
    ) -> bool:
        n = error.numel()
        if not (self._fits(x, error, server_error, out) and n and server_error.numel() == n):
            return super().allreduce_one_(x, error, server_error, out, scale)
        device, mean_abs = error.device, scale == "mean_abs"
        tiling = _tiling(_whole(n), None, n, device)  # a piece per block, one segment
        blocks = tiling.blocks
        partials = torch.empty(blocks, dtype=torch.float32, device=device)
        sums = torch.empty(2 * blocks, dtype=torch.float64, device=device)
        scales = torch.empty(2, dtype=torch.float32, device=device)

        def run(pass_: int) -> None:
            _solo_pass[(blocks,)](x, x.numel(), error, server_error, partials, sums, scales, out,
                                  n, BLOCK=BLOCK, PASS=pass_, MEAN_ABS=mean_abs)  # fmt: skip
            if pass_ < 2:
                _solo_scales[(1,)](partials, sums, tiling.segment_first, tiling.lengths, scales, n,
                                   CHUNK=1024, MEAN_ABS=mean_abs, SERVER=pass_ == 1)  # fmt: skip

        run(0)
        if not host.read(torch.isfinite(scales[0])):
            return False
        if mean_abs:
            run(1)
        run(2)
        return True

    # SPEC 2: the server and the result.

    def decompress_(self, packed: Tensor, scales: Tensor, out: Tensor) -> Tensor:
        k, m = packed.shape
        if not (self._fits(out) and self._rows_fit(packed) and m):
            return super().decompress_(packed, scales, out)
        pieces = np.zeros((k, 4), dtype=np.int64)  # row j's whole chunk, one column
        pieces[:, 0], pieces[:, 2] = np.arange(k), 8 * m
        return self.decompress_pieces_(packed, scales.reshape(k, 1), torch.from_numpy(pieces),
                                       out)  # fmt: skip

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
        table = pieces.numpy()
        edges = np.append(table[:, 0] * 8 * m + table[:, 1], table[-1, 0] * 8 * m + table[-1, 2])
        tiling = _tiling(edges, table[:, 3], n, out.device)
        row_scales = self._row_scales(scales, out.device)
        offset = row_scales.storage_offset()  # the storage's start is aligned
        whole = row_scales.as_strided((offset + row_scales.numel(),), (1,), 0)
        _decompress[(tiling.blocks,)](
            packed, packed.stride(0), 8 * m, whole, offset, row_scales.stride(0),
            *tiling.table(), out, n, BLOCK=BLOCK,
        )  # fmt: skip
        return out

    # The packed momentum's fused passes (:mod:`onebit.kernels.fused`).

    packs_momentum = True
    packs_masked_momentum = True

    def momentum_signs(
        self, runs: BucketRuns, grads: Tensor, inv_scale: float | Tensor | None,
        momentum: Tensor | PackedMomentum, weight: float, error: Tensor | None, out: Tensor,
        scale: str, post: Tensor | None, dtype: torch.dtype = torch.float32,
    ) -> Tensor:  # fmt: skip
        tables = self._runs(runs, out.device)
        partials = torch.empty(len(tables.tiling.starts), dtype=torch.float32, device=out.device)
        self._momentum_pass(tables, grads, inv_scale, momentum, weight, error, post, dtype,
                            signs=out, partials=partials, sums=scale)  # fmt: skip
        return self._scales(tables.tiling, partials, scale)

    def momentum_commit(
        self, runs: BucketRuns, grads: Tensor, inv_scale: float | Tensor | None,
        momentum: Tensor | PackedMomentum, weight: float, error: Tensor | None, scales: Tensor,
        out: Tensor, post: Tensor | None, dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        tables = self._runs(runs, out.device)
        scales = scales.to(device=out.device, dtype=torch.float32).contiguous()
        self._momentum_pass(tables, grads, inv_scale, momentum, weight, error, post, dtype,
                            scales=scales, out=out)  # fmt: skip

    def momentum_update(
        self, runs: BucketRuns, params: Tensor, momentum: PackedMomentum, denominator: Tensor,
        decay: Tensor, value: Tensor, dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        device = denominator.device
        tables = self._runs(runs, device)
        masks = momentum.masks
        _momentum_update[(tables.tiling.blocks,)](
            params.to(device), momentum.bits, momentum.bits.stride(0), momentum.chunk,
            momentum.scales, momentum.bits if masks is None else masks, denominator,
            decay.to(device), value.to(device), tables.starts, tables.columns, tables.params,
            tables.offsets, *tables.tiling.table(), tables.numel,
            BLOCK=BLOCK, MASKED=masks is not None, ELEMENT=DTYPES.index(dtype),
        )  # fmt: skip

    @staticmethod
    def _runs(runs: BucketRuns, device: torch.device) -> _RunTables:
        tables = runs.device_tables.get(device)
        if tables is None:
            tables = runs.device_tables[device] = _RunTables(runs, device)
        return tables

    @staticmethod
    def _momentum_pass(
        tables: _RunTables, grads: Tensor, inv_scale: float | Tensor | None,
        momentum: Tensor | PackedMomentum, weight: float, error: Tensor | None,
        post: Tensor | None, dtype: torch.dtype, *, signs: Tensor | None = None,
        partials: Tensor | None = None,
        sums: str | None = None, scales: Tensor | None = None, out: Tensor | None = None,
    ) -> None:  # fmt: skip
        device = tables.starts.device
        dense = not isinstance(momentum, PackedMomentum)
        bits = momentum if dense else momentum.bits
        masks = None if dense else momentum.masks
        coeff, small = lerp_coefficient(weight)
        any_ = bits
        _momentum_pass[(tables.tiling.blocks,)](
            grads.to(device), 1.0 if inv_scale is None else inv_scale, momentum if dense else any_,
            bits, 0 if dense else bits.stride(0), 1 if dense else momentum.chunk,
            any_ if dense else momentum.scales, any_ if masks is None else masks, coeff,
            any_ if post is None else post.to(device=device, dtype=torch.float32).contiguous(),
            any_ if error is None else error, tables.starts, tables.columns, tables.segments,
            tables.params, tables.offsets, *tables.tiling.table(), any_ if signs is None else signs,
            any_ if partials is None else partials, any_ if scales is None else scales,
            any_ if out is None else out, tables.numel,
            BLOCK=BLOCK, USE_INV=inv_scale is not None, INV_PTR=torch.is_tensor(inv_scale),
            DENSE=dense, MASKED=masks is not None, SMALL=small, HAS_POST=post is not None,
            HAS_ERROR=error is not None, SIGNS=signs is not None, SUMS=sums is not None,
            MEAN_ABS=sums == "mean_abs", COMMIT=scales is not None, ELEMENT=DTYPES.index(dtype),
        )  # fmt: skip

    @staticmethod
    def _row_scales(scales: Tensor, device: torch.device) -> Tensor:
        return scales.to(device=device, dtype=torch.float32).contiguous()

    @staticmethod
    def _served(pieces: Tensor, numel: int, device: torch.device) -> Tiling:
        table = pieces.numpy()
        return _tiling(np.append(table[:, 0], table[-1, 1]), table[:, 2], numel, device)
