"""The Triton kernels of :mod:`onebit.kernels.triton_kernels`: a bucket at a time, the 1-bit
allreduce's passes and the packed momentum's (see that module for the design and
:class:`~onebit.kernels.triton_kernels.TritonKernels` for the launches)."""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import (
    bit_at,
    element_load,
    element_pointers,
    element_round,
    element_store,
    emit,
    launched,
    lerp_rounded,
    packed_momentum,
    piece_columns,
    program_block,
    program_runs,
    read_gradient,
    row_and_place,
    segment_scale,
    signed,
    times_mask,
)


@triton.jit
def _row_term(row, row_scales, start, local, column, valid):
    """``±scale`` of each element from one packed row and its scales (indexed by column)."""
    byte = tl.load(row + start // 8 + local // 8, mask=valid, other=0)
    return signed(bit_at(byte, local), tl.load(row_scales + column, mask=valid, other=0.0))


@launched(4)
@triton.jit(do_not_specialize=["nx", "row_stride", "k", "scale_stride", "n"])
def y_pass(
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
    start, local, valid = program_block(n, BLOCK)
    block = tl.program_id(0)
    p0, p1 = tl.load(first + block), tl.load(first + block + 1)
    column = piece_columns(local, start, starts, ends, columns, p0, p1)
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
            e = e - signed(e >= 0, tl.load(last + column, mask=valid, other=0.0))
        y = y + e
    if STORE_Y:
        tl.store(y_out + start + local, y, mask=valid)
    emit(y, start, local, valid, p0, p1, starts, ends, column, signs, partials, scales, out, n,
         BLOCK, SIGNS, SUMS, MEAN_ABS, COMMIT)  # fmt: skip


@launched(4)
@triton.jit(do_not_specialize=["stride", "chunk", "n"])
def momentum_pass(
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
    ``w - 1`` where ``SMALL`` is false), then :func:`emit`. Pieces are runs' parts: each run has
    its parameter (its gradient's address is ``grads[param]``, 0: zeros; its factor
    ``post[param]``; the packed ``m``'s mask, ``masks[param]`` where ``MASKED``), momentum column
    (< 0: padding, ``y = e``) and segment; gradients are of ``ELEMENT`` (:func:`read_gradient`). A
    bucket's length ``n`` is a multiple of 8."""
    start, local, valid = program_block(tl.multiple_of(n, 8), BLOCK)
    p0, p1, run, column, present, param = program_runs(
        local, start, valid, starts, ends, columns, first, run_columns, run_params
    )
    g = read_gradient(
        grads, inv, param, run_offsets, run_starts, run, start, local, present, USE_INV,
        INV_PTR, ELEMENT,
    )  # fmt: skip
    if DENSE:
        m = tl.load(dense + start + local, mask=valid, other=0.0)
    else:
        m = packed_momentum(bits, stride, chunk, momentum_scales, column, start, local, present,
                            BLOCK)  # fmt: skip
        m = times_mask(m, masks, param, run_offsets, run_starts, run, start, local, present, MASKED)
    y = lerp_rounded(m, g, coeff, SMALL)
    if HAS_POST:
        y = y * tl.load(post + param, mask=present, other=1.0)
    y = tl.where(present, y, 0.0)
    if HAS_ERROR:
        y = y + tl.load(error + start + local, mask=valid, other=0.0)
    segment = tl.load(run_segments + run, mask=valid, other=0).to(tl.int32)
    emit(y, start, local, valid, p0, p1, starts, ends, segment, signs, partials, scales, out, n,
         BLOCK, SIGNS, SUMS, MEAN_ABS, COMMIT)  # fmt: skip


@launched(8)
@triton.jit(do_not_specialize=["stride", "chunk", "n"])
def momentum_update_kernel(
    bases, bits, stride, chunk, momentum_scales, masks, denominator, decay, value, run_starts,
    run_columns, run_params, run_offsets, starts, ends, columns, first, n, BLOCK: tl.constexpr,
    MASKED: tl.constexpr, ELEMENT: tl.constexpr,
):  # fmt: skip
    """Pass 3 of :mod:`onebit.kernels.fused` on a block of a bucket:
    ``p = p·decay + (value·m) / denominator`` per parameter, as ``torch._foreach_mul_`` and
    ``torch._foreach_addcdiv_`` round it on the CPU (no step where ``decay`` is 1), each result
    rounded to the parameters' ``ELEMENT``. A bucket's length ``n`` is a multiple of 8."""
    start, local, valid = program_block(tl.multiple_of(n, 8), BLOCK)
    _, _, run, column, present, param = program_runs(
        local, start, valid, starts, ends, columns, first, run_columns, run_params
    )
    at, present = element_pointers(bases, param, run_offsets, run_starts, run, start, local,
                                   present, ELEMENT)  # fmt: skip
    p = element_load(at, present, ELEMENT)
    d = tl.load(decay + param, mask=present, other=1.0)
    p = tl.where(d != 1.0, element_round(p * d, ELEMENT), p)
    m = packed_momentum(bits, stride, chunk, momentum_scales, column, start, local, present,
                        BLOCK)  # fmt: skip
    m = times_mask(m, masks, param, run_offsets, run_starts, run, start, local, present, MASKED)
    v = tl.load(value + param, mask=present, other=0.0)
    u = tl.math.div_rn(v * m, tl.load(denominator + start + local, mask=present, other=1.0))
    element_store(at, p + u, present, ELEMENT)


@launched(4)
@triton.jit(do_not_specialize=["row_stride", "row_numel", "scales_from", "scale_stride", "n"])
def decompress_kernel(
    rows, row_stride, row_numel, row_scales, scales_from, scale_stride, starts, ends, columns,
    first, out, n, BLOCK: tl.constexpr,
):  # fmt: skip
    """``out[i] = ±scale`` of its row's piece, from packed rows of ``row_numel`` elements (a
    multiple of 8); the scales' rows start ``scales_from`` floats into ``row_scales``, so that
    scales anywhere in a buffer take the kernel variant of an aligned one."""
    start, local, valid = program_block(n, BLOCK)
    block = tl.program_id(0)
    column = piece_columns(local, start, starts, ends, columns, tl.load(first + block),
                           tl.load(first + block + 1))  # fmt: skip
    row, at = row_and_place(start, local, row_numel, BLOCK)
    byte = tl.load(rows + row * row_stride + at // 8, mask=valid, other=0)
    s = tl.load(row_scales + scales_from + row * scale_stride + column, mask=valid, other=0.0)
    tl.store(out + start + local, signed(bit_at(byte, local), s), mask=valid)


@launched(4)
@triton.jit(do_not_specialize=["nx", "n"])
def solo_pass(
    x, nx, error, server_error, partials, sums, scales, out, n,
    BLOCK: tl.constexpr, PASS: tl.constexpr, MEAN_ABS: tl.constexpr,
):  # fmt: skip
    """The compressed allreduce at world size 1 on a block: ``y = x + e`` (``x`` zero past
    ``nx``), the worker's scale ``s``, ``z = ±s + e_s`` (``e_s``: the server error), the server's
    scale ``σ``. ``PASS`` 0: the block's sum of ``y²`` (``|y|``) as :func:`emit` sums it, and for
    the rms scale the fp64 sums of ``±e_s`` (``y``'s sign) and of ``e_s²``, from which
    ``sum(z²) = n·s² + 2s·sum(±e_s) + sum(e_s²)`` (:func:`solo_scales`). 1: the block's sum of
    ``|z|`` (``scales``: ``[s]``). 2: the worker error ``y - ±s``, the server error
    ``z - ±σ`` and ``out = ±σ`` (``scales``: ``[s, σ]``)."""
    start, local, valid = program_block(n, BLOCK)
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
        z = signed(y >= 0, s) + e_s
        if PASS == 1:
            tl.store(partials + block, tl.sum(tl.where(valid, tl.abs(z), 0.0)))
        else:
            tl.store(error + start + local, y - signed(y >= 0, s), mask=valid)
            result = signed(z >= 0, tl.load(scales + 1))
            tl.store(server_error + start + local, z - result, mask=valid)
            tl.store(out + start + local, result, mask=in_x)


@launched()
@triton.jit(do_not_specialize=["n"])
def solo_scales(
    partials, sums, first, lengths, scales, n, CHUNK: tl.constexpr, MEAN_ABS: tl.constexpr,
    SERVER: tl.constexpr,
):  # fmt: skip
    """:func:`solo_pass`'s scales from its blocks' sums: without ``SERVER`` the worker's
    ``scales[0]`` (and for the rms scale the server's ``scales[1]``, from the identity there);
    with it the server's mean absolute value, ``scales[1]``."""
    scale = segment_scale(partials, first, lengths, 0, CHUNK, MEAN_ABS)
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
