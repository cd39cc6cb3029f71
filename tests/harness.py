"""One harness for what OnebitAdam, ZeroOneAdam and OnebitLamb share in their tests.

Each optimizer has a :class:`Case`: its test problem (parameters in two groups, gradients that
depend on the step and the rank), its settings, and where its schedule is worth resuming or
poisoning. :func:`run` records a run step by step; the optimizers' own test files use it for their
reference tests, and ``test_run_resume_skip_inputs.py`` for the resume, skip and bad-input tests
of all three, which run on two ranks through :func:`two_rank_runs` and :func:`resumed_runs`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from optimizer_state import flat

import onebit


@dataclass(frozen=True)
class Problem:
    """Parameters of ``shapes`` in two groups: the first two with the optimizer's lr and weight
    decay (``lrs[0]``, ``wds[0]``), the rest with ``lrs[2]`` and ``wds[2]``. A gradient depends
    on the parameter, the step and the rank (seeded ``seed_stride * step + 10 * rank + i``)."""

    shapes: tuple[tuple[int, ...], ...]
    lrs: tuple[float, ...]
    wds: tuple[float, ...]
    seed_stride: int = 1000

    @property
    def sizes(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def params(self, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in self.shapes]

    def groups(self, params: list[torch.nn.Parameter]) -> list[dict]:
        return [
            {"params": params[:2]},
            {"params": params[2:], "lr": self.lrs[2], "weight_decay": self.wds[2]},
        ]

    def grad(self, step: int, rank: int, i: int, p: torch.Tensor) -> torch.Tensor:
        """Depends on the parameter, so ranks whose parameters differ get different gradients."""
        gen = torch.Generator().manual_seed(self.seed_stride * step + 10 * rank + i)
        return torch.randn(p.shape, generator=gen) * (1 + rank) + 0.3 * p.detach().float()

    def set_grads(self, params: list[torch.nn.Parameter], step: int, rank: int) -> None:
        for i, p in enumerate(params):
            p.grad = self.grad(step, rank, i, p).to(p.dtype)


def poison(params: list[torch.nn.Parameter], value: float = float("inf")) -> None:
    """Put one non-finite ``value`` into the gradients (of the second parameter)."""
    params[1].grad.view(-1)[0] = value


@dataclass(frozen=True)
class Case:
    """One optimizer under test.

    ``steps`` is the length of a straight run; the two-rank run saves a checkpoint after step
    ``checkpoint`` and single-process runs are resumed after each of ``resume_points``. In the
    run with non-finite gradients, the last rank gets one on each call of ``poisoned``, which
    names the stage that call runs in. ``bad_arguments`` are the optimizer's own constructor
    arguments rejected with a ``ValueError`` matching the string; ``required`` the keyword
    arguments it cannot do without. ``observe`` is what else to record after every step.
    """

    cls: type[onebit.optim.base.CompressedOptimizer]
    problem: Problem
    settings: dict[str, Any]
    steps: int
    checkpoint: int
    resume_points: tuple[int, ...]
    poisoned: dict[int, str]
    required: dict[str, Any]
    bad_arguments: tuple[tuple[dict[str, Any], str], ...]
    observe: Callable[[Any], Any] | None = None
    # The optimizer's own state expected after the resumed run (``state_dict()["onebit"]``).
    final_extra: dict[str, Any] = field(default_factory=dict)

    def optimizer(self, params: list[torch.nn.Parameter], **overrides: Any):
        """The optimizer over the problem's two groups, with ``overrides`` of the settings."""
        kwargs = {"lr": self.problem.lrs[0], "weight_decay": self.problem.wds[0]}
        return self.cls(self.problem.groups(params), **{**kwargs, **self.settings, **overrides})


# OnebitAdam's and OnebitLamb's: a freeze step that is not one, AutoFreeze without "auto", a
# total_steps that is not one, or one that auto_freeze contradicts.
FREEZE_BAD_ARGUMENTS = tuple(
    (dict(freeze_step=value), "freeze_step") for value in (0, 2.5, "never", True)
) + (
    (dict(freeze_step=3, auto_freeze=onebit.AutoFreeze()), "auto_freeze"),
    (dict(total_steps=0), "total_steps must be an int >= 1"),
    (dict(total_steps=10, auto_freeze=onebit.AutoFreeze(total_steps=20)), "disagree"),
)

# Variance updates at 1, 2, 4, 6, 8, 12; phase B syncs every step, then every 2, then every 4.
ZERO_ONE_SCHEDULE = dict(
    var_freeze_step=12, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4
)

CASES = {
    "adam": Case(
        cls=onebit.OnebitAdam,
        problem=Problem(((7, 5), (13,), (3, 3, 2)), (1e-2, 1e-2, 3e-3), (0.1, 0.1, 0.0), 100),
        settings=dict(freeze_step=3, bucket_size=32, warmup_compression="fp32"),
        steps=10,
        checkpoint=5,
        resume_points=(2, 3, 4, 5),
        poisoned={2: "warmup", 6: "compression"},
        required=dict(),
        bad_arguments=FREEZE_BAD_ARGUMENTS,
    ),
    "zero_one": Case(
        cls=onebit.ZeroOneAdam,
        problem=Problem(
            ((7, 5), (13,), (0,), (3, 3, 2)), (1e-2, 1e-2, 3e-3, 3e-3), (0.1, 0.1, 0.0, 0.0)
        ),
        settings=dict(bucket_size=32, warmup_compression="fp32", **ZERO_ONE_SCHEDULE),
        steps=30,
        checkpoint=22,  # between two syncs of phase B
        resume_points=(5, 12, 13, 22),
        # Skipped calls are retried: call 5 is step 4, call 19 step 17, call 26 step 24.
        poisoned={3: "compression", 5: "variance", 19: "local", 26: "sync"},
        required=dict(var_freeze_step=5),
        bad_arguments=tuple(
            ({key: value}, key)
            for key, values in [
                ("var_freeze_step", (0, 1.5, True)),
                ("var_update_scaler", (0,)),
                ("local_step_scaler", (0,)),
                ("local_step_clipper", (0,)),
                ("total_steps", (0, 2.5)),
            ]
            for value in values
        ),
        final_extra=dict(local_step_interval=4, var_interval=8),
    ),
    "lamb": Case(
        cls=onebit.OnebitLamb,
        problem=Problem(
            ((7, 5), (13,), (0,), (3, 3, 2), (4,)),
            (2e-2, 2e-2, 5e-3, 5e-3, 5e-3),
            (0.1, 0.1, 0.0, 0.0, 0.0),
        ),
        settings=dict(freeze_step=8, bucket_size=32, warmup_compression="fp32"),
        steps=20,
        checkpoint=14,
        resume_points=(3, 8, 9, 14),
        poisoned={3: "warmup", 12: "compression"},  # call 12 is step 11
        required=dict(),
        bad_arguments=FREEZE_BAD_ARGUMENTS
        + (
            (dict(max_coeff=0.001), "min_coeff <= max_coeff"),
            (dict(min_coeff=0.0), "min_coeff <= max_coeff"),
            (dict(coeff_beta=1.0), "coeff_beta"),
            (dict(factor_min=0.0), "factor_min <= factor_max"),
            (dict(factor_max=0.1), "factor_min <= factor_max"),
            (dict(factor_threshold=-0.1), "factor_threshold"),
            (dict(factor_threshold=1.0), "factor_threshold"),
        ),
        observe=onebit.OnebitLamb.get_lamb_coeffs,
    ),
}

# Rejected by all three optimizers.
COMMON_BAD_ARGUMENTS = (
    (dict(lr=-1.0), "learning rate"),
    (dict(betas=(1.0, 0.999)), "beta parameter at index 0"),
    (dict(betas=(0.9, -0.1)), "beta parameter at index 1"),
    (dict(betas=(0.9, 1.0)), "beta parameter at index 1"),
    (dict(eps=-1e-8), "epsilon"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(bucket_size=0), "bucket_size"),
    (dict(bucket_size=2**30 + 1), "bucket_size must be at most 2..30"),
)

# Stages in which a rank drops its own non-finite gradient instead of every rank skipping.
DROPPED_ALONE = ("local", "sync")


@dataclass
class Trace:
    """A run, step by step: the stage each step ran in, the flat parameters after it, and what
    the case observes after it."""

    stages: list[str] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    observed: list[Any] = field(default_factory=list)

    def extend(self, other: Trace) -> Trace:
        self.stages += other.stages
        self.params += other.params
        self.observed += other.observed
        return self


def run(case: Case, params, opt, rank: int, first: int, last: int) -> Trace:
    """Steps ``first..last`` on ``rank``, each with that step's gradients."""
    trace = Trace()
    for t in range(first, last + 1):
        trace.stages.append(opt.stage)
        case.problem.set_grads(params, t, rank)
        opt.step()
        trace.params.append(flat(params))
        trace.observed.append(case.observe(opt) if case.observe else None)
    return trace


def checkpoint(params, opt) -> dict:
    """What a training loop saves: the parameters and the optimizer's state dict."""
    return {"params": [p.detach().clone() for p in params], "optim": opt.state_dict()}


def restore(case: Case, saved: dict):
    """A fresh problem and optimizer, loaded from ``saved`` (see :func:`checkpoint`)."""
    params = case.problem.params()
    opt = case.optimizer(params)
    with torch.no_grad():
        for p, q in zip(params, saved["params"]):
            p.copy_(q)
    opt.load_state_dict(saved["optim"])
    return params, opt


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested dicts, lists and tensors."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def low_precision_runs(case: Case, rank: int) -> dict[torch.dtype, tuple[Trace, bool]]:
    """A straight run with bf16 and with fp16 parameters, and whether all state stayed fp32."""
    results = {}
    for dtype in (torch.bfloat16, torch.float16):
        params = case.problem.params(dtype)
        opt = case.optimizer(params)
        trace = run(case, params, opt, rank, 1, case.steps)
        state = [s for p in params for s in opt.state[p].values()]
        results[dtype] = (trace, all(s.dtype == torch.float32 for s in state))
    return results


def checkpoint_path(directory: str | Path, name: str, rank: int) -> Path:
    return Path(directory) / f"{name}-rank{rank}.pt"


@dataclass
class Call:
    """One call of the run with non-finite gradients: its stage, and the parameters and the rest
    of the optimizer's state (moments, error feedback) before and after it."""

    stage: str
    params_before: torch.Tensor
    state_before: torch.Tensor
    params_after: torch.Tensor
    state_after: torch.Tensor


def _state(opt) -> torch.Tensor:
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return flat(state + [e for c in opt.comms for e in (c.worker_error, c.server_error)])


def _straight(case: Case, name: str, rank: int, directory: str) -> tuple:
    params = case.problem.params()
    opt = case.optimizer(params)
    trace = run(case, params, opt, rank, 1, case.checkpoint)
    torch.save(checkpoint(params, opt), checkpoint_path(directory, name, rank))
    trace.extend(run(case, params, opt, rank, case.checkpoint + 1, case.steps))
    return trace, opt.comm_stats, opt.state_dict()


def _non_finite(case: Case, rank: int, world_size: int) -> tuple:
    """The last rank gets a non-finite gradient (NaN first, then inf) on each poisoned call;
    runs two calls past the last of them."""
    params = case.problem.params()
    opt = case.optimizer(params)
    calls = []
    for call in range(1, max(case.poisoned) + 3):
        stage, params_before, state_before = opt.stage, flat(params), _state(opt)
        case.problem.set_grads(params, call, rank)
        if rank == world_size - 1 and call in case.poisoned:
            poison(params, float("nan") if call == min(case.poisoned) else float("inf"))
        opt.step()
        calls.append(Call(stage, params_before, state_before, flat(params), _state(opt)))
    # Only ZeroOneAdam has stages in which a rank drops a gradient alone.
    dropped = getattr(opt, "local_skipped_steps", 0)
    return calls, opt.skipped_steps, dropped, opt.num_steps


def _mismatched(case: Case, rank: int) -> str | None:
    """The error a rank gets when its parameters are not those of the other ranks."""
    try:
        case.cls(case.problem.params()[: 2 + rank], **case.required)
    except ValueError as err:
        return str(err)
    return None


def two_rank_runs(rank: int, world_size: int, directory: str) -> dict[str, dict]:
    """For every optimizer, on this rank: a straight run that saves a checkpoint to
    ``directory`` after step ``checkpoint``, a run with non-finite gradients on the last rank,
    and a construction with parameters that differ across ranks.

    All optimizers share one launch of the ranks, which costs more than their runs.
    """
    results = {
        name: {
            "straight": _straight(case, name, rank, directory),
            "non_finite": _non_finite(case, rank, world_size),
        }
        for name, case in CASES.items()
    }
    for name, case in CASES.items():
        results[name]["mismatched"] = _mismatched(case, rank)
    return results


def resumed_runs(rank: int, world_size: int, directory: str) -> dict[str, tuple]:
    """For every optimizer, on this rank: the checkpoint of :func:`two_rank_runs` loaded into a
    fresh optimizer in this fresh process, and run to the end."""
    results = {}
    for name, case in CASES.items():
        saved = torch.load(checkpoint_path(directory, name, rank), weights_only=False)
        params, opt = restore(case, saved)
        trace = run(case, params, opt, rank, case.checkpoint + 1, case.steps)
        results[name] = (trace, opt.comm_stats, opt.state_dict())
    return results
