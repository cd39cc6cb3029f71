"""Train with Hugging Face Accelerate and a onebit optimizer.

Replace ``accelerator.prepare`` with :func:`prepare` for the model and its onebit optimizer::

    from onebit.integrations.accelerate import prepare

    optimizer = onebit.OnebitAdam(model.parameters(), lr=3e-4, freeze_step=1000,
                                  max_grad_norm=1.0)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader)

What :func:`prepare` configures:

* it calls ``accelerator.prepare`` with everything given, unchanged;
* it registers :func:`onebit.ddp_comm_hook` on the DDP model Accelerate builds, so DDP sends
  nothing and the optimizer does all gradient communication
  (``DistributedDataParallelKwargs(comm_hook=...)`` takes only Accelerate's own enum and drops
  a callable);
* it registers a ``save_state`` pre-hook that gathers every rank's error-feedback state into
  the one optimizer file rank 0 writes, so ``accelerator.load_state`` resumes every rank
  exactly.

What the user still does: build the optimizer after ``Accelerator()`` (which sets up
``torch.distributed``) and on the model's parameters; clip with the optimizer's
``max_grad_norm``, not ``accelerator.clip_grad_norm_``, which clips each rank's local gradient
(see the README's clipping rules); and, to resume mid-epoch, skip the consumed batches with
``accelerator.skip_first_batches`` as usual. ``mixed_precision="bf16"`` or ``"fp16"``,
``accelerator.accumulate`` and ``accelerator.backward`` work unchanged.
``ProjectConfiguration(save_on_each_node=True)`` is refused: only global rank 0 holds the
gathered state.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator

from ._common import hand_gradients_to, onebit_optimizer


def prepare(accelerator: Accelerator, model: Any, optimizer: Any, *others: Any) -> tuple[Any, ...]:
    """``accelerator.prepare(model, optimizer, *others)`` for a onebit optimizer.

    Returns what ``accelerator.prepare`` returns, in the same order. Call it on every rank,
    once per optimizer.
    """
    inner = onebit_optimizer(optimizer, "onebit.integrations.accelerate.prepare")
    if accelerator.project_configuration.save_on_each_node and accelerator.num_processes > 1:
        raise ValueError(
            "save_on_each_node=True is not supported; the optimizer's per-rank state is "
            "gathered on global rank 0 only"
        )
    prepared = accelerator.prepare(model, optimizer, *others)
    hand_gradients_to(prepared[0], inner)
    accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: inner.consolidate_state_dict(to=0)
    )
    return prepared
