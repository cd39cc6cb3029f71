"""What a kernel backend implements: the interface that :func:`onebit.kernels.for_device` returns.

:class:`Kernels` holds the operations every backend has (SPEC sections 1 and 2): scales, signs,
errors and the server's average over whole buffers, the public call's passes over an unpadded
input, and the same with a scale per segment. Their argument conventions are those of the
functions of the same name in :mod:`onebit.compress`, which checks the arguments.

Two capability groups are optional:

* :class:`FusedMomentum`: the packed momentum's fused passes (:mod:`onebit.kernels.fused`), which
  a backend with ``packs_momentum`` has (the C and Triton kernels);
* the quantized warmup's kernels and the packed momentum's passes over every bucket at once:
  ``block_quantizer`` and ``model_passes`` return ``None`` where a backend has none, and the
  caller then runs torch tiles or a bucket at a time.

:class:`~onebit.kernels.reference.TorchKernels` implements :class:`Kernels` with torch ops; it is
the reference. A faster backend derives from it and names each operation it takes from the
reference (``op = TorchKernels.op``), so that none is taken by omission:
:func:`onebit.kernels.undeclared` lists those a backend neither defines nor names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .fused import BucketRuns, PackedMomentum

__all__ = ["FUSED_MOMENTUM", "OPERATIONS", "OPTIONAL", "FusedMomentum", "Kernels"]


class Kernels(Protocol):
    """The operations of every backend.

    Attributes:
        name: what ``ONEBIT_BACKEND`` calls it.
        packs_momentum: whether it has :class:`FusedMomentum`, which :mod:`onebit.wire.momentum`
            needs to keep the momentum packed.
        packs_masked_momentum: whether those passes also read the momentum's masks
            (``exp_avg_mask``).
        error_dtypes: the dtypes of error buffers that those passes and ``serve_pieces_`` read
            and write where they are; the others get an fp32 copy (:mod:`onebit.kernels.errors`).
        tile_numel: elements per tile of the quantized warmup (:mod:`onebit.wire.quantized`).
    """

    name: str
    packs_momentum: bool
    packs_masked_momentum: bool
    error_dtypes: tuple[torch.dtype, ...]
    tile_numel: int

    def unavailable(self) -> str | None:
        """Why this backend cannot run on this machine, or ``None`` if it can."""

    def runs_on(self, device: torch.device) -> bool:
        """Whether it takes tensors on ``device``."""

    def reads_input(self, *tensors: Tensor) -> bool:
        """Whether ``compress_input`` and ``commit_input_`` read these tensors where they are."""

    def block_quantizer(
        self, buckets: list, block_size: int, bits: str, rank: int, device: torch.device
    ) -> object | None:
        """The quantized warmup's kernels for these buckets, or ``None``."""

    def model_passes(self, geometry: object, device: torch.device) -> object | None:
        """The packed momentum's passes over every bucket at once, or ``None``."""

    # SPEC 1: one buffer, one scale.
    def compute_scale(self, x: Tensor, scale: str) -> Tensor: ...
    def pack_signs(self, x: Tensor) -> Tensor: ...
    def unpack_signs(self, packed: Tensor) -> Tensor: ...
    def subtract_compressed_(
        self, y: Tensor, s: Tensor, out: Tensor, signs: Tensor | None = None
    ) -> Tensor: ...
    def compress_(self, buffer: Tensor, error: Tensor, scale: str) -> tuple[Tensor, Tensor]: ...

    # The public call's passes over an unpadded input.
    def compress_input(
        self, x: Tensor, error: Tensor, scale: str, bounds: Tensor | None
    ) -> tuple[Tensor, Tensor]: ...
    def commit_input_(
        self, x: Tensor, error: Tensor, scales: Tensor, bounds: Tensor | None
    ) -> Tensor: ...
    def allreduce_one_(
        self, x: Tensor, error: Tensor, server_error: Tensor, out: Tensor, scale: str
    ) -> bool: ...

    # SPEC 2: the server and the result, one scale per row.
    def decompress_(self, packed: Tensor, scales: Tensor, out: Tensor) -> Tensor: ...
    def average_signs_(self, packed: Tensor, scales: Tensor, out: Tensor) -> Tensor: ...
    def serve_chunk_(
        self, packed: Tensor, scales: Tensor, error: Tensor, scale: str, z: Tensor | None
    ) -> tuple[Tensor, Tensor]: ...

    # A scale per segment.
    def segment_scales(self, y: Tensor, bounds: Tensor, scale: str) -> Tensor: ...
    def subtract_compressed_segments_(
        self, y: Tensor, scales: Tensor, bounds: Tensor, out: Tensor
    ) -> Tensor: ...
    def average_signs_pieces_(
        self, packed: Tensor, scales: Tensor, pieces: Tensor, out: Tensor
    ) -> Tensor: ...
    def serve_pieces_(
        self,
        packed: Tensor,
        scales: Tensor,
        pieces: Tensor,
        bounds: Tensor,
        store: Tensor,
        last: Tensor | None,
        scale: str,
    ) -> tuple[Tensor, Tensor]: ...
    def decompress_pieces_(
        self, packed: Tensor, scales: Tensor, pieces: Tensor, out: Tensor
    ) -> Tensor: ...


class FusedMomentum(Protocol):
    """The packed momentum's fused passes, with the arguments of ``signs``, ``commit`` and
    ``update`` in :mod:`onebit.kernels.fused`, which calls them."""

    def momentum_signs(
        self, runs: BucketRuns, grads: Tensor, inv_scale: float | None,
        momentum: Tensor | PackedMomentum, weight: float, error: Tensor | None, out: Tensor,
        scale: str, post: Tensor | None, dtype: torch.dtype = torch.float32,
    ) -> Tensor: ...  # fmt: skip
    def momentum_commit(
        self, runs: BucketRuns, grads: Tensor, inv_scale: float | None,
        momentum: Tensor | PackedMomentum, weight: float, error: Tensor | None, scales: Tensor,
        out: Tensor, post: Tensor | None, dtype: torch.dtype = torch.float32,
    ) -> None: ...  # fmt: skip
    def momentum_update(
        self, runs: BucketRuns, params: Tensor, momentum: PackedMomentum, denominator: Tensor,
        decay: Tensor, value: Tensor, dtype: torch.dtype = torch.float32,
    ) -> None: ...  # fmt: skip


def _operations(protocol: type) -> tuple[str, ...]:
    return tuple(n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_"))


OPERATIONS = _operations(Kernels)
"""The names of :class:`Kernels`' operations."""

OPTIONAL = ("block_quantizer", "model_passes")
"""Those of :data:`OPERATIONS` that may return ``None``: capabilities a backend may lack."""

FUSED_MOMENTUM = _operations(FusedMomentum)
"""The names of :class:`FusedMomentum`'s passes."""
