"""torch.amp.GradScaler and autocast with the three optimizers, on 2 gloo ranks."""

import pytest
import torch
from distributed import run_ranks
from family import NAMES, all_equal, batch, loss_of, make_model, make_optimizer, params_of

STEPS = 8


def _scaled_run(rank, world_size, name, mode, inject, dtype=torch.float32):
    """Train STEPS steps. ``mode``: "plain" (no scaler), "scaler" (scaler.step), "unscale"
    (scaler.unscale_ first). ``inject``: steps where rank 1's gradient gets an inf."""
    model = make_model().to(dtype)
    opt = make_optimizer(name, model.parameters(), allow_edited_grads=True)  # the injected inf
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=10**6)
    history, skipped = [], []
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        loss = loss_of(model, step, rank) if dtype == torch.float32 else _loss(model, step, rank)
        (loss if mode == "plain" else scaler.scale(loss)).backward()
        if step in inject and rank == 1:
            next(model.parameters()).grad[0, 0] = float("inf")
        before = params_of(model)
        if mode == "plain":
            opt.step()
        else:
            if mode == "unscale":
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        history.append(params_of(model))
        if step in inject:
            skipped.append(all_equal(before, history[-1]))
    return history, opt.skipped_steps, skipped, opt.comm_stats.steps


def _loss(model, step, rank):
    x, y = batch(step, rank)
    return torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)


def _three_runs(rank, world_size, name, dtype):
    """The plain, scaler and unscale runs, one after another on the same ranks."""
    return {mode: _scaled_run(rank, world_size, name, mode, (), dtype)
            for mode in ("plain", "scaler", "unscale")}  # fmt: skip


@pytest.mark.parametrize(
    "name,dtype",
    [(n, torch.float32) for n in NAMES] + [("adam", torch.bfloat16), ("zero_one", torch.bfloat16)],
)
def test_constant_power_of_two_loss_scale_is_bitwise_the_unscaled_run(name, dtype):
    results = run_ranks(_three_runs, 2, name, dtype)
    for mode in ("scaler", "unscale"):
        for ranks in results:
            for step, (a, b) in enumerate(zip(ranks["plain"][0], ranks[mode][0])):
                assert all_equal(a, b), f"{mode}: step {step + 1} differs"
    stages = results[0]["plain"][3]
    assert set(stages) - {"warmup", "variance"}, "the run must cross the freeze"


@pytest.mark.parametrize("name", NAMES)
def test_inf_on_one_rank_makes_every_rank_skip_the_step(name):
    # One inf before the freeze and one after (0/1 Adam: both in phase A, where it skips
    # together; in phase B a rank drops its own bad gradient by design).
    inject = (2, 3) if name == "zero_one" else (2, 6)
    results = run_ranks(_scaled_run, 2, name, "scaler", inject)
    for history, skipped_steps, unchanged, _ in results:
        assert skipped_steps == len(inject)
        assert unchanged == [True] * len(inject)
        assert all(torch.isfinite(p).all() for p in history[-1])
    for step in range(STEPS):
        if name != "zero_one" or step < 4:
            assert all_equal(results[0][0][step], results[1][0][step])


def _bf16_autocast(rank, world_size, name):
    model = make_model()
    opt = make_optimizer(name, model.parameters())
    losses = []
    for step in range(1, 13):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, step % 2, rank)  # two batches, seen again and again
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if name == "zero_one":
        opt.synchronize()
    return losses, params_of(model), opt.comm_stats.steps


@pytest.mark.parametrize("name", NAMES)
def test_bf16_autocast_without_a_scaler_trains(name):
    results = run_ranks(_bf16_autocast, 2, name)
    for losses, _, _ in results:
        assert all(torch.isfinite(torch.tensor(losses)))
        assert losses[-2] < losses[0]  # the same batch, 10 steps later
    assert all_equal(results[0][1], results[1][1])
    assert set(results[0][2]) - {"warmup", "variance"}


def _overlap_with_scaler(rank, world_size):
    model = make_model()
    opt = make_optimizer("adam", model.parameters(), overlap_backward=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for step in range(1, 4):
        opt.zero_grad()
        scaler.scale(loss_of(model, step, rank)).backward()
        try:
            scaler.step(opt)
        except RuntimeError as err:
            return step, str(err)
        scaler.update()
    return None


def test_overlap_backward_with_a_grad_scaler_is_a_clear_error_on_every_rank():
    for result in run_ranks(_overlap_with_scaler, 2, timeout=120):
        # The first step is never overlapped; the second has its buckets in flight.
        assert result is not None and result[0] == 2
        assert "overlap_backward=False with a GradScaler" in result[1]


def test_a_step_that_raises_under_a_scaler_leaves_no_stale_scale():
    model = make_model()
    params = list(model.parameters())
    opt = make_optimizer("adam", [{"params": params[:2]}, {"params": params[2:]}])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=10**6)
    opt.param_groups[1]["betas"] = (0.8, 0.999)
    scaler.scale(loss_of(model, 1, 0)).backward()
    with pytest.raises(RuntimeError, match="differ between param groups"):
        scaler.step(opt)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    opt.param_groups[1]["betas"] = (0.9, 0.999)
    scaler.update()
    ref = make_model()
    ref_opt = make_optimizer("adam", ref.parameters())
    for net, o, scaled in ((model, opt, True), (ref, ref_opt, False)):
        o.zero_grad()
        loss = loss_of(net, 1, 0)
        if scaled:  # the retried step unscales by this scale alone, not the stale one too
            scaler.scale(loss).backward()
            scaler.step(o)
        else:
            loss.backward()
            o.step()
    assert all_equal(params_of(model), params_of(ref))
