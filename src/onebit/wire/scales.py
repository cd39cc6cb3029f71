"""Where the scales of a 1-bit allreduce apply (SPEC section 2).

Each rank's worker compresses its buffer with scales, and each server its chunk. The rule is
one of two: :class:`OneScale` (SPEC 2: one scale per buffer on the worker, one per chunk on the
server) or :class:`SegmentScales` (one per tensor, ``segments``, on the worker and one per piece,
a segment's part of a chunk, on the server), each placed by a :class:`ScaleGeometry`. A
:class:`~onebit.wire.comm.CompressedAllreduce` holds one rule and calls it where the two differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..compress import (
    decompress_,
    decompress_pieces_,
    segment_scales,
    serve_chunk_,
    serve_pieces_,
    server_error_,
    subtract_compressed_,
    subtract_compressed_segments_,
)


def scale_rule(
    segments: Sequence[int] | None, numel: int, padded: int, world_size: int, scale: str
) -> OneScale | SegmentScales:
    """The rule of a buffer of ``numel`` elements (``padded`` with the padding) that holds
    ``segments``, or one scale per buffer if ``None``; ``scale`` is ``"rms"`` or
    ``"mean_abs"``."""
    if segments is not None and numel:
        return SegmentScales(ScaleGeometry(list(segments), padded, world_size), scale)
    return OneScale(padded, world_size, scale)


class OneScale:
    """SPEC 2's scales: one per buffer on the worker, one per chunk on the server."""

    worker_count = server_count = 1
    bounds = None

    def __init__(self, padded: int, world_size: int, scale: str) -> None:
        self.padded, self.world_size, self.scale = padded, world_size, scale
        self._geometry: ScaleGeometry | None = None

    @property
    def geometry(self) -> ScaleGeometry:
        """One segment of the whole padded buffer (made on first use)."""
        if self._geometry is None:
            self._geometry = ScaleGeometry([self.padded], self.padded, self.world_size)
        return self._geometry

    def worker(self, buffer: Tensor, scale: Tensor) -> Tensor:
        """The worker's scales of ``buffer``, given its one ``scale``."""
        return scale

    def commit_worker(self, y: Tensor, scale: Tensor, signs: Tensor | None, error: Tensor) -> None:
        """The worker error of a call that sent ``y`` compressed (its ``signs``, if kept, and
        ``scale``), into ``error``."""
        subtract_compressed_(y, scale, out=error, signs=signs)

    def serve(
        self,
        received: Tensor,
        scales: Tensor,
        rank: int,
        store: Tensor,
        last: Tensor | None,
        z: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Compress rank ``rank``'s chunk, from every rank's ``received`` signs and worker
        ``scales``, with the server buffer ``store`` (holding the served ``z`` of the last call
        where ``last``, its pieces' scales, is given; ``z``: scratch for the served chunk).
        Returns its signs, its message's server scales, and what the buffer's ``last`` is
        now."""
        if last is not None:  # a pass over every bucket kept z: the error first
            server_error_(store, last, self.geometry.chunk_bounds[rank])
        packed, sigma = serve_chunk_(received, scales[:, 0], store, self.scale, z)
        return packed, sigma, None

    def decompress(self, signs: Tensor, scales: Tensor, out: Tensor) -> None:
        """Every chunk's result from its signs and server scale."""
        decompress_(signs, scales[:, 0], out)


class SegmentScales:
    """A scale per segment on the worker and per piece (a segment's part of a chunk) on the
    server, where :attr:`geometry` places them."""

    def __init__(self, geometry: ScaleGeometry, scale: str) -> None:
        self.geometry, self.scale = geometry, scale
        self.bounds = geometry.bounds
        self.worker_count, self.server_count = geometry.count, geometry.most_pieces

    def worker(self, buffer: Tensor, scale: Tensor) -> Tensor:
        return segment_scales(buffer, self.bounds, self.scale)

    def commit_worker(self, y: Tensor, scale: Tensor, signs: Tensor | None, error: Tensor) -> None:
        subtract_compressed_segments_(y, scale, self.bounds, error)

    def serve(
        self,
        received: Tensor,
        scales: Tensor,
        rank: int,
        store: Tensor,
        last: Tensor | None,
        z: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """As :meth:`OneScale.serve`; the buffer keeps the served ``z``, and the pieces'
        scales are its ``last``."""
        bounds = self.geometry.chunk_bounds[rank]
        served = self.geometry.served[rank]
        packed, pieces = serve_pieces_(received, scales, served, bounds, store, last, self.scale)
        sigma = torch.zeros(self.server_count, device=pieces.device)
        sigma[: len(bounds) - 1] = pieces
        return packed, sigma, pieces

    def decompress(self, signs: Tensor, scales: Tensor, out: Tensor) -> None:
        decompress_pieces_(signs, scales, self.geometry.gathered, out)


class ScaleGeometry:
    """Where the segments (and the padding, one more segment) fall in the padded buffer and in
    each chunk, as the int64 tables the segmented kernels of :mod:`onebit.compress` take: each
    segment has a worker scale, each piece a server scale.

    Attributes:
        bounds: ``[count + 1]`` segment boundaries in the padded buffer.
        chunk_bounds: per chunk, the boundaries of its pieces (a segment's part of the chunk),
            in chunk coordinates.
        served: per chunk, its pieces as ``(start, end, segment)`` rows.
        gathered: every chunk's pieces as ``(chunk, start, end, piece index)`` rows.
    """

    def __init__(self, segments: list[int], padded: int, world_size: int) -> None:
        sizes = [*segments, padded - sum(segments)] if padded > sum(segments) else segments
        self.bounds = torch.tensor([0, *sizes], dtype=torch.int64).cumsum(0)
        self.count = len(sizes)
        chunk = padded // world_size
        edges = self.bounds.tolist()
        self.chunk_bounds, self.served, gathered = [], [], []
        for j in range(world_size):
            lo, hi = j * chunk, (j + 1) * chunk
            pieces = [
                (max(a, lo) - lo, min(b, hi) - lo, k)
                for k, (a, b) in enumerate(zip(edges[:-1], edges[1:]))
                if max(a, lo) < min(b, hi)
            ]
            self.served.append(torch.tensor(pieces, dtype=torch.int64).reshape(-1, 3))
            self.chunk_bounds.append(torch.tensor([0] + [b for _, b, _ in pieces]))
            gathered += [(j, a, b, i) for i, (a, b, _) in enumerate(pieces)]
        self.gathered = torch.tensor(gathered, dtype=torch.int64).reshape(-1, 4)
        self.most_pieces = max(len(p) for p in self.served)
