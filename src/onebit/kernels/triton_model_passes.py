"""The Triton kernels of :mod:`onebit.kernels.triton_model`: the packed momentum's passes over
every bucket at once, each bucket starting a block of its own and reading its values from small
tables (see that module for the design and :class:`~onebit.kernels.triton_model.ModelPasses` for
the launches)."""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import (
    as_stored,
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
    program_runs,
    read_gradient,
    row_and_place,
    run_pointers,
    segment_scale,
    signed,
    times_mask,
)


@triton.jit
def _bucket_block(block_starts, block_buckets, bucket_starts, bucket_ends, BLOCK: tl.constexpr):
    """This program's block: its bucket, its first element (int64, in the buffer of every
    bucket end to end), its bucket's first element, its elements' offsets and their validity."""
    pid = tl.program_id(0)
    bucket = tl.load(block_buckets + pid)
    start = tl.load(block_starts + pid)
    origin = tl.load(bucket_starts + bucket)
    local = tl.arange(0, BLOCK)
    valid = local < tl.minimum(tl.load(bucket_ends + bucket) - start, BLOCK).to(tl.int32)
    return bucket, start, origin, local, valid


@triton.jit
def _block_runs(block_starts, block_buckets, bucket_starts, bucket_ends, starts, ends, columns,
                first, run_columns, run_params, BLOCK: tl.constexpr):  # fmt: skip
    """:func:`_bucket_block`, and each element's run in the worker's tiling: the block's pieces
    ``[p0, p1)``, each element's run, its momentum column (< 0: padding), whether it has a
    parameter's element (``present``) and that parameter (int32)."""
    bucket, start, origin, local, valid = _bucket_block(
        block_starts, block_buckets, bucket_starts, bucket_ends, BLOCK
    )
    p0, p1, run, column, present, param = program_runs(
        local, start, valid, starts, ends, columns, first, run_columns, run_params
    )
    return bucket, start, origin, local, valid, p0, p1, run, column, present, param


@triton.jit
def _store_signs(y, message, row_stride, part, chunk, start, origin, end, BLOCK: tl.constexpr):
    """Pack the signs of ``y`` (a block of a bucket) into the bucket's ``part`` of ``message``:
    element ``i`` of the bucket goes to row ``i // chunk``, bit ``i % 8`` of byte
    ``(i % chunk) // 8`` of the part."""
    local = tl.arange(0, BLOCK)
    bits = (y >= 0).to(tl.uint8) << (local % 8).to(tl.uint8)
    packed = tl.sum(tl.reshape(bits, [BLOCK // 8, 8]), axis=1).to(tl.uint8)
    bytes_ = tl.arange(0, BLOCK // 8)
    row, at = row_and_place(start - origin, bytes_ * 8, chunk, BLOCK)
    limit = (tl.minimum(end - start, BLOCK) // 8).to(tl.int32)
    tl.store(message + part + row * row_stride + at // 8, packed, mask=bytes_ < limit)


@launched(4)
@triton.jit(do_not_specialize=["row_stride", "bits_stride"])
def worker_pass(
    grads, inv, dense, bits, bits_stride, momentum_scales, masks, coeff, post, error,
    run_starts, run_columns, run_segments, run_params, run_offsets, starts, ends, columns, first,
    block_starts, block_buckets, bucket_starts, bucket_ends, chunks, parts1, parts2,
    message, row_stride, partials, scales, out,
    BLOCK: tl.constexpr, USE_INV: tl.constexpr, INV_PTR: tl.constexpr, DENSE: tl.constexpr,
    MASKED: tl.constexpr, SMALL: tl.constexpr, HAS_POST: tl.constexpr, HAS_ERROR: tl.constexpr,
    SIGNS: tl.constexpr, SUMS: tl.constexpr, MEAN_ABS: tl.constexpr, COMMIT: tl.constexpr,
    ELEMENT: tl.constexpr,
):  # fmt: skip
    """``momentum_pass`` of :mod:`~onebit.kernels.triton_kernels` on a block of any bucket:
    ``y = lerp(m, g·inv, w)·post + e``, then its signs into the phase-1 ``message``, its sums
    per piece, or ``out = y - ±scales``. The packed momentum ``m`` is read from the last
    phase-2 message (``bits``, each bucket's part at ``parts2``), times ``masks`` where
    ``MASKED``."""
    bucket, start, origin, local, valid, p0, p1, run, column, present, param = _block_runs(
        block_starts, block_buckets, bucket_starts, bucket_ends, starts, ends, columns, first,
        run_columns, run_params, BLOCK,
    )  # fmt: skip
    g = read_gradient(
        grads, inv, param, run_offsets, run_starts, run, start, local, present, USE_INV,
        INV_PTR, ELEMENT,
    )  # fmt: skip
    chunk = tl.load(chunks + bucket)
    if DENSE:
        m = tl.load(dense + start + local, mask=valid, other=0.0)
    else:
        m = packed_momentum(
            bits + tl.load(parts2 + bucket), bits_stride, chunk, momentum_scales, column,
            start - origin, local, present, BLOCK,
        )  # fmt: skip
        m = times_mask(m, masks, param, run_offsets, run_starts, run, start, local, present, MASKED)
    y = lerp_rounded(m, g, coeff, SMALL)
    if HAS_POST:
        y = y * tl.load(post + param, mask=present, other=1.0)
    y = tl.where(present, y, 0.0)
    if HAS_ERROR:
        y = y + tl.load(error + start + local, mask=valid, other=0.0).to(tl.float32)
    if SIGNS:
        end = tl.load(bucket_ends + bucket)
        _store_signs(y, message, row_stride, tl.load(parts1 + bucket), chunk, start, origin, end,
                     BLOCK)  # fmt: skip
    segment = tl.load(run_segments + run, mask=valid, other=0).to(tl.int32)
    emit(y, start, local, valid, p0, p1, starts, ends, segment, out, partials, scales, out, 0,
         BLOCK, False, SUMS, MEAN_ABS, COMMIT)  # fmt: skip


@launched(4)
@triton.jit(do_not_specialize=["nx", "row_stride"])
def input_pass(
    x, nx, post, error, starts, ends, columns, first, block_starts, block_buckets, bucket_starts,
    bucket_ends, chunks, parts1, message, row_stride, partials, scales, out,
    BLOCK: tl.constexpr, HAS_POST: tl.constexpr, HAS_ERROR: tl.constexpr, STORE_Y: tl.constexpr,
    SIGNS: tl.constexpr, SUMS: tl.constexpr, MEAN_ABS: tl.constexpr, COMMIT: tl.constexpr,
):  # fmt: skip
    """``y_pass`` of :mod:`~onebit.kernels.triton_kernels` on a block of any bucket of a flat
    buffer ``x`` (zeros from ``nx`` on: the padding): ``y = x·post + e`` (``post``: a flat
    buffer of ``nx``), stored over ``x``, its signs into the phase-1 ``message`` and its sums
    per piece; or ``out = y - ±scales`` (a piece's column is its segment)."""
    bucket, start, origin, local, valid = _bucket_block(
        block_starts, block_buckets, bucket_starts, bucket_ends, BLOCK
    )
    block = tl.program_id(0)
    p0, p1 = tl.load(first + block), tl.load(first + block + 1)
    column = piece_columns(local, start, starts, ends, columns, p0, p1)
    in_x = valid & (start + local < nx)
    y = tl.load(x + start + local, mask=in_x, other=0.0)
    if HAS_POST:
        y = y * tl.load(post + start + local, mask=in_x, other=1.0)
    if HAS_ERROR:
        y = y + tl.load(error + start + local, mask=valid, other=0.0).to(tl.float32)
    if STORE_Y:
        tl.store(x + start + local, y, mask=valid)
    if SIGNS:
        _store_signs(y, message, row_stride, tl.load(parts1 + bucket), tl.load(chunks + bucket),
                     start, origin, tl.load(bucket_ends + bucket), BLOCK)  # fmt: skip
    emit(y, start, local, valid, p0, p1, starts, ends, column, out, partials, scales, out, 0,
         BLOCK, False, SUMS, MEAN_ABS, COMMIT)  # fmt: skip


@launched(4)
@triton.jit(do_not_specialize=["row_stride", "k", "scale_stride"])
def serve_pass(
    rows, row_stride, k, row_scales, scale_stride, last, error, piece_segments,
    starts, ends, columns, first, block_starts, block_buckets, bucket_starts, bucket_ends,
    chunks, parts1, parts2, message, partials,
    BLOCK: tl.constexpr, LAST: tl.constexpr, MEAN_ABS: tl.constexpr,
):  # fmt: skip
    """The server's pass over its chunk of every bucket, as ``serve_pieces_`` of
    :mod:`~onebit.kernels.triton_kernels`: ``z = average of the k ranks' rows + e`` (``e`` the
    error, or ``e - ±last`` of a kept ``z``), stored in ``error``; its signs into the phase-2
    ``message`` and its sums per piece. ``rows`` is the phase-1 message as received (row ``j``
    from rank ``j``, each bucket's part at ``parts1``); a piece's column is its index among the
    served pieces, ``piece_segments`` its segment (the column of its ``row_scales``)."""
    bucket, start, origin, local, valid = _bucket_block(
        block_starts, block_buckets, bucket_starts, bucket_ends, BLOCK
    )
    block = tl.program_id(0)
    p0, p1 = tl.load(first + block), tl.load(first + block + 1)
    piece = piece_columns(local, start, starts, ends, columns, p0, p1)
    segment = tl.load(piece_segments + piece, mask=valid, other=0).to(tl.int32)
    within = (start - origin).to(tl.int32) + local
    source = rows + tl.load(parts1 + bucket) + within // 8
    byte = tl.load(source, mask=valid, other=0)
    y = signed(bit_at(byte, local), tl.load(row_scales + segment, mask=valid, other=0.0))
    for r in range(1, k):
        byte = tl.load(source + r * row_stride, mask=valid, other=0)
        s = tl.load(row_scales + r * scale_stride + segment, mask=valid, other=0.0)
        y = y + signed(bit_at(byte, local), s)
    if k != 1:
        y = tl.math.div_rn(y, tl.zeros_like(y) + k)
    e = tl.load(error + start + local, mask=valid, other=0.0).to(tl.float32)
    if LAST:
        e = e - signed(e >= 0, tl.load(last + piece, mask=valid, other=0.0))
    y = y + e
    tl.store(error + start + local, as_stored(y, error), mask=valid)
    end = tl.load(bucket_ends + bucket)
    _store_signs(y, message, 0, tl.load(parts2 + bucket), tl.load(chunks + bucket), start,
                 origin, end, BLOCK)  # fmt: skip
    emit(y, start, local, valid, p0, p1, starts, ends, piece, error, partials, error, error, 0,
         BLOCK, False, True, MEAN_ABS, False)  # fmt: skip


@launched(8)
@triton.jit(do_not_specialize=["bits_stride"])
def update_pass(
    bases, bits, bits_stride, momentum_scales, masks, denominator, decay, value, run_starts,
    run_columns, run_params, run_offsets, starts, ends, columns, first, block_starts,
    block_buckets, bucket_starts, bucket_ends, chunks, parts2, BLOCK: tl.constexpr,
    MASKED: tl.constexpr, ELEMENT: tl.constexpr,
):  # fmt: skip
    """``momentum_update_kernel`` of :mod:`~onebit.kernels.triton_kernels` on a block of any bucket:
    ``p = p·decay + (value·m) / denominator`` per parameter of ``ELEMENT``, ``m`` read from the
    phase-2 message as in :func:`worker_pass`."""
    bucket, start, origin, local, valid, _, _, run, column, present, param = _block_runs(
        block_starts, block_buckets, bucket_starts, bucket_ends, starts, ends, columns, first,
        run_columns, run_params, BLOCK,
    )  # fmt: skip
    at, present = element_pointers(bases, param, run_offsets, run_starts, run, start, local,
                                   present, ELEMENT)  # fmt: skip
    p = element_load(at, present, ELEMENT)
    d = tl.load(decay + param, mask=present, other=1.0)
    p = tl.where(d != 1.0, element_round(p * d, ELEMENT), p)
    m = packed_momentum(
        bits + tl.load(parts2 + bucket), bits_stride, tl.load(chunks + bucket), momentum_scales,
        column, start - origin, local, present, BLOCK,
    )  # fmt: skip
    m = times_mask(m, masks, param, run_offsets, run_starts, run, start, local, present, MASKED)
    v = tl.load(value + param, mask=present, other=0.0)
    u = tl.math.div_rn(v * m, tl.load(denominator + start + local, mask=present, other=1.0))
    element_store(at, p + u, present, ELEMENT)


@launched(8)
@triton.jit(do_not_specialize=["row_stride"])
def sync_progress_pass(
    grads, inv, coeff, bases, momentum, denominator, anchor, decay, value, since, error,
    run_starts, run_columns, run_params, run_offsets, starts, ends, columns, first, block_starts,
    block_buckets, bucket_starts, bucket_ends, piece_starts, piece_ends, piece_first, chunks,
    parts1, message, row_stride, partials,
    BLOCK: tl.constexpr, STEP: tl.constexpr, USE_INV: tl.constexpr, SMALL: tl.constexpr,
    MEAN_ABS: tl.constexpr,
):  # fmt: skip
    """0/1 Adam's sync step up to its allreduce, on a block of any bucket: with ``STEP``, the
    local step ``m = lerp(m, g·inv, w)``, ``p' = p·decay + (value·m) / denominator`` (not
    stored: the sync replaces ``p``); then the preconditioned progress the allreduce sends,
    ``(p' - since·anchor)·denominator``, plus the worker ``error``: ``y``, over ``momentum``,
    its signs into the phase-1 ``message`` and its sums per piece of the buckets cut by their
    segments (``piece_*``, as :func:`input_pass` sums them). Each op rounds as the torch ops
    it replaces (``lerp_``, ``mul_``, ``addcdiv_``, ``sub_(alpha=)``: an FMA, the allreduce's
    ``post``, and :func:`input_pass`)."""
    bucket, start, origin, local, valid, _, _, run, column, present, param = _block_runs(
        block_starts, block_buckets, bucket_starts, bucket_ends, starts, ends, columns, first,
        run_columns, run_params, BLOCK,
    )  # fmt: skip
    at, has = run_pointers(bases, param, run_offsets, run_starts, run, start, local, present)
    p = tl.load(at, mask=has, other=0.0)
    d = tl.load(denominator + start + local, mask=present, other=1.0)
    if STEP:
        g = read_gradient(grads, inv, param, run_offsets, run_starts, run, start, local, present,
                          USE_INV, False, 0)  # fmt: skip
        m = tl.load(momentum + start + local, mask=present, other=0.0)
        m = lerp_rounded(m, g, coeff, SMALL)
        w = tl.load(decay + param, mask=present, other=1.0)
        p = tl.where(w != 1.0, p * w, p)
        v = tl.load(value + param, mask=present, other=0.0)
        p = p + tl.math.div_rn(v * m, d)
    a = tl.load(anchor + start + local, mask=present, other=0.0)
    s = tl.load(since + param, mask=present, other=1.0)
    y = tl.where(present, tl.fma(-s, a, p) * d, 0.0)
    y = y + tl.load(error + start + local, mask=valid, other=0.0).to(tl.float32)
    tl.store(momentum + start + local, y, mask=valid)
    _store_signs(y, message, row_stride, tl.load(parts1 + bucket), tl.load(chunks + bucket),
                 start, origin, tl.load(bucket_ends + bucket), BLOCK)  # fmt: skip
    block = tl.program_id(0)
    p0, p1 = tl.load(piece_first + block), tl.load(piece_first + block + 1)
    emit(y, start, local, valid, p0, p1, piece_starts, piece_ends, 0, message, partials,
         partials, message, 0, BLOCK, False, True, MEAN_ABS, False)  # fmt: skip


@launched(8)
@triton.jit(do_not_specialize=["bits_stride"])
def sync_apply_pass(
    bases, bits, bits_stride, momentum_scales, momentum, denominator, anchor, since, factor,
    run_starts, run_columns, run_params, run_offsets, starts, ends, columns, first, block_starts,
    block_buckets, bucket_starts, bucket_ends, chunks, parts2,
    BLOCK: tl.constexpr, APPLIED: tl.constexpr,
):  # fmt: skip
    """0/1 Adam's sync step after its allreduce, on a block of any bucket: where ``APPLIED``,
    with ``u`` the average read from the phase-2 message as :func:`update_pass` reads the
    momentum, ``anchor = anchor·since + u / denominator`` and ``momentum = u·factor``, else
    ``momentum = 0``; then ``p = anchor``."""
    bucket, start, origin, local, valid, _, _, run, column, present, param = _block_runs(
        block_starts, block_buckets, bucket_starts, bucket_ends, starts, ends, columns, first,
        run_columns, run_params, BLOCK,
    )  # fmt: skip
    at, has = run_pointers(bases, param, run_offsets, run_starts, run, start, local, present)
    a = tl.load(anchor + start + local, mask=present, other=0.0)
    if APPLIED:
        s = tl.load(since + param, mask=present, other=1.0)
        a = tl.where(s != 1.0, a * s, a)
        u = packed_momentum(
            bits + tl.load(parts2 + bucket), bits_stride, tl.load(chunks + bucket),
            momentum_scales, column, start - origin, local, present, BLOCK,
        )  # fmt: skip
        a = a + tl.math.div_rn(u, tl.load(denominator + start + local, mask=present, other=1.0))
        tl.store(anchor + start + local, a, mask=present)
        m = u * tl.load(factor + param, mask=present, other=0.0)
    else:
        m = tl.zeros_like(a)
    tl.store(momentum + start + local, m, mask=present)
    tl.store(at, a, mask=has)


@launched(8)
@triton.jit(do_not_specialize=["new_stride", "last_stride", "pieces"])
def lamb_pass(
    bases, new_bits, new_stride, new_scales, last_bits, last_stride, last_scales, masks, fresh,
    frozen, decay, sizes, maxima, partials, pieces, neg_beta1, keep1, beta2, keep2, root_bc2, eps,
    bc1, run_starts, run_columns, run_params, run_offsets, starts, ends, columns, first,
    block_starts, block_buckets, bucket_starts, bucket_ends, chunks, parts2,
    BLOCK: tl.constexpr, UPDATE: tl.constexpr, DENSE: tl.constexpr, NORMS: tl.constexpr,
    ELEMENT: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """1-bit LAMB's step after its allreduce, on a block of any bucket, each op rounded as the
    torch formulation rounds it (parameters of ``ELEMENT``: :func:`element_pointers`). ``m``
    is the new momentum (``new``, packed as in :func:`update_pass`), ``last`` the one before
    (packed, or the fp32 buffer ``last_bits`` where ``DENSE``), ``frozen`` the frozen
    denominator and ``u = m / frozen / bc1`` Adam's update. Where ``MASKED`` both momenta are
    times their ``exp_avg_mask`` (``masks``, as :func:`worker_pass` reads them) but in the
    gradient they imply, which takes the new one as the allreduce returned it.

    Without ``UPDATE``: the gradient the two momenta imply goes into the fresh variance
    (``fresh``, in place); each layer's largest ratio of ``frozen`` to the fresh denominator
    into ``maxima`` (zeros before); with ``NORMS``, each piece's sums of ``u²`` and of
    ``(u + decay·p)²`` at ``partials[piece]`` and ``partials[pieces + piece]``.
    With ``UPDATE``: ``p = p - sizes[layer]·(u + decay·p)``."""
    bucket, start, origin, local, valid, p0, p1, run, column, present, param = _block_runs(
        block_starts, block_buckets, bucket_starts, bucket_ends, starts, ends, columns, first,
        run_columns, run_params, BLOCK,
    )  # fmt: skip
    chunk = tl.load(chunks + bucket)
    part2 = tl.load(parts2 + bucket)
    result = packed_momentum(new_bits + part2, new_stride, chunk, new_scales, column,
                             start - origin, local, present, BLOCK)  # fmt: skip
    m = times_mask(
        result, masks, param, run_offsets, run_starts, run, start, local, present, MASKED
    )
    d = tl.load(frozen + start + local, mask=present, other=1.0)
    u = tl.math.div_rn(tl.math.div_rn(m, d), tl.zeros_like(m) + bc1)
    if UPDATE or NORMS:
        at, present = element_pointers(bases, param, run_offsets, run_starts, run, start, local,
                                       present, ELEMENT)  # fmt: skip
        p = element_load(at, present, ELEMENT)
        wd = tl.load(decay + param, mask=present, other=0.0)
        decayed = tl.where(wd != 0.0, tl.fma(wd, p, u), u)
    if UPDATE:
        size = tl.load(sizes + param, mask=present, other=0.0)
        element_store(at, p - size * decayed, present, ELEMENT)
    else:
        if DENSE:
            last = tl.load(last_bits + start + local, mask=present, other=0.0)
        else:
            last = packed_momentum(last_bits + part2, last_stride, chunk, last_scales, column,
                                   start - origin, local, present, BLOCK)  # fmt: skip
            last = times_mask(last, masks, param, run_offsets, run_starts, run, start, local,
                              present, MASKED)  # fmt: skip
        g = tl.math.div_rn(last * neg_beta1 + result, tl.zeros_like(m) + keep1)
        v = tl.load(fresh + start + local, mask=present, other=0.0)
        v = tl.fma(g * keep2, g, v * beta2)
        tl.store(fresh + start + local, v, mask=present)
        denominator = tl.math.div_rn(tl.math.sqrt_rn(v), tl.zeros_like(v) + root_bc2) + eps
        ratio = tl.where(present, tl.math.div_rn(d, denominator), 0.0)
        for piece in range(p0, p1):
            lo = (tl.load(starts + piece) - start).to(tl.int32)
            hi = (tl.load(ends + piece) - start).to(tl.int32)
            inside = (local >= lo) & (local < hi)
            owner = tl.load(columns + piece)
            layer = tl.load(run_params + owner)
            real = tl.load(run_columns + owner) >= 0
            tl.atomic_max(maxima + layer, tl.max(tl.where(inside, ratio, 0.0)), mask=real)
            if NORMS:
                adaptive = tl.where(inside & present, u * u, 0.0)
                tl.store(partials + piece, tl.sum(adaptive))
                total = tl.where(inside & present, decayed * decayed, 0.0)
                tl.store(partials + pieces + piece, tl.sum(total))


@launched(4)
@triton.jit(do_not_specialize=["bits_stride"])
def decompress_pass(
    bits, bits_stride, momentum_scales, run_columns, starts, ends, columns, first, block_starts,
    block_buckets, bucket_starts, bucket_ends, chunks, parts2, out, BLOCK: tl.constexpr,
):  # fmt: skip
    """The result of every bucket from the phase-2 message as received (``bits``, each
    bucket's part at ``parts2``) and its scales, into the flat ``out``: ``±σ`` of each
    element's run, as :func:`update_pass` reads the momentum (the padding is left as it is)."""
    bucket, start, origin, local, valid = _bucket_block(
        block_starts, block_buckets, bucket_starts, bucket_ends, BLOCK
    )
    block = tl.program_id(0)
    run = piece_columns(local, start, starts, ends, columns, tl.load(first + block),
                        tl.load(first + block + 1))  # fmt: skip
    column = tl.load(run_columns + run, mask=valid, other=-1).to(tl.int32)
    present = valid & (column >= 0)
    m = packed_momentum(
        bits + tl.load(parts2 + bucket), bits_stride, tl.load(chunks + bucket), momentum_scales,
        column, start - origin, local, present, BLOCK,
    )  # fmt: skip
    tl.store(out + start + local, m, mask=present)


@launched()
@triton.jit(do_not_specialize=["rows", "row_stride", "header_from", "header_at"])
def placed_scales(
    partials, first, lengths, scales, message, rows, row_stride, places, header, header_from,
    header_at,
    CHUNK: tl.constexpr, MEAN_ABS: tl.constexpr, HEADER_BYTES: tl.constexpr,
    HEADER_SPAN: tl.constexpr,
):  # fmt: skip
    """``segments_to_scales`` of :mod:`~onebit.kernels.triton_kernels`, each scale also written as
    its four bytes at byte ``places[q]`` of each of the ``rows`` rows of ``message``, where the
    message's layout puts it (not always at a multiple of 4). With ``HEADER_BYTES``, the last
    program writes those bytes of ``header`` from byte ``header_from`` at byte ``header_at`` of
    each row instead."""
    q = tl.program_id(0)
    if HEADER_BYTES and q == tl.num_programs(0) - 1:
        offsets = tl.arange(0, HEADER_SPAN)
        present = offsets < HEADER_BYTES
        values = tl.load(header + header_from + offsets, mask=present)
        for r in range(rows):
            tl.store(message + r * row_stride + header_at + offsets, values, mask=present)
    else:
        value = segment_scale(partials, first, lengths, q, CHUNK, MEAN_ABS)
        tl.store(scales + q, value)
        word = value.to(tl.uint32, bitcast=True)
        shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
        bytes_ = ((word >> shifts) & 0xFF).to(tl.uint8)
        at = message + tl.load(places + q) + tl.arange(0, 4)
        for r in range(rows):
            tl.store(at + r * row_stride, bytes_)
