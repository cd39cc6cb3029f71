"""Train with Hugging Face ``transformers.Trainer`` and a onebit optimizer.

Three lines in the user's script::

    from onebit.integrations.transformers import OnebitCallback, create_optimizer

    optimizer = create_optimizer(model, args, onebit.OnebitAdam)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None))
    trainer.add_callback(OnebitCallback(trainer))

What :func:`create_optimizer` and :class:`OnebitCallback` configure:

* the optimizer gets ``TrainingArguments``' ``learning_rate``, ``adam_beta1/2``,
  ``adam_epsilon`` and ``weight_decay`` (not on biases and norms, as Trainer's AdamW), and
  ``max_grad_norm`` as its own cross-rank clipping;
* at ``on_train_begin`` the DDP model Trainer built gets :func:`onebit.ddp_comm_hook`, so
  DDP sends nothing and the optimizer does all gradient communication
  (``TrainingArguments`` cannot pass a comm hook);
* Trainer's own clipping, which would clip each rank's local gradient, is turned off for the
  run (``args.max_grad_norm`` is 0 while training and restored after): the optimizer clips
  instead, at the same norm;
* before each checkpoint the callback gathers every rank's error-feedback state into the one
  ``optimizer.pt`` that rank 0 writes, so ``trainer.train(resume_from_checkpoint=...)`` resumes
  every rank exactly.

Trainer's logged ``grad_norm`` is rank 0's local gradient norm, since gradients are averaged
inside ``optimizer.step()``; ``optimizer.grad_norm`` is the norm the clipping used.

What the user still does: pass ``optimizers=(optimizer, None)`` and add the callback.
Trainer's schedulers, ``bf16``/``fp16``, gradient accumulation and logging work unchanged.
``save_on_each_node`` is refused: only global rank 0 holds the gathered state.

With FSDP2 (hybrid sharding: FSDP2 inside a node, 1-bit Adam across nodes), :func:`shard_hsdp`
shards the model and returns the process group the optimizer averages over; leave ``fsdp`` out
of ``TrainingArguments`` (Trainer's FSDP would shard again, and average across nodes itself)::

    replicas = shard_hsdp(model, model.transformer.h, args)
    optimizer = create_optimizer(model, args, onebit.OnebitAdam, process_group=replicas)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None))
    trainer.add_callback(OnebitCallback(trainer))

Given a sharded optimizer, :class:`OnebitCallback` calls :func:`onebit.fsdp.attach` and tells
Trainer the model places and averages itself (no DDP around it; every rank still reads its own
batches). Each checkpoint then holds the gathered model (``model.safetensors``, as usual) and
``onebit/``, the sharded model and optimizer with every rank's error buffers, written by
:func:`onebit.fsdp.save`; ``resume_from_checkpoint`` loads that with :func:`onebit.fsdp.load`,
bit for bit on the same mesh. ``load_best_model_at_end`` is refused.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_pt_utils import get_parameter_names

from ..fsdp import attach, load, save
from ..optim.adam import OnebitAdam
from ..optim.base import CompressedOptimizer, onebit_optimizer
from ..transport.sharding import Sharded
from ._common import hand_gradients_to

# Trainer.get_decay_parameter_names: no weight decay on biases and norms.
_NO_DECAY = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def create_optimizer(
    model: torch.nn.Module,
    args: TrainingArguments,
    optimizer_class: type[CompressedOptimizer] = OnebitAdam,
    **kwargs: Any,
) -> CompressedOptimizer:
    """Build ``optimizer_class`` on ``model`` with the hyperparameters Trainer gives AdamW.

    Reads ``learning_rate``, ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``,
    ``weight_decay`` (two param groups, as Trainer's) and ``max_grad_norm`` from ``args``;
    ``kwargs`` (``freeze_step``, ``bucket_size``...) are passed on and take precedence. With
    ``args.max_steps`` set, it tells the optimizer the run's length (``total_steps``):
    ``freeze_step="auto"`` then freezes by a fifth of it at the latest, and 0/1 Adam sizes its
    local steps to it. It sets up ``torch.distributed``
    first, as Trainer would, so that under ``torchrun`` every rank builds the optimizer in the
    same process group.
    """
    args.device  # noqa: B018 - initialises the process group under torchrun
    weight_decay = kwargs.pop("weight_decay", args.weight_decay)
    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], _NO_DECAY))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    settings: dict[str, Any] = {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "max_grad_norm": args.max_grad_norm if args.max_grad_norm > 0 else None,
    }
    if args.max_steps > 0:
        settings["total_steps"] = args.max_steps
    return optimizer_class([g for g in groups if g["params"]], **{**settings, **kwargs})


def shard_hsdp(
    model: nn.Module,
    blocks: Iterable[nn.Module],
    args: TrainingArguments,
    shards: int | None = None,
    **fully_shard_kwargs: Any,
) -> dist.ProcessGroup:
    """Shard ``model`` with FSDP2 over the ``shards`` ranks of each node, each of ``blocks``
    and then the model, and return the process group across nodes (the ranks that hold the
    same shard) to build the onebit optimizer with.

    ``shards`` defaults to the ranks per node (``LOCAL_WORLD_SIZE``, as torchrun sets it);
    ``fully_shard_kwargs`` (``mp_policy``, ``reshard_after_forward``...) go to every
    ``fully_shard``. It sets up ``torch.distributed`` first, as Trainer would.

    Raises:
        ValueError: with ``fsdp`` in ``args``, outside ``torch.distributed``, or if ``shards``
            does not divide the world.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if args.fsdp:
        raise ValueError(
            f"TrainingArguments(fsdp={args.fsdp!r}) would make Trainer shard the model again, "
            "on a mesh where FSDP2 averages across nodes in fp32: leave fsdp out, shard_hsdp "
            "shards the model"
        )
    device = args.device  # initialises the process group under torchrun
    if not dist.is_initialized():
        raise ValueError("shard_hsdp needs torch.distributed: launch with torchrun")
    world = dist.get_world_size()
    shards = shards or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if shards < 1 or world % shards:
        raise ValueError(f"shards={shards} ranks per node does not divide the {world} ranks")
    mesh = init_device_mesh(
        device.type, (world // shards, shards), mesh_dim_names=("replicate", "shard")
    )
    for block in blocks:
        fully_shard(block, mesh=mesh["shard"], **fully_shard_kwargs)
    fully_shard(model, mesh=mesh["shard"], **fully_shard_kwargs)
    return mesh["replicate"].get_group()


class OnebitCallback(TrainerCallback):
    """Hands a ``Trainer``'s gradient communication, clipping and checkpoints to its onebit
    optimizer; see the module docstring for what it configures."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._max_grad_norm: float | None = None
        self._sharded = trainer.optimizer is not None and isinstance(
            self._optimizer(trainer.optimizer).shards, Sharded
        )
        if self._sharded:
            _ShardedTrainer(trainer, self._optimizer(trainer.optimizer))
        elif hasattr(trainer, "_get_grad_norm"):
            trainer._get_grad_norm = _local_grad_norm

    def _optimizer(self, optimizer: Any) -> CompressedOptimizer:
        return onebit_optimizer(optimizer, "OnebitCallback (Trainer(optimizers=(opt, None)))")

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        optimizer = self._optimizer(kwargs.get("optimizer"))
        if args.save_on_each_node and args.world_size > 1:
            raise ValueError(
                "OnebitCallback: save_on_each_node=True is not supported; the optimizer's "
                "per-rank state is gathered on global rank 0 only"
            )
        if args.max_grad_norm and args.max_grad_norm > 0:
            if optimizer.max_grad_norm != args.max_grad_norm:
                raise ValueError(
                    f"TrainingArguments(max_grad_norm={args.max_grad_norm}) would clip each "
                    "rank's local gradient; build the optimizer with "
                    "onebit.integrations.transformers.create_optimizer(model, args, ...), or pass "
                    f"max_grad_norm={args.max_grad_norm} to it, or set max_grad_norm=0 "
                    f"(the optimizer has max_grad_norm={optimizer.max_grad_norm})"
                )
            self._max_grad_norm, args.max_grad_norm = args.max_grad_norm, 0.0
        hand_gradients_to(self.trainer.model_wrapped, optimizer)

    def _before_save(
        self, args: TrainingArguments, control: TrainerControl, optimizer: Any
    ) -> None:
        if control.should_save and not args.save_only_model and not self._sharded:
            self._optimizer(optimizer).consolidate_state_dict(to=0)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._before_save(args, control, kwargs.get("optimizer"))

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._before_save(args, control, kwargs.get("optimizer"))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._max_grad_norm is not None:
            args.max_grad_norm, self._max_grad_norm = self._max_grad_norm, None


def _local_grad_norm(model: nn.Module, grad_norm: Any = None) -> Any:
    """Trainer's logged ``grad_norm`` (this rank's local gradient's), read without writing
    ``.grad``: Trainer's own takes it with ``clip_grad_norm_(..., inf)``, which multiplies every
    gradient by 1 in place, and the optimizer refuses gradients written after backward."""
    if grad_norm is not None:
        return grad_norm
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


class _ShardedTrainer:
    """Trainer's model placement and checkpoints for a model :func:`shard_hsdp` sharded.

    Trainer's flag for models sharded when loaded (``is_distributed_loading_by_transformers``)
    keeps Accelerate from wrapping the model in DDP or sharding it again. Trainer would save
    the optimizer's state from rank 0 alone, which holds one shard and one rank's error buffers;
    so each checkpoint's ``onebit/`` holds what :func:`onebit.fsdp.save` writes, and resuming
    loads the model and the optimizer from there."""

    def __init__(self, trainer: Trainer, optimizer: CompressedOptimizer) -> None:
        if trainer.is_fsdp_enabled:
            raise ValueError(
                "a model sharded by shard_hsdp needs no FSDP in TrainingArguments (or "
                "Accelerate's config): Trainer's FSDP would shard it again, on a mesh where "
                "FSDP2 averages across nodes in fp32"
            )
        if trainer.args.load_best_model_at_end:
            raise ValueError(
                "load_best_model_at_end=True is not supported with a model sharded by "
                "shard_hsdp: load the best checkpoint with onebit.fsdp.load"
            )
        if not hasattr(trainer, "is_distributed_loading_by_transformers"):
            raise ValueError(
                "this transformers has no Trainer.is_distributed_loading_by_transformers, "
                "which shard_hsdp needs: install transformers>=5.23"
            )
        attach(trainer.model, optimizer)
        self.trainer, self.optimizer = trainer, optimizer
        trainer.is_distributed_loading_by_transformers = True
        self._save = trainer._save
        trainer._save = self.save_model
        trainer._save_optimizer_and_scheduler = self.save_optimizer_and_scheduler
        trainer._load_from_checkpoint = self.load_model
        trainer._load_optimizer_and_scheduler = self.load_optimizer_and_scheduler

    def save_model(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if state_dict is None:  # a collective: every rank is here
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state_dict = get_model_state_dict(self.trainer.model, options=options)
        self._save(output_dir, state_dict)

    def save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save(self.trainer.model, self.optimizer, os.path.join(output_dir, "onebit"))
        if self.trainer.args.should_save and self.trainer.lr_scheduler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the scheduler's warning about saving it
                torch.save(self.trainer.lr_scheduler.state_dict(), _scheduler(output_dir))

    def load_model(self, checkpoint: str, model: nn.Module | None = None) -> None:
        """Nothing: the model is loaded with the optimizer, from ``onebit/``."""

    def load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        folder = os.path.join(checkpoint, "onebit")
        if not os.path.isdir(folder):
            raise ValueError(
                f"{folder} is missing: resume_from_checkpoint needs a checkpoint saved by Trainer "
                "with OnebitCallback and a model sharded by shard_hsdp"
            )
        load(self.trainer.model, self.optimizer, folder)
        if self.trainer.lr_scheduler is not None and os.path.isfile(_scheduler(checkpoint)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                state = torch.load(_scheduler(checkpoint), weights_only=True)
            self.trainer.lr_scheduler.load_state_dict(state)


def _scheduler(folder: str) -> str:
    return os.path.join(folder, "scheduler.pt")
