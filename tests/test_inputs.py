"""Inputs that used to give confusing errors or silent results, for all three optimizers."""

import pytest
import torch
from family import NAMES, batch, loss_of, make_model, make_optimizer

import onebit


def _steps(model, opt, steps, start=1):
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, step, 0).backward()
        opt.step()


@pytest.mark.parametrize("name", NAMES)
def test_meta_device_parameters_are_a_clear_error(name):
    with torch.device("meta"):
        model = make_model()
    with pytest.raises(ValueError, match="meta device"):
        make_optimizer(name, model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_float64_parameters_train(name):
    model, ref = make_model().double(), make_model()
    opt = make_optimizer(name, model.parameters())
    ref_opt = make_optimizer(name, ref.parameters())
    for step in range(1, 9):
        for net, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            x, y = batch(step, 0)
            dtype = next(net.parameters()).dtype
            torch.nn.functional.mse_loss(net(x.to(dtype)), y.to(dtype)).backward()
            o.step()
        if step == 2:  # full-precision steps: fp32 state, so the same numbers to rounding
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.float(), q, rtol=1e-5, atol=1e-6)
    assert set(opt.comm_stats.steps) - {"warmup", "variance"}
    assert all(p.dtype == torch.float64 and torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_param_group_is_accepted(name):
    model = make_model()
    opt = make_optimizer(name, [{"params": list(model.parameters())}, {"params": []}])
    _steps(model, opt, 8)
    assert opt.num_steps == 8 and all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(ValueError, match="got no parameters"):
        make_optimizer(name, [{"params": []}])


def _masked(name, **settings):
    """A model and an optimizer whose mask zeroes the first 4 rows of the first weight."""
    model = make_model()
    weight = model[0].weight
    mask = torch.ones_like(weight)
    mask[:4] = 0
    return (
        model,
        weight,
        make_optimizer(name, model.parameters(), exp_avg_mask={weight: mask}, **settings),
    )


@pytest.mark.parametrize("name", NAMES)
def test_exp_avg_mask_keeps_masked_momentum_at_zero(name):
    model, weight, opt = _masked(name)
    _steps(model, opt, 8)
    assert set(opt.comm_stats.steps) - {"warmup", "variance"}
    exp_avg = opt.state_dict()["state"][0]["exp_avg"]  # 1-bit Adam: packed, unpacked here
    assert torch.all(exp_avg[:4] == 0) and torch.all(exp_avg[4:] != 0)
    with pytest.raises(ValueError, match="exp_avg_mask"):
        make_optimizer(name, model.parameters(), exp_avg_mask={weight: torch.ones(3)})
    half = torch.full_like(weight, 0.5)
    with pytest.raises(ValueError, match="only 0s and 1s"):
        make_optimizer(name, model.parameters(), exp_avg_mask={weight: half})


@pytest.mark.parametrize("name", NAMES)
def test_a_skipped_step_leaves_the_masked_momentum_untouched(name):
    model, weight, opt = _masked(name, allow_edited_grads=True)  # the NaN is written by hand
    before_bad = 6 if name == "zero_one" else 4  # 0/1 Adam: step 7 is a local step
    _steps(model, opt, before_bad)
    opt.zero_grad()
    loss_of(model, before_bad + 1, 0).backward()
    weight.grad[0, 0] = float("nan")
    # A mask that would change the momentum if it were applied on the skipped step.
    opt.masks[0][1].zero_()
    before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    opt.step()
    if name == "zero_one":  # phase B drops the bad gradient on this rank only
        assert opt.local_skipped_steps == 1
    else:
        assert opt.skipped_steps == 1
    for key, value in opt.state_dict()["state"][0].items():
        assert torch.equal(value, before[key]), key


def test_load_state_dict_of_another_kind_is_a_clear_error():
    model = make_model()
    opt = onebit.OnebitAdam(model.parameters(), warmup_compression="fp32", freeze_step=2)
    with pytest.raises(ValueError, match="not a onebit state dict"):
        opt.load_state_dict(torch.optim.SGD(model.parameters()).state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_scale_per_is_checked_and_bucket_gives_one_scale_per_bucket(name):
    with pytest.raises(ValueError, match="scale_per must be one of"):
        make_optimizer(name, make_model().parameters(), scale_per="layer")
    per_tensor = make_optimizer(name, make_model().parameters())
    per_bucket = make_optimizer(name, make_model().parameters(), scale_per="bucket")
    # make_model has 4 tensors; bucket_size=128 splits them over 3 buckets.
    segments = [comm.worker_scale_count for comm in per_tensor.comms]
    assert sum(len(per_tensor.layout.segments(k)) for k in range(len(segments))) >= 4
    assert all(comm.worker_scale_count == 1 for comm in per_bucket.comms)
    assert max(segments) > 1
