"""Train with PyTorch Lightning and a onebit optimizer.

Return the optimizer from ``configure_optimizers`` and add the callback::

    from onebit.integrations.lightning import OnebitCallback

    class Model(L.LightningModule):
        def configure_optimizers(self):
            return onebit.OnebitAdam(self.parameters(), lr=3e-4, freeze_step=1000,
                                     max_grad_norm=1.0)

    trainer = L.Trainer(strategy="ddp", callbacks=[OnebitCallback()], ...)

What :class:`OnebitCallback` configures, at ``on_fit_start``:

* it registers :func:`onebit.ddp_comm_hook` on the DDP model the strategy built, on CPU/gloo
  and on CUDA/NCCL alike (``DDPStrategy(ddp_comm_hook=...)`` is applied on CUDA only, and before
  ``configure_optimizers`` has built the optimizer the hook needs);
* with ``Trainer(gradient_clip_val=c)`` (by norm) and an optimizer built with
  ``max_grad_norm=c``, it turns Lightning's clipping off for the run, so the optimizer's
  cross-rank clipping is the only one; any other ``gradient_clip_val`` is an error, since
  Lightning would clip each rank's local gradient.

Checkpoints need nothing: Lightning calls the optimizer's ``consolidate_state_dict()`` on every
rank before rank 0 writes, so ``trainer.fit(..., ckpt_path=...)`` resumes every rank exactly.
Precision plugins (``"16-mixed"``, ``"bf16-mixed"``) and ``accumulate_grad_batches`` work
unchanged. Exact resume from a mid-epoch checkpoint also needs a dataloader that Lightning can
restore to its position; with a plain ``DataLoader``, checkpoint at epoch ends.
"""

from __future__ import annotations

import lightning.pytorch as pl

from ..base import onebit_optimizer
from ._common import hand_gradients_to


class OnebitCallback(pl.Callback):
    """Hands a Lightning ``Trainer``'s DDP gradient communication and clipping to its onebit
    optimizer; see the module docstring."""

    def __init__(self) -> None:
        self._clip: float | None = None  # Lightning's gradient_clip_val, while it is handed over

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"OnebitCallback needs exactly one optimizer, got {len(trainer.optimizers)}: a "
                "DDP model has one communication hook, given to one onebit optimizer"
            )
        optimizer = onebit_optimizer(trainer.optimizers[0], "OnebitCallback")
        clip = trainer.gradient_clip_val
        if clip:
            by_norm = trainer.gradient_clip_algorithm in (None, "norm")
            if not by_norm or optimizer.max_grad_norm != clip:
                raise ValueError(
                    f"Trainer(gradient_clip_val={clip}) would clip each rank's local gradient; "
                    f"build the optimizer with max_grad_norm={clip} (clipping by norm) and "
                    "OnebitCallback hands clipping to it, or drop gradient_clip_val "
                    f"(the optimizer has max_grad_norm={optimizer.max_grad_norm})"
                )
            self._clip, trainer.gradient_clip_val = clip, None
        hand_gradients_to(trainer.strategy.model, optimizer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._clip is not None:
            trainer.gradient_clip_val, self._clip = self._clip, None
