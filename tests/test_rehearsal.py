"""The rehearsal (:mod:`onebit.optim.rehearsal`): after the first warmup step, a tiny copy of the
optimizer launches every Triton kernel variant that the later steps launch, so that on a GPU
they compile then and not at the freeze; and the run goes on bit for bit as without it, on real
gloo ranks.

Variants are named as an H100 would compile them: each launch, recorded under the interpreter,
goes through Triton's own binder for sm_90 in a fresh process (``benchmarks/registers.py``).
On the CPU the rehearsal is switched on by hand: it applies where kernels compile at run time,
Triton on CUDA (the ``cuda`` test checks it there by Triton's own count of compiled variants).
"""

from pathlib import Path

import pytest
import torch
from backends import use_backend
from distributed import run_ranks
from heavy import slow

import onebit
from onebit import kernels
from onebit.optim import rehearsal

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

CASES = {
    "OnebitAdam": ("OnebitAdam", {}),
    "OnebitAdam, clip": ("OnebitAdam", {"max_grad_norm": 0.05}),
    "OnebitAdam, one scale per bucket": ("OnebitAdam", {"scale_per": "bucket"}),
    "OnebitAdam, GradScaler": ("OnebitAdam", {"scaler": True}),
    "OnebitAdam, overlap_backward": ("OnebitAdam", {"overlap_backward": True}),
    "OnebitAdam, exp_avg_mask": ("OnebitAdam", {"mask": True}),
    "OnebitAdam, bf16 parameters": ("OnebitAdam", {"dtype": torch.bfloat16}),
    "OnebitLamb": ("OnebitLamb", {}),
    "OnebitLamb, clip": ("OnebitLamb", {"max_grad_norm": 0.05}),
    "ZeroOneAdam": ("ZeroOneAdam", {}),
    "ZeroOneAdam, clip": ("ZeroOneAdam", {"max_grad_norm": 0.05}),
}
"""The runs checked: an optimizer and its options (``scaler``: under a GradScaler; ``mask``:
an ``exp_avg_mask``; ``dtype``: the parameters')."""

STEPS = 16
COMPRESSED_STEPS = 8
"""1-bit Adam's and LAMB's steps in the variants' check: 3 of warmup, then 5 the same."""


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(  # 8 tensors: tables of a value each are 16-byte aligned
        torch.nn.Linear(24, 48),
        torch.nn.GELU(),
        torch.nn.Linear(48, 16),
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 8),
    )
    return model.to(dtype)


def _optimizer(name: str, model: torch.nn.Module, options: dict):
    """``name`` on ``model``: 1-bit Adam and LAMB freeze after 3 steps; 0/1 Adam's phase A has
    variance and compressed steps until 8, its phase B syncs and local steps."""
    params = list(model.parameters())
    settings = {k: v for k, v in options.items() if k not in ("scaler", "mask", "dtype")}
    if options.get("mask"):
        settings["exp_avg_mask"] = {params[0]: (torch.rand_like(params[0]) > 0.2).float()}
    if name == "ZeroOneAdam":
        return onebit.ZeroOneAdam(params, lr=1e-3, weight_decay=0.01, var_freeze_step=8,
                                  var_update_scaler=2, local_step_scaler=2, local_step_clipper=4,
                                  **settings)  # fmt: skip
    return getattr(onebit, name)(params=params, lr=1e-3, weight_decay=0.01, freeze_step=3,
                                 **settings)  # fmt: skip


def _train(name: str, options: dict, steps: int, rank: int = 0):
    """``steps`` steps of ``name`` with ``options`` on a small model, each on a batch of its
    own (``rank``'s); 0/1 Adam ends with ``synchronize()``."""
    model = _model(options.get("dtype", torch.float32))
    opt = _optimizer(name, model, options)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if options.get("scaler") else None
    generator = torch.Generator().manual_seed(1 + rank)
    for _ in range(steps):
        x = torch.randn(16, 24, generator=generator).to(next(model.parameters()).dtype)
        loss = model(x).float().square().mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    if name == "ZeroOneAdam":
        opt.synchronize()
    return model, opt


@pytest.mark.skipif("triton" not in kernels.available(), reason="Triton cannot run here")
@pytest.mark.slow
def test_the_rehearsal_launches_every_variant_the_later_steps_launch(monkeypatch):
    """Per case: the variants launched after the first step (through the freeze, compression,
    0/1 Adam's local steps, syncs and ``synchronize()``) are among those the first step and
    its rehearsal launched; and the first step alone did not launch them all, so the test
    fails if the rehearsal does nothing. 0/1 Adam runs its :data:`STEPS`, 1-bit Adam and LAMB
    :data:`COMPRESSED_STEPS` (their compression steps are all alike)."""
    use_backend("triton", monkeypatch)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import registers

    monkeypatch.setattr(rehearsal, "applies", lambda optimizer: True)
    runs = {}
    rehearse = rehearsal.rehearse
    with registers.recording() as launches:
        for case, (name, options) in CASES.items():
            launches.clear()
            bounds = []

            def rehearsed(*args, _bounds=bounds, **kwargs):
                _bounds.append(len(launches))
                rehearse(*args, **kwargs)
                _bounds.append(len(launches))

            monkeypatch.setattr(rehearsal, "rehearse", rehearsed)
            _train(name, options, STEPS if name == "ZeroOneAdam" else COMPRESSED_STEPS)
            assert len(bounds) == 2, f"{case}: the first step did not rehearse"
            runs[case] = (list(launches), bounds)
    everything = [launch for recorded, _ in runs.values() for launch in recorded]
    keys = iter(registers.variant_keys(everything))
    for case, (recorded, (start, end)) in runs.items():
        case_keys = [next(keys) for _ in recorded]
        first, rehearsed, later = (
            set(case_keys[:start]), set(case_keys[start:end]), set(case_keys[end:])
        )  # fmt: skip
        assert later <= first | rehearsed, f"{case}: compiled after the rehearsal"
        assert not later <= first, f"{case}: nothing left for the rehearsal to compile"


def _run(rank: int, world_size: int, name: str, options: dict, rehearse: bool):
    """A run of ``name`` with the rehearsal switched on, or (not ``rehearse``) off, through the
    freeze (0/1 Adam's local steps and syncs too); what it ends with, and how many times it
    rehearsed."""
    use_backend("triton")
    calls = []
    original = rehearsal.rehearse

    def counted(copy, scaled):
        calls.append(copy)
        original(copy, scaled)

    rehearsal.applies = lambda optimizer: rehearse
    rehearsal.rehearse = counted
    model, opt = _train(name, options, 12 if name == "ZeroOneAdam" else 6, rank=rank)
    params = [p.detach().clone() for p in model.parameters()]
    ended = (params, opt.state_dict()["state"], opt.comm_stats.bytes_total, opt.skipped_steps)
    return (*ended, torch.get_rng_state(), len(calls))


@pytest.mark.skipif("triton" not in kernels.available(), reason="Triton cannot run here")
@pytest.mark.parametrize("case", ["OnebitAdam, clip", slow("OnebitLamb"), slow("ZeroOneAdam")])
def test_the_rehearsal_leaves_the_run_as_it_was_on_two_ranks(case):
    """On 2 gloo ranks (its copy's collectives on the same group), a run with the rehearsal
    ends with the parameters, state, bytes sent and random number generator of one without
    it, bit for bit, and each rank rehearsed once."""
    name, options = CASES[case]
    with_, without = (run_ranks(_run, 2, name, options, r, timeout=300) for r in (True, False))
    for a, b in zip(with_, without):
        assert a[-1] == 1 and b[-1] == 0
        for x, y in zip(a[:-1], b[:-1]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.cuda
def test_on_cuda_the_steps_after_the_first_compile_nothing(monkeypatch):
    """On a GPU, each optimizer's steps after its first compile no Triton variant: the
    rehearsal at the end of the first step compiled them (Triton's own count, from an empty
    in-process cache)."""
    monkeypatch.delenv(kernels.ENV, raising=False)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from launches import _launched_kernels, _variants

    for name in ("OnebitAdam", "OnebitLamb", "ZeroOneAdam"):
        for kernel in _launched_kernels():
            kernel.device_caches.clear()
        model = _model().cuda()
        opt = _optimizer(name, model, {})
        assert opt.backend == "triton"
        counts = []
        for _ in range(STEPS):
            model(torch.randn(16, 24, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad()
            counts.append(_variants())
        assert counts[-1] == counts[0] > 0, f"{name}: variants compiled by each step {counts}"
