"""Lightning's ``ModelParallelStrategy`` with FSDP2 hybrid sharding and a onebit optimizer, on 4
gloo ranks as 2 replicas x 2 shards: the README's recipe trains with 1-bit traffic between
replicas, every rank reads its own batches, the ranks that hold the same shard stay bitwise
equal, and ``ckpt_path=`` resumes bit for bit from ``ModelCheckpoint``'s checkpoint taken after
the freeze. What would go wrong raises on every rank, naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from frameworks import (
    FREEZE,
    Probe,
    assert_hybrid_shards_trained,
    assert_resumed_from,
    launched_as,
    needs,
    text_windows,
)

pytestmark = [pytest.mark.slow, needs("lightning", "transformers")]

EPOCHS, STEPS_PER_EPOCH, BATCH = 2, 4, 2  # 32 windows over 4 ranks


def _fit(rank: int, world_size: int, out: str, resume: str | None = None, clip: bool = True,
         **strategy: bool) -> dict:  # fmt: skip
    """The README's recipe, with a checkpoint at each epoch's end."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    import onebit
    from onebit.integrations.lightning import OnebitCallback

    launched_as(rank, world_size)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.batches = Probe(), []

        def configure_model(self) -> None:
            shard = self.device_mesh["tensor_parallel"]
            for block in self.model.gpt.transformer.h:
                fully_shard(block, mesh=shard)
            fully_shard(self.model, mesh=shard)

        def configure_optimizers(self) -> onebit.OnebitAdam:
            replicas = self.device_mesh["data_parallel"].get_group()
            return onebit.OnebitAdam(self.parameters(), warmup_compression="fp32", lr=1e-2,
                                     freeze_step=FREEZE, max_grad_norm=1.0 if clip else None,
                                     process_group=replicas)  # fmt: skip

        def training_step(self, batch: dict, index: int) -> torch.Tensor:
            self.batches.append(batch["input_ids"].clone())
            return self.model(**batch)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(text_windows(32), batch_size=BATCH)

    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, max_epochs=EPOCHS, gradient_clip_val=1.0,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, **strategy),
        default_root_dir=out, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            OnebitCallback(),
            pl.callbacks.ModelCheckpoint(dirpath=out, save_top_k=-1, every_n_epochs=1),
        ],
    )  # fmt: skip
    trainer.fit(module, ckpt_path=resume)
    optimizer = trainer.optimizers[0]
    return {
        "shard": trainer.strategy.device_mesh["tensor_parallel"].get_local_rank(),
        "params": [p.detach().to_local().clone() for p in module.model.parameters()],
        "batches": module.batches,
        "stats": optimizer.comm_stats,
        "frozen": not optimizer.in_warmup,
    }


def _fit_and_resume(rank: int, world_size: int, out: str) -> tuple[dict, dict]:
    first = _fit(rank, world_size, out)
    return first, _fit(rank, world_size, out, f"{out}/epoch=0-step={STEPS_PER_EPOCH}.ckpt")


def test_the_recipe_trains_with_one_bit_reads_distinct_data_and_resumes_exactly(tmp_path):
    out = str(tmp_path / "checkpoints")
    runs, resumed = zip(*run_ranks(_fit_and_resume, 4, out, timeout=400, frameworks=True))
    steps = EPOCHS * STEPS_PER_EPOCH
    for run in runs:
        assert run["frozen"] and len(run["batches"]) == steps
        assert run["stats"].steps["compression"] == steps - FREEZE
    assert_hybrid_shards_trained(runs)
    assert any(p.numel() == 0 for p in runs[1]["params"])  # Probe's empty shards
    saved = Path(out) / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
    assert sorted(p.name for p in (saved / "onebit").iterdir()) == [
        f"rank_{rank}.pt" for rank in range(4)
    ]
    assert_resumed_from(runs, resumed, STEPS_PER_EPOCH)


def _refusals(rank: int, world_size: int, out: str) -> dict[str, str]:
    errors = {}
    for name, kwargs in [
        ("clip", {"clip": False}),
        ("gathered", {"save_distributed_checkpoint": False}),
        ("resume", {"resume": out}),
    ]:
        try:
            _fit(rank, world_size, out, **kwargs)
        except ValueError as err:
            errors[name] = str(err)
    return errors


def test_what_would_go_wrong_raises_on_every_rank_with_the_fix(tmp_path):
    out = tmp_path / "not-a-checkpoint"
    out.mkdir()
    for rank, errors in enumerate(run_ranks(_refusals, 4, str(out), timeout=400, frameworks=True)):
        assert "build the optimizer with max_grad_norm=1.0" in errors["clip"]
        assert "keep the default, True" in errors["gathered"]
        assert f"onebit/rank_{rank}.pt is missing" in errors["resume"]
