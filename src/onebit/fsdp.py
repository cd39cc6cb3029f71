"""1-bit Adam with FSDP2: shard inside a node, send 1 bit across nodes (SPEC section 8).

The model is sharded over the ``S`` ranks of a node with ``fully_shard(..., mesh=mesh["shard"])``:
FSDP2 all-gathers the parameters and reduce-scatters (averages) the gradients over the fast link
inside the node. The optimizer, built on the sharded parameters with
``process_group=mesh["replicate"].get_group()``, averages each local shard across the ``R``
nodes in ``step()``: in fp32 (or the quantized warmup) until the freeze, then as 1-bit
compressed momentum. Each rank's optimizer state covers its own shard only::

    mesh = init_device_mesh("cuda", (R, S), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = onebit.OnebitAdam(
        model.parameters(), lr=1e-4, process_group=mesh["replicate"].get_group()
    )
    onebit.fsdp.attach(model, optimizer)

:func:`save` and :func:`load` checkpoint the model and the optimizer, every rank's error
buffers included, through ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .optim.base import CompressedOptimizer, onebit_optimizer
from .optim.checkpoint import to_cpu
from .transport.sharding import Sharded

__all__ = ["attach", "load", "save"]


def attach(model: nn.Module, optimizer: Any) -> None:
    """Tie a onebit ``optimizer`` (or a framework's wrapper of one) to the FSDP2-sharded
    ``model`` whose parameters it steps.

    Checks that FSDP2 sharded the model on the 1-D mesh of the optimizer's parameters, so that
    FSDP2 averages inside the node and onebit, not FSDP2, across nodes; from then on a
    ``step()`` after a backward with ``set_requires_gradient_sync(False)`` (whose gradients
    FSDP2 kept unreduced) raises on every rank instead of stepping on stale gradients.

    Raises:
        ValueError: if the model has no FSDP2 module, the optimizer was not built on its
            sharded parameters, or FSDP2 shards it on another mesh.
    """
    from torch.distributed.fsdp import FSDPModule

    shards = onebit_optimizer(optimizer, "onebit.fsdp.attach").shards
    if not isinstance(shards, Sharded):
        raise ValueError(
            "attach needs a onebit optimizer built on the parameters of a model sharded with "
            'fully_shard(..., mesh=mesh["shard"]): build the optimizer after fully_shard'
        )
    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                groups.append(group)
    if not groups:
        raise ValueError("the model has no module sharded by fully_shard")
    sharded = {id(fsdp_param.sharded_param) for g in groups for fsdp_param in g.fsdp_params}
    if any(id(p) not in sharded for p in shards.params):
        raise ValueError("the optimizer has parameters that FSDP2 does not shard in this model")
    for group in groups:
        mesh = group.mesh_info.mesh
        if mesh.ndim != 1 or mesh != shards.mesh:
            raise ValueError(
                f"FSDP2 shards the model on {mesh}, the optimizer's parameters are on "
                f'{shards.mesh}: shard every module with fully_shard(..., mesh=mesh["shard"])'
            )
    shards.fsdp_groups = groups


def rank_state(
    optimizer: CompressedOptimizer, state: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What the optimizer state dict of ``torch.distributed.checkpoint`` leaves out: this
    rank's error buffers, counters and schedule (``"onebit"``), the param groups, and the names
    of each parameter's state, which change at the freeze. ``state`` is
    ``optimizer.state_dict()`` if already taken."""
    state = optimizer.state_dict() if state is None else state
    return {
        "param_groups": state["param_groups"],
        "onebit": state["onebit"],
        "state_keys": {i: list(s) for i, s in state["state"].items()},
        "mesh": _mesh(optimizer).tolist(),
    }


def state_template(
    optimizer: CompressedOptimizer, rest: dict[str, Any]
) -> dict[int, dict[str, torch.Tensor]]:
    """Per-parameter state shaped and named as :func:`rank_state` ``rest`` says it was saved (the
    names change at the freeze), as DTensors, to load into."""
    shards = optimizer.shards
    return {
        i: {key: shards.wrap(i, torch.zeros_like(local)) for key in keys}
        for (i, keys), local in zip(rest["state_keys"].items(), shards.locals())
    }


def write_rank_state(optimizer: CompressedOptimizer, directory: str | os.PathLike) -> None:
    """Write this rank's :func:`rank_state` to ``<directory>/onebit/rank_<rank>.pt``, beside a
    framework's checkpoint of the sharded optimizer, which leaves it out."""
    path = _rank_file(directory)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(to_cpu(rank_state(optimizer)), path)


@contextlib.contextmanager
def resuming(
    optimizer: CompressedOptimizer, directory: str | os.PathLike, saver: str, fix: str
) -> Iterator[None]:
    """Within the block, a framework loads its checkpoint in ``directory`` into the sharded
    ``optimizer``, and the state :func:`write_rank_state` saved there comes with it.

    Frameworks load the per-parameter state with ``torch.distributed.checkpoint`` into a
    template taken from the optimizer as it is (before the freeze it lacks state that some
    optimizers add at the freeze), then hand the optimizer a state dict without onebit's part.
    So first the optimizer takes the state and the part it was saved with; within the block, a
    ``load_state_dict`` given no ``"onebit"`` part takes the saved one.

    Raises:
        ValueError: if this rank's file is missing (``saver`` says what writes it), or the
            checkpoint was saved on another mesh (``fix`` says what to do instead).
    """
    path = _rank_file(directory)
    if not os.path.isfile(path):
        raise ValueError(
            f"{path} is missing: resuming needs a checkpoint written by {saver}, on as many ranks"
        )
    rest = torch.load(path, weights_only=True)
    check_mesh(optimizer, rest["mesh"], fix)
    template = state_template(optimizer, rest)
    optimizer.load_state_dict(
        {"state": template, "param_groups": rest["param_groups"], "onebit": rest["onebit"]}
    )
    load = optimizer.load_state_dict

    def load_state_dict(state_dict: dict[str, Any]) -> None:
        load(state_dict if "onebit" in state_dict else {**state_dict, "onebit": rest["onebit"]})

    optimizer.load_state_dict = load_state_dict
    try:
        yield
    finally:
        del optimizer.load_state_dict


def _rank_file(directory: str | os.PathLike) -> str:
    return os.path.join(os.path.expanduser(directory), "onebit", f"rank_{dist.get_rank()}.pt")


def check_mesh(optimizer: CompressedOptimizer, saved: list[int], fix: str) -> None:
    """``ValueError`` unless the optimizer's ``[replicas, shards]`` are ``saved``."""
    here = _mesh(optimizer).tolist()
    if saved != here:
        raise ValueError(
            f"checkpoint saved on a mesh of {saved[0]} replicas x {saved[1]} shards, this run "
            f"has {here[0]} x {here[1]}: each rank's error-feedback buffers cannot be resharded. "
            f"Resume on the same mesh, or {fix}"
        )


def _mesh(optimizer: CompressedOptimizer) -> torch.Tensor:
    """``[replicas, shards]`` of the optimizer's mesh."""
    return torch.tensor([optimizer.world_size, optimizer.shards.size])


def _own(rank: int) -> str:
    return f"onebit_rank_{rank}"


def save(model: nn.Module, optimizer: Any, checkpoint_id: str | os.PathLike) -> None:
    """Save the sharded model and optimizer to the directory ``checkpoint_id`` with
    ``torch.distributed.checkpoint``.

    A collective: call it on every rank. ``optimizer`` is a onebit optimizer or a framework's
    wrapper of one (Accelerate's, Lightning's). The parameters, the momentum and the variance are
    DTensors, each rank writing its own shards. The rest of the optimizer's state (its error
    buffers, counters and schedules) is one object per rank, under the rank's own key.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    optimizer = onebit_optimizer(optimizer, "onebit.fsdp.save")
    state = optimizer.state_dict()
    rest = rank_state(optimizer, state)
    buffer = io.BytesIO()
    torch.save(to_cpu(rest), buffer)
    dcp.save(
        {
            "model": get_model_state_dict(model),
            "optimizer": state["state"],
            _own(dist.get_rank()): buffer.getvalue(),
            "onebit_mesh": _mesh(optimizer),
        },
        checkpoint_id=checkpoint_id,
    )


def load(
    model: nn.Module,
    optimizer: Any,
    checkpoint_id: str | os.PathLike,
    reshard: bool = False,
) -> None:
    """Load what :func:`save` wrote into the sharded model and optimizer.

    A collective: call it on every rank. On the mesh it was saved from, the run resumes bit
    for bit. On another mesh the error-feedback buffers, which belong to each rank's bucket
    layout, cannot follow: this raises ``ValueError`` on every rank unless ``reshard``, which
    loads the model, the momentum and the variance resharded by
    ``torch.distributed.checkpoint`` and restarts the error buffers at zero, with a warning
    (as :meth:`~onebit.optim.base.CompressedOptimizer.load_state_dict` does for another world size).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    optimizer = onebit_optimizer(optimizer, "onebit.fsdp.load")
    first = {"onebit_mesh": torch.zeros(2, dtype=torch.int64)}
    dcp.load(first, checkpoint_id=checkpoint_id)
    saved, here = first["onebit_mesh"].tolist(), _mesh(optimizer).tolist()
    if not reshard:
        check_mesh(optimizer, saved, "pass reshard=True to restart them at zero")
    own = _own(dist.get_rank() if saved == here else 0)
    first = {own: b""}
    dcp.load(first, checkpoint_id=checkpoint_id)
    rest = torch.load(io.BytesIO(first[own]), weights_only=True)
    if saved != here:
        rest["onebit"]["ranks"] = {}  # load_state_dict warns, and restarts them at zero
    template = state_template(optimizer, rest)
    state = {"model": get_model_state_dict(model), "optimizer": template}
    dcp.load(state, checkpoint_id=checkpoint_id)
    set_model_state_dict(model, state["model"])
    optimizer.load_state_dict(
        {"state": template, "param_groups": rest["param_groups"], "onebit": rest["onebit"]},
        allow_inexact=reshard,
    )
