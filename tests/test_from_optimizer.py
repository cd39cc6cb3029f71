"""``from_optimizer``: a script's own ``AdamW`` (decay and no-decay groups, per-group learning
rates) becomes a onebit optimizer in one line, or a clear error names what cannot be honoured."""

from __future__ import annotations

import pytest
import torch
from family import all_equal, loss_of, make_model, params_of

import onebit


def _adamw(model: torch.nn.Module, **kwargs) -> torch.optim.AdamW:
    """A ``configure_optimizers()`` as GPT trainers write it: decay on the matrices only, and
    a group of its own learning rate."""
    weight, bias = model[0].weight, model[0].bias
    rest = list(model[2].parameters())
    groups = [
        {"params": [weight], "weight_decay": 0.1, "name": "decay"},
        {"params": [bias], "weight_decay": 0.0},
        {"params": rest, "weight_decay": 0.0, "lr": 3e-3},
    ]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-7, **kwargs)


def _train(model, opt, steps: int = 4) -> list[torch.Tensor]:
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss_of(model, step, 0).backward()
        opt.step()
    return params_of(model)


@pytest.mark.parametrize("cls", [onebit.OnebitAdam, onebit.OnebitLamb, onebit.ZeroOneAdam])
def test_the_groups_and_their_hyperparameters_are_kept(cls):
    model = make_model()
    adamw = _adamw(model)
    options = {"var_freeze_step": 3} if cls is onebit.ZeroOneAdam else {"total_steps": 100}
    opt = cls.from_optimizer(adamw, max_grad_norm=1.0, **options)
    assert isinstance(opt, cls) and opt.max_grad_norm == 1.0
    assert [g["params"] for g in opt.param_groups] == [g["params"] for g in adamw.param_groups]
    for ours, theirs in zip(opt.param_groups, adamw.param_groups):
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert ours[key] == theirs[key], key
    assert opt.param_groups[0]["name"] == "decay"  # the script's own keys stay
    assert "fused" not in opt.param_groups[0] and "amsgrad" not in opt.param_groups[0]


def test_its_fp32_warmup_is_the_adamw_it_came_from_bit_for_bit():
    reference, ours = make_model(), make_model()
    want = _train(reference, _adamw(reference))
    opt = onebit.OnebitAdam.from_optimizer(_adamw(ours), warmup_compression="fp32")
    assert all_equal(_train(ours, opt), want)


def test_adam_with_decoupled_decay_and_without_decay_are_accepted():
    model = make_model()
    adam = torch.optim.Adam(model.parameters(), lr=1e-2, decoupled_weight_decay=True,
                            weight_decay=0.1)  # fmt: skip
    assert onebit.OnebitAdam.from_optimizer(adam).param_groups[0]["weight_decay"] == 0.1
    plain = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-2))  # a tensor lr too
    assert onebit.OnebitAdam.from_optimizer(plain).param_groups[0]["lr"] == pytest.approx(1e-2)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), "amsgrad"),
        (lambda m: torch.optim.AdamW(m.parameters(), maximize=True), "maximize"),
        (lambda m: torch.optim.Adam(m.parameters(), weight_decay=0.1), "L2 term"),
        (lambda m: torch.optim.AdamW(m.parameters(), differentiable=True), "differentiable"),
    ],
)
def test_what_onebit_cannot_honour_is_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        onebit.OnebitAdam.from_optimizer(make(make_model()))


def test_other_optimizers_a_stepped_one_and_a_repeated_hyperparameter_are_refused():
    model = make_model()
    with pytest.raises(TypeError, match="torch.optim.AdamW or torch.optim.Adam, got SGD"):
        onebit.OnebitAdam.from_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    stepped = _adamw(model)
    _train(model, stepped, 1)
    with pytest.raises(ValueError, match="already stepped"):
        onebit.OnebitAdam.from_optimizer(stepped)
    with pytest.raises(ValueError, match="takes lr from the optimizer's param groups"):
        onebit.OnebitAdam.from_optimizer(_adamw(make_model()), lr=1.0)
