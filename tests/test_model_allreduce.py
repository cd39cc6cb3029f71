"""The compressed allreduce of every bucket at once (:mod:`onebit.wire.model_allreduce`, on the
Triton kernels, under the interpreter here) against the same kernels a bucket at a time: the same
bits, on real gloo ranks, through non-finite gradients on the last rank (skipped steps, 0/1 Adam's
skipped sync) and the error buffers read mid-run. Every bucket at once, 0/1 Adam's sync step is its
Triton passes (``ModelPasses.sync_progress``); a bucket at a time, torch ops."""

import dataclasses

import pytest
import torch
from backends import use_backend
from distributed import run_ranks
from harness import CASES, _non_finite
from heavy import slow

from onebit import kernels


def _with(name: str, **settings):
    return dataclasses.replace(CASES[name], settings={**CASES[name].settings, **settings})


RUNS = {
    **CASES,
    "adam, clip": _with("adam", max_grad_norm=0.05),
    "adam, one scale per bucket": _with("adam", scale_per="bucket"),
    "adam, one scale per bucket, clip": _with("adam", scale_per="bucket", max_grad_norm=0.05),
    "zero_one, one scale per bucket": _with("zero_one", scale_per="bucket"),
    "zero_one, clip": _with("zero_one", max_grad_norm=0.05),
    "lamb, clip": _with("lamb", max_grad_norm=0.05),
}
"""The runs checked: 1-bit Adam with ``max_grad_norm`` (clipping every step) keeps its momentum
in fp32 and sends it every bucket at once too, with the squared gradient norms in the header;
with one scale per bucket (SPEC 2's) its momentum is never packed, and goes every bucket at once
with or without clipping, as 0/1 Adam's compressed steps and syncs do. 1-bit LAMB sends every
bucket at once where its momentum is not packed (here: clipping); packed, a bucket at a time."""


AT_ONCE = [n for n in RUNS if n != "lamb"]  # packed: a bucket at a time


def _count(cls: type, method: str, calls: list[int]) -> None:
    """Count the calls of ``cls.method`` in ``calls[0]`` (in a rank's own process)."""
    original = getattr(cls, method)

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    setattr(cls, method, counted)


def _run(rank: int, world_size: int, name: str, whole: bool):
    """``RUNS[name]``'s run with non-finite gradients, every bucket at once or (``whole``
    false) a bucket at a time; with how many steps sent every bucket at once, and how many
    compressed allreduces went a bucket at a time."""
    from onebit.kernels import triton_model
    from onebit.transport import engine
    from onebit.wire import momentum

    use_backend("triton")
    took, apart, fused = [0], [0], [0]
    communicate = engine.Engine.communicate

    def counted_apart(self, kind, *args, **kwargs):
        apart[0] += kind == "compressed"
        return communicate(self, kind, *args, **kwargs)

    engine.Engine.communicate = counted_apart
    for method in ("compress", "signs"):  # the allreduce's input; 1-bit Adam's compression
        _count(triton_model.ModelPasses, method, took)
    _count(triton_model.ModelPasses, "sync_progress", fused)  # 0/1 Adam's sync
    if not whole:
        engine.Engine.model_allreduce = lambda self: None
        momentum.PackedMomentumStage.passes = lambda self: None
    calls, skipped, dropped, steps = _non_finite(RUNS[name], rank, world_size)
    trace = [(c.stage, c.params_after, c.state_after) for c in calls]
    return trace, skipped, dropped, took[0], apart[0], fused[0]


@pytest.mark.skipif("triton" not in kernels.available(), reason="Triton cannot run here")
@pytest.mark.parametrize(
    "world_size,name",
    [(1, n) for n in AT_ONCE]
    + [slow(3, n) for n in ("adam", "zero_one")]
    + [slow(2, n) for n in AT_ONCE if n not in ("adam", "zero_one")],
)
def test_every_bucket_at_once_gives_the_bits_of_a_bucket_at_a_time(world_size, name):
    """Every run on 1 rank; 1-bit and 0/1 Adam on 3 (chunks split unevenly); the runs with
    clipping or a scale per bucket (1-bit LAMB's too), which change each rank's own gradient
    or scales, on 2."""
    whole = run_ranks(_run, world_size, name, True, timeout=600)
    per_bucket = run_ranks(_run, world_size, name, False, timeout=600)
    for (calls, skipped, dropped, took, apart, fused), apart_run in zip(whole, per_bucket):
        want, want_skipped, want_dropped, none, _, none_fused = apart_run
        sent = sum(stage in ("compression", "sync") for stage, _, _ in calls)
        syncs = sum(stage == "sync" for stage, _, _ in calls)
        assert (
            none == none_fused == 0 and took > 0 and (name.startswith("zero_one") or took == sent)
        )
        assert fused == (syncs if name.startswith("zero_one") else 0)  # 0/1 Adam's fused sync
        assert apart == 0  # no compressed allreduce went a bucket at a time
        assert (skipped, dropped) == (want_skipped, want_dropped) and skipped > 0
        for i, ((stage, params, state), (want_stage, want_params, want_state)) in enumerate(
            zip(calls, want)
        ):
            assert stage == want_stage, i
            assert torch.equal(params, want_params), (i, stage)
            assert torch.equal(state, want_state), (i, stage)


def _sync_run(rank: int, world_size: int, fused: bool) -> tuple[list, int]:
    """0/1 Adam with two param groups (weight decay in one), local steps, a sync step every
    interval and ``synchronize()`` between syncs, with its sync step's Triton passes or
    (``fused`` false) torch ops: the parameters and momentum after each call, and how many
    syncs took the passes."""
    import onebit
    from onebit.kernels import triton_model

    use_backend("triton")
    took = [0]
    _count(triton_model.ModelPasses, "sync_progress", took)
    if not fused:
        onebit.optim.zero_one_adam._Sync.passes = lambda self, grads: None
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((9, 7), (40,), (5, 3))]
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "lr": 3e-3}]
    opt = onebit.ZeroOneAdam(groups, lr=1e-2, bucket_size=64, var_freeze_step=3,
                             local_step_scaler=2, local_step_clipper=4)  # fmt: skip
    trace = []
    for t in range(14):
        g = torch.Generator().manual_seed(100 * rank + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        if t in (6, 10):  # between syncs: parameters apart, no local step to take
            opt.synchronize()
        state = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params])
        trace.append((opt.stage, torch.cat([p.detach().reshape(-1) for p in params]), state))
    return trace, took[0]


@pytest.mark.skipif("triton" not in kernels.available(), reason="Triton cannot run here")
def test_zero_one_sync_passes_give_the_bits_of_torch_ops():
    fused = run_ranks(_sync_run, 2, True, timeout=600)
    torch_ops = run_ranks(_sync_run, 2, False, timeout=600)
    for (trace, took), (want, none) in zip(fused, torch_ops):
        assert none == 0 and took >= 6  # the syncs of steps and both synchronize() calls
        assert [stage for stage, _, _ in trace] == [stage for stage, _, _ in want]
        for t, ((stage, params, m), (_, want_params, want_m)) in enumerate(zip(trace, want)):
            assert torch.equal(params, want_params), (t, stage)
            assert torch.equal(m, want_m), (t, stage)
    for t in (6, 10):  # after synchronize(): the same on every rank
        assert torch.equal(fused[0][0][t][1], fused[1][0][t][1])


LARGE = [(3001, 64), (64,), (64, 192), (192,), (256, 64), (256,), (64, 256), (777, 33)] * 5
"""About 1.3M elements in 40 tensors: at a bucket size of 2**16, 20 buckets of 16 blocks
each, with tensors across bucket boundaries, so that the GPU runs many blocks at once."""

LARGE_CASES = {
    "adam": ("OnebitAdam", {"freeze_step": 2}),
    "adam, clip": ("OnebitAdam", {"freeze_step": 2, "max_grad_norm": 1.0}),
    "adam, one scale per bucket": ("OnebitAdam", {"freeze_step": 2, "scale_per": "bucket"}),
    "lamb, clip": ("OnebitLamb", {"freeze_step": 2, "max_grad_norm": 1.0}),
    "zero_one": ("ZeroOneAdam", {"var_freeze_step": 2, "local_step_scaler": 10**9}),
}


def _large_start(split: bool = False) -> torch.Tensor | list[torch.Tensor]:
    """The parameters ``_large_trajectory`` starts from, on the CPU: one per shape of ``LARGE``,
    or (``split=False``) laid end to end."""
    torch.manual_seed(0)
    params = [torch.randn(s) * 0.1 for s in LARGE]
    return params if split else torch.cat([p.reshape(-1) for p in params])


def _large_trajectory(name: str, device: str = "cuda", steps: int = 8) -> tuple[list, int]:
    """``LARGE_CASES[name]`` on ``device`` at world size 1: each step's stage and parameters (on the
    CPU), and how many passes over every bucket ran."""
    import onebit
    from onebit.kernels import triton_model

    optimizer, options = LARGE_CASES[name]
    took = [0]
    originals = {m: getattr(triton_model.ModelPasses, m) for m in ("compress", "signs")}

    def counted(self, *args, _method, **kwargs):
        took[0] += 1
        return originals[_method](self, *args, **kwargs)

    params = [torch.nn.Parameter(p.to(device)) for p in _large_start(split=True)]
    opt = getattr(onebit, optimizer)(params, lr=1e-3, bucket_size=2**16, **options)
    trace = []
    try:
        for m in originals:
            setattr(triton_model.ModelPasses, m,
                    lambda self, *a, _m=m, **k: counted(self, *a, _method=_m, **k))  # fmt: skip
        for t in range(steps):
            g = torch.Generator(device=device).manual_seed(t)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g, device=device) * (1 + t % 3)
            opt.step()
            trace.append((opt.stage, torch.cat([p.detach().reshape(-1) for p in params]).cpu()))
    finally:
        for m, original in originals.items():
            setattr(triton_model.ModelPasses, m, original)
    return trace, took[0]


@pytest.mark.cuda
@pytest.mark.parametrize("name", LARGE_CASES)
def test_on_cuda_every_bucket_at_once_follows_a_bucket_at_a_time(name, monkeypatch):
    """On a GPU the blocks of a pass run at once, in any order: a block that read what another
    writes would corrupt whole blocks of elements, which the interpreter (one block after the
    other) cannot show. A compiled reduction sums a block in its own order, so a scale may
    differ in its last bit, and the parameters then by about 1e-7 (an H100 after 8 steps:
    at most 1.2e-7); an element whose sign flips on such a difference moves by about ``lr``.
    In 1-bit LAMB a flipped sign also changes its tensor's fresh-variance factor (a maximum over
    the tensor, which may move by ``factor_threshold`` a step), and so every update of that
    tensor by up to 10% (an H100: 46 elements apart by up to 1.8e-5 after 4 steps). 0/1 Adam's
    sync step is Triton passes over every bucket, and torch ops a bucket at a time, whose
    ``addcdiv`` rounds ``p + value·(m/d)`` on CUDA (``(value·m)/d`` on the CPU, as the passes
    do), so its parameters differ in their last bits and a sign of the progress may flip. In
    both an element passes if it stays within a quarter of the distance it travelled."""
    from onebit.transport import engine
    from onebit.wire import momentum

    monkeypatch.delenv(kernels.ENV, raising=False)
    whole, took = _large_trajectory(name)
    monkeypatch.setattr(engine.Engine, "model_allreduce", lambda self: None)
    monkeypatch.setattr(momentum.PackedMomentumStage, "passes", lambda self: None)
    per_bucket, none = _large_trajectory(name)
    assert took >= 5 and none == 0
    travelled = torch.zeros_like(per_bucket[0][1])
    previous = _large_start()
    for t, ((stage, params), (want_stage, want)) in enumerate(zip(whole, per_bucket)):
        assert stage == want_stage, t
        travelled += (want - previous).abs()
        previous = want
        apart = (params - want).abs()
        bound = 1e-6 + (0.25 * travelled if name.startswith(("lamb", "zero_one")) else 0)
        assert int((apart > bound).sum()) <= 16, (t, stage, float(apart.max()))
