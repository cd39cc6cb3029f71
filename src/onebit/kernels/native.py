"""The C kernels (``_kernels.c``, AVX2, built at install and loaded by :mod:`onebit._native`)
as a backend: each pass over a buffer is one fused loop at about memory speed, with scales per
tensor from segment tables. They also run the fused passes of the packed momentum
(:mod:`onebit.kernels.fused`).

Each op takes contiguous fp32 tensors on the CPU and falls back to the numpy chunks (then the
torch reference) for anything else. Signs, packing and error updates are bit for bit the
reference's; scales differ only by their reduction order (fp32 partial sums of 4096 elements,
added in fp64).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _native
from .errors import ERROR_DTYPES, written
from .fused import DTYPES, BucketRuns, PackedMomentum
from .numpy_chunks import NumpyKernels, finish_scale, np, suits
from .reference import scales_from_totals


def _fp32(*tensors: Tensor) -> bool:
    return suits(*tensors) and all(t.dtype == torch.float32 for t in tensors)


class CKernels(NumpyKernels):
    """:class:`NumpyKernels` with every op the C kernels have in C."""

    name = "c"
    packs_momentum = True
    packs_masked_momentum = True
    error_dtypes = ERROR_DTYPES

    def unavailable(self) -> str | None:
        if np is None:
            return "numpy is not installed"
        if _native.load() is None:
            return f"the C kernels are not loaded ({_native.unavailable})"
        return None

    def reads_input(self, *tensors: Tensor) -> bool:
        return _fp32(*tensors)

    # The packed momentum's fused passes (:mod:`onebit.kernels.fused`).

    def momentum_signs(
        self, runs: BucketRuns, grads: Tensor, inv_scale: float | None,
        momentum: Tensor | PackedMomentum, weight: float, error: Tensor | None, out: Tensor,
        scale: str, post: Tensor | None, dtype: torch.dtype = torch.float32,
    ) -> Tensor:  # fmt: skip
        totals = torch.empty(len(runs.lengths), dtype=torch.float64)
        post = None if post is None else runs.per_run(post)
        addresses = runs.addresses(grads, dtype.itemsize)  # kept alive while the kernel reads it
        y, _ = _y_arguments(runs, addresses, inv_scale, momentum, weight, post, error)
        _native.load().ob_fused_signs(*y, out.data_ptr(), scale == "mean_abs", totals.data_ptr(),
                                      len(totals), DTYPES.index(dtype), _code(error))  # fmt: skip
        return scales_from_totals(totals, runs.lengths, scale)

    def momentum_commit(
        self, runs: BucketRuns, grads: Tensor, inv_scale: float | None,
        momentum: Tensor | PackedMomentum, weight: float, error: Tensor | None, scales: Tensor,
        out: Tensor, post: Tensor | None, dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        scales = scales.to(torch.float32).contiguous()
        post = None if post is None else runs.per_run(post)
        addresses = runs.addresses(grads, dtype.itemsize)  # kept alive while the kernel reads it
        y, _ = _y_arguments(runs, addresses, inv_scale, momentum, weight, post, error)
        _native.load().ob_fused_commit(*y, scales.data_ptr(), out.data_ptr(), DTYPES.index(dtype),
                                       _code(error), _code(out))  # fmt: skip

    def momentum_update(
        self, runs: BucketRuns, params: Tensor, momentum: PackedMomentum, denominator: Tensor,
        decay: Tensor, value: Tensor, dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        decay = decay.to(dtype).float()  # torch's _foreach_mul_ on the CPU rounds it so
        decay, value = runs.per_run(decay), runs.per_run(value, padding=0.0)
        addresses = runs.addresses(params, dtype.itemsize)
        where, _ = _momentum(momentum, runs)
        _native.load().ob_fused_update(
            runs.runs.data_ptr(), len(runs.runs), addresses.data_ptr(), *where[1:],
            denominator.data_ptr(), decay.data_ptr(), value.data_ptr(), DTYPES.index(dtype),
        )  # fmt: skip

    def subtract_compressed_(
        self, y: Tensor, s: Tensor, out: Tensor, signs: Tensor | None = None
    ) -> Tensor:
        if not _fp32(y, out) or y.shape != out.shape:
            return super().subtract_compressed_(y, s, out, signs)
        _native.load().ob_commit(y.data_ptr(), float(s), out.data_ptr(), y.numel())
        return out

    def compress_(self, buffer: Tensor, error: Tensor, scale: str) -> tuple[Tensor, Tensor]:
        numel = buffer.numel()
        if not _fp32(buffer, error) or numel == 0:
            return super().compress_(buffer, error, scale)
        packed = torch.empty(numel // 8, dtype=torch.uint8)
        args = (buffer.data_ptr(), error.data_ptr(), packed.data_ptr(), numel)
        total = _native.load().ob_compress(*args, scale == "mean_abs")
        return packed, finish_scale(total, numel, scale)

    def compress_input(
        self, x: Tensor, error: Tensor, scale: str, bounds: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        n = error.numel()
        if not (n and _fp32(x, error)):
            return super().compress_input(x, error, scale, bounds)
        lib, signs = _native.load(), torch.empty(n // 8, dtype=torch.uint8)
        args = (x.data_ptr(), x.numel(), error.data_ptr())
        if bounds is None:
            total = lib.ob_add_signs(*args, signs.data_ptr(), n, scale == "mean_abs")
            return signs, finish_scale(total, n, scale)
        lengths = bounds.diff().to(torch.float64)
        totals = torch.empty(len(lengths), dtype=torch.float64)
        lib.ob_add_signs_segments(*args, bounds.data_ptr(), len(lengths), signs.data_ptr(),
                                  scale == "mean_abs", totals.data_ptr())  # fmt: skip
        return signs, scales_from_totals(totals, lengths, scale)

    def commit_input_(
        self, x: Tensor, error: Tensor, scales: Tensor, bounds: Tensor | None
    ) -> Tensor:
        n = error.numel()
        if not (n and _fp32(x, error)):
            return super().commit_input_(x, error, scales, bounds)
        if bounds is None:
            bounds = torch.tensor([0, n], dtype=torch.int64)
        scales = scales.to(torch.float32).reshape(-1).contiguous()
        lib = _native.load()
        lib.ob_add_commit(x.data_ptr(), x.numel(), error.data_ptr(), scales.data_ptr(),
                          bounds.data_ptr(), len(bounds) - 1, error.data_ptr())  # fmt: skip
        return error

    def allreduce_one_(
        self, x: Tensor, error: Tensor, server_error: Tensor, out: Tensor, scale: str
    ) -> bool:
        n = error.numel()
        if not (n and _fp32(x, error, server_error, out) and server_error.numel() == n):
            return super().allreduce_one_(x, error, server_error, out, scale)
        signs, s = self.compress_input(x, error, scale, None)
        if not bool(torch.isfinite(s)):
            return False
        lib, z_signs = _native.load(), torch.empty(n // 8, dtype=torch.uint8)
        total = lib.ob_solo_commit_signs(x.data_ptr(), x.numel(), error.data_ptr(), float(s),
                                         server_error.data_ptr(), z_signs.data_ptr(), n,
                                         scale == "mean_abs")  # fmt: skip
        sigma = float(finish_scale(total, n, scale))
        lib.ob_solo_serve_commit(signs.data_ptr(), float(s), server_error.data_ptr(), sigma,
                                 out.data_ptr(), out.numel(), n)  # fmt: skip
        return True

    def decompress_(self, packed: Tensor, scales: Tensor, out: Tensor) -> Tensor:
        if not (_fp32(out) and packed.stride(-1) == 1):
            return super().decompress_(packed, scales, out)
        k, m = packed.shape
        scales = scales.to(torch.float32).contiguous()
        args = (packed.data_ptr(), packed.stride(0), scales.data_ptr(), k, m, out.data_ptr())
        _native.load().ob_decompress(*args, out.numel())
        return out

    def average_signs_(self, packed: Tensor, scales: Tensor, out: Tensor) -> Tensor:
        if not (_fp32(out) and packed.stride(-1) == 1):
            return super().average_signs_(packed, scales, out)
        k, m = packed.shape
        scales = scales.to(torch.float32).contiguous()
        _native.load().ob_average(packed.data_ptr(), packed.stride(0), scales.data_ptr(), k, m,
                                  out.data_ptr())  # fmt: skip
        return out

    def serve_chunk_(
        self, packed: Tensor, scales: Tensor, error: Tensor, scale: str, z: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        k, m = packed.shape
        if not (m and _fp32(error) and packed.stride(-1) == 1):
            return super().serve_chunk_(packed, scales, error, scale, z)
        lib = _native.load()
        scales = scales.to(torch.float32).contiguous()
        signs, total = torch.empty(m, dtype=torch.uint8), torch.empty(1, dtype=torch.float64)
        rows = (packed.data_ptr(), packed.stride(0), scales.data_ptr())
        failed = lib.ob_serve_chunk_signs(*rows, k, error.data_ptr(), signs.data_ptr(), 8 * m,
                                          scale == "mean_abs", total.data_ptr())  # fmt: skip
        sigma = finish_scale(float(total), 8 * m, scale)
        piece = torch.tensor([0, 8 * m, 0], dtype=torch.int64)
        if failed or lib.ob_serve_commit(*rows, 1, k, piece.data_ptr(), 1, sigma.data_ptr(),
                                         error.data_ptr()):  # fmt: skip
            raise MemoryError("onebit's server kernel could not allocate its scale table")
        return signs, sigma

    def segment_scales(self, y: Tensor, bounds: Tensor, scale: str) -> Tensor:
        if not _fp32(y):
            return super().segment_scales(y, bounds, scale)
        lengths = bounds.diff().to(torch.float64)
        totals = torch.empty(len(lengths), dtype=torch.float64)
        _native.load().ob_sums(y.data_ptr(), bounds.data_ptr(), len(lengths),
                               scale == "mean_abs", totals.data_ptr())  # fmt: skip
        return scales_from_totals(totals, lengths, scale)

    def subtract_compressed_segments_(
        self, y: Tensor, scales: Tensor, bounds: Tensor, out: Tensor
    ) -> Tensor:
        if not _fp32(y, out):
            return super().subtract_compressed_segments_(y, scales, bounds, out)
        scales = scales.to(torch.float32).contiguous()
        _native.load().ob_commit_segments(y.data_ptr(), scales.data_ptr(), bounds.data_ptr(),
                                          len(bounds) - 1, out.data_ptr())  # fmt: skip
        return out

    def average_signs_pieces_(
        self, packed: Tensor, scales: Tensor, pieces: Tensor, out: Tensor
    ) -> Tensor:
        if not (_fp32(out) and packed.stride(-1) == 1):
            return super().average_signs_pieces_(packed, scales, pieces, out)
        k = packed.shape[0]
        scales = scales.to(torch.float32).contiguous()
        _native.load().ob_average_pieces(packed.data_ptr(), packed.stride(0), scales.data_ptr(),
                                         scales.shape[1], k, pieces.data_ptr(), len(pieces),
                                         out.data_ptr())  # fmt: skip
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
        if not (store.is_contiguous() and store.dtype in ERROR_DTYPES and packed.stride(-1) == 1):
            with written(store) as staged:
                return super().serve_pieces_(packed, scales, pieces, bounds, staged, last, scale)
        k = packed.shape[0]
        scales = scales.to(torch.float32).contiguous()
        last = None if last is None else last.to(torch.float32).contiguous()
        signs = torch.empty(store.numel() // 8, dtype=torch.uint8)
        totals = torch.empty(len(pieces), dtype=torch.float64)
        lib = _native.load()
        if lib.ob_serve_store(packed.data_ptr(), packed.stride(0), scales.data_ptr(),
                              scales.shape[1], k, pieces.data_ptr(), len(pieces),
                              store.data_ptr(), 0 if last is None else last.data_ptr(),
                              signs.data_ptr(), scale == "mean_abs", totals.data_ptr(),
                              _code(store)):  # fmt: skip
            raise MemoryError("onebit's server kernel could not allocate its scale table")
        return signs, scales_from_totals(totals, bounds.diff().to(torch.float64), scale)

    def decompress_pieces_(
        self, packed: Tensor, scales: Tensor, pieces: Tensor, out: Tensor
    ) -> Tensor:
        if not (_fp32(out) and packed.stride(-1) == 1):
            return super().decompress_pieces_(packed, scales, pieces, out)
        m = packed.shape[1]
        scales = scales.to(torch.float32).contiguous()
        _native.load().ob_decompress_pieces(packed.data_ptr(), packed.stride(0),
                                            scales.data_ptr(), scales.shape[1], m,
                                            pieces.data_ptr(), len(pieces), out.data_ptr(),
                                            out.numel())  # fmt: skip
        return out


def _code(error: Tensor | None) -> int:
    """The C kernels' code of an error buffer's dtype (``None``: no buffer, read as zeros)."""
    return 0 if error is None else DTYPES.index(error.dtype)


def _momentum(m: Tensor | PackedMomentum, runs: BucketRuns) -> tuple[tuple, Tensor | None]:
    """The C arguments that say where the momentum is, and the per-run mask addresses they
    point into (to be kept alive while the kernel runs)."""
    if not isinstance(m, PackedMomentum):
        return (m.data_ptr(), 0, 0, 1, 0, 0), None
    masks = None if m.masks is None else runs.addresses(m.masks, itemsize=1)
    pointer = 0 if masks is None else masks.data_ptr()
    return (0, m.bits.data_ptr(), m.bits.stride(0), m.chunk, m.scales.data_ptr(), pointer), masks


def _y_arguments(
    runs: BucketRuns,
    grads: Tensor,
    inv_scale: float | None,
    momentum: Tensor | PackedMomentum,
    weight: float,
    post: Tensor | None,
    error: Tensor | None,
) -> tuple[tuple, Tensor | None]:
    """The C arguments that say how ``y`` is computed, shared by passes 1 and 2, and what they
    point into that must be kept alive while the kernel runs (:func:`_momentum`)."""
    inv = 1.0 if inv_scale is None else inv_scale
    where, keep = _momentum(momentum, runs)
    return (
        runs.runs.data_ptr(), len(runs.runs), grads.data_ptr(), inv, inv_scale is not None,
        *where, weight, 0 if post is None else post.data_ptr(),
        0 if error is None else error.data_ptr(),
    ), keep  # fmt: skip
