"""The optimizers ``onebit train`` can run, and how each one communicates.

``adamw`` is the baseline everybody uses: ``torch.optim.AdamW`` with the model wrapped in
``DistributedDataParallel``. ``lamb`` is plain LAMB on fp32-averaged gradients: a
:class:`onebit.OnebitLamb` that never leaves its warmup, where it is exactly LAMB. The three
1-bit optimizers own their communication and wrap nothing.

With ``--shard S`` (:func:`shard`) FSDP2 shards the model over the ``S`` ranks of each emulated
node: ``adamw`` is then torch's HSDP (FSDP2 on the 2-D mesh), and the 1-bit optimizers average
each shard across nodes themselves (:mod:`onebit.fsdp`).

Bytes are counted on one convention for all: what a bandwidth-optimal collective sends from each
rank (``2(n-1)/n`` of the buffer for an allreduce); with ``--shard``, between nodes only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

import onebit
from onebit.optim import registry
from onebit.optim.options import DEFAULT_BUCKET_SIZE
from onebit.wire.protocol import allreduce_bytes

_ONEBIT = {entry.name: entry for entry in registry.OPTIMIZERS}

REFERENCE = {name: entry.reference for name, entry in _ONEBIT.items()}
"""The uncompressed optimizer each 1-bit optimizer is measured against."""

OPTIMIZERS = tuple(dict.fromkeys(n for name, ref in REFERENCE.items() for n in (ref, name)))
"""``--optimizer`` choices: each uncompressed optimizer before the 1-bit ones measured against
it."""

WARMUP_COMPRESSION = onebit.optim.options.WARMUP_COMPRESSION
"""``--warmup-compression`` choices: how the 1-bit optimizers' warmup averages gradients."""

WARMUP_COMPRESSED = tuple(_ONEBIT)
"""The optimizers whose full-precision steps ``warmup_compression`` can quantize: 1-bit Adam's
and 1-bit LAMB's warmup, 0/1 Adam's variance steps."""

DEFAULT_WARMUP_COMPRESSION = onebit.optim.options.DEFAULT_WARMUP_COMPRESSION
"""``onebit train``'s warmup compression for :data:`WARMUP_COMPRESSED`: the library's default."""

ERROR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``--error-dtype`` choices: the dtype of the 1-bit optimizers' error buffers."""

DEFAULT_FREEZE_STEP = "auto"
"""``onebit train``'s warmup length for :data:`WARMUP_COMPRESSED`: the library's default,
``freeze_step="auto"`` not told the run's length, so that the run is the one
``OnebitAdam(params, lr=...)`` gives."""

NEVER = 2**62
"""A freeze step no run reaches: keeps OnebitLamb in its exact-LAMB warmup."""


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class behind ``name``, one of :data:`OPTIMIZERS`."""
    if name == "adamw":
        return torch.optim.AdamW
    return onebit.OnebitLamb if name == "lamb" else _ONEBIT[name].cls


def is_compressed(name: str) -> bool:
    """Whether ``name`` sends 1-bit compressed messages (and so has error feedback)."""
    return name in REFERENCE


def default_lr(name: str) -> float:
    """A learning rate that suits the built-in models: LAMB's trust ratio wants a larger one."""
    return 1e-2 if REFERENCE.get(name, name) == "lamb" else 1e-3


def default_freeze_step(name: str, steps: int) -> int:
    """A fixed warmup length: 20% of the run, as the papers do (15-25%): that of runs saved
    before ``"auto"`` became the default (0/1 Adam's included)."""
    return max(1, steps // 5)


@dataclass
class Trainer:
    """What the training loop needs from an optimizer.

    Attributes:
        model: the module to run forward and backward (the DDP wrapper for ``adamw``).
        optimizer: the optimizer; :meth:`step` runs it on every rank.
        stage: returns the stage the last step ran in (``"fp32"`` for uncompressed optimizers).
        last_step_bytes: returns the bytes this rank sent in the last step.
        last_step_rounds: returns the collectives the last step launched (DDP: one
            ``all_reduce`` per gradient bucket).
        scaler: the fp16 loss scaler, or ``None``.
        clip: the gradient norm to clip to outside the optimizer (``adamw``; the 1-bit
            optimizers clip inside, with ``max_grad_norm``), or ``None``.
        scaler_skips: steps the scaler skipped for an optimizer that does not count them.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    stage: Callable[[], str]
    last_step_bytes: Callable[[], int]
    last_step_rounds: Callable[[], int]
    scaler: torch.amp.GradScaler | None = None
    clip: float | None = None
    scaler_skips: int = 0

    def step(self, loss: Tensor) -> None:
        """Backward from ``loss`` and one optimizer step, with the loss scaler and clipping."""
        opt = self.optimizer
        opt.zero_grad(set_to_none=True)
        if self.scaler is None:
            loss.backward()
            if self.clip is not None:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            opt.step()
            return
        self.scaler.scale(loss).backward()
        if self.clip is not None:
            self.scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        scale = self.scaler.get_scale()
        self.scaler.step(opt)
        self.scaler.update()
        if self.scaler.get_scale() < scale and not hasattr(opt, "skipped_steps"):
            self.scaler_skips += 1

    def skipped_steps(self) -> int:
        """Steps skipped so far on every rank for a non-finite gradient."""
        return getattr(self.optimizer, "skipped_steps", self.scaler_skips)

    def state_dict(self) -> dict:
        """What a checkpoint needs besides the model and the optimizer."""
        scaler = None if self.scaler is None else self.scaler.state_dict()
        return {"scaler": scaler, "scaler_skips": self.scaler_skips}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.scaler_skips = state["scaler_skips"]

    def synchronize(self) -> tuple[int, int]:
        """Make the replicas identical before evaluating; return the bytes and the rounds that
        took.

        Only 0/1 Adam's local steps leave the ranks' parameters apart; it syncs them like a
        scheduled sync step would.
        """
        synchronize = getattr(self.optimizer, "synchronize", None)
        if synchronize is None:
            return 0, 0
        stats = self.optimizer.comm_stats
        before = stats.bytes_total, stats.rounds_total
        synchronize()
        return stats.bytes_total - before[0], stats.rounds_total - before[1]

    def settle(self, x: Tensor, y: Tensor) -> None:
        """Run one forward and backward that changes nothing, so that a fresh and a resumed run
        communicate the same way from their first step.

        DDP regroups its gradient buckets after its first backward, and the order of a
        floating-point sum depends on where an element sits in its bucket; settling first makes
        resumed AdamW runs bitwise equal to straight ones. The other optimizers need nothing.
        """
        if isinstance(self.model, nn.parallel.DistributedDataParallel):
            _, loss = self.model(x, y)
            loss.backward()
            self.optimizer.zero_grad(set_to_none=True)

    def freeze_step(self) -> int | None:
        """The step after which the variance was frozen (None if not, or never)."""
        if isinstance(self.optimizer, torch.optim.AdamW) or self.stage() == "fp32":
            return None
        step = getattr(self.optimizer, "var_freeze_step", None)
        return step if step is not None else self.optimizer.freeze_step


def shard(model: nn.Module, shards: int, name: str, device: torch.device) -> DeviceMesh:
    """Shard ``model`` (its blocks, then the rest) with FSDP2 over ``shards`` ranks per node;
    return the ``(replicate, shard)`` mesh of the world.

    ``adamw`` shards on the 2-D mesh, so that FSDP2 also averages across nodes (torch's HSDP);
    the onebit optimizers on its ``shard`` dimension, averaging across nodes in ``step()``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world_size = dist.get_world_size()
    mesh = init_device_mesh(
        device.type, (world_size // shards, shards), mesh_dim_names=("replicate", "shard")
    )
    on = mesh if name == "adamw" else mesh["shard"]
    for block in model.blocks:
        fully_shard(block, mesh=on)
    fully_shard(model, mesh=on)
    return mesh


def build(
    name: str,
    model: nn.Module,
    param_groups: list[dict],
    *,
    lr: float,
    freeze_step: int | str | None,
    steps: int,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    local_step_scaler: int | None = None,
    var_update_scaler: int | None = None,
    local_step_clipper: int | None = None,
    max_grad_norm: float | None = None,
    scaler: torch.amp.GradScaler | None = None,
    warmup_compression: str = "fp32",
    error_dtype: str = "fp32",
    mesh: DeviceMesh | None = None,
) -> Trainer:
    """Make optimizer ``name`` for ``model`` on the initialised default process group.

    ``freeze_step`` is the 1-bit optimizers' warmup (``var_freeze_step`` for 0/1 Adam): an int,
    ``"auto"`` (the library's rule; for 0/1 Adam its default for the run's length,
    :func:`onebit.zero_one_adam.run_freeze_step`), or ``None`` for :func:`default_freeze_step`.
    ``local_step_scaler``, ``var_update_scaler`` and ``local_step_clipper`` are 0/1 Adam's
    (``None``: :func:`onebit.zero_one_adam.run_schedule` of the run).
    ``max_grad_norm`` clips the averaged gradients (``None``: no clipping); ``scaler`` is the fp16
    loss scaler. ``warmup_compression`` is that of the 1-bit optimizers; ``error_dtype`` (a key
    of :data:`ERROR_DTYPES`) that of the 1-bit optimizers' error buffers. ``mesh`` is
    :func:`shard`'s if it sharded the model. Every rank must call this with the same arguments.
    """
    cls = optimizer_class(name)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    numel = sum(p.numel() for p in model.parameters())
    if freeze_step is None:
        freeze_step = default_freeze_step(name, steps)
    if name == "adamw":
        optimizer = torch.optim.AdamW(param_groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
        per_step = allreduce_bytes(4 * numel, world_size)
        rounds: Callable[[], int] = _no_rounds
        if mesh is not None:  # HSDP: each rank's shard, averaged across nodes
            replicas, shards = mesh.size(0), mesh.size(1)
            per_step = allreduce_bytes(4 * math.ceil(numel / shards), replicas)
            if replicas > 1:  # an all_reduce across nodes per FSDP unit
                rounds = functools.partial(_count_of, FSDPModule, model)
        elif world_size > 1:
            model = nn.parallel.DistributedDataParallel(model)
            rounds = functools.partial(_ddp_buckets, model)
        return Trainer(
            model,
            optimizer,
            lambda: "fp32",
            lambda: per_step,
            rounds,
            scaler=scaler,
            clip=max_grad_norm,
        )
    common = {"lr": lr, "bucket_size": bucket_size, "max_grad_norm": max_grad_norm}
    if mesh is not None:
        common["process_group"] = mesh["replicate"].get_group()
    if name == "lamb":
        optimizer = cls(param_groups, freeze_step=NEVER, warmup_compression="fp32", **common)
        _attach(model, optimizer, mesh)
        return Trainer(
            model,
            optimizer,
            lambda: "fp32",
            lambda: _last_bytes(optimizer),
            lambda: _last_rounds(optimizer),
            scaler,
        )
    common["error_dtype"] = ERROR_DTYPES[error_dtype]
    common["warmup_compression"] = warmup_compression
    if name == "zero-one-adam":
        optimizer = cls(
            param_groups,
            var_freeze_step=None if freeze_step == "auto" else freeze_step,
            local_step_scaler=local_step_scaler,
            var_update_scaler=var_update_scaler,
            local_step_clipper=local_step_clipper,
            total_steps=steps,
            **common,
        )
    else:
        optimizer = cls(param_groups, freeze_step=freeze_step, **common)
    _attach(model, optimizer, mesh)
    return Trainer(
        model,
        optimizer,
        lambda: optimizer.comm_stats.last_step_stage,
        lambda: _last_bytes(optimizer),
        lambda: _last_rounds(optimizer),
        scaler,
    )


def _attach(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh | None) -> None:
    if mesh is not None:
        onebit.fsdp.attach(model, optimizer)


def _last_bytes(optimizer: torch.optim.Optimizer) -> int:
    return optimizer.comm_stats.last_step_bytes


def _last_rounds(optimizer: torch.optim.Optimizer) -> int:
    return optimizer.comm_stats.last_step_rounds


def _no_rounds() -> int:
    return 0


def _count_of(kind: type, model: nn.Module) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


def _ddp_buckets(model: nn.parallel.DistributedDataParallel) -> int:
    """DDP's collectives per step: one ``all_reduce`` per gradient bucket, as it regrouped them
    after its first backward."""
    data = model._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return len(str(sizes).split(","))


def drop_error_feedback(optimizer: torch.optim.Optimizer) -> None:
    """Zero every error buffer of a 1-bit optimizer (call after each step).

    With the errors zeroed before every call, each compressed allreduce is plain 1-bit
    compression: what it loses is lost for good. A research ablation, not for real runs.
    """
    for comm in getattr(optimizer, "comms", ()):
        comm.reset()
