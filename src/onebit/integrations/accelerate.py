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
  exactly;
* ``accelerator.clip_grad_norm_`` on the optimizer's parameters raises: it would clip each
  rank's local gradient (the node's, under FSDP2). The optimizer's ``max_grad_norm`` clips the
  averaged gradient instead.

With FSDP2 (hybrid sharding: FSDP2 inside a node, 1-bit Adam across nodes) the model is
sharded by hand on the 1-D shard dimension of Accelerate's mesh and the optimizer built on it,
before :func:`prepare`; Accelerate's own sharding would use the 2-D mesh, where FSDP2 itself
averages across nodes in fp32::

    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
        parallelism_config=ParallelismConfig(dp_replicate_size=nodes, dp_shard_size=gpus),
    )
    mesh = accelerator.torch_device_mesh
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh["dp_shard_cp"])
    fully_shard(model, mesh=mesh["dp_shard_cp"])
    optimizer = onebit.OnebitAdam(model.parameters(), lr=3e-4, max_grad_norm=1.0,
                                  process_group=mesh["dp_replicate"].get_group())
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader)

:func:`prepare` then keeps the optimizer on the sharded parameters (Accelerate re-matches them
by memory address, which empty local shards share) and calls :func:`onebit.fsdp.attach`. Each
rank reads its own batches. ``accelerator.save_state`` also writes each rank's error buffers,
counters and schedule (``onebit/rank_<rank>.pt``), which Accelerate's FSDP2 optimizer state
leaves out, and ``accelerator.load_state`` resumes every rank exactly from them, on the same
mesh.

What the user still does: build the optimizer after ``Accelerator()`` (which sets up
``torch.distributed``) and on the model's parameters; and, to resume mid-epoch, skip the
consumed batches with ``accelerator.skip_first_batches`` as usual. ``mixed_precision="bf16"``
or ``"fp16"``, ``accelerator.accumulate`` and ``accelerator.backward`` work unchanged.
``ProjectConfiguration(save_on_each_node=True)`` is refused: only global rank 0 holds the
gathered state.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ..fsdp import attach, resuming, write_rank_state
from ..optim.base import CompressedOptimizer, onebit_optimizer
from ._common import hand_gradients_to

_SHARD_BY_HAND = (
    "shard the model on the shard dimension of Accelerate's mesh "
    '(fully_shard(module, mesh=accelerator.torch_device_mesh["dp_shard_cp"]) for each block and '
    "the model), build the optimizer on it with "
    'process_group=accelerator.torch_device_mesh["dp_replicate"].get_group(), then call '
    "prepare: see onebit.integrations.accelerate"
)


def prepare(accelerator: Accelerator, model: Any, optimizer: Any, *others: Any) -> tuple[Any, ...]:
    """``accelerator.prepare(model, optimizer, *others)`` for a onebit optimizer.

    Returns what ``accelerator.prepare`` returns, in the same order. Call it on every rank,
    once per optimizer.

    Raises:
        ValueError: with ``save_on_each_node``, or under FSDP for a model that is not already
            sharded by FSDP2 (the message says how to shard it).
    """
    from torch.distributed.fsdp import FSDPModule

    inner = onebit_optimizer(optimizer, "onebit.integrations.accelerate.prepare")
    if accelerator.project_configuration.save_on_each_node and accelerator.num_processes > 1:
        raise ValueError(
            "save_on_each_node=True is not supported; the optimizer's per-rank state is "
            "gathered on global rank 0 only"
        )
    sharded = isinstance(model, FSDPModule)
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if fsdp and not accelerator.is_fsdp2:
        raise ValueError(
            "onebit works with FSDP2 only (FullyShardedDataParallelPlugin(fsdp_version=2)): "
            "FSDP1 flattens the parameters the optimizer steps"
        )
    if fsdp and not sharded:
        raise ValueError(
            "with FSDP, Accelerate would shard the model after the optimizer was built, and "
            "with hybrid sharding on a 2-D mesh where FSDP2 averages across nodes itself: "
            + _SHARD_BY_HAND
        )
    params = [list(group["params"]) for group in inner.param_groups]
    prepared = accelerator.prepare(model, optimizer, *others)
    if sharded:
        for group, kept in zip(inner.param_groups, params):
            group["params"] = kept
        attach(prepared[0], inner)
        _ShardedCheckpoints(accelerator, inner)
    else:
        hand_gradients_to(prepared[0], inner)
        accelerator.register_save_state_pre_hook(
            lambda models, weights, output_dir: inner.consolidate_state_dict(to=0)
        )
    _hand_clipping_to(accelerator, inner)
    return prepared


class _ShardedCheckpoints:
    """``save_state`` and ``load_state`` of an FSDP2-sharded onebit optimizer.

    Accelerate saves and loads the per-parameter state (momentum, variance) through
    ``torch.distributed.checkpoint``'s optimizer state dict, which leaves out the rest of
    onebit's state (each rank's error buffers, counters and schedule). Each rank writes the rest
    to ``onebit/rank_<rank>.pt`` in the checkpoint, and ``load_state`` loads Accelerate's
    checkpoint within :func:`onebit.fsdp.resuming`.
    """

    def __init__(self, accelerator: Accelerator, optimizer: CompressedOptimizer):
        self.accelerator, self.optimizer = accelerator, optimizer
        self._load_state = accelerator.load_state
        accelerator.register_save_state_pre_hook(
            lambda models, weights, output_dir: write_rank_state(optimizer, output_dir)
        )
        accelerator.load_state = self.load_state

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> Any:
        if input_dir is None:
            raise ValueError(
                "load_state of an FSDP2-sharded onebit optimizer needs the checkpoint's "
                "directory: pass it as input_dir"
            )
        saver = "accelerator.save_state after onebit's prepare"
        fix = "save with onebit.fsdp.save and load with onebit.fsdp.load(..., reshard=True)"
        with resuming(self.optimizer, input_dir, saver, fix):
            return self._load_state(input_dir, **kwargs)


def _hand_clipping_to(accelerator: Accelerator, optimizer: CompressedOptimizer) -> None:
    """Make ``accelerator.clip_grad_norm_`` raise for the optimizer's parameters, whose gradients
    are averaged only inside ``step()``; other parameters are clipped as before."""
    clip = accelerator.clip_grad_norm_
    ours = {id(p) for group in optimizer.param_groups for p in group["params"]}

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        parameters = [parameters] if torch.is_tensor(parameters) else list(parameters)
        if any(id(p) in ours for p in parameters):
            raise ValueError(
                f"accelerator.clip_grad_norm_(..., {max_norm}) would clip each rank's local "
                "gradient (under FSDP2, the node's), before onebit averages it across ranks in "
                f"step(): build the optimizer with max_grad_norm={max_norm} and drop this call "
                f"(the optimizer has max_grad_norm={optimizer.max_grad_norm}; "
                "optimizer.grad_norm is the norm it clipped)"
            )
        return clip(parameters, max_norm, norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_
