"""The 1-node HSDP smoke test of ``test_fsdp.py`` on NCCL, one rank per GPU (run by torchrun).

FSDP2 shards the family's wide model over every GPU of this machine (a 1 x S mesh); OnebitAdam
steps the CUDA shards through its warmup and compression stage with the GPU kernels, beside
torch's own FSDP2 + AdamW. Prints one JSON line per rank.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import onebit


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 2))
    return model.cuda()


def _shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model, opt, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 6, generator=gen).cuda(), torch.randn(8, 2, generator=gen).cuda()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    shards = dist.get_world_size()
    mesh = init_device_mesh("cuda", (1, shards), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), mesh["shard"])
    opt = onebit.OnebitAdam(
        model.parameters(),
        warmup_compression="fp32",
        lr=1e-2,
        freeze_step=3,
        process_group=mesh["replicate"].get_group(),
    )
    onebit.fsdp.attach(model, opt)
    ours = _train(model, opt, range(3), rank)
    ref = _shard(_model(), mesh["shard"])
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    theirs = _train(ref, adamw, range(3), rank)
    diff = max(
        float((a.full_tensor() - b.full_tensor()).abs().max())
        for a, b in zip(model.parameters(), ref.parameters())
    )
    after = _train(model, opt, range(3, 8), rank)
    finite = all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())
    result = {
        "rank": rank,
        "warmup_diff": diff,
        "losses": [ours, theirs, after],
        "stage": opt.stage,
        "finite": finite,
        "backend": onebit.kernels.for_device(torch.device("cuda")).name,
    }
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
