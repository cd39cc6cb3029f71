"""PyTorch Lightning with 1-bit Adam: a LightningModule whose ``configure_optimizers`` returns
``onebit.OnebitAdam``, trained by ``Trainer(strategy="ddp")``.

    torchrun --nproc-per-node 2 examples/lightning_module.py
    python examples/lightning_module.py        # one process: trains, sends nothing

Two changes to a Lightning script: ``configure_optimizers`` returns the onebit optimizer, built
with ``max_grad_norm`` equal to the Trainer's ``gradient_clip_val``; and ``OnebitCallback()``
joins the Trainer's callbacks. It hands the gradient communication of the DDP model Lightning
builds to the optimizer (on CPU/gloo as on GPUs), and Lightning's clipping, which would clip
each rank's local gradient, to the optimizer's clipping of the averaged one. Under torchrun
Lightning takes its ranks from the torchrun environment; ``devices`` must be the number of
processes per node.
"""

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

import onebit
from onebit.integrations.lightning import OnebitCallback

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class GPT(pl.LightningModule):
    def __init__(self, lr, steps):
        super().__init__()
        self.model, self.lr, self.steps = tiny_gpt2(), lr, steps

    def training_step(self, batch, index):
        return self.model(**batch).loss

    def on_train_batch_end(self, outputs, batch, index):
        if self.global_step % 20 == 0 or self.global_step == 1:
            log_step(self.global_step, outputs["loss"].item(), self.optimizers())

    def configure_optimizers(self):
        return onebit.OnebitAdam(
            self.parameters(),
            lr=self.lr,
            total_steps=self.steps,
            max_grad_norm=1.0,  # = gradient_clip_val: OnebitCallback hands the clipping over
        )


parser = arguments(__doc__.splitlines()[0])
parser.add_argument("--precision", default="32-true", help="Lightning's, e.g. bf16-mixed, 16-mixed")
args = parser.parse_args()
train, val = text_data()
trainer = pl.Trainer(
    accelerator="gpu" if gpu_per_rank() else "cpu",
    precision=args.precision,
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
    strategy="ddp",
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

# Every rank holds the same parameters: 1-bit Adam applies the same averaged update everywhere.
report(trainer.optimizers[0], evaluate(module.model, val, device=module.device))
close_process_group()
