"""The models and the methods that ``benchmarks/network.py`` trains them with: one table.

Each :class:`Method` names itself, says how the tables label it, builds its optimizer (and DDP
wrapper or comm hook) and its measuring :class:`Plan`, and says which launch it runs in and which
stage a whole run's warmup is measured by. The benchmark's docstring says what each one is.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from torch import nn
    from torch.optim import Optimizer

MODELS: dict[str, dict[str, Any]] = {
    # Communication-bound: 25M parameters, 2 sequences of 32 tokens per worker.
    "comm": dict(block_size=32, n_layer=2, n_head=16, n_embd=1024, batch=2),
    # The same with 16 tokens per worker: communication-bound even at 1 Gbit/s.
    "comm-b1": dict(block_size=16, n_layer=2, n_head=16, n_embd=1024, batch=1),
    # The default `onebit train` model (0.84M parameters) and batch (16 x 128 tokens per worker).
    "gpt": dict(block_size=128, n_layer=4, n_head=4, n_embd=128, batch=16),
}

LR = 1e-4
EPS = 1e-3
"""The variance is frozen after 1-4 steps here, to reach each stage quickly. Embedding rows no
batch has touched yet then have v = 0, and eps = 1e-8 would divide their later momentum by 1e-8
until the weights overflow and steps are skipped. eps = 1e-3 keeps every update finite; it changes
no byte sent and no kernel's cost."""
NEVER = 10**9
"""A freeze step no run reaches: the optimizer stays in its warmup."""


@dataclass
class Plan:
    """How many steps to run before measuring, how many to measure, and how to summarise."""

    warmup: int
    measured: int
    mean: bool = False  # mean over the measured steps (whole sync periods) instead of median


Built = tuple["nn.Module", "Optimizer", Plan]
"""The module to run (the model, or DDP around it), its optimizer and the plan."""
Builder = Callable[["nn.Module", argparse.Namespace], Built]
Setup = Callable[[argparse.Namespace], tuple[dict[str, Any], Plan]]
"""A onebit method's keyword arguments for its optimizer class, and its plan."""


@dataclass(frozen=True)
class Method:
    """One row of the benchmark's tables."""

    name: str
    label: str
    build: Builder
    launch: Literal["together", "alone", "twice"] = "together"
    """``together``: in one launch with the other methods; ``alone``: a launch of its own per
    model, with less time, as it may kill or hang its workers (PowerSGD on gloo); ``twice``:
    together, and again last, so that it sees the machine's load over the whole launch."""
    warmup_stage: str | None = None
    """The method whose step time a whole run's warmup costs, for the end-to-end column (shown
    only where this is set; without it the whole run is this method)."""
    baseline: str = "adamw"
    """The method the speedups are measured against: AdamW + DDP, or torch's HSDP for the
    methods that shard (``--shard``)."""


def _adamw(model: nn.Module) -> Optimizer:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)


def _compute(model: nn.Module, args: argparse.Namespace) -> Built:
    """AdamW with no communication at all: the physical floor."""
    return model, _adamw(model), Plan(1, args.steps)


def _ddp(
    hook: Callable[[argparse.Namespace], tuple[Any, Callable]] | None = None,
    warmup: int = 2,
    one_bucket: bool = False,
) -> Builder:
    """AdamW under DistributedDataParallel, with ``hook(args)``'s ``(state, comm hook)`` if any."""

    def build(model: nn.Module, args: argparse.Namespace) -> Built:
        from torch import nn

        optimizer = _adamw(model)
        buckets = {"bucket_cap_mb": 1 << 14} if one_bucket else {}
        ddp = nn.parallel.DistributedDataParallel(model, **buckets)
        if hook is not None:
            ddp.register_comm_hook(*hook(args))
        return ddp, optimizer, Plan(warmup, args.steps)

    return build


def _fp16_hook(args: argparse.Namespace) -> tuple[Any, Callable]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return None, default_hooks.fp16_compress_hook


def _powersgd_hook(args: argparse.Namespace) -> tuple[Any, Callable]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=args.powersgd_rank,
        start_powerSGD_iter=2,
        use_error_feedback=True,
        warm_start=True,
    )
    return state, powerSGD_hook.powerSGD_hook


def _onebit(class_name: str, setup: Setup) -> Builder:
    """``onebit.<class_name>`` configured by ``setup``, overlapping communication with backward
    where the class offers it, as DDP does."""

    def build(model: nn.Module, args: argparse.Namespace) -> Built:
        import onebit

        cls = getattr(onebit, class_name, None)
        if cls is None:
            raise NotImplementedError(f"onebit.{class_name} does not exist in this version")
        kwargs, plan = setup(args)
        if args.overlap and "overlap_backward" in inspect.signature(cls).parameters:
            kwargs["overlap_backward"] = True
        return model, cls(model.parameters(), lr=LR, eps=EPS, **kwargs), plan

    return build


LAMB = "OnebitLamb"


def _kept_in_warmup(bits: str, class_name: str = "OnebitAdam") -> Builder:
    """``onebit.<class_name>`` kept in its warmup, its allreduce in ``bits``."""

    def setup(args: argparse.Namespace) -> tuple[dict[str, Any], Plan]:
        kwargs = {"freeze_step": NEVER, "warmup_compression": bits}
        return kwargs, Plan(1 if bits == "fp32" else 2, args.steps)

    return _onebit(class_name, setup)


def _warmup(args: argparse.Namespace) -> tuple[dict[str, Any], Plan]:
    return {"freeze_step": NEVER, "warmup_compression": "fp32"}, Plan(1, args.steps)


def _compression(args: argparse.Namespace) -> tuple[dict[str, Any], Plan]:
    """Step 1 is the warmup; steps 2-3 warm the compression stage up."""
    return {"freeze_step": 1}, Plan(3, args.steps)


def _zero_one_a(args: argparse.Namespace) -> tuple[dict[str, Any], Plan]:
    """var_interval doubles after every variance step: fp32 at steps 1, 2, 4, 8; 5-7 are 1-bit."""
    return {"var_freeze_step": NEVER, "var_update_scaler": 1}, Plan(4, min(args.steps, 3))


def _zero_one_b(args: argparse.Namespace) -> tuple[dict[str, Any], Plan]:
    """Phase B from step 2; the local interval doubles every step up to H, so from step 2H on
    every H-th step is a sync. Measure whole periods, each ending with its sync."""
    h = args.local_steps
    kwargs = {"var_freeze_step": 1, "local_step_scaler": 1, "local_step_clipper": h}
    warmup = h * -(-max(h, 2) // h)  # the interval is h by step h (h >= 2): syncs at k*h
    return kwargs, Plan(warmup, h * max(1, -(-args.steps // h)), mean=True)


def _hsdp(setup: Setup | None) -> Builder:
    """The model sharded by FSDP2 over the ``--shard`` ranks of each host: torch's HSDP with
    AdamW (``setup`` ``None``), or OnebitAdam configured by ``setup`` on the shard dimension,
    averaging each shard across hosts (:mod:`onebit.fsdp`)."""

    def build(model: nn.Module, args: argparse.Namespace) -> Built:
        import torch

        import onebit
        from onebit.train.optim import shard

        name = "adamw" if setup is None else "onebit-adam"
        mesh = shard(model, args.shard, name, torch.device("cpu"))
        if setup is None:
            return model, _adamw(model), Plan(2, args.steps)
        kwargs, plan = setup(args)
        group = mesh["replicate"].get_group()
        optimizer = onebit.OnebitAdam(
            model.parameters(), lr=LR, eps=EPS, process_group=group, **kwargs
        )
        onebit.fsdp.attach(model, optimizer)
        return model, optimizer, plan

    return build


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("compute", "compute only (no comm)", _compute, launch="twice"),
        Method("adamw", "AdamW + DDP (fp32)", _ddp()),
        Method("fp16", "DDP + fp16_compress_hook", _ddp(_fp16_hook)),
        Method("powersgd", "DDP + PowerSGD hook", _ddp(_powersgd_hook, warmup=3), launch="alone"),
        Method(
            "powersgd-1b",
            "DDP (1 bucket) + PowerSGD",
            _ddp(_powersgd_hook, warmup=3, one_bucket=True),
            launch="alone",
        ),
        Method("onebit-warmup", "OnebitAdam warmup", _kept_in_warmup("fp32")),
        Method("onebit-warmup-bf16", "OnebitAdam warmup, bf16", _kept_in_warmup("bf16")),
        Method("onebit-warmup-int8", "OnebitAdam warmup, int8", _kept_in_warmup("int8")),
        Method("onebit-warmup-int4", "OnebitAdam warmup, int4", _kept_in_warmup("int4")),
        Method(
            "onebit",
            "OnebitAdam compression",
            _onebit("OnebitAdam", _compression),
            warmup_stage="onebit-warmup",
        ),
        Method("zero-one-a", "ZeroOneAdam phase A (1-bit)", _onebit("ZeroOneAdam", _zero_one_a)),
        Method("zero-one", "ZeroOneAdam phase B (local)", _onebit("ZeroOneAdam", _zero_one_b)),
        Method("lamb-warmup", "OnebitLamb warmup", _onebit("OnebitLamb", _warmup)),
        Method("lamb-warmup-int8", "OnebitLamb warmup, int8", _kept_in_warmup("int8", LAMB)),
        Method("lamb-warmup-int4", "OnebitLamb warmup, int4", _kept_in_warmup("int4", LAMB)),
        Method(
            "onebit-lamb",
            "OnebitLamb compression",
            _onebit("OnebitLamb", _compression),
            warmup_stage="lamb-warmup",
        ),
        Method("hsdp-adamw", "HSDP + AdamW (fp32)", _hsdp(None), baseline="hsdp-adamw"),
        Method("hsdp-onebit-warmup", "onebit HSDP warmup", _hsdp(_warmup), baseline="hsdp-adamw"),
        Method(
            "hsdp-onebit",
            "onebit HSDP compression",
            _hsdp(_compression),
            warmup_stage="hsdp-onebit-warmup",
            baseline="hsdp-adamw",
        ),
    )
}
"""Every method, in the order of the tables and of a launch."""

HSDP = [name for name in METHODS if name.startswith("hsdp-")]
"""The methods that shard with FSDP2 (``network.py --shard S``)."""

LABELS: dict[str, str] = {name: m.label for name, m in METHODS.items()}
"""Each method's label, for readers of the result files (``scaling.py``)."""


def build(method: str, model_name: str, args: argparse.Namespace) -> Built:
    """``(module to run, optimizer, plan)`` for ``method`` on ``MODELS[model_name]``; the model
    is seeded identically on every rank, so that all ranks start from the same weights."""
    import torch

    from onebit.train.model import ModelConfig, Transformer

    spec = MODELS[model_name]
    torch.manual_seed(0)
    config = ModelConfig("gpt", spec["block_size"], spec["n_layer"], spec["n_head"], spec["n_embd"])
    return METHODS[method].build(Transformer(config), args)
