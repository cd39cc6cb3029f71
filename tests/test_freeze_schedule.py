"""FreezeSchedule, the state object that ends the warmup, and the warmup step the three
optimizers share."""

import pytest
import torch
from optimizer_state import roundtrip

import onebit
from onebit.freeze import AutoFreeze, FreezeSchedule, VarianceMonitor

QUICK = AutoFreeze(window=2, tolerance=0.5, patience=1, min_step=4)


def _denominators(step):
    return [torch.full((6,), 1 + 1 / step), torch.full((3,), 2.0)]


def _params():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(8, 4), (4,), (3,)]]


def _set_grads(params, step):
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(100 * step + i)
        p.grad = torch.randn(p.shape, generator=gen) * (1 + 2 / step)


def test_bad_arguments_raise_value_error():
    for freeze_step in ("Auto", 0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match="freeze_step must be an int >= 1"):
            FreezeSchedule(freeze_step)
    with pytest.raises(ValueError, match="auto_freeze needs"):
        FreezeSchedule(5, QUICK)
    with pytest.raises(ValueError, match="auto_freeze must be an AutoFreeze"):
        FreezeSchedule("auto", {"window": 2})


def test_a_fixed_step_answers_without_watching_and_keeps_its_step_on_load():
    schedule = FreezeSchedule(3)
    assert [schedule.in_warmup(n) for n in range(5)] == [True, True, True, False, False]
    assert [schedule.variance_step(t) for t in range(1, 6)] == [1, 2, 3, 3, 3]
    assert schedule.monitor is None and schedule.auto_freeze is None
    assert not schedule.measures(2) and not schedule.observe(2, _denominators(2))
    assert schedule.state_dict() == {"freeze_step": 3, "auto_freeze": None}
    schedule.load_state_dict({"freeze_step": 9, "auto_freeze": None})
    schedule.load_state_dict({})  # 0/1 Adam's checkpoints from before it had a schedule
    assert schedule.freeze_step == 3


def test_auto_decides_once_and_a_resumed_decision_continues_exactly():
    straight = FreezeSchedule("auto", QUICK)
    assert straight.freeze_step is None and straight.in_warmup(10**6)
    decided = [t for t in range(1, 12) if straight.observe(t, _denominators(t))]
    assert decided == [4] and straight.freeze_step == 4
    assert not straight.measures(6) and straight.variance_step(9) == 4

    first = FreezeSchedule("auto", QUICK)
    assert not first.observe(2, _denominators(2))
    resumed = FreezeSchedule("auto", QUICK)
    resumed.load_state_dict(roundtrip(first.state_dict()))
    assert resumed.monitor.stable_windows == first.monitor.stable_windows
    assert [t for t in range(3, 12) if resumed.observe(t, _denominators(t))] == [4]


def test_the_monitor_weighs_layers_by_the_denominators_sizes_unless_told():
    told = VarianceMonitor(AutoFreeze(window=1, patience=1, min_step=1), numels=[6, 3])
    guessed = VarianceMonitor(AutoFreeze(window=1, patience=1, min_step=1))
    for t in range(1, 5):
        assert told.observe(t, _denominators(t)) == guessed.observe(t, _denominators(t))
        assert told.last_change == guessed.last_change


@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
def test_each_optimizer_holds_its_schedule_and_reports_it(name):
    params = _params()
    make = {
        "adam": lambda: onebit.OnebitAdam(
            params, warmup_compression="fp32", freeze_step="auto", auto_freeze=QUICK
        ),
        "lamb": lambda: onebit.OnebitLamb(
            params, warmup_compression="fp32", freeze_step="auto", auto_freeze=QUICK
        ),
        "zero_one": lambda: onebit.ZeroOneAdam(params, var_freeze_step=4),
    }[name]
    opt = make()
    assert isinstance(opt.freeze, FreezeSchedule)
    warmups = []
    for t in range(1, 7):
        warmups.append(opt.in_warmup)
        _set_grads(params, t)
        opt.step()
    assert warmups == [True] * 4 + [False] * 2
    assert opt.freeze_step == opt.freeze.freeze_step == opt.comm_stats.freeze_step == 4
    state = opt.state_dict()
    assert state["onebit"]["freeze_step"] == 4
    if name == "zero_one":  # its checkpoints from before it had a schedule lack the keys
        for key in ("freeze_step", "auto_freeze"):
            state["onebit"].pop(key)
        again = make()
        again.load_state_dict(state)
        assert again.freeze_step == again.comm_stats.freeze_step == 4 and not again.in_warmup


def _run(opt, params, steps):
    for t in range(1, steps + 1):
        _set_grads(params, t)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("warmup", ["fp32", "int4"])
def test_one_bit_adam_and_zero_one_adam_share_the_warmup_step_bit_for_bit(bias_correction, warmup):
    """Before any freeze, with every 0/1 Adam step a variance step, both are AdamW on the
    same averaged (fp32 or int4), clipped gradients: the same code, so the same bits."""

    def groups(params):
        return [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "lr": 3e-3}]

    common = dict(
        lr=1e-2, max_grad_norm=1.0, bias_correction=bias_correction, warmup_compression=warmup
    )
    params = _params()
    adam = onebit.OnebitAdam(groups(params), freeze_step=100, **common)
    one_bit = _run(adam, params, 8)
    params = _params()
    zero_one = onebit.ZeroOneAdam(
        groups(params), var_freeze_step=100, var_update_scaler=100, **common
    )
    assert torch.equal(_run(zero_one, params, 8), one_bit)
