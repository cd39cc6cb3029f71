"""Ranks that disagree get the same clear error on every rank: no hang, no abort, no silent
divergence. Every case runs under run_ranks' timeout, so a hang fails the test."""

import pytest
import torch
from distributed import run_ranks
from family import NAMES, loss_of, make_model, make_optimizer

CONSTRUCTION_CASES = {
    "freeze_step": ("adam", lambda rank: dict(freeze_step=3 + rank)),
    "bucket_size": ("adam", lambda rank: dict(bucket_size=64 * (1 + rank))),
    "lr": ("zero_one", lambda rank: dict(lr=1e-2 * (1 + rank))),
    "betas": ("lamb", lambda rank: dict(betas=(0.9, 0.999 - 0.009 * rank))),
    "schedules": ("zero_one", lambda rank: dict(var_freeze_step=5 + rank)),
    "dtypes": ("adam", lambda rank: {}),
    "meta": ("adam", lambda rank: {}),  # rank 1 alone fails its own checks
    "invalid": ("lamb", lambda rank: dict(freeze_step=3 - 3 * rank)),
    "invalid schedule": ("zero_one", lambda rank: dict(local_step_clipper=1 - rank)),
}


def _construct(rank, world_size):
    messages = {}
    for case, (name, kwargs) in CONSTRUCTION_CASES.items():
        model = make_model()
        if case == "dtypes" and rank == 1:
            model = model.double()
        if case == "meta" and rank == 1:
            model = model.to("meta")
        try:
            make_optimizer(name, model.parameters(), **kwargs(rank))
            messages[case] = None
        except ValueError as err:
            messages[case] = str(err)
    return messages


def test_settings_that_differ_across_ranks_fail_construction_on_every_rank():
    for messages in run_ranks(_construct, 2, timeout=120):
        for case, message in messages.items():
            assert message is not None, f"{case}: no error"
            if case in ("meta", "invalid", "invalid schedule"):
                want = {
                    "meta": "parameters are on the meta device",
                    "invalid": "freeze_step must be an int >= 1",
                    "invalid schedule": "local_step_clipper must be an int >= 1",
                }[case]
                assert message.startswith(f"rank 1: {want}"), message
                continue
            key = "param groups" if case in ("lr", "betas") else case
            assert "settings differ across ranks" in message and key in message, message


def _missed_step(rank, world_size, name, skip_at):
    model = make_model()
    opt = make_optimizer(name, model.parameters())
    for step in range(1, 10):
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        if rank == 1 and step == skip_at:
            continue  # this rank's loop skips step(), the other's does not
        try:
            opt.step()
        except RuntimeError as err:
            return step, str(err)
    return None


@pytest.mark.parametrize(
    "name,skip_at",
    [("adam", 2), ("adam", 5), ("lamb", 5), ("zero_one", 2), ("zero_one", 4), ("zero_one", 7)],
)
def test_a_rank_that_misses_a_step_is_a_clear_error_on_every_rank(name, skip_at):
    results = run_ranks(_missed_step, 2, name, skip_at, timeout=120)
    for rank, result in enumerate(results):
        assert result is not None, "the ranks paired steps off by one silently"
        step, message = result
        # Rank 1's next step() meets rank 0's step of the loop step it skipped, and the
        # backward passes disagree. 0/1 Adam's local step 7 sends nothing: its ranks meet again
        # at the sync of step() call 8.
        want = (8 if skip_at == 7 else skip_at) + rank
        assert step == want and "ranks are at different steps" in message
        assert "after 8 backward passes" in message if skip_at == 7 else True
        assert "rank 0: call" in message and "rank 1: call" in message


def _lr_on_one_rank(rank, world_size, name):
    model = make_model()
    opt = make_optimizer(name, model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(1, 8):
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        try:
            opt.step()
        except RuntimeError as err:
            return step, str(err)
        if rank == 0 and step == 4:
            scheduler.step()  # on one rank only
    return None


@pytest.mark.parametrize("name", NAMES)
def test_a_scheduler_that_steps_on_one_rank_only_is_reported(name):
    for result in run_ranks(_lr_on_one_rank, 2, name, timeout=120):
        assert result is not None
        step, message = result
        assert step == 5 and "hyperparameters differ across ranks" in message


def _groups_stop_agreeing(rank, world_size):
    model = make_model()
    params = list(model.parameters())
    opt = make_optimizer("adam", [{"params": params[:2]}, {"params": params[2:]}])
    for step in range(1, 6):
        if step == 3:  # e.g. a scheduler that cycles the momentum of one group only
            opt.param_groups[1]["betas"] = (0.85, 0.999)
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        try:
            opt.step()
        except RuntimeError as err:
            return step, str(err), opt.num_steps
    return None


def test_betas_that_stop_agreeing_across_groups_are_an_error_at_that_step():
    for result in run_ranks(_groups_stop_agreeing, 2, timeout=120):
        assert result is not None
        step, message, num_steps = result
        assert (step, num_steps) == (3, 2)
        assert "betas or eps that differ between param groups" in message
