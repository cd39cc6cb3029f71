"""Rank agreement at construction: every rank checks that all ranks built the same optimizer,
and starts from the same parameters.

A rank whose own checks failed sends its error instead of its settings, so that every rank
raises it together rather than one rank raising while the others wait in a collective.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def digest(value: Any) -> str:
    """A short hash of ``repr(value)``: what ranks exchange and checkpoints record."""
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def check_ranks_agree(
    settings: dict[str, Any] | str,
    group: dist.ProcessGroup | None,
    shard: int | None = None,
    per_shard: tuple[str, ...] = (),
) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks have the same settings.

    ``settings`` is a string where this rank's own checks failed: every rank then raises it,
    prefixed with the rank that failed. With sharded parameters every rank of the mesh takes
    part, ``shard`` is the shard this rank holds, and the ``per_shard`` settings (the local
    shapes, say) need only agree among the ranks that hold the same shard.
    """
    mine = settings if isinstance(settings, str) else {k: digest(v) for k, v in settings.items()}
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (shard, mine), group=group)
    problems = [f"rank {r}: {g}" for r, (_, g) in enumerate(gathered) if isinstance(g, str)]
    if problems:
        raise ValueError("; ".join(problems))
    assert isinstance(settings, dict)
    first_of = {}
    for s, g in gathered:
        first_of.setdefault(s, g)

    def reference(s: int | None, key: str) -> Any:
        return (first_of[s] if key in per_shard else gathered[0][1]).get(key)

    differ = sorted({key for s, g in gathered for key in g if g.get(key) != reference(s, key)})
    if differ:
        ranks = [
            r
            for r, (s, g) in enumerate(gathered)
            if any(g.get(k) != reference(s, k) for k in differ)
        ]
        shown = {key: settings[key] for key in differ if key not in ("shapes", "dtypes")}
        raise ValueError(
            f"settings differ across ranks: {', '.join(differ)} (rank(s) {ranks} differ from "
            f"rank 0{' or the first rank with their shard' if per_shard else ''}). Build the "
            f"model and optimizer the same way on every rank. This rank has {shown}"
        )


def broadcast_from_first_rank(params: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """Give every rank rank 0's parameters. Parameters on a device the group's backend cannot
    send from (a model still on the CPU under NCCL, as HF Trainer builds it) go through a copy
    on the current CUDA device."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    supported = getattr(group or dist.group.WORLD, "_device_types", None)
    with torch.no_grad():
        for p in params:
            if supported is None or p.device.type in {d.type for d in supported}:
                dist.broadcast(p.data, src=src, group=group)
            else:
                staged = p.data.to(torch.device("cuda", torch.cuda.current_device()))
                dist.broadcast(staged, src=src, group=group)
                p.data.copy_(staged)
