"""A fourth optimizer is one module: its hyperparameters and checks, its buffers, its stages.

``OnebitSGD`` below is 1-bit SGD with momentum, written as ``docs/ARCHITECTURE.md`` says a new
optimizer is written ("Where to make a change"): a warmup of plain SGD with momentum on
gradients averaged at full precision, then steps that send each rank's momentum through the
1-bit compressed allreduce. It uses only what the base and the engine offer every optimizer, so
these tests fail if the base comes to assume Adam (its betas, its variance, its stage names) or
if a stage needs more than the ``Stage`` interface to run, save and load.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from family import all_equal, loss_of, make_model, params_of
from optimizer_state import roundtrip
from torch import Tensor

from onebit.freeze import FreezeSchedule
from onebit.optim.base import CompressedOptimizer
from onebit.optim.options import DEFAULT_BUCKET_SIZE, check_same_in_every_group, shared_options
from onebit.optim.stage import Stage, Taken
from onebit.transport.engine import Sender

FREEZE = 3


def sgd_update_(opt: OnebitSGD, grads: Tensor, momentum: Tensor) -> None:
    """``torch.optim.SGD``'s step with momentum (its foreach formulation) on the flat buffers:
    ``g += wd·p``, ``m = μ·m + g``, ``p -= lr·m``; ``grads`` is used as scratch."""
    for group, params, gs, ms in opt.flat.per_group(grads, momentum):
        if group["weight_decay"]:
            torch._foreach_add_(gs, params, alpha=group["weight_decay"])
        torch._foreach_mul_(ms, group["momentum"])
        torch._foreach_add_(ms, gs)
        torch._foreach_add_(params, ms, alpha=-group["lr"])


class _Warmup(Stage):
    """SGD with momentum on gradients averaged by an fp32 allreduce, as SGD + DDP."""

    name = "warmup"
    shows = {"momentum_buffer": "momentum_buffer"}

    def sends(self) -> Sender:
        engine = self.optimizer.engine
        return engine.sender(engine.full_precision)

    def step(self, t: int) -> Taken:
        opt = self.optimizer
        applied, nbytes = opt.engine.average_gradients()
        if applied:
            sgd_update_(opt, opt.engine.grads, opt.momentum_buffer)
        if applied and t == opt.freeze_step:
            opt.set_frozen(True)
            opt.engine.end_warmup()
        return Taken(applied, nbytes)


class _Compression(Stage):
    """Each rank's momentum ``μ·m + g + wd·p`` through the 1-bit compressed allreduce; every
    rank steps by the average."""

    name = "compression"
    frozen = True
    shows = {"momentum_buffer": "momentum_buffer"}

    def step(self, t: int) -> Taken:
        opt = self.optimizer
        opt.engine.clip_own_gradient()
        g, m = opt.engine.gather_grads(), opt.momentum_buffer
        for group, params, gs in opt.flat.per_group(g):
            if group["weight_decay"]:
                torch._foreach_add_(gs, params, alpha=group["weight_decay"])
        g.add_(m, alpha=opt.hyper)
        applied, nbytes = opt.engine.compressed_allreduce()  # in place: the averaged momentum
        if applied:
            m.copy_(g)
            for group, params, ms in opt.flat.per_group(m):
                torch._foreach_add_(params, ms, alpha=-group["lr"])
        return Taken(applied, nbytes)


class OnebitSGD(CompressedOptimizer):
    """SGD with momentum whose communication drops to 1 bit per element after ``freeze_step``
    steps (a sketch: no packed momentum, no overlap with backward)."""

    _group_keys = ("lr", "momentum", "weight_decay")
    _stage_types = (_Warmup, _Compression)

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-2,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        *,
        freeze_step: int,
        process_group: dist.ProcessGroup | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        max_grad_norm: float | None = None,
    ) -> None:
        def check() -> FreezeSchedule:
            if not 0.0 <= momentum < 1.0:
                raise ValueError(f"Invalid momentum value: {momentum}")
            check_same_in_every_group(self.param_groups, ("momentum",))
            return FreezeSchedule(freeze_step)

        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay)
        super().__init__(params, defaults, check=check, **shared_options(locals()))

    def _step_hyperparameters(self, groups: list[dict[str, Any]]) -> tuple[float, bool]:
        momentum = groups[0]["momentum"]
        return momentum, all(g["momentum"] == momentum for g in groups)

    def _allocate_state(self) -> None:
        self.momentum_buffer = self.flat.zeros()
        self.set_frozen(False)


def _run(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(rank)  # different initial weights per rank: rank 0's are broadcast
    model = make_model(seed=rank)
    ours = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    groups = [
        {"params": list(ddp.parameters())[:2], "weight_decay": 0.01},
        {"params": list(ddp.parameters())[2:], "lr": 3e-2},
    ]
    reference = torch.optim.SGD(groups, lr=1e-2, momentum=0.9, foreach=True)
    ours_groups = [
        {"params": list(ours.parameters())[:2], "weight_decay": 0.01},
        {"params": list(ours.parameters())[2:], "lr": 3e-2},
    ]
    opt = OnebitSGD(ours_groups, freeze_step=FREEZE, bucket_size=64)
    out: dict[str, Any] = {"stages": [], "warmup_equal": [], "states": []}
    for step in range(1, steps + 1):
        for net, optimizer in ((ddp, reference), (ours, opt)):
            optimizer.zero_grad()
            loss_of(net, step, rank).backward()
            if optimizer is opt:
                out["stages"].append(opt.stage)
            optimizer.step()
        if step <= FREEZE:
            out["warmup_equal"].append(all_equal(params_of(model), params_of(ours)))
        out["states"].append(sorted(opt.state[next(ours.parameters())]))
        if step == FREEZE + 1:
            saved = roundtrip(opt.state_dict())
            saved_params = params_of(ours)
    out["params"] = params_of(ours)
    out["comm_stats"] = dict(opt.comm_stats.steps)
    out["bytes"] = dict(opt.comm_stats.total_bytes)
    out["one_bit_call"] = sum(comm.bytes_per_call for comm in opt.comms)

    resumed = make_model(seed=7)  # the saved step's parameters, then its optimizer state
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), saved_params):
            p.copy_(q)
    groups_again = [
        {"params": list(resumed.parameters())[:2], "weight_decay": 0.01},
        {"params": list(resumed.parameters())[2:], "lr": 3e-2},
    ]
    again = OnebitSGD(groups_again, freeze_step=FREEZE, bucket_size=64)
    again.load_state_dict(saved)
    for step in range(FREEZE + 2, steps + 1):
        again.zero_grad()
        loss_of(resumed, step, rank).backward()
        again.step()
    out["resumed"] = params_of(resumed)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_run, 2, FREEZE + 4)


def test_its_warmup_is_sgd_with_momentum_and_ddp_bit_for_bit(two_ranks):
    for rank in two_ranks:
        assert rank["warmup_equal"] == [True] * FREEZE
        assert rank["stages"] == ["warmup"] * FREEZE + ["compression"] * 4


def test_its_compression_stage_sends_one_bit_and_keeps_the_ranks_together(two_ranks):
    first, second = two_ranks
    assert all_equal(first["params"], second["params"])
    assert first["comm_stats"] == {"warmup": FREEZE, "compression": 4}
    per_step = {stage: first["bytes"][stage] / n for stage, n in first["comm_stats"].items()}
    assert per_step["compression"] == first["one_bit_call"]  # the 1-bit allreduce, once
    assert per_step["compression"] < per_step["warmup"] / 4  # of a tiny model: scales weigh
    assert all(state == ["momentum_buffer"] for state in first["states"])


def test_its_checkpoint_resumes_to_the_same_bits(two_ranks):
    for rank in two_ranks:
        assert all_equal(rank["resumed"], rank["params"])


def test_its_settings_are_checked_on_every_rank_and_it_says_its_stage():
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    with pytest.raises(ValueError, match="momentum"):
        OnebitSGD(params, momentum=1.5, freeze_step=2)
    opt = OnebitSGD(params, freeze_step=1)
    assert opt.stage == "warmup"
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert opt.stage == "compression" and set(opt.state[params[0]]) == {"momentum_buffer"}
