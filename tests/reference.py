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


class RefCompressedAllreduce:
    """SPEC section 2 for ``n`` simulated ranks: call with a list of ``n`` buffers."""

    def __init__(self, numel: int, n: int, kind: str = "rms") -> None:
        self.numel, self.n, self.kind = numel, n, kind
        self.padded = -(-numel // (8 * n)) * 8 * n
        self.chunk = self.padded // n
        self.worker_error = [torch.zeros(self.padded) for _ in range(n)]
        self.server_error = [torch.zeros(self.chunk) for _ in range(n)]

    def __call__(self, buffers: list[Tensor]) -> Tensor:
        n, c = self.n, self.chunk
        compressed = []
        for r, b in enumerate(buffers):
            y = torch.zeros(self.padded)
            y[: self.numel] = b.reshape(-1)
            y = y + self.worker_error[r]
            s = scale(y, self.kind)
            self.worker_error[r] = y - s * sign(y)
            compressed.append((s, sign(y)))
        result = torch.empty(self.padded)
        for j in range(n):
            parts = torch.stack([s * sg[j * c : (j + 1) * c] for s, sg in compressed])
            z = parts.sum(0) / n + self.server_error[j]
            sigma = scale(z, self.kind)
            self.server_error[j] = z - sigma * sign(z)
            result[j * c : (j + 1) * c] = sigma * sign(z)
        return result[: self.numel]


def bucket_bounds(numel: int, bucket_size: int, n: int) -> list[tuple[int, int]]:
    """Consecutive buckets of at most ``bucket_size`` elements, a multiple of ``8n``."""
    size = max(8 * n, bucket_size // (8 * n) * 8 * n)
    return [(s, min(s + size, numel)) for s in range(0, max(numel, 1), size)]


class RefBucketedAllreduce:
    """A flat buffer split into buckets, each with its own reference compressed allreduce."""

    def __init__(self, numel: int, n: int, bucket_size: int) -> None:
        self.bounds = bucket_bounds(numel, bucket_size, n)
        self.buckets = [RefCompressedAllreduce(e - s, n) for s, e in self.bounds]

    def __call__(self, flats: list[Tensor]) -> Tensor:
        return torch.cat(
            [ref([f[s:e] for f in flats]) for ref, (s, e) in zip(self.buckets, self.bounds)]
        )
