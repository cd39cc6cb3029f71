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

With FSDP2 (hybrid sharding: FSDP2 inside a node, 1-bit Adam across nodes), use
``ModelParallelStrategy``: its ``"tensor_parallel"`` dimension is the shard dimension, on which
``configure_model`` shards the model, and its ``"data_parallel"`` dimension the one onebit
averages over::

    class Model(L.LightningModule):
        def configure_model(self):
            shard = self.device_mesh["tensor_parallel"]
            for block in self.gpt.transformer.h:
                fully_shard(block, mesh=shard)
            fully_shard(self.gpt, mesh=shard)

        def configure_optimizers(self):
            return onebit.OnebitAdam(self.parameters(), lr=3e-4, max_grad_norm=1.0,
                                     process_group=self.device_mesh["data_parallel"].get_group())

    strategy = ModelParallelStrategy(data_parallel_size=nodes, tensor_parallel_size=gpus)
    trainer = L.Trainer(strategy=strategy, callbacks=[OnebitCallback()], ...)

There :class:`OnebitCallback` calls :func:`onebit.fsdp.attach`; gives every rank its own batches
(the strategy's sampler would split the data over the ``"data_parallel"`` dimension only, so
the shards of one replica would read the same batches); and makes ``trainer.save_checkpoint``
(``ModelCheckpoint`` too) write each rank's error buffers, counters and schedule beside the
strategy's distributed checkpoint (``onebit/rank_<rank>.pt``), which ``ckpt_path=`` resumes
exactly from, on the same mesh. ``save_distributed_checkpoint=False`` is refused, as is
``FSDPStrategy`` (FSDP1 flattens the parameters the optimizer steps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from ..fsdp import attach, resuming, write_rank_state
from ..optim.base import CompressedOptimizer, onebit_optimizer
from ._common import hand_gradients_to

_RECIPE = (
    "shard the model in configure_model with fully_shard(module, mesh=self.device_mesh["
    '"tensor_parallel"]) for each block and the model, and build the optimizer in '
    'configure_optimizers with process_group=self.device_mesh["data_parallel"].get_group(): '
    "see onebit.integrations.lightning"
)


class OnebitCallback(pl.Callback):
    """Hands a Lightning ``Trainer``'s gradient communication, clipping and, with
    ``ModelParallelStrategy``, its sharded checkpoints to its onebit optimizer; see the module
    docstring."""

    def __init__(self) -> None:
        self._clip: float | None = None  # Lightning's gradient_clip_val, while it is handed over

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"OnebitCallback needs exactly one optimizer, got {len(trainer.optimizers)}: a "
                "DDP model has one communication hook, given to one onebit optimizer"
            )
        optimizer = onebit_optimizer(trainer.optimizers[0], "OnebitCallback")
        if isinstance(trainer.strategy, FSDPStrategy):
            raise ValueError(
                "onebit works with FSDP2 only, which Lightning runs as ModelParallelStrategy: "
                "FSDPStrategy's FSDP1 flattens the parameters the optimizer steps; " + _RECIPE
            )
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
        if isinstance(trainer.strategy, ModelParallelStrategy):
            _hybrid_shard(trainer.strategy, optimizer)
        else:
            hand_gradients_to(trainer.strategy.model, optimizer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._clip is not None:
            trainer.gradient_clip_val, self._clip = self._clip, None


def _hybrid_shard(strategy: ModelParallelStrategy, optimizer: CompressedOptimizer) -> None:
    """Attach the optimizer to the model sharded on the strategy's ``"tensor_parallel"``
    dimension, give every rank its own batches, and keep onebit's state in checkpoints."""
    if not strategy._save_distributed_checkpoint:
        raise ValueError(
            "ModelParallelStrategy(save_distributed_checkpoint=False) would gather the optimizer "
            "state on rank 0, without each rank's error buffers: keep the default, True"
        )
    try:
        attach(strategy.model, optimizer)
    except ValueError as err:
        raise ValueError(f"{err}; with ModelParallelStrategy, {_RECIPE}") from None
    mesh = strategy.device_mesh
    replicas = optimizer.world_size
    if optimizer.shards.mesh != mesh["tensor_parallel"] or replicas != mesh["data_parallel"].size():
        raise ValueError(
            "the optimizer averages over another group than the strategy's data_parallel "
            f"dimension: {_RECIPE}"
        )
    if type(strategy) is ModelParallelStrategy:
        strategy.__class__ = _EveryRankItsOwnBatches
    elif strategy.distributed_sampler_kwargs != _own_batches(strategy):
        raise ValueError(
            f"{type(strategy).__name__}.distributed_sampler_kwargs splits the data over the "
            "data_parallel dimension only, so the shards of one replica would read the same "
            f"batches: return {_own_batches(strategy)} (every rank its own batches)"
        )
    checkpoints = getattr(strategy.load_checkpoint, "__self__", None)
    if isinstance(checkpoints, _ShardedCheckpoints):
        checkpoints.optimizer = optimizer  # a later fit, with the optimizer it built anew
    else:
        _ShardedCheckpoints(strategy, optimizer)


def _own_batches(strategy: ModelParallelStrategy) -> dict[str, int]:
    return {"num_replicas": strategy.world_size, "rank": strategy.global_rank}


class _EveryRankItsOwnBatches(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose sampler gives every rank its own batches, as FSDP2 on the
    ``"tensor_parallel"`` dimension needs (tensor parallelism, which the strategy is built for,
    needs the same batches on that dimension)."""

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return _own_batches(self)


class _ShardedCheckpoints:
    """``save_checkpoint`` and ``load_checkpoint`` of the strategy, with each rank's part of the
    onebit optimizer's state (error buffers, counters, schedule) beside its distributed
    checkpoint, which leaves it out (see :func:`onebit.fsdp.resuming`)."""

    def __init__(self, strategy: ModelParallelStrategy, optimizer: CompressedOptimizer) -> None:
        self.strategy, self.optimizer = strategy, optimizer
        self._save, self._load = strategy.save_checkpoint, strategy.load_checkpoint
        strategy.save_checkpoint, strategy.load_checkpoint = self.save, self.load

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self._save(checkpoint, filepath, storage_options)
        write_rank_state(self.optimizer, Path(self.strategy.broadcast(filepath)))

    def load(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.strategy.broadcast(checkpoint_path))
        saver = "trainer.save_checkpoint with OnebitCallback and ModelParallelStrategy"
        fix = "save with onebit.fsdp.save and load with onebit.fsdp.load(..., reshard=True)"
        with resuming(self.optimizer, path, saver, fix):
            return self._load(checkpoint_path, weights_only)
