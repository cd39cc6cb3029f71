"""Train with Hugging Face ``transformers.Trainer`` and a onebit optimizer.

Three lines in the user's script::

    from onebit.integrations.transformers import OnebitCallback, create_optimizer

    optimizer = create_optimizer(model, args, onebit.OnebitAdam, freeze_step=1000)
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

What the user still does: pick ``freeze_step`` (or ``"auto"``, which ``max_steps`` bounds),
pass ``optimizers=(optimizer, None)`` and add the callback. Trainer's schedulers,
``bf16``/``fp16``, gradient accumulation and logging work unchanged. ``save_on_each_node`` is
refused: only global rank 0 holds the gathered state.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_pt_utils import get_parameter_names

from ..adam import OnebitAdam
from ..base import CompressedOptimizer, onebit_optimizer
from ..freeze import AutoFreeze
from ..zero_one_adam import ZeroOneAdam
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
    ``args.max_steps`` set, it tells the optimizer the run's length: ``freeze_step="auto"``
    then freezes by a quarter of it at the latest (``AutoFreeze(total_steps=max_steps)``), and
    0/1 Adam sizes its local steps to it (``total_steps``). It sets up ``torch.distributed``
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
        if issubclass(optimizer_class, ZeroOneAdam):
            settings["total_steps"] = args.max_steps
        elif kwargs.get("freeze_step") == "auto":
            settings["auto_freeze"] = AutoFreeze(total_steps=args.max_steps)
    return optimizer_class([g for g in groups if g["params"]], **{**settings, **kwargs})


class OnebitCallback(TrainerCallback):
    """Hands a ``Trainer``'s gradient communication, clipping and checkpoints to its onebit
    optimizer; see the module docstring for what it configures."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._max_grad_norm: float | None = None

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
        if control.should_save and not args.save_only_model:
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
