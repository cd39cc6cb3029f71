"""What OnebitAdam, ZeroOneAdam and OnebitLamb share, tested on each: bitwise-exact resume (on
two ranks in fresh processes, and in one process at every turn of the schedules), skipping a
step when one rank's gradient is not finite, and rejecting bad constructor arguments.

The two-rank runs of all three optimizers share two launches of the ranks (see
``harness.two_rank_runs``), made once for this module.
"""

import pytest
import torch
from distributed import run_ranks
from harness import (
    CASES,
    COMMON_BAD_ARGUMENTS,
    DROPPED_ALONE,
    checkpoint,
    checkpoint_path,
    restore,
    resumed_runs,
    run,
    same,
    two_rank_runs,
)
from optimizer_state import roundtrip

import onebit

NAMES = list(CASES)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The checkpoint directory and each rank's results of ``harness.two_rank_runs``."""
    directory = str(tmp_path_factory.mktemp("checkpoints"))
    return directory, run_ranks(two_rank_runs, 2, directory)


@pytest.fixture(scope="module")
def resumed(two_ranks):
    """Each rank's results of ``harness.resumed_runs``, from the checkpoints of ``two_ranks``."""
    return run_ranks(resumed_runs, 2, two_ranks[0])


@pytest.mark.parametrize("name", NAMES)
def test_resume_on_two_ranks_in_fresh_processes_is_bitwise_exact(name, two_ranks, resumed):
    case = CASES[name]
    for straight, again in zip(two_ranks[1], resumed):
        trace, stats, state = straight[name]["straight"]
        resumed_trace, resumed_stats, resumed_state = again[name]
        assert same(resumed_trace.params, trace.params[case.checkpoint :])
        assert resumed_trace.stages == trace.stages[case.checkpoint :]
        assert resumed_trace.observed == trace.observed[case.checkpoint :]
        assert resumed_stats == stats
        assert same(resumed_state, state)
        for key, value in case.final_extra.items():
            assert resumed_state["onebit"][key] == value


@pytest.mark.parametrize("name", NAMES)
def test_two_rank_checkpoint_on_one_rank_keeps_moments_and_resets_error_feedback(name, two_ranks):
    saved = torch.load(checkpoint_path(two_ranks[0], name, 0), weights_only=False)
    # The error buffers really matter: dropping them (as the reference did) changes the result.
    for comm in saved["optim"]["onebit"]["ranks"][0]["comms"]:
        assert comm["worker_error"].abs().sum() > 0
    case = CASES[name]
    params = case.problem.params()
    opt = case.optimizer(params)
    with pytest.raises(ValueError, match="cannot resume every rank exactly"):
        opt.load_state_dict(saved["optim"])
    with pytest.warns(UserWarning, match="error-feedback buffers reset"):
        opt.load_state_dict(saved["optim"], allow_inexact=True)
    assert all(c.worker_error.abs().sum() == 0 for c in opt.comms)
    exp_avg = opt.state[params[0]]["exp_avg"]
    assert torch.equal(exp_avg, saved["optim"]["state"][0]["exp_avg"])
    assert exp_avg.dtype == torch.float32


@pytest.mark.parametrize(
    "name,after",
    [pytest.param(n, t, id=f"{n}-after-{t}") for n in NAMES for t in CASES[n].resume_points],
)
def test_resume_in_one_process_is_bitwise_exact_at_every_turn_of_the_schedule(name, after):
    case = CASES[name]
    params = case.problem.params()
    straight = run(case, params, case.optimizer(params), 0, 1, case.steps)
    params = case.problem.params()
    opt = case.optimizer(params)
    run(case, params, opt, 0, 1, after)
    params, opt = restore(case, roundtrip(checkpoint(params, opt)))
    resumed = run(case, params, opt, 0, after + 1, case.steps)
    assert same(resumed.params, straight.params[after:])
    assert resumed.stages == straight.stages[after:]
    assert resumed.observed == straight.observed[after:]


def _non_finite(name, two_ranks):
    """Each rank's run with non-finite gradients on the last rank, and the calls each kind."""
    poisoned = CASES[name].poisoned
    skipped = [call for call, stage in poisoned.items() if stage not in DROPPED_ALONE]
    alone = [call for call, stage in poisoned.items() if stage in DROPPED_ALONE]
    return [r[name]["non_finite"] for r in two_ranks[1]], skipped, alone


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(name, two_ranks):
    runs, skipped, _ = _non_finite(name, two_ranks)
    for calls, skipped_steps, _, num_steps in runs:
        assert skipped_steps == len(skipped)
        assert num_steps == len(calls) - len(skipped)  # the schedules stay in step
    poisoned = CASES[name].poisoned
    for number, calls in enumerate(zip(*[r[0] for r in runs]), start=1):
        stage = calls[0].stage
        assert all(c.stage == stage for c in calls)
        assert all(torch.isfinite(c.params_after).all() for c in calls)
        if number in poisoned:
            assert stage == poisoned[number]
        if number in skipped:  # nothing changes: parameters, moments, error feedback
            assert all(torch.equal(c.params_after, c.params_before) for c in calls)
            assert all(torch.equal(c.state_after, c.state_before) for c in calls)
        if stage != "local":
            assert all(torch.equal(c.params_after, calls[0].params_after) for c in calls), (
                f"replicas differ after call {number} ({stage})"
            )


@pytest.mark.parametrize(
    "name", [n for n in NAMES if set(CASES[n].poisoned.values()) & set(DROPPED_ALONE)]
)
def test_non_finite_gradient_between_syncs_is_dropped_by_its_rank_alone(name, two_ranks):
    runs, _, alone = _non_finite(name, two_ranks)
    assert [dropped for _, _, dropped, _ in runs] == [0] * (len(runs) - 1) + [len(alone)]
    for number in alone:
        *others, poisoned = [r[0][number - 1] for r in runs]
        if poisoned.stage == "local":
            assert torch.equal(poisoned.params_after, poisoned.params_before)
            assert all(not torch.equal(c.params_after, c.params_before) for c in others)


@pytest.mark.parametrize("name", NAMES)
def test_parameters_that_differ_across_ranks_are_a_clear_error(name, two_ranks):
    for result in two_ranks[1]:
        message = result[name]["mismatched"]
        assert message is not None and "differ across ranks" in message


def _argument_id(kwargs):
    return ",".join(
        f"{k}={v!r}" if isinstance(v, int | float | str | tuple) else f"{k}={type(v).__name__}"
        for k, v in kwargs.items()
    )


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        pytest.param(n, kwargs, match, id=f"{n}-{_argument_id(kwargs)}")
        for n in NAMES
        for kwargs, match in COMMON_BAD_ARGUMENTS + CASES[n].bad_arguments
    ],
)
def test_bad_constructor_argument_raises_value_error(name, kwargs, match):
    case = CASES[name]
    with pytest.raises(ValueError, match=match):
        case.cls(case.problem.params(), **{**case.required, **kwargs})


def test_zero_one_adam_needs_its_phase_a_length_or_the_runs():
    with pytest.raises(ValueError, match="var_freeze_step=N .* or total_steps=N"):
        CASES["zero_one"].cls(CASES["zero_one"].problem.params())
    told = CASES["zero_one"].cls(CASES["zero_one"].problem.params(), total_steps=50)
    assert told.var_freeze_step == 10 and told.warmup_compression == "int4"


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_given_only_lr_the_warmup_is_int4_and_freezes_by_auto(name):
    """``OnebitAdam(params, lr=...)`` and ``OnebitLamb``'s: an int4 warmup, frozen by
    ``"auto"``; ``total_steps`` caps it at a fifth of the run."""
    opt = CASES[name].cls(CASES[name].problem.params(), lr=1e-3)
    assert opt.warmup_compression == "int4" and len(opt.warmup_comms) == len(opt.comms)
    assert opt.freeze_step is None and opt.freeze.auto_freeze == onebit.AutoFreeze()
    told = CASES[name].cls(CASES[name].problem.params(), lr=1e-3, total_steps=1000)
    assert told.freeze.auto_freeze == onebit.AutoFreeze(total_steps=1000)
    assert told.freeze.auto_freeze.last_step == 200


@pytest.mark.parametrize("name", NAMES)
def test_param_groups_with_different_betas_raise_value_error(name):
    case = CASES[name]
    params = case.problem.params()
    groups = [{"params": params[:1]}, {"params": params[1:], "betas": (0.8, 0.9)}]
    with pytest.raises(ValueError, match="betas must be the same"):
        case.cls(groups, **case.required)


@pytest.mark.parametrize("name", NAMES)
def test_exp_avg_mask_of_the_wrong_shape_raises_value_error(name):
    case = CASES[name]
    params = case.problem.params()
    with pytest.raises(ValueError, match="exp_avg_mask"):
        case.cls(params, **case.required, exp_avg_mask={params[0]: torch.ones(3)})


@pytest.mark.parametrize("name", NAMES)
def test_sparse_gradient_is_rejected_before_anything_changes(name):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = CASES[name].cls(emb.parameters(), **CASES[name].required)
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(before, emb.weight) and opt.num_steps == 0
