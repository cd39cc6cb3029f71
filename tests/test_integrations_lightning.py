"""PyTorch Lightning with a onebit optimizer, on 2 gloo ranks (DDP on CPU, where Lightning
ignores ``ddp_comm_hook``): 1-bit traffic, the same training as a plain loop, exact resume
from Lightning's checkpoints, 16-mixed with its GradScaler, and an inf on one rank."""

import pytest
import torch
from distributed import run_ranks
from frameworks import (
    check_an_inf_on_one_rank_skips_everywhere,
    check_plain_loop_and_exact_resume,
    launched_as,
    needs,
    onebit_adam,
    replay,
    text_windows,
    tiny_gpt2,
)

pytestmark = [pytest.mark.slow, needs("lightning")]

EPOCHS, STEPS_PER_EPOCH, BATCH = 2, 4, 4  # 32 windows over 2 ranks


def _fit(rank, world_size, out, *, resume=None, precision="32-true", inf_at=None, clip=1.0):
    import lightning.pytorch as pl

    from onebit.integrations.lightning import OnebitCallback

    launched_as(rank, world_size)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2(seed=1 if resume else 0)
            self.batches = []

        def training_step(self, batch, index):
            self.batches.append(batch)
            loss = self.model(**batch).loss
            if rank == 1 and self.global_step + 1 == inf_at:
                loss = loss * float("inf")
            return loss

        def configure_optimizers(self):
            return onebit_adam(self, clip)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(text_windows(32), batch_size=BATCH)

    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy="ddp", max_epochs=EPOCHS,
        precision=precision, gradient_clip_val=1.0, default_root_dir=out, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[
            OnebitCallback(),
            pl.callbacks.ModelCheckpoint(dirpath=out, save_top_k=-1, every_n_epochs=1),
        ],
    )  # fmt: skip
    trainer.fit(module, ckpt_path=resume)
    assert trainer.gradient_clip_val == 1.0  # handed to the optimizer for the run, then back
    optimizer = trainer.optimizers[0]
    params = [p.detach().clone() for p in module.model.parameters()]
    return params, module.batches, optimizer.comm_stats, optimizer.skipped_steps


def _fit_then_replay(rank, world_size, out):
    params, batches, stats, _ = _fit(rank, world_size, out)
    plain, fp32 = replay(batches)
    return params, plain, stats, fp32


def _resume(rank, world_size, out):
    return _fit(rank, world_size, out, resume=f"{out}/epoch=0-step={STEPS_PER_EPOCH}.ckpt")[0]


def test_lightning_is_a_plain_loop_sends_one_bit_and_resumes_exactly(tmp_path):
    check_plain_loop_and_exact_resume(_fit_then_replay, _resume, str(tmp_path / "checkpoints"))


def _fp16_with_inf(rank, world_size, out, inf_at):
    params, _, _, skipped = _fit(rank, world_size, out, precision="16-mixed", inf_at=inf_at)
    return params, skipped


def test_16_mixed_and_an_inf_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    check_an_inf_on_one_rank_skips_everywhere(_fp16_with_inf, str(tmp_path / "checkpoints"))


def _local_clipping(rank, world_size, out):
    try:
        _fit(rank, world_size, out, clip=None)
    except ValueError as err:
        return str(err)


def test_lightning_clipping_the_optimizer_does_not_do_is_a_clear_error_on_every_rank(tmp_path):
    errors = run_ranks(
        _local_clipping, 2, str(tmp_path / "checkpoints"), timeout=240, frameworks=True
    )
    assert all("gradient_clip_val=1.0) would clip each rank" in e for e in errors)
