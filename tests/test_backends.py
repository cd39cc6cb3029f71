"""Every kernel backend through whole optimizer steps, against the torch reference.

The op-by-op conformance is in ``test_kernels.py`` (each op against the straightforward
formulation) and ``test_call_kernels.py`` (the public call on 1 to 4 ranks). Here the three
optimizers run their cases of ``harness.py`` (warmup, freeze, compression stage, 0/1 Adam's
local steps and syncs) on each backend, chosen through ``ONEBIT_BACKEND``, as the library runs
them. Signs, packing and error updates are exact on every backend; only the scales' reduction
order differs (the reference's fp32 norm is within 1e-4 of the exact value, the C and numpy
sums within 2e-6, ``test_kernels.py::test_scale``), so the parameters may differ from the
reference's by what such scales move them: :data:`ATOL`.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from backends import BACKENDS, use_backend
from distributed import run_ranks
from harness import CASES, run
from heavy import slow

from onebit import kernels

ATOL = 1e-5
"""How far a backend's parameters may be from the reference's at any step: the steps are about
1e-2, and scales that differ by 1e-4 of themselves move them by about 1e-6 a step. Measured on
these cases at 3 ranks: numpy bit for bit, the C kernels 1.2e-7 at most."""


WARMUP = dataclasses.replace(
    CASES["adam"], settings={**CASES["adam"].settings, "warmup_compression": "int4"}
)
"""1-bit Adam through a quantized warmup (int4, the packing that shares bytes)."""

EXTRA = {
    "int4 warmup": WARMUP,
    **{
        f"{name}, clip": dataclasses.replace(
            CASES[name], settings={**CASES[name].settings, "max_grad_norm": 0.05}
        )
        for name in ("adam", "lamb")
    },
}
"""Besides :data:`~harness.CASES`: the int4 warmup, and 1-bit Adam and 1-bit LAMB clipping every
step (each rank its own gradient, by a factor the fused passes take, after the freeze)."""


def _trajectories(rank: int, world_size: int, backend: str) -> dict[str, list[torch.Tensor]]:
    use_backend(backend)
    chosen = kernels.for_tensors(torch.zeros(8)).name
    results = {}
    for name, case in {**CASES, **EXTRA}.items():
        params = case.problem.params()
        opt = case.optimizer(params)
        trace = run(case, params, opt, rank, 1, case.steps)
        results[name] = (trace.stages, trace.params)
    return {"backend": chosen, **results}


@pytest.mark.parametrize("world", [1, slow(3)])  # 3: padding, and more than a pair
def test_every_backend_follows_the_reference_through_optimizer_steps(world):
    reference = run_ranks(_trajectories, world, "torch", timeout=300)
    for name in ("adam", "lamb"):  # the clipped cases clip
        assert not torch.equal(reference[0][name][1][-1], reference[0][f"{name}, clip"][1][-1])
    for backend in BACKENDS[:-1]:
        if backend not in kernels.available():
            continue
        got = run_ranks(_trajectories, world, backend, timeout=300)
        for rank in range(world):
            assert got[rank]["backend"] == backend
            for name in [*CASES, *EXTRA]:
                stages, params = got[rank][name]
                assert stages == reference[rank][name][0]
                for t, (p, q) in enumerate(zip(params, reference[rank][name][1]), start=1):
                    diff = float((p - q).abs().max())
                    assert diff <= ATOL, (backend, name, rank, t, diff)


def _built_with(rank: int, world_size: int, value: str) -> str | None:
    """Build an optimizer with ``ONEBIT_BACKEND=value`` on the last rank only (Triton without
    its interpreter: it cannot take CPU tensors)."""
    if rank == world_size - 1:
        os.environ[kernels.ENV] = value
        os.environ["TRITON_INTERPRET"] = "0"
    case = CASES["adam"]
    try:
        case.optimizer(case.problem.params())
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("value", ["triton", "gpu"])
def test_a_backend_that_cannot_run_fails_every_rank_at_construction(value):
    errors = run_ranks(_built_with, 2, value, timeout=120)
    for error in errors:
        assert error is not None and "rank 1: ONEBIT_BACKEND" in error


def _trajectory_on(device: torch.device, case, rank: int = 0) -> tuple:
    """A run of ``case`` as ``rank`` with its parameters on ``device``: the stages, the
    parameters after each step (on the CPU), and the optimizer."""
    params = [torch.nn.Parameter(p.detach().to(device)) for p in case.problem.params()]
    opt = case.optimizer(params)
    stages, trace = [], []
    for t in range(1, case.steps + 1):
        stages.append(opt.stage)
        for i, p in enumerate(params):
            p.grad = case.problem.grad(t, rank, i, p.detach().cpu()).to(device)
        opt.step()
        trace.append(torch.cat([p.detach().reshape(-1).cpu() for p in params]))
    return stages, trace, opt


@pytest.mark.cuda
@pytest.mark.parametrize("name", [*CASES, *EXTRA])
def test_triton_on_cuda_follows_the_torch_reference(name, monkeypatch):
    """On a GPU the Triton kernels run by default (the packed momentum included), within
    :data:`ATOL` of the torch reference on the same GPU."""
    case = {**CASES, **EXTRA}[name]
    cuda = torch.device("cuda")
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert kernels.for_device(cuda).name == "triton"
    stages, got, opt = _trajectory_on(cuda, case)
    monkeypatch.setenv(kernels.ENV, "torch")
    want_stages, want, _ = _trajectory_on(cuda, case)
    assert stages == want_stages
    assert (getattr(opt, "packed_momentum", None) is not None) == (name != "zero_one")
    for t, (p, q) in enumerate(zip(got, want), start=1):
        assert float((p - q).abs().max()) <= ATOL, (name, t)


def _ranks_sharing_cuda(rank: int, world_size: int, name: str) -> tuple:
    """``name``'s case on ranks that share the one GPU, over gloo with CUDA tensors: the kernels
    the optimizer ran, its stages, and the parameters after each step (on the CPU)."""
    os.environ.pop(kernels.ENV, None)
    case = {**CASES, **EXTRA}[name]
    stages, trace, opt = _trajectory_on(torch.device("cuda"), case, rank)
    return opt.backend, stages, trace


@pytest.mark.cuda
def test_ranks_sharing_one_gpu_over_gloo_follow_the_torch_reference():
    """Two ranks on the one GPU (it cannot hold two NCCL ranks; gloo carries CUDA tensors) run
    every case on Triton, within :data:`ATOL` of the torch reference on the CPU's gloo."""
    reference = run_ranks(_trajectories, 2, "torch", timeout=300)
    for name in [*CASES, *EXTRA]:
        for rank, (backend, stages, trace) in enumerate(
            run_ranks(_ranks_sharing_cuda, 2, name, timeout=300)
        ):
            want_stages, want = reference[rank][name]
            assert backend == "triton" and stages == want_stages, (name, rank)
            for t, (p, q) in enumerate(zip(trace, want), start=1):
                assert float((p - q).abs().max()) <= ATOL, (name, rank, t)
