"""The Triton kernels: the backend of CUDA tensors (and of CPU tensors under ``TRITON_INTERPRET=1``,
which is how a machine without a GPU tests them).

Each op is one or two launches over a whole buffer, whatever the number of tensors in it. The
buffer is cut into blocks of :data:`~.triton_common.BLOCK` elements, one program each, and its
segments (a tensor's part of a bucket, with a scale of its own) into *pieces*: a segment's part
of a block. The piece table (:class:`~.triton_common.Tiling`) is built once per segment layout
on the host and cached on the device, so per-tensor scales are read from it, never expanded per
element. Sums of squares (or of absolute values) are reduced per piece in fp32 inside the block,
then per segment in fp64 by a second launch that also turns them into scales: no atomics, so the
result is the same at every run.

Signs, packing, error updates and the server's average are bit for bit those of the torch
reference (no multiplication is fused into an addition; the average divides with IEEE rounding).
Each op takes contiguous fp32 buffers (signs: uint8 rows with a unit inner stride) on the
backend's device and falls back to :class:`~onebit.kernels.reference.TorchKernels` otherwise.

This module launches them; the kernels themselves are in :mod:`.triton_passes`. The passes over
the whole model are in :mod:`.triton_model` (their kernels in :mod:`.triton_model_passes`), the
quantized warmup's in :mod:`.triton_quantized`; what all of them share, in :mod:`.triton_common`.

Importing this module compiles nothing; :mod:`onebit.kernels` imports it only when the Triton
backend is first used, so that ``TRITON_INTERPRET`` may be set until then and a CPU install does
not need Triton.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

from .. import host
from .fused import DTYPES, BucketRuns, PackedMomentum
from .reference import QuantizedBucket, TorchKernels
from .triton_common import (
    BLOCK,
    Tiling,
    cached_tiling,
    lerp_coefficient,
    segments_to_scales,
)
from .triton_interpreter import cache_numpy_dtypes, skip_repatching
from .triton_model import ModelPasses
from .triton_passes import (
    decompress_kernel,
    momentum_pass,
    momentum_update_kernel,
    solo_pass,
    solo_scales,
    y_pass,
)
from .triton_quantized import BlockQuantizer

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether ``TRITON_INTERPRET=1`` was set when this module was imported (as ``triton.jit``
reads it): the kernels then run on CPU tensors, in numpy."""
if INTERPRETED:
    skip_repatching()
    cache_numpy_dtypes()


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
        return BlockQuantizer(buckets, block_size, bits, rank, device)

    def model_passes(self, geometry: object, device: torch.device) -> object | None:
        if not self.runs_on(device):
            return None
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
        """Launch :func:`y_pass` (see it) and, for ``sums``, :func:`segments_to_scales`; return the
        packed signs and the intervals' scales, as asked."""
        device = (x if x is not None else error if error is not None else rows).device
        any_ = x if x is not None else error if error is not None else out
        packed = torch.empty(n // 8, dtype=torch.uint8, device=device) if signs else None
        partials = torch.empty(len(tiling.starts), dtype=torch.float32, device=device)
        k = 1 if rows is None else rows.shape[0]
        y_pass[(tiling.blocks,)](
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
        """Each segment's scale from its pieces' sums (:func:`segments_to_scales`)."""
        result = torch.empty(tiling.count, dtype=torch.float32, device=partials.device)
        segments_to_scales[(tiling.count,)](
            partials, tiling.segment_first, tiling.lengths, result, CHUNK=1024,
            MEAN_ABS=scale == "mean_abs",
        )  # fmt: skip
        return result

    # SPEC 1 on whole buffers.

    def compute_scale(self, x: Tensor, scale: str) -> Tensor:
        n = x.numel()
        if not self._fits(x):
            return super().compute_scale(x, scale)
        tiling = cached_tiling(_whole(n), None, n, x.device)
        return self._pass(tiling, n, x=x, sums=scale)[1].reshape(())

    def pack_signs(self, x: Tensor) -> Tensor:
        n = x.numel()
        if not (self._fits(x) and n):
            return super().pack_signs(x)
        return self._pass(cached_tiling(_whole(n), None, n, x.device), n, x=x, signs=True)[0]

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
        tiling = cached_tiling(_whole(n), None, n, buffer.device)
        packed, s = self._pass(tiling, n, x=buffer, error=error, y_out=buffer, signs=True,
                               sums=scale)  # fmt: skip
        return packed, s.reshape(())

    def compress_input(
        self, x: Tensor, error: Tensor, scale: str, bounds: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        n = error.numel()
        if not (self._fits(x, error) and n):
            return super().compress_input(x, error, scale, bounds)
        tiling = cached_tiling(_whole(n) if bounds is None else bounds, None, n, error.device)
        packed, s = self._pass(tiling, n, x=x, error=error, signs=True, sums=scale)
        return packed, s.reshape(()) if bounds is None else s

    def commit_input_(
        self, x: Tensor, error: Tensor, scales: Tensor, bounds: Tensor | None
    ) -> Tensor:
        n = error.numel()
        if not (self._fits(x, error) and n):
            return super().commit_input_(x, error, scales, bounds)
        tiling = cached_tiling(_whole(n) if bounds is None else bounds, None, n, error.device)
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
        tiling = cached_tiling(_whole(n), None, n, device)  # a piece per block, one segment
        blocks = tiling.blocks
        partials = torch.empty(blocks, dtype=torch.float32, device=device)
        sums = torch.empty(2 * blocks, dtype=torch.float64, device=device)
        scales = torch.empty(2, dtype=torch.float32, device=device)

        def run(pass_: int) -> None:
            solo_pass[(blocks,)](x, x.numel(), error, server_error, partials, sums, scales, out,
                                  n, BLOCK=BLOCK, PASS=pass_, MEAN_ABS=mean_abs)  # fmt: skip
            if pass_ < 2:
                solo_scales[(1,)](partials, sums, tiling.segment_first, tiling.lengths, scales, n,
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
        tiling = cached_tiling(_whole(n), None, n, error.device)
        signs, sigma = self._pass(tiling, n, error=error, y_out=error, rows=packed,
                                  row_scales=row_scales, signs=True, sums=scale)  # fmt: skip
        self._pass(tiling, n, x=error, scales=sigma, out=error)
        return signs, sigma.reshape(())

    # Scales per segment.

    def segment_scales(self, y: Tensor, bounds: Tensor, scale: str) -> Tensor:
        n = y.numel()
        if not (self._fits(y) and n):
            return super().segment_scales(y, bounds, scale)
        return self._pass(cached_tiling(bounds, None, n, y.device), n, x=y, sums=scale)[1]

    def subtract_compressed_segments_(
        self, y: Tensor, scales: Tensor, bounds: Tensor, out: Tensor
    ) -> Tensor:
        n = y.numel()
        if not (self._fits(y, out) and n and out.numel() == n):
            return super().subtract_compressed_segments_(y, scales, bounds, out)
        scales = scales.to(device=y.device, dtype=torch.float32).reshape(-1)
        self._pass(cached_tiling(bounds, None, n, y.device), n, x=y, scales=scales, out=out)
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
        tiling = cached_tiling(edges, table[:, 3], n, out.device)
        row_scales = self._row_scales(scales, out.device)
        offset = row_scales.storage_offset()  # the storage's start is aligned
        whole = row_scales.as_strided((offset + row_scales.numel(),), (1,), 0)
        decompress_kernel[(tiling.blocks,)](
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
        momentum_update_kernel[(tables.tiling.blocks,)](
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
        momentum_pass[(tables.tiling.blocks,)](
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
        return cached_tiling(np.append(table[:, 0], table[-1, 1]), table[:, 2], numel, device)
