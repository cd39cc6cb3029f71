"""The 1-bit compressor: scale, sign and 8-per-byte packing (SPEC section 1).

Everything here is pure tensor math on one device: no communication, no state.
The communicator (:mod:`onebit.comm`) builds the error-feedback allreduce on it.

Conventions shared with the SPEC:

* ``sign(x)`` is ``+1`` where ``x >= 0`` and ``-1`` elsewhere, so zero (and ``-0.0``) maps to
  ``+1`` and NaN to ``-1``.
* Bit ``i`` of byte ``k`` holds the sign of element ``8 * k + i`` (1 means ``+1``).

Three implementations sit behind one interface, chosen per call:

* contiguous fp32 CPU tensors go through fused C loops (:mod:`onebit._native`, AVX2, built at
  install): one pass adds the error, sums the squares and packs the signs, another updates the
  error. They run at about memory speed: compress under 2.5x a ``copy_`` of the same buffer,
  decompress under 1x (``benchmarks/kernels.py``, 2-core EPYC VM);
* where those are unavailable (installed without a compiler, not x86-64,
  ``ONEBIT_NATIVE=0``), numpy does the same work in cache-sized chunks of :data:`CHUNK`
  elements (zero-copy views, ``np.packbits``): about 3-4x a copy for large buffers, more for
  small ones;
* everything else (CUDA, other dtypes, no numpy) runs a few whole-tensor torch ops, the
  straightforward formulation with as few passes as it allows.

All give the same bits: the same signs and packed bytes, the same error update and decompressed
values for a given scale, the same server average (rank order, then the division). Scales differ
only by fp32 rounding, since each path reduces in its own order. NaN payloads are not preserved.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _native

try:  # numpy is optional: without it every device takes the torch path.
    import numpy as np
except ImportError:  # pragma: no cover - torch wheels normally come with numpy
    np = None

SCALES = ("rms", "mean_abs")
"""Scale rules: ``"rms"`` keeps the norm (the reference's choice); ``"mean_abs"`` minimises
the L2 error."""

CHUNK = 1 << 16
"""Elements per chunk on the CPU path: 256 KiB of fp32, so a chunk and its scratch stay in L2."""

_SIGN_BIT = -(1 << 31)
_SHIFTS: dict[torch.device, Tensor] = {}
_WEIGHTS: dict[torch.device, Tensor] = {}
_SIGN_TABLE = None  # numpy int32 [256, 8]: 0 where bit i of the byte is set, else the sign bit


def _shifts(device: torch.device) -> Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return shifts


def _weights(device: torch.device) -> Tensor:
    weights = _WEIGHTS.get(device)
    if weights is None:
        weights = _WEIGHTS[device] = torch.tensor(
            [1 << i for i in range(8)], dtype=torch.uint8, device=device
        )
    return weights


def _sign_table():
    global _SIGN_TABLE
    if _SIGN_TABLE is None:
        bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
        _SIGN_TABLE = np.where(bits == 1, 0, _SIGN_BIT).astype(np.int32)
    return _SIGN_TABLE


def fast_path(*tensors: Tensor) -> bool:
    """Whether the CPU kernels (native, else numpy) apply: numpy present, every tensor on the CPU,
    contiguous, fp32 (or uint8 for packed signs). Otherwise the torch formulation runs."""
    if np is None:
        return False
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            return False
        if t.dtype not in (torch.float32, torch.uint8):
            return False
    return True


def _kernels():
    """The fused C kernels (:mod:`onebit._native`), or ``None``: then the numpy kernels run."""
    return _native.load()


def cpu_kernels() -> str:
    """Which kernels contiguous fp32 CPU tensors get: ``"native"`` (the C kernels built at
    install), ``"numpy"`` (same bits, slower) or ``"torch"`` (no numpy)."""
    if not fast_path(torch.zeros(8)):
        return "torch"
    return "native" if _kernels() is not None else "numpy"


def _np(t: Tensor):
    """Zero-copy numpy view of a CPU tensor (autograd detached)."""
    return t.detach().numpy()


def _f32_bits(s: float) -> int:
    """The int32 bit pattern of the fp32 value ``s``."""
    return int(np.array(s, dtype=np.float32).view(np.int32))


def check_scale(scale: str) -> str:
    """Return ``scale`` if it names a known scale rule, else raise ``ValueError``."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    return scale


# Building blocks, as in SPEC section 1.


def compute_scale(x: Tensor, scale: str = "rms") -> Tensor:
    """The fp32 scale ``s`` of ``C(x) = s * sign(x)``, as a 0-d tensor on ``x``'s device.

    ``"rms"`` is ``||x||_2 / sqrt(d)``; ``"mean_abs"`` is ``||x||_1 / d``. A non-finite ``x``
    gives a non-finite scale, which is how callers detect overflow without another pass.
    """
    check_scale(scale)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if x.dtype == torch.float32 and fast_path(x):
        flat = _np(x).reshape(-1)
        total = sum(_partial_scale(flat[i : i + CHUNK], scale) for i in range(0, flat.size, CHUNK))
        return _finish_scale(total, flat.size, scale)
    if scale == "rms":
        return torch.linalg.vector_norm(x, dtype=torch.float32) / math.sqrt(x.numel())
    return torch.linalg.vector_norm(x, 1, dtype=torch.float32) / x.numel()


def pack_signs(x: Tensor) -> Tensor:
    """Pack ``sign(x)`` 8 per byte into a ``uint8`` tensor of ``x.numel() // 8`` elements.

    ``x.numel()`` must be a multiple of 8: callers pad (see :func:`padded_numel`).
    """
    if x.numel() % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {x.numel()}")
    if x.dtype == torch.float32 and fast_path(x):
        out = torch.empty(x.numel() // 8, dtype=torch.uint8)
        flat, packed = _np(x).reshape(-1), _np(out)
        mask = np.empty(min(CHUNK, flat.size), dtype=bool)
        for i in range(0, flat.size, CHUNK):
            _pack_chunk(flat[i : i + CHUNK], packed[i // 8 : (i + CHUNK) // 8], mask)
        return out
    return _torch_pack(x >= 0)


def unpack_signs(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_signs`: ``uint8 [..., k]`` to fp32 ``±1`` of shape ``[..., 8k]``."""
    if fast_path(packed) and packed.dtype == torch.uint8:
        bits = torch.from_numpy(np.unpackbits(_np(packed), axis=-1, bitorder="little"))
        return bits.to(torch.float32).mul_(2).sub_(1)
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8).to(torch.float32).mul_(2).sub_(1)


def subtract_compressed_(y: Tensor, s: Tensor, out: Tensor, signs: Tensor | None = None) -> Tensor:
    """``out = y - s * sign(y)``: what compression lost, i.e. the new error-feedback buffer.

    ``out`` may be ``y`` itself. ``signs``, if given, must be ``pack_signs(y)`` (as returned by
    :func:`compress_`): the CPU path then reads the signs from it instead of recomputing them,
    which saves two of its four passes over each chunk.
    """
    if fast_path(y, out) and y.dtype == out.dtype == torch.float32 and y.shape == out.shape:
        lib = _kernels()
        if lib is not None:
            lib.ob_commit(y.data_ptr(), float(s), out.data_ptr(), y.numel())
            return out
        src, dst = _np(y).reshape(-1), _np(out).reshape(-1)
        scratch = np.empty(min(CHUNK, src.size), dtype=np.float32)
        if signs is not None and fast_path(signs) and signs.numel() * 8 == src.size:
            table = _signed_table(float(s))
            packed = _np(signs).reshape(-1)
            with np.errstate(all="ignore"):
                for i in range(0, src.size, CHUNK):
                    t = scratch[: min(CHUNK, src.size - i)]
                    _take_signed(table, packed[i // 8 : (i + CHUNK) // 8], t)
                    np.subtract(src[i : i + CHUNK], t, out=dst[i : i + CHUNK])
            return out
        s_bits = _f32_bits(float(s))
        with np.errstate(all="ignore"):
            for i in range(0, src.size, CHUNK):
                _error_chunk(src[i : i + CHUNK], s_bits, dst[i : i + CHUNK], scratch)
        return out
    # y - (±s): the same rounding as torch.where(y >= 0, y - s, y + s), in two passes fewer.
    s = s.to(device=y.device, dtype=torch.float32)
    return torch.sub(y, torch.where(y >= 0, s, s * -1), out=out)


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``8 * world_size``, so every chunk is whole bytes."""
    quantum = 8 * world_size
    return -(-numel // quantum) * quantum


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
    if not (fast_path(buffer, error) and buffer.dtype == error.dtype == torch.float32):
        y = buffer.add_(error)
        return _torch_pack(y >= 0), compute_scale(y, scale)
    packed = torch.empty(numel // 8, dtype=torch.uint8)
    if numel == 0:
        return packed, torch.zeros(())
    lib = _kernels()
    if lib is not None:
        args = (buffer.data_ptr(), error.data_ptr(), packed.data_ptr(), numel)
        return packed, _finish_scale(lib.ob_compress(*args, scale == "mean_abs"), numel, scale)
    b, e, p = _np(buffer), _np(error), _np(packed)
    mask = np.empty(min(CHUNK, numel), dtype=bool)
    total = 0.0
    with np.errstate(all="ignore"):
        for i in range(0, numel, CHUNK):
            y = b[i : i + CHUNK]
            np.add(y, e[i : i + CHUNK], out=y)
            total += _partial_scale(y, scale)
            _pack_chunk(y, p[i // 8 : (i + CHUNK) // 8], mask)
    return packed, _finish_scale(total, numel, scale)


def input_kernels(*tensors: Tensor) -> bool:
    """Whether :func:`compress_input` and :func:`commit_input_` run their C kernels on these
    tensors (contiguous fp32 on the CPU, kernels built), which never store ``y``. Elsewhere they
    store ``y`` in a temporary, and a caller with a buffer of its own does better with
    :func:`compress_` on it."""
    return (
        fast_path(*tensors)
        and all(t.dtype == torch.float32 for t in tensors)
        and _kernels() is not None
    )


def compress_input(
    x: Tensor, error: Tensor, scale: str = "rms", bounds: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Worker pass 1 on an unpadded input: the packed signs and the scale of ``y = x + error``,
    ``x`` (flat fp32, at most ``error.numel()`` elements) being followed by zeros up to
    ``error``'s length, without storing ``y``; with ``bounds`` (as :func:`segment_scales`), the
    scale of each segment. ``error`` is not touched: commit it with :func:`commit_input_`.

    The same bits as :func:`compress_` (then :func:`segment_scales`) on a buffer holding ``x``
    and zeros, which is what runs, on a temporary, where the C kernels do not apply
    (:func:`input_kernels`). Why: the buffer costs a copy of the input and a store of ``y``.
    """
    check_scale(scale)
    n, nx = error.numel(), x.numel()
    if n % 8 or nx > n:
        raise ValueError(f"compress_input needs {nx} <= {n} elements, a multiple of 8")
    if not (n and input_kernels(x, error)):
        y = _padded(x, n)
        signs, s = compress_(y, error, scale)
        return signs, s if bounds is None else segment_scales(y, bounds, scale)
    lib, signs = _kernels(), torch.empty(n // 8, dtype=torch.uint8)
    args = (x.data_ptr(), nx, error.data_ptr())
    if bounds is None:
        total = lib.ob_add_signs(*args, signs.data_ptr(), n, scale == "mean_abs")
        return signs, _finish_scale(total, n, scale)
    lengths = bounds.diff().to(torch.float64)
    totals = torch.empty(len(lengths), dtype=torch.float64)
    lib.ob_add_signs_segments(*args, bounds.data_ptr(), len(lengths), signs.data_ptr(),
                              scale == "mean_abs", totals.data_ptr())  # fmt: skip
    return signs, scales_from_totals(totals, lengths, scale)


def commit_input_(x: Tensor, error: Tensor, scales: Tensor, bounds: Tensor | None = None) -> Tensor:
    """Worker pass 2 of :func:`compress_input` (same ``x``, ``error`` and ``bounds``), once the
    step is known to go ahead: ``error = y - scale * sign(y)``, ``y`` computed again. The same
    bits as :func:`subtract_compressed_` (:func:`subtract_compressed_segments_`) of ``y``."""
    n, nx = error.numel(), x.numel()
    if not (n and input_kernels(x, error)):
        y = _padded(x, n).add_(error)
        if bounds is None:
            return subtract_compressed_(y, scales, out=error)
        return subtract_compressed_segments_(y, scales, bounds, error)
    if bounds is None:
        bounds = torch.tensor([0, n], dtype=torch.int64)
    scales = scales.to(torch.float32).reshape(-1).contiguous()
    _kernels().ob_add_commit(x.data_ptr(), nx, error.data_ptr(), scales.data_ptr(),
                             bounds.data_ptr(), len(bounds) - 1, error.data_ptr())  # fmt: skip
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
    Elsewhere it is :func:`compress_input`, :func:`commit_input_`, :func:`serve_chunk_` and
    :func:`decompress_` in turn, with the same bits.
    """
    signs, s = compress_input(x, error, scale)
    if not bool(torch.isfinite(s)):
        return False
    n = error.numel()
    if not (n and input_kernels(x, error, server_error, out) and server_error.numel() == n):
        commit_input_(x, error, s)
        packed, sigma = serve_chunk_(signs.view(1, -1), s.reshape(1), server_error, scale)
        decompress_(packed.view(1, -1), sigma.reshape(1), out)
        return True
    lib, z_signs = _kernels(), torch.empty(n // 8, dtype=torch.uint8)
    total = lib.ob_solo_commit_signs(x.data_ptr(), x.numel(), error.data_ptr(), float(s),
                                     server_error.data_ptr(), z_signs.data_ptr(), n,
                                     scale == "mean_abs")  # fmt: skip
    sigma = float(_finish_scale(total, n, scale))
    lib.ob_solo_serve_commit(signs.data_ptr(), float(s), server_error.data_ptr(), sigma,
                             out.data_ptr(), out.numel(), n)  # fmt: skip
    return True


def _padded(x: Tensor, numel: int) -> Tensor:
    """``x`` flattened and followed by zeros up to ``numel`` elements, fp32, in a new buffer."""
    y = torch.zeros(numel, dtype=torch.float32, device=x.device)
    y[: x.numel()] = x.reshape(-1)
    return y


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
    if not (fast_path(out) and out.dtype == torch.float32 and packed.device.type == "cpu"):
        flat = _torch_unpack_scaled(packed, scales.to(out.device)).view(-1)[:numel]
        out.view(-1).copy_(flat)
        return out
    lib = _kernels()
    if lib is not None and packed.stride(-1) == 1:
        scales = scales.to(torch.float32).contiguous()
        args = (packed.data_ptr(), packed.stride(0), scales.data_ptr(), k, m, out.data_ptr())
        lib.ob_decompress(*args, numel)
        return out
    p = _np(packed)
    dst = _np(out).reshape(-1)
    for j, s in enumerate(scales.tolist()):
        start = 8 * m * j
        if start >= numel:
            break
        _take_signed(_signed_table(s), p[j], dst[start : min(start + 8 * m, numel)])
    return out


def average_signs_(packed: Tensor, scales: Tensor, out: Tensor) -> Tensor:
    """Server average: ``out = (sum_r scales[r] * sign_r) / k`` for ``packed`` ``uint8 [k, m]``
    (rows may be strided) and ``out`` fp32 of ``8 * m`` elements.

    Terms are added one by one in rank order, then divided by ``k``: a fixed order, the same on
    every device (``Tensor.sum(0)`` may reorder it, which changes the last bit).
    """
    k, m = packed.shape
    if out.numel() != 8 * m:
        raise ValueError(f"out has {out.numel()} elements, expected {8 * m}")
    if not (fast_path(out) and out.dtype == torch.float32 and packed.device.type == "cpu"):
        signs = _torch_unpack_scaled(packed, scales.to(out.device))
        flat = out.view(-1)
        flat.copy_(signs[0])
        for r in range(1, k):
            flat.add_(signs[r])
        return flat.div_(k).view_as(out) if k != 1 else out
    lib = _kernels()
    if lib is not None and packed.stride(-1) == 1:
        scales = scales.to(torch.float32).contiguous()
        lib.ob_average(packed.data_ptr(), packed.stride(0), scales.data_ptr(), k, m, out.data_ptr())
        return out
    p = _np(packed)
    dst = _np(out).reshape(-1)
    tables = [_signed_table(s) for s in scales.tolist()]
    scratch = np.empty(min(CHUNK, dst.size), dtype=np.float32)
    with np.errstate(all="ignore"):
        for i in range(0, dst.size, CHUNK):
            z = dst[i : i + CHUNK]
            rows = slice(i // 8, (i + CHUNK) // 8)
            _take_signed(tables[0], p[0, rows], z)
            t = scratch[: z.size]
            for r in range(1, k):
                _take_signed(tables[r], p[r, rows], t)
                np.add(z, t, out=z)
            if k != 1:
                np.divide(z, np.float32(k), out=z)
    return out


def serve_chunk_(
    packed: Tensor, scales: Tensor, error: Tensor, scale: str = "rms", z: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """A server's whole share of one chunk without segments: ``z`` = the average of the ``k``
    rows of ``packed`` (:func:`average_signs_`, ``scales`` fp32 ``[k]``) plus ``error``; return
    ``z``'s packed signs and scale, and commit ``error = z - ±scale``.

    The C kernels do it in two passes that never store ``z`` (the second computes it again);
    elsewhere it is :func:`average_signs_`, :func:`compress_` and
    :func:`subtract_compressed_` in turn, on ``z`` (fp32 scratch like ``error``; default: a new
    buffer), with the same bits.
    """
    k, m = packed.shape
    if error.numel() != 8 * m:
        raise ValueError(f"error has {error.numel()} elements, expected {8 * m}")
    lib = _kernels() if fast_path(error) and packed.device.type == "cpu" else None
    if lib is None or not m or packed.stride(-1) != 1 or error.dtype != torch.float32:
        z = torch.empty_like(error) if z is None else z
        signs, sigma = compress_(average_signs_(packed, scales, out=z), error, scale)
        subtract_compressed_(z, sigma, out=error, signs=signs)
        return signs, sigma
    scales = scales.to(torch.float32).contiguous()
    signs, total = torch.empty(m, dtype=torch.uint8), torch.empty(1, dtype=torch.float64)
    rows = (packed.data_ptr(), packed.stride(0), scales.data_ptr())
    failed = lib.ob_serve_chunk_signs(*rows, k, error.data_ptr(), signs.data_ptr(), 8 * m,
                                      scale == "mean_abs", total.data_ptr())  # fmt: skip
    sigma = _finish_scale(float(total), 8 * m, scale)
    piece = torch.tensor([0, 8 * m, 0], dtype=torch.int64)
    if failed or lib.ob_serve_commit(*rows, 1, k, piece.data_ptr(), 1, sigma.data_ptr(),
                                     error.data_ptr()):  # fmt: skip
        raise MemoryError("onebit's server kernel could not allocate its scale table")
    return signs, sigma


# Scales per segment: the same operations with one scale per run of elements (a tensor's part of
# a bucket). Segments are ``[bounds[q], bounds[q+1])``; pieces are rows of an int64 table. The
# native kernels loop over them in C; elsewhere the torch formulation expands the scales to one
# per element and runs the single-scale formulas, which gives the same bits.


def segment_scales(y: Tensor, bounds: Tensor, scale: str = "rms") -> Tensor:
    """The scale of each segment ``y[bounds[q]:bounds[q+1]]``, fp32 ``[len(bounds) - 1]``.

    ``bounds`` is an int64 CPU tensor, increasing. An empty segment has scale 0.
    """
    check_scale(scale)
    lengths = bounds.diff().to(torch.float64)
    lib = _kernels() if fast_path(y) and y.dtype == torch.float32 else None
    if lib is not None:
        totals = torch.empty(len(lengths), dtype=torch.float64)
        lib.ob_sums(y.data_ptr(), bounds.data_ptr(), len(lengths), scale == "mean_abs",
                    totals.data_ptr())  # fmt: skip
    else:
        edges = bounds.tolist()
        views = [y[a:b] for a, b in zip(edges[:-1], edges[1:])]
        norms = torch._foreach_norm(views, 2 if scale == "rms" else 1) if views else []
        totals = torch.stack(norms).double().cpu() if norms else lengths.clone()
        totals = totals.square() if scale == "rms" else totals
    return scales_from_totals(totals, lengths, scale).to(y.device)


def scales_from_totals(totals: Tensor, lengths: Tensor, scale: str = "rms") -> Tensor:
    """Segment scales (fp32) from their fp64 sums of squares (``"rms"``) or of absolute values
    (``"mean_abs"``) and their lengths; an empty segment has scale 0."""
    value = totals.sqrt() / lengths.sqrt() if scale == "rms" else totals / lengths
    return torch.where(lengths > 0, value, 0.0).float()


def subtract_compressed_segments_(y: Tensor, scales: Tensor, bounds: Tensor, out: Tensor) -> Tensor:
    """``out = y - s_q * sign(y)`` on each segment ``q``, as :func:`subtract_compressed_`."""
    lib = _kernels() if fast_path(y, out) and y.dtype == out.dtype == torch.float32 else None
    if lib is not None:
        scales = scales.to(torch.float32).contiguous()
        lib.ob_commit_segments(y.data_ptr(), scales.data_ptr(), bounds.data_ptr(),
                               len(bounds) - 1, out.data_ptr())  # fmt: skip
        return out
    s = torch.repeat_interleave(scales.to(y.device), bounds.diff().to(y.device))
    return torch.sub(y, torch.where(y >= 0, s, s * -1), out=out)


def average_signs_pieces_(packed: Tensor, scales: Tensor, pieces: Tensor, out: Tensor) -> Tensor:
    """:func:`average_signs_` with a scale per piece: ``pieces`` rows are ``(start, end, c)``
    and row ``r``'s term on elements ``[start, end)`` is ``scales[r, c] * sign_r``.

    ``packed`` is ``uint8 [k, m]`` (rows may be strided), ``scales`` fp32 ``[k, columns]``,
    ``out`` fp32 of ``8 * m`` elements; the pieces must cover it.
    """
    k, m = packed.shape
    lib = _kernels() if fast_path(out) and packed.device.type == "cpu" else None
    if lib is not None and packed.stride(-1) == 1 and out.dtype == torch.float32:
        scales = scales.to(torch.float32).contiguous()
        lib.ob_average_pieces(packed.data_ptr(), packed.stride(0), scales.data_ptr(),
                              scales.shape[1], k, pieces.data_ptr(), len(pieces),
                              out.data_ptr())  # fmt: skip
        return out
    signs = _torch_unpack_scaled(
        packed, _expand(scales.to(out.device), pieces[:, :2], pieces[:, 2])
    )
    flat = out.view(-1)
    flat.copy_(signs[0])
    for r in range(1, k):
        flat.add_(signs[r])
    return flat.div_(k).view_as(out) if k != 1 else out


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
    kernel does it in one pass; elsewhere it is those functions in turn, with the same bits.
    """
    lib = _kernels() if fast_path(store) and packed.device.type == "cpu" else None
    if lib is None or packed.stride(-1) != 1 or store.dtype != torch.float32:
        if last is not None:
            server_error_(store, last, bounds)
        z = average_signs_pieces_(packed, scales, pieces, torch.empty_like(store))
        signs, _ = compress_(z, store, scale)
        store.copy_(z)
        return signs, segment_scales(store, bounds, scale)
    k = packed.shape[0]
    scales = scales.to(torch.float32).contiguous()
    last = None if last is None else last.to(torch.float32).contiguous()
    signs = torch.empty(store.numel() // 8, dtype=torch.uint8)
    totals = torch.empty(len(pieces), dtype=torch.float64)
    if lib.ob_serve_store(packed.data_ptr(), packed.stride(0), scales.data_ptr(), scales.shape[1],
                          k, pieces.data_ptr(), len(pieces), store.data_ptr(),
                          0 if last is None else last.data_ptr(), signs.data_ptr(),
                          scale == "mean_abs", totals.data_ptr()):  # fmt: skip
        raise MemoryError("onebit's server kernel could not allocate its scale table")
    return signs, scales_from_totals(totals, bounds.diff().to(torch.float64), scale)


def server_error_(z: Tensor, last: Tensor, bounds: Tensor) -> Tensor:
    """The server error from the ``z`` that :func:`serve_pieces_` kept and its pieces' scales
    ``last``, in place: ``z - ±last`` per piece (``bounds``)."""
    return subtract_compressed_segments_(z, last, bounds, z)


def decompress_pieces_(packed: Tensor, scales: Tensor, pieces: Tensor, out: Tensor) -> Tensor:
    """:func:`decompress_` with a scale per piece: ``pieces`` rows are ``(j, start, end, c)``,
    and elements ``[start, end)`` of row ``j`` are ``scales[j, c] * sign``; ``out`` gets the
    first ``out.numel()`` elements of the concatenated rows. The pieces must cover them."""
    k, m = packed.shape
    numel = out.numel()
    lib = _kernels() if fast_path(out) and packed.device.type == "cpu" else None
    if lib is not None and packed.stride(-1) == 1 and out.dtype == torch.float32:
        scales = scales.to(torch.float32).contiguous()
        lib.ob_decompress_pieces(packed.data_ptr(), packed.stride(0), scales.data_ptr(),
                                 scales.shape[1], m, pieces.data_ptr(), len(pieces),
                                 out.data_ptr(), numel)  # fmt: skip
        return out
    offsets = pieces[:, 0:1] * 8 * m
    per_element = _expand(
        scales.reshape(1, -1).to(out.device),
        pieces[:, 1:3] + offsets,
        pieces[:, 0] * scales.shape[1] + pieces[:, 3],
        length=k * 8 * m,
    )
    flat = _torch_unpack_scaled(packed.reshape(1, -1) if packed.is_contiguous() else
                                packed.contiguous().reshape(1, -1), per_element)  # fmt: skip
    out.view(-1).copy_(flat.view(-1)[:numel])
    return out


def _expand(scales: Tensor, spans: Tensor, columns: Tensor, length: int | None = None) -> Tensor:
    """``[rows, length]`` fp32: ``scales[:, columns[p]]`` on the elements of span ``p``
    (``spans`` rows are ``[start, end)``), 0 elsewhere."""
    rows = scales.shape[0]
    length = int(spans[:, 1].max()) if length is None else length
    out = torch.zeros(rows, length, device=scales.device)
    for (a, b), c in zip(spans.tolist(), columns.tolist()):
        out[:, a:b] = scales[:, c : c + 1]
    return out


# numpy chunk kernels (CPU path).


def _partial_scale(y, scale: str) -> float:
    """Sum of squares (rms) or of absolute values (mean_abs) of one chunk, fp32 accumulation."""
    if scale == "rms":
        t = torch.from_numpy(y)
        return float(torch.dot(t, t))
    return float(np.abs(y).sum())


def _finish_scale(total: float, numel: int, scale: str) -> Tensor:
    if scale == "rms":
        value = math.sqrt(total) / math.sqrt(numel)
    else:
        value = total / numel
    return torch.tensor(value, dtype=torch.float32)


def _pack_chunk(y, out, mask) -> None:
    m = mask[: y.size]
    np.greater_equal(y, 0, out=m)
    out[:] = np.packbits(m, bitorder="little")


def _error_chunk(y, s_bits: int, out, scratch) -> None:
    """``out = y - (±s)``, the sign of ``s`` taken from ``y + 0.0`` (so ``-0.0`` counts as
    positive). Integer ops on the sign bit: about 3x cheaper than ``copysign`` or ``where``."""
    t = scratch[: y.size]
    np.add(y, np.float32(0), out=t)
    ti = t.view(np.int32)
    np.bitwise_and(ti, np.int32(_SIGN_BIT), out=ti)
    np.bitwise_or(ti, np.int32(s_bits), out=ti)
    np.subtract(y, t, out=out)


def _signed_table(s: float):
    """fp32 ``[256, 8]``: row ``b`` is ``±s`` by the bits of byte ``b`` (``s * -1`` where clear,
    which has the same bits as ``-1.0 * s``, as the torch formulation computes it)."""
    return (_sign_table() | np.int32(_f32_bits(s))).view(np.float32)


def _take_signed(table, packed, out) -> None:
    """``out = table[packed]`` flattened, for fp32 ``out`` of at most ``8 * len(packed)``."""
    whole = out.size // 8
    if whole:
        # mode="clip": indices are bytes, always in range, and "raise" buffers the output.
        np.take(table, packed[:whole], axis=0, out=out[: 8 * whole].reshape(whole, 8), mode="clip")
    if out.size % 8:
        out[8 * whole :] = table[packed[whole]][: out.size % 8]


# torch formulation (CUDA and everything the CPU path does not take).


def _torch_pack(mask: Tensor) -> Tensor:
    """Pack a bool tensor, 8 per byte, bit ``i`` = element ``8k + i``."""
    bits = mask.reshape(-1, 8).view(torch.uint8) * _weights(mask.device)
    return bits.sum(dim=1, dtype=torch.uint8)


def _torch_unpack_scaled(packed: Tensor, scales: Tensor) -> Tensor:
    """``[k, m]`` packed rows to ``[k, 8m]`` fp32 ``±scales[j]`` (``scales`` ``[k]``), or
    ``±scales[j, i]`` element by element (``scales`` ``[k, 8m]``)."""
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    bits = bits.reshape(packed.shape[0], -1).bool()
    scales = scales.to(torch.float32)
    scales = scales[:, None] if scales.dim() == 1 else scales
    return torch.where(bits, scales, scales * -1)
