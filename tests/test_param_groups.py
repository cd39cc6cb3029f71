"""Hyperparameters are read from the param groups at every step, as torch.optim does."""

import torch
from family import loss_of, make_model

import onebit


def _groups(model, betas):
    params = list(model.parameters())
    return [
        {"params": params[:2], "betas": betas, "eps": 1e-6},
        {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0, "betas": betas, "eps": 1e-6},
    ]


def _run(model, opt, scheduler=None, steps=20):
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss_of(model, step, 0).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def test_betas_and_eps_set_in_param_groups_are_used():
    ours, ref = make_model(), make_model()
    opt = onebit.OnebitAdam(
        _groups(ours, (0.9, 0.95)),
        warmup_compression="fp32",
        lr=1e-2,
        weight_decay=0.1,
        freeze_step=50,
    )
    ref_opt = torch.optim.AdamW(_groups(ref, (0.9, 0.95)), lr=1e-2, weight_decay=0.1)
    _run(ours, opt)
    _run(ref, ref_opt)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    default = make_model()  # and they matter: the defaults (0.9, 0.999) give another run
    _run(
        default,
        onebit.OnebitAdam(default.parameters(), warmup_compression="fp32", lr=1e-2, freeze_step=50),
    )
    assert not torch.allclose(next(default.parameters()), next(ours.parameters()), atol=1e-4)


def test_one_cycle_lr_with_cycle_momentum_matches_adamw_through_warmup():
    ours, ref = make_model(), make_model()
    opt = onebit.OnebitAdam(
        ours.parameters(), warmup_compression="fp32", lr=1e-2, weight_decay=0.01, freeze_step=50
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    schedulers = [
        torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=30, cycle_momentum=True)
        for o in (opt, ref_opt)
    ]
    _run(ours, opt, schedulers[0], steps=25)
    _run(ref, ref_opt, schedulers[1], steps=25)
    assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]
    assert opt.param_groups[0]["betas"][0] != 0.9  # the scheduler really moved beta1
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
