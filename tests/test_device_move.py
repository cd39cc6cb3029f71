"""The optimizer's state follows the parameters to their device.

HF Trainer and Accelerate build the optimizer while the model is on the CPU and move the model
to the GPU afterwards. The optimizer then makes its state anew on the parameters' device at its
next step (through its own state dict), and must go on exactly as one built there. On the CPU
the tests force that rebuild before every step and check the run is bitwise the one without it;
the tests marked ``cuda`` move a real model to the GPU.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from harness import CASES, same
from optimizer_state import flat
from torch.nn.parallel import DistributedDataParallel

import onebit

VARIANTS = [
    ("adam", {}),
    ("adam", {"warmup_compression": "int8"}),
    ("adam", {"max_grad_norm": 1.0}),
    ("adam", {"overlap_backward": True}),
    ("zero_one", {}),
    ("lamb", {}),
    ("lamb", {"warmup_compression": "int4"}),
]


class Holder(torch.nn.Module):
    """The problem's parameters as a module whose loss has the wanted gradients, so that
    backward (and DDP's hooks) produce them."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(params)

    def forward(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.ps, grads))


def _run(name: str, settings: dict, rank: int, move: bool, ddp: bool) -> tuple:
    """A run of the case by backward passes; with ``move`` the state is made anew before every
    step, as when the parameters have moved."""
    case = CASES[name]
    params = case.problem.params()
    model: torch.nn.Module = Holder(params)
    opt = case.optimizer(params, **settings)
    if ddp:
        model = DistributedDataParallel(model)
        model.register_comm_hook(opt, onebit.ddp_comm_hook)
    trace = []
    for t in range(1, case.steps + 1):
        if move:
            opt._move_state_to(torch.device("cpu"))
        grads = [case.problem.grad(t, rank, i, p) for i, p in enumerate(params)]
        opt.zero_grad()
        model(grads).backward()
        opt.step()
        trace.append(flat(params))
    return trace, opt.state_dict(), opt.comm_stats.total_bytes


def _moved_and_straight(rank: int, world_size: int) -> list[bool]:
    results = []
    for name, settings in VARIANTS:
        for ddp in (False, True) if settings.get("overlap_backward") else (False,):
            straight = _run(name, settings, rank, move=False, ddp=ddp)
            moved = _run(name, settings, rank, move=True, ddp=ddp)
            results.append(same(list(straight), list(moved)))
    return results


def test_state_made_anew_before_every_step_continues_bitwise():
    for rank_results in run_ranks(_moved_and_straight, 2, timeout=300):
        assert rank_results == [True] * len(rank_results)


def _split_devices(rank: int, world_size: int) -> str | None:
    case = CASES["adam"]
    params = case.problem.params()
    opt = case.optimizer(params)
    if rank == 1:  # one parameter left behind on another device
        meta = torch.nn.Parameter(torch.empty_like(params[0], device="meta"))
        torch.utils.swap_tensors(params[0], meta)
    for i, p in enumerate(params):
        p.grad = None if p.is_meta else case.problem.grad(1, rank, i, p)
    try:
        opt.step()
    except RuntimeError as err:
        return str(err)
    return None


def test_parameters_on_two_devices_raise_on_every_rank():
    errors = run_ranks(_split_devices, 2, timeout=120)
    for error in errors:
        assert error is not None and "rank 1 has parameters on more than one device" in error


cuda = pytest.mark.cuda


def _train_on_cuda(name: str, settings: dict, build_first: bool, cpu_step: int = 0) -> tuple:
    """A run on CUDA of a model whose optimizer is built before or after ``model.cuda()``;
    step ``cpu_step`` runs on the CPU, the model moved there and back."""
    case = CASES[name]
    model = Holder(case.problem.params())
    if not build_first:
        model.cuda()
    opt = case.optimizer(list(model.ps), **settings)
    model.cuda()
    trace = []
    for t in range(1, case.steps + 1):
        model.to("cpu" if t == cpu_step else "cuda")
        grads = [case.problem.grad(t, 0, i, p.cpu()).to(p.device) for i, p in enumerate(model.ps)]
        opt.zero_grad()
        model(grads).backward()
        opt.step()
        trace.append(flat([p.cpu() for p in model.ps]))
    model.cuda()
    opt.zero_grad()
    opt.step()  # the state follows the parameters at every step
    on_cuda = all(t.is_cuda for s in opt.state.values() for t in s.values())
    on_cuda = on_cuda and opt.backend == "triton"
    return trace, opt.state_dict()["state"], on_cuda


@cuda
@pytest.mark.parametrize("name, settings", VARIANTS)
def test_built_on_the_cpu_then_moved_to_cuda_is_bitwise_built_on_cuda(name, settings):
    built_after = _train_on_cuda(name, settings, build_first=False)
    built_before = _train_on_cuda(name, settings, build_first=True)
    assert built_before[2] and built_after[2]
    assert same(built_before[0], built_after[0]) and same(built_before[1], built_after[1])
    before = CASES[name].checkpoint
    back_and_forth = _train_on_cuda(name, settings, True, cpu_step=before)
    assert back_and_forth[2]
    assert same(back_and_forth[0][: before - 1], built_after[0][: before - 1])
    assert all(torch.isfinite(p).all() for p in back_and_forth[0])


def _ddp_on_cuda(rank: int, world_size: int, build_first: bool) -> list[torch.Tensor]:
    """1-bit Adam with overlap through DDP's comm hook on CUDA (gloo carries CUDA tensors)."""
    case = CASES["adam"]
    model = Holder(case.problem.params())
    if not build_first:
        model.cuda()
    opt = case.optimizer(list(model.ps), overlap_backward=True)
    ddp = DistributedDataParallel(model.cuda())
    ddp.register_comm_hook(opt, onebit.ddp_comm_hook)
    trace = []
    for t in range(1, case.steps + 1):
        grads = [case.problem.grad(t, rank, i, p.cpu()).cuda() for i, p in enumerate(model.ps)]
        opt.zero_grad()
        ddp(grads).backward()
        opt.step()
        trace.append(flat([p.cpu() for p in model.ps]))
    return trace


@cuda
def test_ddp_comm_hook_with_the_optimizer_built_before_the_move():
    built_before = run_ranks(_ddp_on_cuda, 1, True)[0]
    built_after = run_ranks(_ddp_on_cuda, 1, False)[0]
    assert same(built_before, built_after)
