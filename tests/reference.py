"""Reference simulations written straight from SPEC.md, all ranks in one process.

Deliberately naive: plain per-rank loops and no bit packing, so that a bug in the library's
packing, chunking or communication cannot hide in a shared helper.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sign(x: Tensor) -> Tensor:
    return torch.where(x >= 0, 1.0, -1.0)


def scale(x: Tensor, kind: str = "rms") -> Tensor:
    if kind == "rms":
        return x.norm() / math.sqrt(x.numel())
    return x.abs().sum() / x.numel()


def segment_scales(x: Tensor, bounds: list[tuple[int, int]], kind: str) -> Tensor:
    """Each element's scale: that of the segment ``[a, b)`` of ``bounds`` it lies in."""
    out = torch.empty_like(x)
    for a, b in bounds:
        out[a:b] = scale(x[a:b], kind) if b > a else 0.0
    return out


class RefCompressedAllreduce:
    """SPEC section 2 for ``n`` simulated ranks: call with a list of ``n`` buffers.

    With ``segments`` (sizes adding up to ``numel``), each segment has its own worker scale and
    each segment's part of a chunk its own server scale; the padding is a segment of its own.
    """

    def __init__(
        self, numel: int, n: int, kind: str = "rms", segments: list[int] | None = None
    ) -> None:
        self.numel, self.n, self.kind = numel, n, kind
        self.padded = -(-numel // (8 * n)) * 8 * n
        self.chunk = self.padded // n
        self.worker_error = [torch.zeros(self.padded) for _ in range(n)]
        self.server_error = [torch.zeros(self.chunk) for _ in range(n)]
        self.bounds = [(0, self.padded)]
        if segments is not None:
            ends = torch.tensor([0, *segments, self.padded - numel]).cumsum(0).tolist()
            self.bounds = list(zip(ends[:-1], ends[1:]))

    def __call__(self, buffers: list[Tensor]) -> Tensor:
        n, c = self.n, self.chunk
        compressed = []
        for r, b in enumerate(buffers):
            y = torch.zeros(self.padded)
            y[: self.numel] = b.reshape(-1)
            y = y + self.worker_error[r]
            s = segment_scales(y, self.bounds, self.kind)
            self.worker_error[r] = y - s * sign(y)
            compressed.append((s, sign(y)))
        result = torch.empty(self.padded)
        for j in range(n):
            lo, hi = j * c, (j + 1) * c
            parts = torch.stack([s[lo:hi] * sg[lo:hi] for s, sg in compressed])
            z = parts.sum(0) / n + self.server_error[j]
            pieces = [(max(a, lo) - lo, min(b, hi) - lo) for a, b in self.bounds]
            sigma = segment_scales(z, [(a, b) for a, b in pieces if a < b], self.kind)
            self.server_error[j] = z - sigma * sign(z)
            result[lo:hi] = sigma * sign(z)
        return result[: self.numel]


def bucket_bounds(numel: int, bucket_size: int, n: int) -> list[tuple[int, int]]:
    """Consecutive buckets of at most ``bucket_size`` elements, a multiple of ``8n``."""
    size = max(8 * n, bucket_size // (8 * n) * 8 * n)
    return [(s, min(s + size, numel)) for s in range(0, max(numel, 1), size)]


class RefBucketedAllreduce:
    """A flat buffer split into buckets, each with its own reference compressed allreduce.

    With ``tensor_sizes`` (the sizes of the tensors laid out one after another in the buffer),
    every tensor's part of a bucket has its own scales (the optimizers' ``scale_per="tensor"``).
    """

    def __init__(
        self, numel: int, n: int, bucket_size: int, tensor_sizes: list[int] | None = None
    ) -> None:
        self.bounds = bucket_bounds(numel, bucket_size, n)
        ends = torch.tensor([0, *(tensor_sizes or [])]).cumsum(0).tolist()
        self.buckets = []
        for s, e in self.bounds:
            parts = [min(e, b) - max(s, a) for a, b in zip(ends[:-1], ends[1:])]
            segments = [p for p in parts if p > 0] if tensor_sizes else None
            self.buckets.append(RefCompressedAllreduce(e - s, n, segments=segments))

    def __call__(self, flats: list[Tensor]) -> Tensor:
        return torch.cat(
            [ref([f[s:e] for f in flats]) for ref, (s, e) in zip(self.buckets, self.bounds)]
        )
