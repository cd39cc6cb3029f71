"""A gradient changed between backward and ``step()`` by anything but the optimizer
(``clip_grad_norm_``, ``clip_grad_value_``, an in-place edit, ``scaler.unscale_`` and a clip)
would change each rank's gradient before the average: every rank raises the same error at
``step()``, which names the fix, and nothing is stepped. What does not change the maths stays
legal: accumulation, DDP with onebit's hook, a ``GradScaler``, ``unscale_`` alone, and an edit
said to be meant (``allow_edited_grads``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from distributed import run_ranks
from family import all_equal, loss_of, make_model, make_optimizer, params_of

import onebit

utils = torch.nn.utils
EDITS = {
    "clip_grad_norm_": lambda model, rank: utils.clip_grad_norm_(model.parameters(), 0.1),
    "clip_grad_value_": lambda model, rank: utils.clip_grad_value_(model.parameters(), 0.01),
    "mul_ on rank 1": lambda model, rank: rank == 1 and model[2].bias.grad.mul_(2.0),
}


def _edited(rank, world_size, name, edit):
    model = make_model()
    opt = make_optimizer(name, model.parameters())
    before = params_of(model)
    loss_of(model, 1, rank).backward()
    EDITS[edit](model, rank)
    try:
        opt.step()
        return None
    except RuntimeError as err:
        error = str(err)
    unchanged = all_equal(params_of(model), before) and opt.num_steps == 0
    opt.zero_grad()
    loss_of(model, 2, rank).backward()
    opt.step()  # the next step, without the edit, goes on
    return error, unchanged, opt.num_steps


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
def test_an_edit_after_backward_raises_on_every_rank_and_steps_nothing(name, edit):
    results = run_ranks(_edited, 2, name, edit, timeout=120)
    assert all(r is not None for r in results), "the edit was silently accepted"
    (error0, unchanged0, steps0), (error1, unchanged1, steps1) = results
    assert error0 == error1 and unchanged0 and unchanged1 and steps0 == steps1 == 1
    ranks = "rank 1 has" if edit == "mul_ on rank 1" else "ranks 0, 1 have"
    assert f"{ranks} gradients changed between backward and step()" in error0
    assert "max_grad_norm" in error0 and "allow_edited_grads=True" in error0


def _legal(rank, world_size, how):
    """Four steps of a loop that changes nothing of the maths; the parameters at the end."""
    model = make_model()
    opt = make_optimizer("adam", model.parameters())
    trained = model
    if how == "ddp":
        trained = torch.nn.parallel.DistributedDataParallel(model)
        trained.register_comm_hook(opt, onebit.ddp_comm_hook)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=how.startswith("scaler"))
    for step in range(1, 5):
        for micro in range(2):  # accumulation: two backward passes a step
            last = micro == 1
            sync = trained.no_sync() if how == "ddp" and not last else contextlib.nullcontext()
            with sync:
                scaler.scale(loss_of(trained, step, rank, micro)).backward()
        if how == "scaler, unscale_":
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return params_of(model), opt.num_steps


@pytest.mark.parametrize("how", ["accumulation", "ddp", "scaler", "scaler, unscale_"])
def test_what_keeps_the_maths_stays_legal(how):
    (params0, steps0), (params1, steps1) = run_ranks(_legal, 2, how, timeout=120)
    assert steps0 == steps1 == 4 and all_equal(params0, params1)


def _unscale_then_clip(rank, world_size):
    model = make_model()
    opt = make_optimizer("adam", model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scaler.scale(loss_of(model, 1, rank)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with pytest.raises(RuntimeError) as caught:
        scaler.step(opt)
    return str(caught.value)


def test_a_clip_after_unscale_names_the_optimizers_unscale():
    for message in run_ranks(_unscale_then_clip, 2, timeout=120):
        assert "ranks 0, 1 have gradients changed after scaler.unscale_(optimizer)" in message
        assert "scaler.step(optimizer) without scaler.unscale_" in message
        assert "max_grad_norm" in message


def _halved(rank, world_size, by_hand):
    """Halve every gradient: by hand after backward (said to be meant), or through the loss."""
    model = make_model()
    opt = make_optimizer("adam", model.parameters(), allow_edited_grads=by_hand)
    for step in range(1, 7):  # through the freeze at step 3
        opt.zero_grad()
        loss = loss_of(model, step, rank)
        (loss if by_hand else 0.5 * loss).backward()
        if by_hand:
            for p in model.parameters():
                p.grad.mul_(0.5)
        opt.step()
    return params_of(model)


def test_an_edit_said_to_be_meant_is_honoured():
    by_hand = run_ranks(_halved, 2, True, timeout=120)
    through_the_loss = run_ranks(_halved, 2, False, timeout=120)
    assert all(all_equal(a, b) for a, b in zip(by_hand, through_the_loss))
