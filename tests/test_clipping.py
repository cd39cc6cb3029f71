"""max_grad_norm, and edits of .grad after an overlapped backward, on 2 gloo ranks."""

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from family import NAMES, all_equal, loss_of, make_model, make_optimizer, params_of
from torch.nn.parallel import DistributedDataParallel

MAX_NORM = 0.05  # well below the gradient norms of these runs: every step clips


def _warmup_vs_ddp_clip_adamw(rank, world_size, name):
    model = make_model(seed=rank)  # different weights per rank: both broadcast rank 0's
    ours = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    ref = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01)
    if name == "adam":
        opt = make_optimizer(name, ours.parameters(), freeze_step=20, weight_decay=0.01)
    else:  # variance updates on every step of phase A: AdamW on fp32-averaged gradients
        opt = make_optimizer(
            name, ours.parameters(), var_freeze_step=20, var_update_scaler=50, weight_decay=0.01
        )
    opt.max_grad_norm = MAX_NORM
    norms = []
    for step in range(1, 9):
        ref.zero_grad()
        loss_of(ddp, step, rank).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)))
        ref.step()
        opt.zero_grad()
        loss_of(ours, step, rank).backward()
        opt.step()
        assert abs(opt.grad_norm - norms[-1]) <= 1e-6 * norms[-1]
    return params_of(model), params_of(ours), norms


@pytest.mark.parametrize("name", ["adam", "zero_one"])
def test_warmup_clipping_equals_ddp_clip_grad_norm_adamw(name):
    for want, got, norms in run_ranks(_warmup_vs_ddp_clip_adamw, 2, name):
        assert min(norms) > MAX_NORM  # it clipped on every step
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def _lamb_warmup_vs_clipped_lamb(rank, world_size):
    """OnebitLamb's clipped warmup against plain LAMB (the same optimizer alone on its rank)
    fed with the gradient DDP averaged and clip_grad_norm_ clipped."""
    solo_groups = [dist.new_group([r]) for r in range(world_size)]
    model = make_model()
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    opt = make_optimizer("lamb", ours.parameters(), freeze_step=20, max_grad_norm=MAX_NORM)
    ref_opt = make_optimizer(
        "lamb", ref.parameters(), freeze_step=20, process_group=solo_groups[rank]
    )
    for step in range(1, 9):
        ddp.zero_grad()
        loss_of(ddp, step, rank).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
        for p, q in zip(ref.parameters(), ddp.parameters()):
            p.grad = q.grad.clone()
        ref_opt.step()
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                p.copy_(q)
        opt.zero_grad()
        loss_of(ours, step, rank).backward()
        opt.step()
    return params_of(ref), params_of(ours)


def test_lamb_warmup_clipping_equals_lamb_on_ddp_clipped_gradients():
    for want, got in run_ranks(_lamb_warmup_vs_clipped_lamb, 2):
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def _clip_run(rank, world_size, name, max_grad_norm, overlap=False):
    model = make_model()
    kwargs = dict(max_grad_norm=max_grad_norm)
    if overlap:
        kwargs["overlap_backward"] = True
    opt = make_optimizer(name, model.parameters(), **kwargs)
    history, norms = [], []
    for step in range(1, 9):
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        local = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
        opt.step()
        history.append(params_of(model))
        norms.append((opt.comm_stats.last_step_stage, float(local), opt.grad_norm))
    return history, norms


@pytest.mark.parametrize("name", NAMES)
def test_max_grad_norm_that_never_binds_is_bitwise_no_clipping(name):
    plain = run_ranks(_clip_run, 2, name, None)
    loose = run_ranks(_clip_run, 2, name, 1e9)
    for (want, _), (got, _) in zip(plain, loose):
        for a, b in zip(want, got):
            assert all_equal(a, b)


def _own_clip_run(rank, world_size, name, by_hand):
    """max_grad_norm on the 1-bit steps only, or no max_grad_norm and each rank's own
    clip_grad_norm_ before those steps (``by_hand``)."""
    model = make_model()
    opt = make_optimizer(name, model.parameters(), allow_edited_grads=by_hand)
    history, norms = [], []
    for step in range(1, 9):
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        local, one_bit = None, opt.stage not in ("warmup", "variance")  # this step's
        if one_bit and by_hand:
            local = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        elif not by_hand:
            opt.max_grad_norm = MAX_NORM if one_bit else None
        opt.step()
        history.append(params_of(model))
        norms.append((local, opt.grad_norm, opt.comm_stats.last_step_stage))
    return history, norms


@pytest.mark.parametrize("name", NAMES)
def test_one_bit_steps_clip_each_ranks_own_gradient_as_clip_grad_norm_would(name):
    """Every step that sends 1 bit (or none: 0/1 Adam's local steps) clips the rank's own
    gradient before it is sent: bitwise the rank's own clip_grad_norm_, packed momentum and
    all."""
    ours = run_ranks(_own_clip_run, 2, name, False)
    by_hand = run_ranks(_own_clip_run, 2, name, True)
    unclipped = run_ranks(_clip_run, 2, name, None)
    for (want, hand_norms), (got, norms), (plain, _) in zip(by_hand, ours, unclipped):
        for a, b in zip(want, got):
            assert all_equal(a, b)
        clipped = [(local, norm) for (local, _, _), (_, norm, _) in zip(hand_norms, norms)
                   if local is not None]  # fmt: skip
        assert len(clipped) >= 4 and all(local > MAX_NORM for local, _ in clipped)
        assert all(norm == pytest.approx(local, rel=1e-6) for local, norm in clipped)
        assert not all_equal(plain[-1], got[-1])  # clipping changed the run
    if name != "zero_one":
        assert all_equal(ours[0][0][-1], ours[1][0][-1])  # replicas stay identical


def test_overlap_clips_the_result_by_the_mean_of_the_local_norms():
    """With overlap_backward the buckets leave before the whole gradient's norm is known:
    warmup steps are bitwise the plain ones, and 1-bit steps clip the result by the mean of
    the ranks' norms, which their headers carried."""
    plain = run_ranks(_clip_run, 2, "adam", MAX_NORM)
    overlapped = run_ranks(_clip_run, 2, "adam", MAX_NORM, True)
    for (want, _), (got, _) in zip(plain, overlapped):
        for t in range(3):  # the warmup
            assert all_equal(want[t], got[t])
        assert not all_equal(want[-1], got[-1])
    assert all_equal(overlapped[0][0][-1], overlapped[1][0][-1])
    checked = 0
    for (stage, local0, norm0), (_, local1, norm1) in zip(overlapped[0][1], overlapped[1][1]):
        if stage == "compression":
            assert norm0 == norm1 == pytest.approx((local0 + local1) / 2, rel=1e-5)
            checked += 1
    assert checked == 5


def _edit_after_overlapped_backward(rank, world_size, edit, allowed=False):
    model = make_model()
    opt = make_optimizer(
        "adam", model.parameters(), overlap_backward=True, allow_edited_grads=allowed
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    for step in range(1, 4):
        opt.zero_grad()
        loss = loss_of(model, step, rank)
        (scaler.scale(loss) if edit == "unscale_" else loss).backward()
        try:
            if edit == "clip_grad_norm_":
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            elif edit == "mul_":
                next(model.parameters()).grad.mul_(0.5)
            if edit == "unscale_":
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        except RuntimeError as err:
            return step, str(err), opt.num_steps
    return None


@pytest.mark.parametrize("edit", ["clip_grad_norm_", "unscale_", "mul_"])
def test_editing_grads_after_an_overlapped_backward_is_a_clear_error(edit):
    """An edit of ``.grad`` after backward raises on every rank from the first step, which is
    never overlapped; said to be meant (``allow_edited_grads``), it is honoured there, and
    raises from the second step, whose buckets left during backward."""
    for result in run_ranks(_edit_after_overlapped_backward, 2, edit, timeout=120):
        assert result is not None, "the edit was silently ignored"
        step, message, num_steps = result
        if edit == "unscale_":  # unscaling alone changes no rank's maths: the scaler tells
            assert step == 2 and num_steps == 1
            assert "overlap_backward=False with a GradScaler" in message
        else:
            assert step == 1 and num_steps == 0
            assert "ranks 0, 1 have gradients changed between backward and step()" in message
            assert "max_grad_norm" in message and "allow_edited_grads=True" in message
    if edit == "unscale_":
        return
    for result in run_ranks(_edit_after_overlapped_backward, 2, edit, True, timeout=120):
        step, message, num_steps = result
        assert step == 2 and num_steps == 1
        assert "changed after backward" in message and "max_grad_norm" in message
