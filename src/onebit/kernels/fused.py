"""The fused passes of the packed momentum, run by the backends that have them (the C kernels on
the CPU, Triton on CUDA: ``packs_momentum``).

Unfused, a compression step makes about a dozen passes over model-sized buffers: gather the
gradients, the momentum update, add the error, the signs, the scales, the error update,
decompress into the momentum, the denominator, weight decay and the update. Fused, the worker
side of a bucket makes three, each reading the gradient straight from ``.grad``:

1. :func:`signs`: ``y = lerp(m, g, 1 - β1) + e``, packed into signs and per-tensor sums of squares
   (reads ``g`` and ``e``; no float is written);
2. :func:`commit`, once every rank's scales are known to be finite: ``e = y - ±s``, with ``y``
   computed again (reads ``g`` and ``e``, writes ``e``);
3. :func:`update`: ``p = p·(1 - lr·wd) + (-lr/bc1)·m / denominator``, with ``m = ±σ`` read from
   the packed result of the allreduce (reads ``p`` and the frozen denominator, writes ``p``).

The momentum ``m`` is read either from an fp32 buffer (the first compression step, after the
warmup) or from the signs and scales the previous step's allreduce returned (about ``d/8``
bytes): after a compression step every momentum element is ``±σ`` of its piece, so it needs no
fp32 copy. The results are bit for bit those of the unfused torch formulation
(``torch.lerp``, ``torch._foreach_mul_``, ``torch._foreach_addcdiv_`` and
:mod:`onebit.compress`), which ``tests/test_fused.py`` checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from .. import host
from .errors import fp32, written

if TYPE_CHECKING:
    from .interface import Kernels

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The parameter dtypes the passes update in place and read the gradients of, in that dtype:
loaded exactly, computed in fp32 and each stored result rounded to nearest, ties to even, as
torch's ops round a low-precision result."""


@dataclass
class PackedMomentum:
    """Momentum that is ``±scale`` per element: ``bits`` ``uint8 [rows, chunk // 8]`` (rows may
    be strided, as in a gathered message; bit ``i % 8`` of byte ``(i % chunk) // 8`` of row
    ``i // chunk`` is element ``i``'s sign) and ``scales`` fp32, indexed by the runs' columns;
    times a mask where ``masks`` (int64 per parameter: the address of its ``exp_avg_mask``, 0/1
    bytes in the flat buffers' order, 0 for none) has one (backends with
    ``packs_masked_momentum``)."""

    bits: Tensor
    scales: Tensor
    chunk: int
    masks: Tensor | None = None


class BucketRuns:
    """One bucket cut into runs: pieces of one parameter within one chunk, with one momentum scale.

    Args:
        segments: the sizes of the parameters' parts in the bucket, in order (as given to
            :class:`~onebit.wire.comm.CompressedAllreduce`), followed by the padding, if any.
        served: per chunk, its pieces as ``(start, end, segment)`` rows in chunk coordinates
            (``CompressedAllreduce``'s geometry).
        chunk: elements per chunk.
        columns: momentum scale columns per chunk (scales of chunk ``j`` start at
            ``j * columns``).
        params: the parameter index of each segment (``None`` for the padding).
        param_offsets: the element of each segment's parameter where the segment starts.
        per_chunk: one scale per chunk (no ``segments`` on the communicator): every run of
            chunk ``j`` has column ``j``.
    """

    def __init__(
        self,
        segments: list[int],
        served: list[Tensor],
        chunk: int,
        columns: int,
        params: list[int | None],
        param_offsets: list[int],
        per_chunk: bool = False,
    ) -> None:
        rows, run_params, run_offsets = [], [], []
        starts = [0]
        for size in segments:
            starts.append(starts[-1] + size)
        for j, pieces in enumerate(served):
            for i, (a, b, q) in enumerate(pieces.tolist()):
                start = j * chunk + a
                padding = params[q] is None
                column = j * columns + (0 if per_chunk else i)
                rows.append((start, j * chunk + b, q, -1 if padding else column))
                run_params.append(-1 if padding else params[q])
                run_offsets.append(0 if padding else param_offsets[q] + start - starts[q])
        self.runs = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
        self.run_params = torch.tensor(run_params, dtype=torch.int64)
        self.run_offsets = torch.tensor(run_offsets, dtype=torch.int64) * 4  # bytes, fp32
        self.lengths = torch.tensor(segments, dtype=torch.float64)
        self.device_tables: dict = {}  # copies of these tables on a device, by their users
        # numpy copies for the per-step lookups on the CPU (a few µs, against torch's tens)
        self._params = np.maximum(np.array(run_params, dtype=np.int64), 0)
        self._padding = np.array(run_params, dtype=np.int64) < 0
        self._offsets = self.run_offsets.numpy()

    def per_run(self, values: Tensor, padding: float = 1.0) -> Tensor:
        """Per-parameter ``values`` as fp32 per run on the CPU (``padding`` for the padding)."""
        values = values.detach().to(device="cpu", dtype=torch.float32).numpy()[self._params]
        return torch.from_numpy(np.where(self._padding, np.float32(padding), values))

    def columns_and_params(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The momentum scale column of each run that is not padding, and its parameter, on
        ``device`` (uploaded once)."""
        key = ("columns_and_params", device)
        if key not in self.device_tables:
            real = self.run_params >= 0
            self.device_tables[key] = tuple(
                host.upload(t, device) for t in (self.runs[real, 3], self.run_params[real])
            )
        return self.device_tables[key]

    def addresses(self, bases: Tensor, itemsize: int = 4) -> Tensor:
        """Per run, the address of its first element given each parameter's base address in
        ``bases`` (int64; 0 for a missing tensor, which stays 0) of ``itemsize``-byte elements
        (fp32; a mask's 1), on the CPU."""
        base = bases.cpu().numpy()[self._params]
        first = base + self._offsets // 4 * itemsize
        return torch.from_numpy(np.where(self._padding | (base == 0), 0, first))


@dataclass
class ModelGeometry:
    """Every bucket of a packed momentum step, for backends that run each pass over all buckets
    at once (``model_passes``). Bucket ``b`` is ``numels[b]`` elements (padded) from
    ``origins[b]`` of the flat buffers, cut into ``runs[b]``; its messages are part ``b`` of each
    phase's :class:`~onebit.wire.exchange.Exchange`.

    Attributes:
        runs: each bucket's :class:`BucketRuns`.
        origins, numels: where each bucket lies in the flat buffers.
        numel: the elements before the last bucket's padding.
        segment_counts: each bucket's segments, padding included (its worker scales).
        bounds: each bucket's segment boundaries, from 0 to its padded length.
        served: each bucket's pieces of the chunk this rank serves, ``(start, end, segment)``
            rows in chunk coordinates.
        server_columns: each bucket's scale columns per chunk (``server_scale_count``).
        parts1, width1: each bucket's byte offset in a phase-1 row, and the row's bytes.
        parts2, width2: the same in phase 2.
        world_size, header_numel: the group's size and the fp32 header values of each bucket.
    """

    runs: list[BucketRuns]
    origins: list[int]
    numels: list[int]
    numel: int
    segment_counts: list[int]
    bounds: list[Tensor]
    served: list[Tensor]
    server_columns: list[int]
    parts1: list[int]
    width1: int
    parts2: list[int]
    width2: int
    world_size: int
    header_numel: int


def _backend(out: Tensor) -> Kernels:
    from . import for_tensors  # the package imports this module: import it when called

    backend = for_tensors(out)
    if not backend.packs_momentum:
        raise ValueError(f"the {backend.name} kernels have no fused momentum passes")
    return backend


def signs(
    runs: BucketRuns,
    grads: Tensor,
    inv_scale: float | Tensor | None,
    momentum: Tensor | PackedMomentum,
    weight: float,
    error: Tensor | None,
    out: Tensor,
    scale: str = "rms",
    post: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Pass 1: pack the signs of ``y = lerp(m, g·inv_scale, weight)·post + error`` into ``out``
    (``uint8``, one bit per element of the bucket) and return each segment's scale (fp32).

    ``grads`` holds each parameter's gradient address (int64, on ``out``'s device; 0 is a zero
    gradient: :func:`gradient_addresses`), gradients of ``dtype`` (one of :data:`DTYPES`).
    ``inv_scale`` is a number, or on Triton a 0-dim fp32 tensor on the device (the inverse loss
    scale and clipping coefficient, never read).
    ``error`` ``None`` is an error of zeros; a bf16 one is read in place by backends whose
    ``error_dtypes`` have it (C), through an fp32 copy by the others. ``post``
    is fp32 per parameter (1-bit LAMB's momentum scaling; ``None``: no factor).
    """
    backend = _backend(out)
    return backend.momentum_signs(runs, grads, inv_scale, momentum, weight,
                                  fp32(error, backend.error_dtypes), out, scale, post,
                                  dtype)  # fmt: skip


def commit(
    runs: BucketRuns,
    grads: Tensor,
    inv_scale: float | Tensor | None,
    momentum: Tensor | PackedMomentum,
    weight: float,
    error: Tensor | None,
    scales: Tensor,
    out: Tensor,
    post: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Pass 2: ``out = y - (y >= 0 ? s : -s)`` per segment, with ``y`` as in :func:`signs` (same
    arguments) and ``scales`` its segment scales; ``out`` may be ``error`` or the fp32
    ``momentum`` itself, and bf16 (rounded to it, in place or through an fp32 copy, as
    :func:`signs` reads it)."""
    backend = _backend(out)
    with written(out, backend.error_dtypes) as staged:
        error = staged if error is out else fp32(error, backend.error_dtypes)
        backend.momentum_commit(runs, grads, inv_scale, momentum, weight, error, scales, staged,
                                post, dtype)  # fmt: skip


def update(
    runs: BucketRuns,
    params: Tensor,
    momentum: PackedMomentum,
    denominator: Tensor,
    decay: Tensor,
    value: Tensor,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Pass 3: per parameter ``i``, ``p = p·decay[i]`` (skipped where it is 1), then
    ``p = p + (value[i]·m) / denominator`` with ``m = ±σ`` from ``momentum``, each result
    rounded to the parameters' ``dtype`` (one of :data:`DTYPES`; on the CPU ``decay`` too, as
    ``torch._foreach_mul_`` rounds its factor there).

    ``params`` holds each parameter's address (int64, on ``denominator``'s device),
    ``denominator`` is the bucket's fp32 slice, ``decay`` and ``value`` are fp32 per parameter,
    on the same device.
    """
    _backend(denominator).momentum_update(runs, params, momentum, denominator, decay, value,
                                          dtype)  # fmt: skip


def laid_out(t: Tensor, strides: Sequence[int]) -> bool:
    """Whether ``t`` has ``strides`` in every dimension of more than one element (the others'
    strides address nothing)."""
    return all(s == want for n, s, want in zip(t.shape, t.stride(), strides) if n > 1)


def gradient_addresses(
    params: Sequence[Tensor], strides: Sequence[Sequence[int]]
) -> tuple[list[int], list[Tensor], bool]:
    """Each parameter's gradient as the address the fused passes read (upload them with a
    :class:`~onebit.host.Uploaded`): a ``.grad`` of the parameter's dtype and ``strides`` (its
    flat layout's, :attr:`~onebit.state.layout.FlatLayout.strides`) in place, any other through a
    copy with them (returned, to be kept alive while the passes run); 0 for no gradient or a
    sparse one (then also returns True)."""
    addresses, keep, sparse = [], [], False
    for p, stride in zip(params, strides):
        g = p.grad
        if g is None or g.is_sparse:
            sparse |= g is not None
            addresses.append(0)
            continue
        if g.dtype != p.dtype or g.device != p.device or not laid_out(g, stride):
            g = torch.empty_strided(p.shape, stride, dtype=p.dtype, device=p.device).copy_(g)
            keep.append(g)
        addresses.append(g.data_ptr())
    return addresses, keep, sparse
