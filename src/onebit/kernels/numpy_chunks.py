"""The CPU kernels in numpy, for a CPU without the C kernels (an install without a compiler, not
x86-64, ``ONEBIT_NATIVE=0``): the same bits as the torch reference, in cache-sized chunks of
:data:`CHUNK` elements (zero-copy views, ``np.packbits``), about 3-4x a copy for large buffers.

Only the single-scale ops have a numpy form; the others are :class:`TorchKernels`'.
Each op takes contiguous fp32 (signs: uint8) tensors and falls back for anything else.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .reference import TorchKernels

try:  # numpy is optional: without it the CPU takes the torch reference.
    import numpy as np
except ImportError:  # pragma: no cover - torch wheels normally come with numpy
    np = None

CHUNK = 1 << 16
"""Elements per chunk: 256 KiB of fp32, so a chunk and its scratch stay in L2."""

_SIGN_BIT = -(1 << 31)
_SIGN_TABLE = None  # numpy int32 [256, 8]: 0 where bit i of the byte is set, else the sign bit


def suits(*tensors: Tensor) -> bool:
    """Whether the CPU kernels take these tensors: contiguous fp32, or uint8 signs."""
    return all(t.is_contiguous() and t.dtype in (torch.float32, torch.uint8) for t in tensors)


def finish_scale(total: float, numel: int, scale: str) -> Tensor:
    """The fp32 scale from the sum of squares (``"rms"``) or of absolute values."""
    value = math.sqrt(total) / math.sqrt(numel) if scale == "rms" else total / numel
    return torch.tensor(value, dtype=torch.float32)


class NumpyKernels(TorchKernels):
    """:class:`TorchKernels` with the single-scale ops in numpy chunks."""

    name = "numpy"
    tile_numel = 1 << 16

    def unavailable(self) -> str | None:
        return "numpy is not installed" if np is None else None

    def runs_on(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def compute_scale(self, x: Tensor, scale: str) -> Tensor:
        if not (x.dtype == torch.float32 and suits(x)):
            return super().compute_scale(x, scale)
        flat = _np(x).reshape(-1)
        total = sum(_partial_scale(flat[i : i + CHUNK], scale) for i in range(0, flat.size, CHUNK))
        return finish_scale(total, flat.size, scale)

    def pack_signs(self, x: Tensor) -> Tensor:
        if not (x.dtype == torch.float32 and suits(x)):
            return super().pack_signs(x)
        out = torch.empty(x.numel() // 8, dtype=torch.uint8)
        flat, packed = _np(x).reshape(-1), _np(out)
        mask = np.empty(min(CHUNK, flat.size), dtype=bool)
        for i in range(0, flat.size, CHUNK):
            _pack_chunk(flat[i : i + CHUNK], packed[i // 8 : (i + CHUNK) // 8], mask)
        return out

    def unpack_signs(self, packed: Tensor) -> Tensor:
        if not (packed.dtype == torch.uint8 and suits(packed)):
            return super().unpack_signs(packed)
        bits = torch.from_numpy(np.unpackbits(_np(packed), axis=-1, bitorder="little"))
        return bits.to(torch.float32).mul_(2).sub_(1)

    def subtract_compressed_(
        self, y: Tensor, s: Tensor, out: Tensor, signs: Tensor | None = None
    ) -> Tensor:
        if not _fp32(y, out) or y.shape != out.shape:
            return super().subtract_compressed_(y, s, out, signs)
        src, dst = _np(y).reshape(-1), _np(out).reshape(-1)
        scratch = np.empty(min(CHUNK, src.size), dtype=np.float32)
        if signs is not None and suits(signs) and signs.numel() * 8 == src.size:
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

    def compress_(self, buffer: Tensor, error: Tensor, scale: str) -> tuple[Tensor, Tensor]:
        numel = buffer.numel()
        if not _fp32(buffer, error):
            return super().compress_(buffer, error, scale)
        packed = torch.empty(numel // 8, dtype=torch.uint8)
        if numel == 0:
            return packed, torch.zeros(())
        b, e, p = _np(buffer), _np(error), _np(packed)
        mask = np.empty(min(CHUNK, numel), dtype=bool)
        total = 0.0
        with np.errstate(all="ignore"):
            for i in range(0, numel, CHUNK):
                y = b[i : i + CHUNK]
                np.add(y, e[i : i + CHUNK], out=y)
                total += _partial_scale(y, scale)
                _pack_chunk(y, p[i // 8 : (i + CHUNK) // 8], mask)
        return packed, finish_scale(total, numel, scale)

    def decompress_(self, packed: Tensor, scales: Tensor, out: Tensor) -> Tensor:
        if not (_fp32(out) and packed.dtype == torch.uint8):
            return super().decompress_(packed, scales, out)
        m, numel = packed.shape[1], out.numel()
        p, dst = _np(packed), _np(out).reshape(-1)
        for j, s in enumerate(scales.tolist()):
            start = 8 * m * j
            if start >= numel:
                break
            _take_signed(_signed_table(s), p[j], dst[start : min(start + 8 * m, numel)])
        return out

    def average_signs_(self, packed: Tensor, scales: Tensor, out: Tensor) -> Tensor:
        if not (_fp32(out) and packed.dtype == torch.uint8):
            return super().average_signs_(packed, scales, out)
        k = packed.shape[0]
        p, dst = _np(packed), _np(out).reshape(-1)
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

    # The reference's: built on the ops above, or with no numpy form.
    reads_input = TorchKernels.reads_input
    compress_input = TorchKernels.compress_input
    commit_input_ = TorchKernels.commit_input_
    allreduce_one_ = TorchKernels.allreduce_one_
    serve_chunk_ = TorchKernels.serve_chunk_
    segment_scales = TorchKernels.segment_scales
    subtract_compressed_segments_ = TorchKernels.subtract_compressed_segments_
    average_signs_pieces_ = TorchKernels.average_signs_pieces_
    serve_pieces_ = TorchKernels.serve_pieces_
    decompress_pieces_ = TorchKernels.decompress_pieces_


def _fp32(*tensors: Tensor) -> bool:
    return suits(*tensors) and all(t.dtype == torch.float32 for t in tensors)


def _np(t: Tensor) -> np.ndarray:
    """Zero-copy numpy view of a CPU tensor (autograd detached)."""
    return t.detach().numpy()


def _f32_bits(s: float) -> int:
    """The int32 bit pattern of the fp32 value ``s``."""
    return int(np.array(s, dtype=np.float32).view(np.int32))


def _sign_table() -> np.ndarray:
    global _SIGN_TABLE
    if _SIGN_TABLE is None:
        bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
        _SIGN_TABLE = np.where(bits == 1, 0, _SIGN_BIT).astype(np.int32)
    return _SIGN_TABLE


def _partial_scale(y: np.ndarray, scale: str) -> float:
    """Sum of squares (rms) or of absolute values (mean_abs) of one chunk, fp32 accumulation."""
    if scale == "rms":
        t = torch.from_numpy(y)
        return float(torch.dot(t, t))
    return float(np.abs(y).sum())


def _pack_chunk(y: np.ndarray, out: np.ndarray, mask: np.ndarray) -> None:
    m = mask[: y.size]
    np.greater_equal(y, 0, out=m)
    out[:] = np.packbits(m, bitorder="little")


def _error_chunk(y: np.ndarray, s_bits: int, out: np.ndarray, scratch: np.ndarray) -> None:
    """``out = y - (±s)``, the sign of ``s`` taken from ``y + 0.0`` (so ``-0.0`` counts as
    positive). Integer ops on the sign bit: about 3x cheaper than ``copysign`` or ``where``."""
    t = scratch[: y.size]
    np.add(y, np.float32(0), out=t)
    ti = t.view(np.int32)
    np.bitwise_and(ti, np.int32(_SIGN_BIT), out=ti)
    np.bitwise_or(ti, np.int32(s_bits), out=ti)
    np.subtract(y, t, out=out)


def _signed_table(s: float) -> np.ndarray:
    """fp32 ``[256, 8]``: row ``b`` is ``±s`` by the bits of byte ``b`` (``s * -1`` where clear,
    which has the same bits as ``-1.0 * s``, as the torch formulation computes it)."""
    return (_sign_table() | np.int32(_f32_bits(s))).view(np.float32)


def _take_signed(table: np.ndarray, packed: np.ndarray, out: np.ndarray) -> None:
    """``out = table[packed]`` flattened, for fp32 ``out`` of at most ``8 * len(packed)``."""
    whole = out.size // 8
    if whole:
        # mode="clip": indices are bytes, always in range, and "raise" buffers the output.
        np.take(table, packed[:whole], axis=0, out=out[: 8 * whole].reshape(whole, 8), mode="clip")
    if out.size % 8:
        out[8 * whole :] = table[packed[whole]][: out.size % 8]
