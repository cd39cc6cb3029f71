"""PyTorch Lightning with FSDP2 inside a node and 1-bit Adam across nodes (hybrid sharding).

    torchrun --nproc-per-node 4 examples/lightning_hsdp.py            # 2 emulated nodes of 2
    torchrun --nproc-per-node 4 examples/lightning_hsdp.py --out ckpt # and save a checkpoint

``ModelParallelStrategy(data_parallel_size=nodes, tensor_parallel_size=gpus)`` builds a 2-D
mesh. ``configure_model`` shards the model with FSDP2 on its ``"tensor_parallel"`` dimension
(inside a node), and ``configure_optimizers`` builds the optimizer with the ``"data_parallel"``
dimension's process group (across nodes). FSDP2 reduce-scatters the gradients inside each node;
``optimizer.step()`` averages each rank's shard across the nodes, in int4 until Adam's variance
settles (by a fifth of the run), then in 1 bit. ``OnebitCallback`` gives every rank its own
batches and keeps each rank's optimizer state in ``trainer.save_checkpoint``'s checkpoint."""

import os
import warnings

import lightning.pytorch as pl
import torch
from common import (
    arguments,
    close_process_group,
    evaluate,
    gpu_per_rank,
    log_step,
    report,
    text_data,
    tiny_gpt2,
)
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

import onebit
from onebit.integrations.lightning import OnebitCallback

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class GPT(pl.LightningModule):
    def __init__(self, lr, steps):
        super().__init__()
        self.model, self.lr, self.steps = tiny_gpt2(), lr, steps

    def configure_model(self):
        shard = self.device_mesh["tensor_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=shard)
        fully_shard(self.model, mesh=shard)

    def configure_optimizers(self):
        return onebit.OnebitAdam(
            self.parameters(),
            lr=self.lr,
            total_steps=self.steps,
            max_grad_norm=1.0,  # = gradient_clip_val: OnebitCallback hands the clipping over
            process_group=self.device_mesh["data_parallel"].get_group(),
        )

    def training_step(self, batch, index):
        return self.model(**batch).loss

    def on_train_batch_end(self, outputs, batch, index):
        if self.global_step % 20 == 0 or self.global_step == 1:
            log_step(self.global_step, outputs["loss"].item(), self.optimizers())


parser = arguments(__doc__.splitlines()[0])
parser.add_argument("--shard", type=int, default=2, help="ranks per node (FSDP2 shards over them)")
parser.add_argument("--out", default=None, help="trainer.save_checkpoint here at the end")
args = parser.parse_args()
ranks = int(os.environ.get("WORLD_SIZE", 1))
train, val = text_data()
trainer = pl.Trainer(
    accelerator="gpu" if gpu_per_rank() else "cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
    strategy=ModelParallelStrategy(
        data_parallel_size=ranks // args.shard, tensor_parallel_size=args.shard
    ),  # fmt: skip
    max_steps=args.steps,
    gradient_clip_val=1.0,
    callbacks=[OnebitCallback()],
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
module = GPT(args.lr, args.steps)
loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True)
trainer.fit(module, train_dataloaders=loader)
if args.out:
    trainer.save_checkpoint(args.out)

report(trainer.optimizers[0], evaluate(module.model, val, device=module.device))
close_process_group()
