"""Accelerate with FSDP2 hybrid sharding and a onebit optimizer, on 4 gloo ranks as 2 replicas x
2 shards: the README's recipe trains with 1-bit traffic between replicas, every rank reads its
own batches, the ranks that hold the same shard stay bitwise equal, and a run resumed from
``accelerator.save_state`` or ``onebit.fsdp.save`` in the middle continues bit for bit through
the freeze. What would go wrong raises on every rank, naming the fix.

Accelerate runs FSDP2 only on GPUs; its FSDP2 path is taken on the CPU here
(:func:`frameworks.accelerate_hsdp_on_cpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from family import all_equal
from frameworks import (
    FREEZE,
    Probe,
    accelerate_hsdp_on_cpu,
    assert_hybrid_shards_trained,
    assert_resumed_from,
    launched_as,
    needs,
    text_windows,
)

pytestmark = [pytest.mark.slow, needs("accelerate", "transformers")]

STEPS, SAVE_AT, BATCH = 8, 5, 2


def _recipe(state_dict_type: str | None = None):
    """The README's recipe: shard by hand on the shard dimension, build the optimizer on the
    replica group, then onebit's ``prepare``."""
    from torch.distributed.fsdp import fully_shard

    import onebit
    from onebit.integrations.accelerate import prepare

    accelerator = accelerate_hsdp_on_cpu(2, 2, state_dict_type)
    mesh = accelerator.torch_device_mesh
    model = Probe()
    for block in model.gpt.transformer.h:
        fully_shard(block, mesh=mesh["dp_shard_cp"])
    fully_shard(model, mesh=mesh["dp_shard_cp"])
    optimizer = onebit.OnebitAdam(model.parameters(), warmup_compression="fp32", lr=1e-2,
                                  freeze_step=FREEZE, max_grad_norm=1.0,
                                  process_group=mesh["dp_replicate"].get_group())  # fmt: skip
    loader = torch.utils.data.DataLoader(text_windows(64), batch_size=BATCH)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader)
    return accelerator, mesh, model, optimizer, loader


def _train(rank: int, world_size: int, out: str, how: str, resume: bool) -> dict:
    """Train, saving at step SAVE_AT (``how``: with onebit.fsdp, or with Accelerate's
    ``save_state`` and the plugin's ``state_dict_type``); or resume from there."""
    import onebit

    launched_as(rank, world_size)
    accelerator, mesh, model, optimizer, loader = _recipe(None if how == "onebit.fsdp" else how)
    start = 0
    if resume:
        if how == "onebit.fsdp":
            onebit.fsdp.load(model, optimizer, out)
        else:
            accelerator.load_state(out)
        start, loader = SAVE_AT, accelerator.skip_first_batches(loader, SAVE_AT)
    first = [p.detach().to_local().clone() for p in model.parameters()]
    batches = []
    for step, batch in enumerate(loader, start=start + 1):
        batches.append(batch["input_ids"].clone())
        accelerator.backward(model(**batch))
        optimizer.step()
        optimizer.zero_grad()
        if step == SAVE_AT and not resume:
            if how == "onebit.fsdp":
                onebit.fsdp.save(model, optimizer, out)
            else:
                accelerator.save_state(out)
        if step == STEPS:
            break
    inner = optimizer.optimizer
    return {
        "shard": mesh["dp_shard_cp"].get_local_rank(),
        "first": first,
        "params": [p.detach().to_local().clone() for p in model.parameters()],
        "batches": batches,
        "stats": inner.comm_stats,
        "frozen": not inner.in_warmup,
    }


@pytest.mark.parametrize("how", ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "onebit.fsdp"])
def test_the_recipe_trains_with_one_bit_reads_distinct_data_and_resumes_exactly(how, tmp_path):
    """Saved after the freeze, by Accelerate's ``save_state`` (either state dict type) or
    ``onebit.fsdp.save``, the run resumes bit for bit."""
    out = str(tmp_path / "checkpoint")
    runs = run_ranks(_train, 4, out, how, False, timeout=300, frameworks=True)
    for run in runs:
        assert run["frozen"] and not all_equal(run["first"], run["params"])
        assert run["stats"].steps["compression"] == STEPS - FREEZE
    assert_hybrid_shards_trained(runs)
    assert any(p.numel() == 0 for p in runs[1]["params"])  # Probe's empty shards
    if how != "onebit.fsdp":  # Accelerate's FSDP2 checkpoint, with each rank's part beside it
        saved = {path.name for path in Path(out).iterdir()}
        optimizer = "optimizer_0" if how == "SHARDED_STATE_DICT" else "optimizer.bin"
        assert {optimizer, "onebit"} <= saved
        assert sorted(path.name for path in (Path(out) / "onebit").iterdir()) == [
            f"rank_{rank}.pt" for rank in range(4)
        ]
    resumed = run_ranks(_train, 4, out, how, True, timeout=300, frameworks=True)
    assert_resumed_from(runs, resumed, SAVE_AT)


def _refusals(rank: int, world_size: int, out: str) -> dict:
    """What a user may try that would go wrong; each call's error."""
    import onebit
    from onebit.integrations.accelerate import prepare

    launched_as(rank, world_size)
    errors = {}
    accelerator, mesh, model, optimizer, loader = _recipe()
    batch = next(iter(loader))
    accelerator.backward(model(**batch))
    (Path(out) / "empty").mkdir(parents=True, exist_ok=True)
    for name, call in [
        ("clip", lambda: accelerator.clip_grad_norm_(model.parameters(), 1.0)),
        ("load_state", lambda: accelerator.load_state(str(Path(out) / "empty"))),
    ]:
        try:
            call()
        except ValueError as err:
            errors[name] = str(err)
    optimizer.step()  # and the optimizer's own clipping went on
    errors["clipped"] = optimizer.optimizer.grad_norm is not None

    model = Probe()
    try:
        prepare(
            accelerator,
            model,
            onebit.OnebitAdam(model.parameters(), warmup_compression="fp32", freeze_step=FREEZE),
        )
    except ValueError as err:
        errors["unsharded"] = str(err)
    return errors


def test_what_would_go_wrong_raises_on_every_rank_with_the_fix(tmp_path):
    results = run_ranks(_refusals, 4, str(tmp_path / "state"), timeout=300, frameworks=True)
    for rank, errors in enumerate(results):
        assert "build the optimizer with max_grad_norm=1.0" in errors["clip"]
        assert f"onebit/rank_{rank}.pt is missing" in errors["load_state"]
        assert errors["clipped"]
        assert 'mesh["dp_shard_cp"]' in errors["unsharded"]


def _accelerate_own_prepare(rank: int, world_size: int) -> tuple[int, str | None]:
    """Accelerate's own ``prepare`` of the sharded model: it re-matches the parameters by
    address, which the empty shards share."""
    from torch.distributed.fsdp import fully_shard

    import onebit

    launched_as(rank, world_size)
    accelerator = accelerate_hsdp_on_cpu(2, 2)
    mesh = accelerator.torch_device_mesh
    model = Probe()
    fully_shard(model, mesh=mesh["dp_shard_cp"])
    replicas = mesh["dp_replicate"].get_group()
    optimizer = onebit.OnebitAdam(
        model.parameters(), warmup_compression="fp32", freeze_step=FREEZE, process_group=replicas
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randint(0, 256, (2, 8))
    accelerator.backward(model(input_ids=x, labels=x))
    shard = mesh["dp_shard_cp"].get_local_rank()
    try:
        optimizer.step()
    except RuntimeError as err:
        return shard, str(err)
    return shard, None


def test_accelerate_own_prepare_of_empty_shards_raises_on_every_rank_instead_of_hanging():
    """The ranks with the empty shards name the fix; the others point to them."""
    for shard, error in run_ranks(_accelerate_own_prepare, 4, timeout=300, frameworks=True):
        assert error is not None
        if shard == 1:
            assert "a parameter twice" in error
            assert "onebit.integrations.accelerate.prepare" in error
        else:
            assert "the ranks that hold another shard raised an error" in error
