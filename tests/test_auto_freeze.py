"""freeze_step="auto": the rule, its knobs, its records, resume, and agreement across ranks."""

import io
import math

import pytest
import torch
from distributed import run_ranks

import onebit
from onebit.freeze import AutoFreeze, VarianceMonitor

SHAPES = [(20, 10), (10,), (0,), (5,)]
KNOBS = AutoFreeze(window=10, tolerance=0.3, patience=2, min_step=20, max_step=400)
GROWING = AutoFreeze(tolerance=0.2, patience=2)  # the default window: freezes near 200
RUN = 250


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _set_grads(params, step, rank=0):
    """Noisy gradients whose scale decays from 5x to 1x: Adam's variance settles over time."""
    scale = 1 + 4 * math.exp(-step / 15)
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(1000 * step + 10 * rank + i)
        p.grad = (torch.randn(p.shape, generator=gen) * scale + 0.1 * p.detach()).to(p.dtype)


def _adam(params, freeze_step, **kwargs):
    kwargs.setdefault("auto_freeze", KNOBS if freeze_step == "auto" else None)
    return onebit.OnebitAdam(params, lr=1e-2, betas=(0.9, 0.99), freeze_step=freeze_step, **kwargs)


def _lamb(params, freeze_step, **kwargs):
    kwargs.setdefault("auto_freeze", KNOBS if freeze_step == "auto" else None)
    return onebit.OnebitLamb(params, lr=1e-2, betas=(0.9, 0.99), freeze_step=freeze_step, **kwargs)


def _run(params, opt, first, last, rank=0):
    history = []
    for t in range(first, last + 1):
        _set_grads(params, t, rank)
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1) for p in params]))
    return history


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# The rule on synthetic denominators.


def _observe(monitor, steps, denominators_at):
    decisions = []
    for t in range(1, steps + 1):
        if monitor.observe(t, denominators_at(t)):
            decisions.append(t)
    return decisions


def test_stable_variance_freezes_after_patience_windows_and_not_before_min_step():
    numels = [6, 3]
    stable = lambda t: [torch.ones(6), torch.full((3,), 2.0)]  # noqa: E731
    monitor = VarianceMonitor(AutoFreeze(window=10, patience=2, min_step=1), numels=numels)
    # Measured at 10 (no reference yet), 20 (stable 1), 30 (stable 2): freeze at 30.
    assert _observe(monitor, 30, stable)[0] == 30
    monitor = VarianceMonitor(AutoFreeze(window=10, patience=2, min_step=45), numels=numels)
    assert _observe(monitor, 60, stable)[0] == 50


def test_the_statistic_is_the_change_per_unit_of_relative_time():
    """A third of the elements drift by 2% per window of 10 steps: at step 100 that is a change
    of (1.02^10 - 1) / 3 over a window that is a ninth of the 90 steps before it; with a memory
    of 50 steps, a fifth of it."""
    numels = [6, 3]

    def one_layer_drifts(t):
        return [torch.ones(6), torch.full((3,), 1.02**t)]

    per_window = (1.02**10 - 1) / 3
    for memory, elapsed in ((math.inf, 90), (50, 50)):
        knobs = AutoFreeze(window=10, tolerance=0.01, patience=1, min_step=1)
        monitor = VarianceMonitor(knobs, memory, numels=numels)
        assert _observe(monitor, 100, one_layer_drifts) == []
        assert monitor.last_change == pytest.approx(per_window * elapsed / 10, rel=1e-4)
    knobs = AutoFreeze(window=10, tolerance=0.01, min_step=1, max_step=57)
    assert _observe(VarianceMonitor(knobs, numels=numels), 60, one_layer_drifts)[0] == 57
    nan = lambda t: [torch.full((6,), float("nan")), torch.ones(3)]  # noqa: E731
    monitor = VarianceMonitor(AutoFreeze(window=10, patience=1, min_step=1), numels=numels)
    assert _observe(monitor, 100, nan) == []


def test_the_default_window_grows_with_the_run():
    """About 8 measurements per doubling of the step, at any length of run."""
    due = [t for t in range(1, 2**14) if VarianceMonitor(AutoFreeze()).due(t)]
    assert due[:20] == list(range(1, 17)) + [18, 20, 22, 24]
    for low in (64, 1024, 8192):
        between = [t for t in due if low <= t < 2 * low]
        assert between == list(range(low, 2 * low, low // 8))


def test_a_settling_variance_freezes_by_its_own_time_scale():
    """``d(t) = 1 + c / t``, the mean of a variance averaging gradients that shrank early on:
    the same rule freezes a run 1000 times longer 1000 times later, where no fixed window
    could."""
    freezes = []
    for c in (3, 3000):
        monitor = VarianceMonitor(AutoFreeze(min_step=1), numels=[4])
        decided = _observe(monitor, 100 * c, lambda t: [torch.full((4,), 1 + c / t)])  # noqa: B023
        freezes.append(decided[0])
    assert 5 <= freezes[0] <= 20 and 500 * freezes[0] <= freezes[1] <= 2000 * freezes[0]


def test_a_tiny_noisy_layer_cannot_hold_the_freeze_back():
    gen = torch.Generator().manual_seed(0)

    def noisy_bias(t):
        return [torch.ones(1000), 1 + 0.2 * torch.rand(2, generator=gen)]

    knobs = AutoFreeze(window=10, patience=2, min_step=1)
    assert _observe(VarianceMonitor(knobs, numels=[1000, 2]), 30, noisy_bias)[0] == 30


def test_told_the_run_length_it_freezes_by_a_fraction_of_it():
    drifting = lambda t: [torch.full((4,), 1.05**t)]  # noqa: E731
    assert AutoFreeze(total_steps=300).last_step == 60  # a fifth by default
    assert AutoFreeze().last_step is None  # untold: the learning rate's fall stands in
    for total, fraction, last in ((300, 0.25, 75), (1000, 0.1, 100), (6, 0.25, 1)):
        knobs = AutoFreeze(total_steps=total, max_fraction=fraction)
        assert knobs.last_step == last and knobs.first_step == min(50, last)
        assert _observe(VarianceMonitor(knobs), total, drifting)[0] == last
    # Stable enough, a 300-step run freezes before its cap, past the minimum of 50 steps.
    settling = lambda t: [torch.full((4,), 1 + 3 / t)]  # noqa: E731
    decided = _observe(VarianceMonitor(AutoFreeze(total_steps=300)), 300, settling)
    assert 50 <= decided[0] < 60
    assert AutoFreeze(max_step=10, total_steps=300).last_step == 10  # an explicit cap wins


def test_every_reasonable_combination_of_knobs_is_accepted():
    assert AutoFreeze(max_step=10).first_step == 10  # a cap below the default minimum lowers it
    assert AutoFreeze(total_steps=100).first_step == 20
    assert AutoFreeze(min_step=5, max_step=5).last_step == 5
    assert AutoFreeze(min_step=500, total_steps=10_000).first_step == 500
    assert AutoFreeze(min_step=0).first_step == 0  # no minimum at all


def test_bad_knobs_raise_value_error():
    for kwargs in [
        dict(window=0),
        dict(patience=0),
        dict(tolerance=0.0),
        dict(tolerance=float("nan")),
        dict(min_step=1.5),
        dict(min_step=-1),
        dict(max_step=0),
        dict(window=True),
        dict(total_steps=0),
        dict(total_steps=100, max_fraction=0),
        dict(total_steps=100, max_fraction=1.5),
        dict(max_fraction="a"),
    ]:
        with pytest.raises(ValueError, match="AutoFreeze"):
            AutoFreeze(**kwargs)
    with pytest.raises(ValueError, match="min_step=50 is above max_step=10.*Lower min_step"):
        AutoFreeze(min_step=50, max_step=10)
    with pytest.raises(ValueError, match=r"above max_step=20 \(0.2 of total_steps=100\)"):
        AutoFreeze(min_step=50, total_steps=100)
    for make in (_adam, _lamb):
        for freeze_step in ("Auto", 0, -3, 2.5, True, None):
            with pytest.raises(ValueError):
                make(_params(), freeze_step, auto_freeze=None)
        with pytest.raises(ValueError):
            make(_params(), 10, auto_freeze=KNOBS)  # knobs without "auto"


# The rule inside the optimizers.


@pytest.mark.parametrize("make", [_adam, _lamb], ids=["OnebitAdam", "OnebitLamb"])
def test_auto_is_the_fixed_run_at_the_step_it_chose_and_is_recorded(make):
    params = _params()
    opt = make(params, "auto")
    assert opt.freeze_step is None and opt.comm_stats.freeze_step is None
    auto = _run(params, opt, 1, RUN)
    chosen = opt.freeze_step
    assert chosen is not None and KNOBS.min_step <= chosen < RUN and chosen % KNOBS.window == 0
    assert opt.comm_stats.freeze_step == chosen
    assert opt.state_dict()["onebit"]["freeze_step"] == chosen
    assert opt.comm_stats.steps == {"warmup": chosen, "compression": RUN - chosen}
    # Watching the variance changes nothing: the run is bit for bit the fixed one.
    params = _params()
    fixed = _run(params, make(params, chosen), 1, RUN)
    assert all(torch.equal(a, b) for a, b in zip(auto, fixed))


@pytest.mark.parametrize("knobs", [KNOBS, GROWING], ids=["fixed-window", "growing-window"])
@pytest.mark.parametrize("make", [_adam, _lamb], ids=["OnebitAdam", "OnebitLamb"])
def test_resume_in_the_middle_of_the_decision_is_exact(make, knobs):
    params = _params()
    opt = make(params, "auto", auto_freeze=knobs)
    straight = _run(params, opt, 1, RUN)
    chosen = opt.freeze_step
    checkpoint = chosen - 5  # some stable windows already counted
    params = _params()
    opt = make(params, "auto", auto_freeze=knobs)
    _run(params, opt, 1, checkpoint)
    assert opt.freeze_step is None and opt.freeze.monitor.stable_windows >= 1
    saved = _roundtrip({"model": [p.detach().clone() for p in params], "optim": opt.state_dict()})
    params = _params()
    opt = make(params, "auto", auto_freeze=knobs)
    with torch.no_grad():
        for p, q in zip(params, saved["model"]):
            p.copy_(q)
    opt.load_state_dict(saved["optim"])
    resumed = _run(params, opt, checkpoint + 1, RUN)
    assert opt.freeze_step == chosen and opt.comm_stats.freeze_step == chosen
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight[checkpoint:]))
    # A decided step survives a resume too; a fixed freeze_step stays the constructor's.
    fresh = make(_params(), "auto")
    fresh.load_state_dict(_roundtrip(opt.state_dict()))
    assert fresh.freeze_step == chosen and fresh.stage == "compression"
    fixed = make(_params(), 7)
    fixed.load_state_dict(_roundtrip(opt.state_dict()))
    assert fixed.freeze_step == 7 == fixed.comm_stats.freeze_step


def test_default_knobs_freeze_a_settled_run():
    params = _params()
    opt = onebit.OnebitAdam(params, warmup_compression="fp32", lr=1e-2, freeze_step="auto")
    _run(params, opt, 1, 500)
    assert opt.freeze_step is not None and 50 <= opt.freeze_step < 500
    params = _params()
    told = AutoFreeze(total_steps=100)
    opt = onebit.OnebitAdam(
        params, warmup_compression="fp32", lr=1e-2, freeze_step="auto", auto_freeze=told
    )
    _run(params, opt, 1, 100)
    assert opt.freeze_step == 20 == opt.comm_stats.freeze_step


# Agreement across ranks.


def _agreement(rank, world_size):
    # The monitor alone, fed different denominators on each rank: only the last rank's drift.
    # Alone, the other ranks would freeze at step 15.
    drift = 1.02 if rank == world_size - 1 else 1.0
    knobs = AutoFreeze(window=5, tolerance=0.01, patience=1, min_step=1)
    monitor = VarianceMonitor(knobs, numels=[4, 2])
    decisions = _observe(monitor, 40, lambda t: [torch.ones(4), torch.full((2,), drift**t)])
    changes = monitor.last_change
    # Both optimizers on rank-dependent gradients.
    chosen, final = [], []
    quick = AutoFreeze(patience=2, min_step=10, total_steps=200)  # the default window
    for make in (_adam, _lamb):
        params = _params(torch.bfloat16 if make is _lamb else torch.float32)
        opt = make(params, "auto", bucket_size=64, auto_freeze=quick)
        _run(params, opt, 1, 80, rank)
        chosen.append((opt.freeze_step, opt.comm_stats.freeze_step, opt.stage))
        final.append(torch.cat([p.detach().float().reshape(-1) for p in params]))
    return decisions, changes, chosen, final


def test_ranks_agree_on_the_freeze_step():
    results = run_ranks(_agreement, 3)
    decisions, change, chosen, final = results[0]
    assert decisions == [] and change == pytest.approx((1.02**5 - 1) / 3 * 35 / 5, rel=1e-4)
    assert chosen[0][0] is not None and chosen[1][0] is not None
    assert chosen[0][0] == chosen[0][1] and chosen[1][0] == chosen[1][1]
    assert [c[2] for c in chosen] == ["compression", "compression"]
    for other in results[1:]:
        assert other[0] == decisions and other[1] == change and other[2] == chosen
        assert all(torch.equal(a, b) for a, b in zip(other[3], final))


def test_untold_it_freezes_once_the_learning_rate_falls_below_its_peak():
    """Not told the run's length, the rule freezes a variance that never settles once the
    learning rate is ``lr_drop`` below its peak, from ``min_step`` on: a fifth into a run whose
    cosine decay to a tenth follows a warmup over its first 5%."""
    drifting = lambda t: [torch.full((4,), 1.05**t)]  # noqa: E731

    def cosine(t, total=600, warmup=30):
        if t < warmup:
            return t / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (t - warmup) / (total - warmup)))

    def freeze_step(knobs, lr):
        monitor = VarianceMonitor(knobs)
        for t in range(1, 601):
            monitor.note_lr(lr(t))
            if monitor.due(t) and monitor.observe(t, drifting(t)):
                return t
        return None

    assert freeze_step(AutoFreeze(), cosine) == 117  # 0.1 + 0.45 (1 + cos) <= 0.95 there
    assert freeze_step(AutoFreeze(), lambda t: cosine(t, 300, 15)) == 59
    assert freeze_step(AutoFreeze(), lambda t: 1e-3) is None  # constant: the variance decides
    assert freeze_step(AutoFreeze(lr_drop=None), cosine) is None
    assert freeze_step(AutoFreeze(lr_drop=0.5), cosine) == 336
    assert freeze_step(AutoFreeze(min_step=200), cosine) == 200  # never before min_step
    assert freeze_step(AutoFreeze(total_steps=600), cosine) == 120  # told: a fifth, as ever
    with pytest.raises(ValueError, match="lr_drop"):
        AutoFreeze(lr_drop=1.0)
