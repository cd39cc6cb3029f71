"""Flat buffers for optimizer state, with per-parameter views and communication buckets.

Parameters are laid out in ``param_groups`` order and parameter order in one flat fp32 buffer
(SPEC section 3), each in the order of its memory: a ``channels_last`` or transposed parameter's
state views take its strides, as DDP's gradient buckets do, so that the fused kernels address a
parameter, its gradient and its state at the same offsets. Buckets are consecutive slices of
it. The bucket length is a multiple of ``8 * world_size``, so only the last bucket needs
padding, and a padded scratch buffer of :attr:`FlatLayout.padded_numel` elements holds every
bucket as a contiguous, ready-to-send slice.
"""

from __future__ import annotations

import operator
import weakref

import torch
from torch import Tensor

from ..compress import padded_numel
from ..kernels.fused import laid_out


class FlatLayout:
    """Where each parameter lives in the flat buffers, and how they split into buckets.

    Attributes:
        params: the tensors the optimizer reads and updates: the parameters, or their local
            shards where FSDP2 shards them (:mod:`onebit.transport.sharding` keeps the list
            current).
        keys: the optimizer's parameters, which key its ``state``.
        bucket_params: per bucket, the indices of the parameters with elements in it, in order.
        strides: per parameter, the strides of its views of the flat buffers:
            :func:`memory_strides` of it when the layout was made (of a tensor that replaced it
            in :attr:`params` with another shape, its own).
    """

    def __init__(
        self,
        params: list[Tensor],
        bucket_size: int,
        world_size: int,
        keys: list[Tensor] | None = None,
    ) -> None:
        self.params = params
        self.keys = params if keys is None else keys
        self._views: dict[tuple, tuple[tuple[Tensor, ...], list[Tensor]]] = {}
        self.numels = [p.numel() for p in params]
        self.strides = [memory_strides(p) for p in params]
        self._shapes = [p.shape for p in params]
        self.offsets = []
        offset = 0
        for n in self.numels:
            self.offsets.append(offset)
            offset += n
        self.numel = offset
        quantum = 8 * world_size
        self.bucket_size = max(quantum, bucket_size // quantum * quantum)
        starts = range(0, max(self.numel, 1), self.bucket_size)
        self.buckets = [(s, min(s + self.bucket_size, self.numel)) for s in starts]
        self.padded_numel = self.buckets[-1][0] + padded_numel(
            self.buckets[-1][1] - self.buckets[-1][0], world_size
        )
        self.bucket_params: list[list[int]] = [[] for _ in self.buckets]
        for i, (o, n) in enumerate(zip(self.offsets, self.numels)):
            for k in range(o // self.bucket_size, (o + n - 1) // self.bucket_size + 1 if n else 0):
                self.bucket_params[k].append(i)

    def zeros(self, padded: bool = False, device: torch.device | None = None) -> Tensor:
        """A new zero fp32 flat buffer; ``padded`` gives the bucket-padded length."""
        return torch.zeros(self.padded_numel if padded else self.numel, device=device)

    def segments(self, k: int) -> list[int]:
        """The sizes of the parameters' parts in bucket ``k``, in layout order."""
        start, end = self.buckets[k]
        sizes = [min(end, o + n) - max(start, o) for o, n in zip(self.offsets, self.numels)]
        return [size for size in sizes if size > 0]

    def views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views of ``flat``, shaped like the parameters.

        A step asks for the views of the same few buffers again and again, and on a GPU making
        hundreds of views costs milliseconds of CPU a step. So they are made once per buffer
        (and again if :attr:`params` changed) and kept until the buffer is freed: they view a
        detached alias of it, which holds its memory but not the tensor, and the entry goes
        when the buffer's tensor does."""
        base = flat if flat._base is None else flat._base
        key = (id(base), flat.storage_offset(), flat.dtype)
        cached = self._views.get(key)
        if cached is None or not all(map(operator.is_, cached[0], self.params)):
            alias = flat.detach()
            for i, p in enumerate(self.params):
                if p.shape != self._shapes[i]:
                    self._shapes[i], self.strides[i] = p.shape, memory_strides(p)
            views = [alias[o : o + n].as_strided(p.shape, s)
                     for p, o, n, s in zip(self.params, self.offsets, self.numels,
                                           self.strides)]  # fmt: skip
            if not any(k[0] == id(base) for k in self._views):
                weakref.finalize(base, self._forget, id(base))
            cached = self._views[key] = (tuple(self.params), views)
        return list(cached[1])

    def in_order(self, i: int, t: Tensor) -> bool:
        """Whether ``t``, shaped like parameter ``i``, holds its elements in the flat buffers'
        order (its strides are :attr:`strides`), so that a kernel may address it as they do."""
        return t.shape == self._shapes[i] and laid_out(t, self.strides[i])

    def flat(self, i: int, t: Tensor) -> Tensor:
        """``t``, shaped like parameter ``i``, as a 1-D tensor in the flat buffers' order: a
        view where :meth:`in_order`, else a copy."""
        if not self.in_order(i, t):
            like = torch.empty_strided(t.shape, self.strides[i], dtype=t.dtype, device=t.device)
            t = like.copy_(t)
        return t.as_strided((t.numel(),), (1,))

    def _forget(self, base_id: int) -> None:
        for key in [key for key in self._views if key[0] == base_id]:
            del self._views[key]

    def bucket_views(self, flat: Tensor, padded: bool = False) -> list[Tensor]:
        """Per-bucket slices of ``flat``; with ``padded`` the last one includes its padding."""
        ends = [e for _, e in self.buckets]
        if padded:
            ends[-1] = self.padded_numel
        return [flat[s:e] for (s, _), e in zip(self.buckets, ends)]


def memory_strides(t: Tensor) -> tuple[int, ...]:
    """The strides of ``t``'s views of a flat buffer: its own where its elements fill one block
    of memory (contiguous, ``channels_last``, a transpose), so that the buffer holds them in
    memory order; else (an expanded or sliced tensor) the contiguous ones."""
    span = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride != span:
            return torch.empty(t.shape, device="meta").stride()
        span *= size
    return tuple(t.stride())
