"""The torch formulation of every kernel: the reference the other backends must match, and the
backend of every device that has no faster one (CUDA until the Triton kernels, MPS, XPU).

Each op is a few whole-tensor torch ops, the straightforward formulation of SPEC sections 1 and
2 with as few passes as it allows. A faster backend subclasses :class:`TorchKernels`, overrides
the ops it does better (falling back to these through ``super()`` for tensors it cannot take),
and names those it takes as they are (:mod:`onebit.kernels.interface`). Ops work on whole
buffers; scales per tensor come from segment tables (``bounds``, ``pieces``: int64 CPU tensors,
see :mod:`onebit.compress`), so a backend that runs one kernel per bucket fits the same
signatures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import host

_SHIFTS: dict[torch.device, Tensor] = {}
_WEIGHTS: dict[torch.device, Tensor] = {}


def _shifts(device: torch.device) -> Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return shifts


def _weights(device: torch.device) -> Tensor:
    weights = _WEIGHTS.get(device)
    if weights is None:
        weights = _WEIGHTS[device] = host.upload([1 << i for i in range(8)], device, torch.uint8)
    return weights


def scales_from_totals(totals: Tensor, lengths: Tensor, scale: str = "rms") -> Tensor:
    """Segment scales (fp32) from their fp64 sums of squares (``"rms"``) or of absolute values
    (``"mean_abs"``) and their lengths; an empty segment has scale 0."""
    value = totals.sqrt() / lengths.sqrt() if scale == "rms" else totals / lengths
    return torch.where(lengths > 0, value, 0.0).float()


def padded(x: Tensor, numel: int) -> Tensor:
    """``x`` flattened and followed by zeros up to ``numel`` elements, fp32, in a new buffer."""
    y = torch.zeros(numel, dtype=torch.float32, device=x.device)
    y[: x.numel()] = x.reshape(-1)
    return y


@dataclass(frozen=True)
class QuantizedBucket:
    """One :class:`~onebit.wire.quantized.QuantizedAllreduce`'s layout, as a backend's kernels for
    it (``block_quantizer``) take it.

    Attributes:
        chunk_pieces: per chunk (one per rank), the sizes of its pieces in order: a tensor's
            part of the chunk, the padding a piece of its own.
        chunk_numel, numel: elements per chunk, and before the padding.
        payload: bytes of a chunk's values in a message row; ``scale_count`` fp32 block scales
            follow them, then (phase 1) the largest ``max |y|`` and ``header_numel`` values.
        scale_count, header_numel: see ``payload``.
        origin: where its buffer starts among buckets laid end to end.
        part1, part2: its byte offset in a row of the phase-1 and the phase-2 message.
    """

    chunk_pieces: tuple[tuple[int, ...], ...]
    chunk_numel: int
    numel: int
    payload: int
    scale_count: int
    header_numel: int
    origin: int = 0
    part1: int = 0
    part2: int = 0


class TorchKernels:
    """:class:`~onebit.kernels.interface.Kernels` with torch ops, on any device (the attributes
    are described there).

    The argument conventions of each op are those of the function of the same name in
    :mod:`onebit.compress`, which checks the arguments and picks the backend.
    """

    name = "torch"
    packs_momentum = False
    packs_masked_momentum = False
    error_dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    tile_numel = 1 << 20

    def unavailable(self) -> str | None:
        """Why this backend cannot run on this machine, or ``None`` if it can."""
        return None

    def block_quantizer(
        self,
        buckets: list[QuantizedBucket],
        block_size: int,
        bits: str,
        rank: int,
        device: torch.device,
    ) -> object | None:
        """The kernels of the phases of one or more
        :class:`~onebit.wire.quantized.QuantizedAllreduce` laid end to end, or ``None`` where each
        runs its own torch tiles (see :class:`~onebit.kernels.triton_quantized.BlockQuantizer`
        for the arguments)."""
        return None

    def runs_on(self, device: torch.device) -> bool:
        """Whether it takes tensors on ``device``."""
        return True

    def model_passes(self, geometry: object, device: torch.device) -> object | None:
        """The packed momentum's passes over every bucket at once, for a
        :class:`~onebit.kernels.fused.ModelGeometry` on ``device`` (see
        :class:`~onebit.kernels.triton_model.ModelPasses`), or ``None`` where the backend runs
        them a bucket at a time (:mod:`onebit.kernels.fused`)."""
        return None

    def reads_input(self, *tensors: Tensor) -> bool:
        """Whether :meth:`compress_input` and :meth:`commit_input_` read these tensors where they
        are, never storing ``y``; here they store it in a temporary."""
        return False

    # SPEC 1: one buffer, one scale.

    def compute_scale(self, x: Tensor, scale: str) -> Tensor:
        if scale == "rms":
            return torch.linalg.vector_norm(x, dtype=torch.float32) / math.sqrt(x.numel())
        return torch.linalg.vector_norm(x, 1, dtype=torch.float32) / x.numel()

    def pack_signs(self, x: Tensor) -> Tensor:
        bits = (x >= 0).reshape(-1, 8).view(torch.uint8) * _weights(x.device)
        return bits.sum(dim=1, dtype=torch.uint8)

    def unpack_signs(self, packed: Tensor) -> Tensor:
        bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
        shape = (*packed.shape[:-1], packed.shape[-1] * 8)
        return bits.reshape(shape).to(torch.float32).mul_(2).sub_(1)

    def subtract_compressed_(
        self, y: Tensor, s: Tensor, out: Tensor, signs: Tensor | None = None
    ) -> Tensor:
        # y - (±s): the same rounding as torch.where(y >= 0, y - s, y + s), in two passes fewer.
        s = s.to(device=y.device, dtype=torch.float32)
        return torch.sub(y, torch.where(y >= 0, s, s * -1), out=out)

    def compress_(self, buffer: Tensor, error: Tensor, scale: str) -> tuple[Tensor, Tensor]:
        y = buffer.add_(error)
        if y.numel() == 0:
            return torch.empty(0, dtype=torch.uint8, device=y.device), torch.zeros(())
        return self.pack_signs(y), self.compute_scale(y, scale)

    # The public call's passes over an unpadded input.

    def compress_input(
        self, x: Tensor, error: Tensor, scale: str, bounds: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        y = padded(x, error.numel())
        signs, s = self.compress_(y, error, scale)
        return signs, s if bounds is None else self.segment_scales(y, bounds, scale)

    def commit_input_(
        self, x: Tensor, error: Tensor, scales: Tensor, bounds: Tensor | None
    ) -> Tensor:
        y = padded(x, error.numel()).add_(error)
        if bounds is None:
            return self.subtract_compressed_(y, scales, out=error)
        return self.subtract_compressed_segments_(y, scales, bounds, error)

    def allreduce_one_(
        self, x: Tensor, error: Tensor, server_error: Tensor, out: Tensor, scale: str
    ) -> bool:
        signs, s = self.compress_input(x, error, scale, None)
        if not host.read(torch.isfinite(s)):
            return False
        self.commit_input_(x, error, s, None)
        packed, sigma = self.serve_chunk_(
            signs.view(1, -1), s.reshape(1), server_error, scale, None
        )
        self.decompress_(packed.view(1, -1), sigma.reshape(1), out)
        return True

    # SPEC 2: the server and the result, one scale per row.

    def decompress_(self, packed: Tensor, scales: Tensor, out: Tensor) -> Tensor:
        flat = _unpack_scaled(packed, scales.to(out.device)).view(-1)[: out.numel()]
        out.view(-1).copy_(flat)
        return out

    def average_signs_(self, packed: Tensor, scales: Tensor, out: Tensor) -> Tensor:
        return _sum_rows(_unpack_scaled(packed, scales.to(out.device)), out)

    def serve_chunk_(
        self, packed: Tensor, scales: Tensor, error: Tensor, scale: str, z: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        z = torch.empty_like(error) if z is None else z
        signs, sigma = self.compress_(self.average_signs_(packed, scales, out=z), error, scale)
        self.subtract_compressed_(z, sigma, out=error, signs=signs)
        return signs, sigma

    # Scales per segment: the single-scale formulas with the scales expanded per element.

    def segment_scales(self, y: Tensor, bounds: Tensor, scale: str) -> Tensor:
        lengths = bounds.diff().to(torch.float64)
        edges = bounds.tolist()
        views = [y[a:b] for a, b in zip(edges[:-1], edges[1:])]
        norms = torch._foreach_norm(views, 2 if scale == "rms" else 1) if views else []
        totals = host.read(torch.stack(norms)).double() if norms else lengths.clone()
        totals = totals.square() if scale == "rms" else totals
        return host.upload(scales_from_totals(totals, lengths, scale), y.device)

    def subtract_compressed_segments_(
        self, y: Tensor, scales: Tensor, bounds: Tensor, out: Tensor
    ) -> Tensor:
        lengths = host.upload(bounds.diff(), y.device)
        s = torch.repeat_interleave(scales.to(y.device), lengths, output_size=y.numel())
        return torch.sub(y, torch.where(y >= 0, s, s * -1), out=out)

    def average_signs_pieces_(
        self, packed: Tensor, scales: Tensor, pieces: Tensor, out: Tensor
    ) -> Tensor:
        per_element = _expand(scales.to(out.device), pieces[:, :2], pieces[:, 2])
        return _sum_rows(_unpack_scaled(packed, per_element), out)

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
        if last is not None:
            self.subtract_compressed_segments_(store, last, bounds, store)
        z = self.average_signs_pieces_(packed, scales, pieces, torch.empty_like(store))
        signs, _ = self.compress_(z, store, scale)
        store.copy_(z)
        return signs, self.segment_scales(store, bounds, scale)

    def decompress_pieces_(
        self, packed: Tensor, scales: Tensor, pieces: Tensor, out: Tensor
    ) -> Tensor:
        k, m = packed.shape
        offsets = pieces[:, 0:1] * 8 * m
        per_element = _expand(
            scales.reshape(1, -1).to(out.device),
            pieces[:, 1:3] + offsets,
            pieces[:, 0] * scales.shape[1] + pieces[:, 3],
            length=k * 8 * m,
        )
        flat = _unpack_scaled(packed.contiguous().reshape(1, -1), per_element)
        out.view(-1).copy_(flat.view(-1)[: out.numel()])
        return out


def _sum_rows(rows: Tensor, out: Tensor) -> Tensor:
    """``out = (rows[0] + rows[1] + ...) / k``, added in row (rank) order: a fixed order, the same
    on every device (``Tensor.sum(0)`` may reorder it, which changes the last bit)."""
    flat = out.view(-1)
    flat.copy_(rows[0])
    for r in range(1, rows.shape[0]):
        flat.add_(rows[r])
    return flat.div_(rows.shape[0]).view_as(out) if rows.shape[0] != 1 else out


def _expand(scales: Tensor, spans: Tensor, columns: Tensor, length: int | None = None) -> Tensor:
    """``[rows, length]`` fp32: ``scales[:, columns[p]]`` on the elements of span ``p``
    (``spans`` rows are ``[start, end)``), 0 elsewhere."""
    rows = scales.shape[0]
    length = int(spans[:, 1].max()) if length is None else length
    out = torch.zeros(rows, length, device=scales.device)
    for (a, b), c in zip(spans.tolist(), columns.tolist()):
        out[:, a:b] = scales[:, c : c + 1]
    return out


def _unpack_scaled(packed: Tensor, scales: Tensor) -> Tensor:
    """``[k, m]`` packed rows to ``[k, 8m]`` fp32 ``±scales[j]`` (``scales`` ``[k]``), or
    ``±scales[j, i]`` element by element (``scales`` ``[k, 8m]``)."""
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    bits = bits.reshape(packed.shape[0], -1).bool()
    scales = scales.to(torch.float32)
    scales = scales[:, None] if scales.dim() == 1 else scales
    return torch.where(bits, scales, scales * -1)
