"""HF Trainer with FSDP2 hybrid sharding and a onebit optimizer, on 4 gloo ranks as 2 replicas x
2 shards: the README's recipe (``shard_hsdp``) trains with 1-bit traffic between replicas,
every rank reads its own batches, the ranks that hold the same shard stay bitwise equal, and
``resume_from_checkpoint`` resumes bit for bit from Trainer's checkpoint taken after the freeze.
What would go wrong raises on every rank, naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from family import all_equal
from frameworks import (
    FREEZE,
    assert_hybrid_shards_trained,
    assert_resumed_from,
    launched_as,
    needs,
    text_windows,
    tiny_gpt2,
)

pytestmark = [pytest.mark.slow, needs("transformers")]

STEPS, SAVE_AT, BATCH = 8, 5, 2  # 64 windows over 4 ranks: one epoch


def _train(rank: int, world_size: int, out: str, resume: str | None = None,
           clip: bool = True, **arguments) -> dict:  # fmt: skip
    """The README's recipe, saving every SAVE_AT steps."""
    from transformers import Trainer, TrainingArguments

    import onebit
    from onebit.integrations.transformers import OnebitCallback, create_optimizer, shard_hsdp

    launched_as(rank, world_size)
    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-2,
        max_grad_norm=1.0, save_steps=SAVE_AT, logging_steps=1, report_to=[], use_cpu=True,
        seed=0, disable_tqdm=True, **arguments,
    )  # fmt: skip
    model = tiny_gpt2()
    replicas = shard_hsdp(model, model.transformer.h, args, shards=2)
    optimizer = create_optimizer(
        model, args, onebit.OnebitAdam, freeze_step=FREEZE, process_group=replicas,
        max_grad_norm=1.0 if clip else None,
    )  # fmt: skip
    batches = []
    model.register_forward_pre_hook(
        lambda _, args, kwargs: batches.append(kwargs["input_ids"].clone()), with_kwargs=True
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=text_windows(64),
        eval_dataset=text_windows(8),
        optimizers=(optimizer, None),
    )
    trainer.add_callback(OnebitCallback(trainer))
    trainer.train(resume_from_checkpoint=resume)
    return {
        "shard": torch.distributed.get_rank() % 2,
        "params": [p.detach().to_local().clone() for p in model.parameters()],
        "batches": batches,
        "stats": optimizer.comm_stats,
        "frozen": not optimizer.in_warmup,
    }


def _train_and_resume(rank: int, world_size: int, out: str) -> tuple[dict, dict]:
    first = _train(rank, world_size, out)
    return first, _train(rank, world_size, out, f"{out}/checkpoint-{SAVE_AT}")


def test_the_recipe_trains_with_one_bit_reads_distinct_data_and_resumes_exactly(tmp_path):
    out = str(tmp_path / "run")
    runs, resumed = zip(*run_ranks(_train_and_resume, 4, out, timeout=400, frameworks=True))
    for run in runs:
        assert run["frozen"] and len(run["batches"]) == STEPS
        assert run["stats"].steps["compression"] == STEPS - FREEZE
    assert_hybrid_shards_trained(runs)
    assert not all_equal(runs[0]["params"], runs[1]["params"])
    saved = Path(out) / f"checkpoint-{SAVE_AT}"
    assert {"model.safetensors", "onebit", "scheduler.pt"} <= {p.name for p in saved.iterdir()}
    assert (saved / "onebit" / ".metadata").is_file()
    assert_resumed_from(runs, resumed, SAVE_AT)


def _refusals(rank: int, world_size: int, out: str) -> dict[str, str]:
    from transformers import TrainerState

    if rank == 0:  # a Trainer checkpoint without onebit's part
        state = TrainerState(train_batch_size=BATCH, logging_steps=1, save_steps=SAVE_AT)
        state.save_to_json(f"{out}/trainer_state.json")
    torch.distributed.barrier()
    errors = {}
    for name, kwargs in [
        ("clip", {"clip": False}),
        ("fsdp", {"fsdp": True, "fsdp_config": {"version": 2}}),
        ("best", {"load_best_model_at_end": True, "eval_strategy": "steps"}),
        ("resume", {"resume": out}),
    ]:
        try:
            _train(rank, world_size, out, **kwargs)
        except ValueError as err:
            errors[name] = str(err)
    return errors


def test_what_would_go_wrong_raises_on_every_rank_with_the_fix(tmp_path):
    out = tmp_path / "not-a-checkpoint"
    out.mkdir()
    for errors in run_ranks(_refusals, 4, str(out), timeout=400, frameworks=True):
        assert "pass max_grad_norm=1.0 to it" in errors["clip"]
        assert "load_best_model_at_end=True is not supported" in errors["best"]
        assert "leave fsdp out, shard_hsdp shards the model" in errors["fsdp"]
        assert "onebit is missing: resume_from_checkpoint needs" in errors["resume"]
