"""onebit with FSDP2 (``onebit.fsdp``): FSDP2 shards inside a node, onebit averages across nodes.

Every test runs real FSDP2 on gloo ranks in fresh processes, on a ``replicas x shards`` mesh: 2x2,
and the edge cases 1x4 (one node: onebit has one replica) and 4x1 (no sharding). The reference is
torch's own HSDP: ``fully_shard`` on the 2-D mesh with ``torch.optim.AdamW``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from family import NAMES, loss_of, make_model, make_optimizer
from optimizer_state import storage_bytes

import onebit

pytestmark = pytest.mark.slow

MESHES = [(2, 2), (1, 4), (4, 1)]
LR = 1e-2


def _mesh(replicas: int, shards: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _shard(model: torch.nn.Module, mesh, **kwargs) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def _wide() -> torch.nn.Module:
    """The family's model with a hidden layer wide enough that the 1-bit messages' scales and
    headers weigh little."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 2))


def _onebit(mesh, name: str = "adam", model=None, fsdp: dict | None = None, **kwargs):
    """``model`` (default: the family's) sharded on ``mesh["shard"]``, and its onebit
    optimizer, attached."""
    model = _shard(model or make_model(), mesh["shard"], **(fsdp or {}))
    group = mesh["replicate"].get_group()
    opt = make_optimizer(name, model.parameters(), process_group=group, **kwargs)
    onebit.fsdp.attach(model, opt)
    return model, opt


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _local(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _train(model, opt, steps: range, clip: float | None = None, micro: int = 1) -> None:
    rank = dist.get_rank()
    for step in steps:
        for m in range(micro):
            if micro > 1:
                model.set_requires_gradient_sync(m == micro - 1)
            (loss_of(model, step, rank, m) / micro).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


def _warmup_vs_hsdp(rank: int, world_size: int, mesh_shape, case: str) -> float:
    """Largest difference from torch's HSDP + AdamW after 4 fp32 warmup steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = _mesh(*mesh_shape)
    fsdp, clip, micro = {}, None, 1
    if case == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fsdp = {"mp_policy": policy}
    elif case == "clip":
        clip = 0.05
    elif case == "accumulate":
        micro = 2
    model, opt = _onebit(mesh, freeze_step=100, fsdp=fsdp, max_grad_norm=clip)
    _train(model, opt, range(4), micro=micro)
    ref = _shard(make_model(0), mesh, **fsdp)
    adamw = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    _train(ref, adamw, range(4), clip, micro)
    if clip is not None:
        assert opt.grad_norm is not None
    return max(float((a - b).abs().max()) for a, b in zip(_full(model), _full(ref)))


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_warmup_equals_torch_hsdp_with_adamw(mesh_shape):
    (diff, *_) = run_ranks(_warmup_vs_hsdp, 4, mesh_shape, "plain")
    assert diff <= 1e-5


@pytest.mark.parametrize("case", ["clip", "bf16", "accumulate"])
def test_warmup_equals_torch_hsdp_in_users_loops(case):
    """``max_grad_norm`` clips by the global norm across shards and nodes, as
    ``clip_grad_norm_`` does on FSDP2's DTensors; bf16 through ``MixedPrecisionPolicy``;
    gradient accumulation with ``set_requires_gradient_sync(False)``."""
    (diff, *_) = run_ranks(_warmup_vs_hsdp, 4, (2, 2), case)
    assert diff <= 1e-5


def _compression_run(rank: int, world_size: int, mesh_shape, name: str) -> dict:
    mesh = _mesh(*mesh_shape)
    model, opt = _onebit(mesh, name, _wide(), bucket_size=4096)
    _train(model, opt, range(8))
    replicas = mesh["replicate"].get_group()
    replicated = _wide()  # the same optimizer on whole parameters, for its state's size
    rep_opt = make_optimizer(
        name, replicated.parameters(), process_group=replicas, bucket_size=4096
    )
    _train(replicated, rep_opt, range(8))
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    return {
        "shard": mesh["shard"].get_local_rank(),
        "local": _local(model),
        "stats": opt.comm_stats.state_dict(),
        "fp32 allreduce bytes": 4
        * local_numel
        * 2
        * (dist.get_world_size(replicas) - 1)
        / dist.get_world_size(replicas),
        "state bytes": storage_bytes(opt),
        "replicated state bytes": storage_bytes(rep_opt),
        "model bytes": model_bytes,
    }


@pytest.mark.parametrize("name", NAMES)
def test_compression_stage_keeps_replicas_equal_at_one_bit(name):
    """Through the compression stage the ranks that hold the same shard stay bitwise equal and
    send about 1/32 of an fp32 allreduce between nodes (scales and headers aside). Each keeps
    1/S of the replicated optimizer's state, for OnebitAdam at most (2 + 1/R + 1/16) / S model
    sizes."""
    replicas, shards = 2, 2
    results = run_ranks(_compression_run, 4, (replicas, shards), name)
    by_shard: dict[int, list] = {}
    for r in results:
        by_shard.setdefault(r["shard"], []).append(r["local"])
        stats = r["stats"]
        compressed = stats["total_bytes"]["compression"] / stats["steps"]["compression"]
        assert compressed <= r["fp32 allreduce bytes"] / 24, (compressed, r)
        assert r["state bytes"] <= 1.05 * r["replicated state bytes"] / shards
        if name == "adam":
            target = (2 + 1 / replicas + 1 / 16) / shards * r["model bytes"]
            assert r["state bytes"] <= target, (r["state bytes"], target)
    assert len(by_shard) == shards
    for peers in by_shard.values():
        assert all(torch.equal(a, b) for a, b in zip(peers[0], peers[1]))
