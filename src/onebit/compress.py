"""The 1-bit compressor: scale, sign and 8-per-byte packing (SPEC section 1), and the server's
and the result's side of the compressed allreduce (SPEC section 2).

Everything here is pure tensor math on one device: no communication, no state. The
communicator (:mod:`onebit.wire.comm`) builds the error-feedback allreduce on it.

Conventions shared with the SPEC:

* ``sign(x)`` is ``+1`` where ``x >= 0`` and ``-1`` elsewhere, so zero (and ``-0.0``) maps to
  ``+1`` and NaN to ``-1``.
* Bit ``i`` of byte ``k`` holds the sign of element ``8 * k + i`` (1 means ``+1``).

Each function checks its arguments, then runs the backend that :func:`onebit.kernels.for_tensors`
picks for its tensors: the fused C kernels on the CPU (compress under 2.5x a ``copy_`` of the
buffer, decompress under 1x, ``benchmarks/kernels.py``), numpy chunks where those were not built,
the Triton kernels on CUDA, the torch reference elsewhere. All give the same bits: the same signs
and packed bytes, the same error update and decompressed values for a given scale, the same server
average (rank order, then the division). Scales differ only by fp32 rounding, since each backend
reduces in its own order. NaN payloads are not preserved.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import kernels
from .kernels.errors import fp32, written

SCALES = ("rms", "mean_abs")
"""Scale rules: ``"rms"`` keeps the norm (the reference's choice); ``"mean_abs"`` minimises
the L2 error."""


def cpu_kernels() -> str:
    """Which kernels contiguous fp32 CPU tensors get: ``"c"`` (the C kernels built at install),
    ``"numpy"`` (same bits, slower) or ``"torch"``, as ``ONEBIT_BACKEND`` allows."""
    return kernels.for_device(torch.device("cpu")).name


def check_scale(scale: str) -> str:
    """Return ``scale`` if it names a known scale rule, else raise ``ValueError``."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    return scale


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``8 * world_size``, so every chunk is whole bytes."""
    quantum = 8 * world_size
    return -(-numel // quantum) * quantum


# Building blocks, as in SPEC section 1.


def compute_scale(x: Tensor, scale: str = "rms") -> Tensor:
    """The fp32 scale ``s`` of ``C(x) = s * sign(x)``, as a 0-d tensor on ``x``'s device.

    ``"rms"`` is ``||x||_2 / sqrt(d)``; ``"mean_abs"`` is ``||x||_1 / d``. A non-finite ``x``
    gives a non-finite scale, which is how callers detect overflow without another pass.
    """
    check_scale(scale)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return kernels.for_tensors(x).compute_scale(x, scale)


def pack_signs(x: Tensor) -> Tensor:
    """Pack ``sign(x)`` 8 per byte into a ``uint8`` tensor of ``x.numel() // 8`` elements.

    ``x.numel()`` must be a multiple of 8: callers pad (see :func:`padded_numel`).
    """
    if x.numel() % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {x.numel()}")
    return kernels.for_tensors(x).pack_signs(x)


def unpack_signs(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_signs`: ``uint8 [..., k]`` to fp32 ``±1`` of shape ``[..., 8k]``."""
    return kernels.for_tensors(packed).unpack_signs(packed)


def subtract_compressed_(y: Tensor, s: Tensor, out: Tensor, signs: Tensor | None = None) -> Tensor:
    """``out = y - s * sign(y)``: what compression lost, i.e. the new error-feedback buffer.

    ``out`` may be ``y`` itself. ``signs``, if given, must be ``pack_signs(y)`` (as returned by
    :func:`compress_`): a backend may read the signs from it instead of recomputing them.
    """
    backend = kernels.for_tensors(y, out)
    with written(out) as staged:
        backend.subtract_compressed_(staged if y is out else y, s, staged, signs)
    return out


# Fused kernels used by the communicator.


def compress_(buffer: Tensor, error: Tensor, scale: str = "rms") -> tuple[Tensor, Tensor]:
    """Worker compression in one pass: ``buffer += error``, then return the packed signs and the
    scale of the result ``y`` (now in ``buffer``).

    ``buffer`` and ``error`` are 1-D fp32 of the same length, a multiple of 8. ``error`` is not
    touched: commit it with ``subtract_compressed_(buffer, s, out=error)`` once it is known that
    the step goes ahead (every rank's scale finite). Same result as :func:`compute_scale` and
    :func:`pack_signs` of ``buffer.add_(error)``, with one read of each buffer instead of four.
    """
    check_scale(scale)
    numel = buffer.numel()
    if numel % 8:
        raise ValueError(f"compress_ needs a multiple of 8 elements, got {numel}")
    if error.numel() != numel:
        raise ValueError(f"buffer has {numel} elements, error {error.numel()}")
    return kernels.for_tensors(buffer, error).compress_(buffer, fp32(error), scale)


def input_kernels(*tensors: Tensor) -> bool:
    """Whether :func:`compress_input` and :func:`commit_input_` read these tensors where they
    are and never store ``y`` (the C and Triton kernels, on contiguous fp32). Elsewhere they store
    ``y`` in a temporary, and a caller with a buffer of its own does better with :func:`compress_`
    on it."""
    return kernels.for_tensors(*tensors).reads_input(*tensors)


def compress_input(
    x: Tensor, error: Tensor, scale: str = "rms", bounds: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Worker pass 1 on an unpadded input: the packed signs and the scale of ``y = x + error``,
    ``x`` (flat fp32, at most ``error.numel()`` elements) being followed by zeros up to
    ``error``'s length, without storing ``y`` where the backend can (:func:`input_kernels`);
    with ``bounds`` (as :func:`segment_scales`), the scale of each segment. ``error`` is not
    touched: commit it with :func:`commit_input_`.

    The same bits as :func:`compress_` (then :func:`segment_scales`) on a buffer holding ``x``
    and zeros. Why: that buffer costs a copy of the input and a store of ``y``.
    """
    check_scale(scale)
    n, nx = error.numel(), x.numel()
    if n % 8 or nx > n:
        raise ValueError(f"compress_input needs {nx} <= {n} elements, a multiple of 8")
    return kernels.for_tensors(x, error).compress_input(x, fp32(error), scale, bounds)


def commit_input_(x: Tensor, error: Tensor, scales: Tensor, bounds: Tensor | None = None) -> Tensor:
    """Worker pass 2 of :func:`compress_input` (same ``x``, ``error`` and ``bounds``), once the
    step is known to go ahead: ``error = y - scale * sign(y)``, ``y`` computed again. The same
    bits as :func:`subtract_compressed_` (:func:`subtract_compressed_segments_`) of ``y``."""
    with written(error) as staged:
        kernels.for_tensors(x, error).commit_input_(x, staged, scales, bounds)
    return error


def allreduce_one_(
    x: Tensor, error: Tensor, server_error: Tensor, out: Tensor, scale: str = "rms"
) -> bool:
    """The compressed allreduce (SPEC section 2, no segments) of one rank's ``x`` at world size
    1: the worker compresses ``x`` (as :func:`compress_input`) with ``error``, the server's share
    is the whole buffer with ``server_error`` (``error``'s length), and its result goes into
    ``out`` (flat fp32, ``x.numel()`` elements, which may be ``x``). Returns ``False``, with
    nothing changed, if the worker's scale is not finite.

    The C kernels take three passes: the worker's signs; the worker error with the server's
    signs (the only row it averages is the worker's own); the server error with the result.
    Triton takes two with the rms scale: the worker's sums, then both errors with the result.
    The server's scale comes from the first pass's sums, as ``sum(z²) = n·s² + 2s·sum(±e_s) +
    sum(e_s²)`` (``±``: the worker's signs; in fp64), the same value within the bound of a
    different summation order. With ``"mean_abs"`` the server's sums take a pass of their own.
    The reference is :func:`compress_input`, :func:`commit_input_`, :func:`serve_chunk_` and
    :func:`decompress_` in turn, with the same bits (but for Triton's rms server scale).
    """
    check_scale(scale)
    backend = kernels.for_tensors(x, error, server_error, out)
    with written(error) as worker, written(server_error) as server:
        return backend.allreduce_one_(x, worker, server, out, scale)


def decompress_(packed: Tensor, scales: Tensor, out: Tensor) -> Tensor:
    """``out = concat_j(scales[j] * sign_j)[:out.numel()]``: rebuild ``k`` compressed chunks.

    ``packed`` is ``uint8 [k, m]`` (rows may be strided, as in a received message), ``scales``
    fp32 ``[k]``, ``out`` a contiguous fp32 tensor of at most ``8 * k * m`` elements; the padding
    past its end is dropped. Equal to ``unpack_signs(packed) * scales[:, None]`` bit for bit.
    """
    k, m = packed.shape
    numel = out.numel()
    if numel > 8 * k * m:
        raise ValueError(f"out has {numel} elements, more than the {8 * k * m} packed")
    if numel == 0:
        return out
    return kernels.for_tensors(packed, out).decompress_(packed, scales, out)


def average_signs_(packed: Tensor, scales: Tensor, out: Tensor) -> Tensor:
    """Server average: ``out = (sum_r scales[r] * sign_r) / k`` for ``packed`` ``uint8 [k, m]``
    (rows may be strided) and ``out`` fp32 of ``8 * m`` elements.

    Terms are added one by one in rank order, then divided by ``k``: a fixed order, the same on
    every device (``Tensor.sum(0)`` may reorder it, which changes the last bit).
    """
    k, m = packed.shape
    if out.numel() != 8 * m:
        raise ValueError(f"out has {out.numel()} elements, expected {8 * m}")
    return kernels.for_tensors(packed, out).average_signs_(packed, scales, out)


def serve_chunk_(
    packed: Tensor, scales: Tensor, error: Tensor, scale: str = "rms", z: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """A server's whole share of one chunk without segments: ``z`` = the average of the ``k``
    rows of ``packed`` (:func:`average_signs_`, ``scales`` fp32 ``[k]``) plus ``error``; return
    ``z``'s packed signs and scale, and commit ``error = z - ±scale``.

    The C kernels do it in two passes that never store ``z`` (the second computes it again);
    the reference is :func:`average_signs_`, :func:`compress_` and :func:`subtract_compressed_`
    in turn, on ``z`` (fp32 scratch like ``error``; default: a new buffer), with the same bits.
    """
    k, m = packed.shape
    if error.numel() != 8 * m:
        raise ValueError(f"error has {error.numel()} elements, expected {8 * m}")
    with written(error) as staged:
        return kernels.for_tensors(packed, error).serve_chunk_(packed, scales, staged, scale, z)


# Scales per segment: the same operations with one scale per run of elements (a tensor's part of
# a bucket). Segments are ``[bounds[q], bounds[q+1])``; pieces are rows of an int64 table. Tables
# are int64 CPU tensors whatever the device of the data, and never decide the backend.


def segment_scales(y: Tensor, bounds: Tensor, scale: str = "rms") -> Tensor:
    """The scale of each segment ``y[bounds[q]:bounds[q+1]]``, fp32 ``[len(bounds) - 1]``.

    ``bounds`` is an int64 CPU tensor, increasing. An empty segment has scale 0.
    """
    check_scale(scale)
    return kernels.for_tensors(y).segment_scales(y, bounds, scale)


def subtract_compressed_segments_(y: Tensor, scales: Tensor, bounds: Tensor, out: Tensor) -> Tensor:
    """``out = y - s_q * sign(y)`` on each segment ``q``, as :func:`subtract_compressed_`."""
    backend = kernels.for_tensors(y, out)
    with written(out) as staged:
        backend.subtract_compressed_segments_(staged if y is out else y, scales, bounds, staged)
    return out


def average_signs_pieces_(packed: Tensor, scales: Tensor, pieces: Tensor, out: Tensor) -> Tensor:
    """:func:`average_signs_` with a scale per piece: ``pieces`` rows are ``(start, end, c)``
    and row ``r``'s term on elements ``[start, end)`` is ``scales[r, c] * sign_r``.

    ``packed`` is ``uint8 [k, m]`` (rows may be strided), ``scales`` fp32 ``[k, columns]``,
    ``out`` fp32 of ``8 * m`` elements; the pieces must cover it.
    """
    backend = kernels.for_tensors(packed, out)
    return backend.average_signs_pieces_(packed, scales, pieces, out)


def serve_pieces_(
    packed: Tensor,
    scales: Tensor,
    pieces: Tensor,
    bounds: Tensor,
    store: Tensor,
    last: Tensor | None,
    scale: str,
) -> tuple[Tensor, Tensor]:
    """A server's whole share with a scale per piece, its error kept as the last ``z``.

    ``store`` (fp32, the chunk) holds the server error, or with ``last`` (each piece's scale of
    the last call) that call's ``z``, whose error is ``z - ±last`` (:func:`server_error_`). Here
    ``z`` = the average of the ``k`` rows of ``packed`` (:func:`average_signs_pieces_`) plus
    that error is written over ``store``; returns ``z``'s packed signs and the scale of each
    piece (``bounds``, the pieces' boundaries), which the next call takes as ``last``.

    Keeping ``z`` saves a pass over the chunk: the error is derived where it is next read. The C
    kernel does it in one pass; the reference is those functions in turn, with the same bits.
    """
    check_scale(scale)
    backend = kernels.for_tensors(packed, store)
    with written(store, backend.error_dtypes) as staged:
        return backend.serve_pieces_(packed, scales, pieces, bounds, staged, last, scale)


def server_error_(z: Tensor, last: Tensor, bounds: Tensor) -> Tensor:
    """The server error from the ``z`` that :func:`serve_pieces_` kept and its pieces' scales
    ``last``, in place: ``z - ±last`` per piece (``bounds``)."""
    return subtract_compressed_segments_(z, last, bounds, z)


def decompress_pieces_(packed: Tensor, scales: Tensor, pieces: Tensor, out: Tensor) -> Tensor:
    """:func:`decompress_` with a scale per piece: ``pieces`` rows are ``(j, start, end, c)``,
    and elements ``[start, end)`` of row ``j`` are ``scales[j, c] * sign``; ``out`` gets the
    first ``out.numel()`` elements of the concatenated rows. The pieces must cover them."""
    return kernels.for_tensors(packed, out).decompress_pieces_(packed, scales, pieces, out)
