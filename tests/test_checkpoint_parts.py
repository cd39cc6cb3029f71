"""The checkpoint protocol: the parts of an optimizer's state, each saving and loading itself,
and what a load does with them."""

import pytest
import torch
from family import NAMES, loss_of, make_model, make_optimizer

from onebit.optim import checkpoint


class _Recording(checkpoint.NoState):
    """A part that logs its ``before_load`` and undo, and raises if asked to."""

    def __init__(self, name: str, log: list[str], fails: bool = False) -> None:
        self.name, self.log, self.fails = name, log, fails

    def before_load(self, saved):
        if self.fails:
            raise ValueError(f"{self.name} cannot load this")
        self.log.append(f"set {self.name}")
        return lambda: self.log.append(f"undo {self.name}")


def test_before_load_undoes_in_order_and_undoes_the_parts_before_one_that_raises():
    log: list[str] = []
    undo = checkpoint.before_load([_Recording("a", log), _Recording("b", log)], {})
    assert log == ["set a", "set b"]
    undo()
    assert log == ["set a", "set b", "undo a", "undo b"]

    log.clear()
    parts = [_Recording("a", log), _Recording("b", log), _Recording("c", log, fails=True)]
    with pytest.raises(ValueError, match="c cannot load this"):
        checkpoint.before_load(parts, {})
    assert log == ["set a", "set b", "undo a", "undo b"]


def test_the_parts_state_lands_in_one_dict_each():
    class Counter(checkpoint.NoState):
        def extra_state(self):
            return {"count": 3}

        def rank_state(self):
            return {"mine": 7}

    parts = [Counter(), checkpoint.Frozen(True, lambda frozen: None), checkpoint.NoState()]
    assert checkpoint.extra_state(parts) == {"count": 3, "frozen": True}
    assert checkpoint.rank_state(parts) == {"mine": 7}


def test_frozen_renames_the_buffers_for_the_saved_stage_and_back():
    named: list[bool] = []
    part = checkpoint.Frozen(True, named.append)
    undo = part.before_load({"frozen": False})
    undo()
    assert named == [False, True]
    checkpoint.Frozen(False, named.append).before_load({})  # onebit 0.1.0 saved no "frozen"
    assert named[-1] is False


def test_a_saved_entry_splits_into_every_ranks_part_and_this_ranks_own():
    saved = {"num_steps": 4, "layout": "L", "ranks": {0: {"comms": [0]}, 1: {"comms": [1]}}}
    extra, ranks = checkpoint.split_ranks(saved, 1, "L")
    assert "ranks" not in extra and extra["num_steps"] == 4 and "ranks" in saved
    assert checkpoint.own_rank_state(extra, ranks, 1, "L") == {"comms": [1]}
    with pytest.raises(ValueError, match=r"holds rank\(s\) \[0, 1\], this is rank 2"):
        checkpoint.own_rank_state(extra, ranks, 2, "L")
    with pytest.raises(ValueError, match="another bucket layout"):
        checkpoint.own_rank_state(extra, ranks, 1, "other")
    legacy = {"num_steps": 4, "comms": [5], "local_skipped_steps": 1}  # onebit 0.1.0
    extra, ranks = checkpoint.split_ranks(legacy, 0, "L")
    assert ranks == {0: {"comms": [5], "local_skipped_steps": 1}}
    assert extra == {"num_steps": 4, "layout": "L"}


def test_what_is_not_a_state_of_this_optimizer_is_refused():
    with pytest.raises(ValueError, match="not a onebit state dict"):
        checkpoint.onebit_entry({"state": {}, "param_groups": []}, "OnebitAdam")
    with pytest.raises(ValueError, match="state dict of OnebitLamb loaded into OnebitAdam"):
        checkpoint.onebit_entry({"onebit": {"optimizer": "OnebitLamb"}}, "OnebitAdam")
    a, b = torch.zeros(1), torch.zeros(2)
    groups = [{"params": [a, b]}]
    assert checkpoint.parameter_index([{"params": [5, 6]}], groups) == {5: a, 6: b}
    with pytest.raises(ValueError, match="different number of params"):
        checkpoint.parameter_index([{"params": [5]}], groups)


@pytest.mark.parametrize("name", NAMES)
def test_every_part_of_an_optimizer_is_in_its_state_dict(name):
    model = make_model()
    opt = make_optimizer(name, model.parameters())
    for step in range(1, 8):  # past the freeze
        opt.zero_grad()
        loss_of(model, step, 0).backward()
        opt.step()
    parts = opt._state_parts()
    assert isinstance(parts[0], checkpoint.ErrorBuffers)
    assert any(isinstance(p, checkpoint.Frozen) for p in parts)
    state = opt.state_dict()["onebit"]
    assert checkpoint.extra_state(parts).keys() <= state.keys()
    assert state["frozen"] is True
    own = state["ranks"][0]
    assert own.keys() == checkpoint.rank_state(parts).keys()
    assert len(own["comms"]) == len(opt.comms)
    worker = opt.comms[0].kept_worker_error
    assert worker is not None and worker.abs().sum() > 0
    parts[0].reset()
    assert opt.comms[0].kept_worker_error is None or opt.comms[0].kept_worker_error.abs().sum() == 0
