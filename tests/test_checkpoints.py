"""Checkpoints that frameworks write from rank 0 only: consolidated state, rank checks, and
states that are not ours."""

import warnings

import pytest
import torch
from distributed import run_ranks
from family import NAMES, all_equal, loss_of, make_model, make_optimizer, params_of

import onebit

STEPS, SAVE_AT = 10, 7  # ZeroOneAdam: step 7 is a local step, so the replicas differ there


def _train(model, opt, rank, start, stop):
    for step in range(start, stop + 1):
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        opt.step()


def _straight(rank, world_size, name):
    model = make_model()
    opt = make_optimizer(name, model.parameters())
    _train(model, opt, rank, 1, STEPS)
    return params_of(model), opt.comm_stats


def _save_consolidated(rank, world_size, name, path):
    model = make_model()
    opt = make_optimizer(name, model.parameters())
    _train(model, opt, rank, 1, SAVE_AT)
    state = opt.consolidated_state_dict(to=0)
    if rank == 0:  # as HF Trainer, Accelerate and Lightning do: one file, from rank 0
        torch.save({"model": model.state_dict(), "optimizer": state}, path)
    return state is None, params_of(model)


def _resume_consolidated(rank, world_size, name, path):
    checkpoint = torch.load(path, weights_only=True)  # torch's safe default loads it
    model = make_model(seed=123)
    opt = make_optimizer(name, model.parameters())
    model.load_state_dict(checkpoint["model"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rank that loads its own part is not warned
        opt.load_state_dict(checkpoint["optimizer"])
    _train(model, opt, rank, SAVE_AT + 1, STEPS)
    return params_of(model), opt.comm_stats


@pytest.mark.parametrize("name", NAMES)
def test_resume_from_one_consolidated_file_is_bitwise_exact(name, tmp_path):
    path = str(tmp_path / "checkpoint.pt")
    straight = run_ranks(_straight, 2, name)
    saved = run_ranks(_save_consolidated, 2, name, path)
    assert [none for none, _ in saved] == [False, True]  # the dict only on rank `to`
    if name == "zero_one":  # saved mid phase B: rank 1's parameters are not rank 0's
        assert not all_equal(saved[0][1], saved[1][1])
    resumed = run_ranks(_resume_consolidated, 2, name, path)
    for (want, want_stats), (got, got_stats) in zip(straight, resumed):
        assert all_equal(want, got)
        assert got_stats == want_stats


def _load_rank0_file(rank, world_size, path):
    """The naive port: ``state_dict()`` saved inside the rank-0 block, loaded on every rank;
    then the same file with ``allow_inexact``."""
    model = make_model()
    opt = make_optimizer("adam", model.parameters())
    _train(model, opt, rank, 1, 5)
    if rank == 0:
        torch.save(opt.state_dict(), path)
    torch.distributed.barrier()
    state = torch.load(path, weights_only=True)
    before = [t.clone() for s in opt.state_dict()["state"].values() for t in s.values()]
    try:
        opt.load_state_dict(state)
        error = None
    except ValueError as err:
        error = str(err)
    after = [t for s in opt.state_dict()["state"].values() for t in s.values()]
    unchanged = opt.num_steps == 5 and all_equal(before, after)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(state, allow_inexact=True)
    errors = sum(float(c.worker_error.abs().sum() + c.server_error.abs().sum()) for c in opt.comms)
    return (
        list(state["onebit"]["ranks"]),
        error,
        unchanged,
        [str(w.message) for w in caught],
        errors,
    )


def test_rank_0s_state_loaded_everywhere_stops_every_rank_or_resets_with_allow_inexact(tmp_path):
    results = run_ranks(_load_rank0_file, 2, str(tmp_path / "rank0.pt"))
    (ranks0, error0, unchanged0, warned0, errors0), (_, error1, unchanged1, warned1, errors1) = (
        results
    )
    assert ranks0 == [0]  # a plain state_dict holds this rank's part only
    assert error0 == error1 and unchanged0 and unchanged1  # every rank stops, nothing changed
    assert "rank 1: the state holds rank(s) [0], this is rank 1" in error0
    assert "consolidated_state_dict()" in error0 and "allow_inexact=True" in error0
    assert warned0 == [] and errors0 > 0  # rank 0 loads its own errors
    assert len(warned1) == 1 and "error-feedback buffers reset" in warned1[0]
    assert "rank(s) [0], this is rank 1" in warned1[0] and errors1 == 0


def test_another_layout_raises_or_resets_the_error_buffers_with_allow_inexact():
    model = make_model()
    opt = make_optimizer("adam", model.parameters(), bucket_size=64)
    _train(model, opt, 0, 1, 5)
    other = make_optimizer("adam", model.parameters(), bucket_size=128)
    with pytest.raises(ValueError, match="another bucket layout.*allow_inexact=True"):
        other.load_state_dict(opt.state_dict())
    assert other.num_steps == 0
    with pytest.warns(UserWarning, match="another bucket layout"):
        other.load_state_dict(opt.state_dict(), allow_inexact=True)
    assert all(float(c.worker_error.abs().sum()) == 0 for c in other.comms)
    saved, restored = opt.state_dict()["state"], other.state_dict()["state"]
    for i, state in saved.items():  # the rest is restored
        assert torch.equal(restored[i]["exp_avg"], state["exp_avg"])
        assert torch.equal(restored[i]["frozen_denom"], state["frozen_denom"])


@pytest.mark.parametrize("name", NAMES)
def test_states_of_other_optimizers_are_refused_and_change_nothing(name):
    model = make_model()
    adamw = torch.optim.AdamW(model.parameters())
    _train(model, adamw, 0, 1, 1)
    opt = make_optimizer(name, model.parameters())
    _train(model, opt, 0, 1, 7)  # past the freeze: the state has changed shape
    before = opt.state_dict()
    with pytest.raises(ValueError, match="not a onebit state dict"):
        opt.load_state_dict(adamw.state_dict())
    for other in NAMES:
        if other != name:
            foreign = make_optimizer(other, model.parameters())
            with pytest.raises(ValueError, match=f"loaded into {type(opt).__name__}"):
                opt.load_state_dict(foreign.state_dict())
    # A state of this optimizer that does not fit (saved before the freeze, other shapes).
    fresh = make_optimizer(name, make_model().double().parameters()).state_dict()
    fresh["state"][0]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="state 'exp_avg' of parameter 0"):
        opt.load_state_dict(fresh)
    after = opt.state_dict()
    assert after["onebit"]["num_steps"] == 7 and before["state"].keys() == after["state"].keys()
    for i, buffers in before["state"].items():
        assert buffers.keys() == after["state"][i].keys()
        assert all(torch.equal(v, after["state"][i][k]) for k, v in buffers.items())


def test_consolidated_state_dict_checks_its_rank():
    opt = onebit.OnebitAdam(make_model().parameters(), warmup_compression="fp32", freeze_step=2)
    assert opt.consolidated_state_dict()["onebit"]["ranks"].keys() == {0}
    with pytest.raises(ValueError, match="to must be a rank"):
        opt.consolidated_state_dict(to=1)


def _consolidate_then_step(rank, world_size):
    model = make_model()
    opt = make_optimizer("adam", model.parameters())
    _train(model, opt, rank, 1, 5)
    opt.consolidate_state_dict(to=1)  # ZeroRedundancyOptimizer's protocol, as Lightning calls it
    gathered = sorted(opt.state_dict()["onebit"]["ranks"])
    _train(model, opt, rank, 6, 6)
    after_step = sorted(opt.state_dict()["onebit"]["ranks"])
    return gathered, after_step


def test_consolidate_state_dict_fills_the_next_state_dict_on_its_rank_until_a_step():
    (gathered0, after0), (gathered1, after1) = run_ranks(_consolidate_then_step, 2)
    assert gathered0 == [0] and gathered1 == [0, 1]
    assert after0 == [0] and after1 == [1]  # a step makes the gathered parts stale
