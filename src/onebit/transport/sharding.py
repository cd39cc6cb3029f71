"""Parameters that FSDP2 shards: the local shards a onebit optimizer steps, and the few
reductions across shards that keep the shards one model.

Under hybrid sharding (SPEC section 8) FSDP2 shards each parameter across the ``S`` ranks of a
node (``fully_shard(..., mesh=mesh["shard"])``) and averages the gradients inside the node; the
optimizer, built with ``process_group=mesh["replicate"].get_group()``, runs 1-bit Adam on each
local shard across the ``R`` ranks that hold the same shard. Elementwise math needs nothing
more. What is a property of the whole model is combined across the shard group here: whether
every gradient is finite, the norms that clipping, LAMB's trust ratios and ``freeze_step="auto"``
read. A replicated model has :class:`Replicated`, whose reductions do nothing, so the optimizers
call the same methods either way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import host
from ..functional import layer_norms
from ..stats import count_collective


def local_tensor(tensor: Any) -> Any:
    """A DTensor's local shard; anything else as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Replicated:
    """Every rank holds whole parameters (one process, or DDP's replicas): the optimizer steps
    the parameters themselves, and there is nothing to combine across shards."""

    sharded = False
    size = 1
    rank: int | None = None

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)

    def locals(self) -> list[Tensor]:
        """The tensors the optimizer steps: the parameters themselves."""
        return list(self.params)

    def refresh(self, params: list[Tensor]) -> None:
        """Point ``params`` (the layout's list) at the current local shards and their gradients
        (nothing to do without shards)."""

    def release(self, params: list[Tensor]) -> None:
        """Drop the references to the gradients that :meth:`refresh` took."""

    def worst(self, code: int) -> int:
        """The largest of the shards' ``code`` (a collective across the shard group)."""
        return code

    def all_(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every shard (a collective across the shard group)."""
        return self.worst(0 if ok else 1) == 0

    def sum_(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` in place across the shard group."""
        return tensor

    def combine(self, norms: Tensor, ord: float = 2) -> Tensor:
        """Per-layer ``ord``-norms of whole layers from those of this rank's shards (``ord`` 1,
        2 or inf), on the device of ``norms``."""
        return norms

    def layer_norms(self, tensors: Sequence[Tensor], ord: float = 2) -> Tensor:
        """:func:`~onebit.functional.layer_norms` of whole layers, on the CPU."""
        return self.combine(host.read(layer_norms(list(tensors), ord)), ord)

    def numels(self) -> list[int]:
        """Each parameter's number of elements, whole (the same on every rank)."""
        return [p.numel() for p in self.params]

    def settings(self) -> dict[str, Any]:
        """What ranks must agree on about the sharding."""
        return {}

    def syncing(self) -> bool:
        """Whether the gradients were reduced for this step (always, without FSDP2)."""
        return True

    def wrap(self, index: int, tensor: Tensor) -> Tensor:
        """Parameter ``index``'s state ``tensor`` as ``state_dict`` returns it."""
        return tensor


class Sharded(Replicated):
    """Parameters that are DTensors sharded by FSDP2 on a 1-D mesh.

    Args:
        params: the optimizer's parameters, all ``DTensor`` on one 1-D mesh with ``Shard``
            placements (what ``fully_shard(..., mesh=mesh["shard"])`` makes).
        replicas: the optimizer's process group: the ranks that hold the same shards.

    Raises:
        ValueError: for parameters FSDP2 did not shard this way (a 2-D mesh, say, where FSDP2
            itself would average across replicas).
    """

    sharded = True

    def __init__(self, params: Sequence[Tensor], replicas: dist.ProcessGroup | None) -> None:
        from torch.distributed.tensor import DTensor, Shard

        if not all(isinstance(p, DTensor) for p in params):
            raise ValueError("either every parameter is a DTensor (sharded by FSDP2) or none is")
        mesh = params[0].device_mesh
        if any(p.device_mesh != mesh for p in params):
            raise ValueError("all sharded parameters must be on one device mesh")
        if mesh.ndim != 1 or any(not isinstance(p.placements[0], Shard) for p in params):
            raise ValueError(
                f"parameters sharded on a {mesh.ndim}-D mesh with placements "
                f"{params[0].placements}: onebit averages across replicas itself. Shard with "
                'fully_shard(module, mesh=mesh["shard"]) (a 1-D mesh) and build the optimizer '
                'with process_group=mesh["replicate"].get_group()'
            )
        super().__init__(params)
        self.mesh = mesh
        self.group = mesh.get_group()
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        replicas_size = dist.get_world_size(replicas)
        if replicas_size * self.size != dist.get_world_size():
            raise ValueError(
                f"{replicas_size} replicas x {self.size} shards is not the world's "
                f"{dist.get_world_size()} ranks: build the optimizer with "
                'process_group=mesh["replicate"].get_group() of the mesh the model is sharded on'
            )
        self._replicas = dist.get_process_group_ranks(replicas) if replicas else None
        self.device = params[0].device if dist.get_backend(self.group) == "nccl" else None
        self.fsdp_groups: list[Any] = []  # onebit.fsdp.attach's

    def _reduce(self, tensor: Tensor, op: Any = dist.ReduceOp.SUM) -> Tensor:
        """All-reduce a small tensor across the shard group, on the device its backend needs."""
        here = host.moved(tensor, self.device or torch.device("cpu"))
        count_collective()
        dist.all_reduce(here, op=op, group=self.group)
        return host.moved(here, tensor.device)

    def locals(self) -> list[Tensor]:
        """The current local shards, plain tensors that share the parameters' memory."""
        return [p._local_tensor for p in self.params]

    def refresh(self, params: list[Tensor]) -> None:
        """FSDP2 may give a parameter a new local tensor (at its lazy init, for one) and sets
        each ``.grad`` anew after every backward: point ``params`` at the local shards, and
        each shard's ``.grad`` at the local shard of its parameter's gradient."""
        params[:] = self.locals()
        for local, p in zip(params, self.params):
            local.grad = None if p.grad is None else local_tensor(p.grad)

    def release(self, params: list[Tensor]) -> None:
        for local in params:
            local.grad = None

    def worst(self, code: int) -> int:
        here = host.upload([float(code)], self.device or torch.device("cpu"))
        count_collective()
        dist.all_reduce(here, op=dist.ReduceOp.MAX, group=self.group)
        return int(host.read(here))

    def sum_(self, tensor: Tensor) -> Tensor:
        return tensor.copy_(self._reduce(tensor))

    def combine(self, norms: Tensor, ord: float = 2) -> Tensor:
        norms = norms.double()
        if ord == math.inf:
            return self._reduce(norms, dist.ReduceOp.MAX).float()
        if ord == 2:
            return self._reduce(norms.square()).sqrt().float()
        if ord == 1:
            return self._reduce(norms).float()
        raise ValueError(f"norms of order {ord} cannot be combined across shards")

    def syncing(self) -> bool:
        """Whether FSDP2 reduced this step's gradients (``set_requires_gradient_sync`` is not
        off) in every module :func:`onebit.fsdp.attach` found."""
        return all(group.reduce_grads for group in self.fsdp_groups)

    def settings(self) -> dict[str, Any]:
        """The mesh, and which shard this rank holds with which replicas: the optimizer's ranks
        must all hold the same shard, and all ranks must see the same mesh."""
        return {"mesh": self.mesh.size(), "shard": (self.rank, self._replicas)}

    def wrap(self, index: int, tensor: Tensor) -> Tensor:
        """A view shaped like parameter ``index``'s local shard becomes a DTensor sharded as the
        parameter is, so that ``torch.distributed.checkpoint`` saves every rank's shard."""
        from torch.distributed.tensor import DTensor

        p = self.params[index]
        if tensor.shape != p._local_tensor.shape:
            return tensor
        return DTensor.from_local(
            tensor, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )


def has_dtensors(params: Sequence[Tensor]) -> bool:
    """Whether any parameter is a DTensor (sharded, by FSDP2 or otherwise)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def shards_of(params: Sequence[Tensor], replicas: dist.ProcessGroup | None) -> Replicated:
    """:class:`Sharded` if the parameters are DTensors, else :class:`Replicated`."""
    return Sharded(params, replicas) if has_dtensors(params) else Replicated(params)
