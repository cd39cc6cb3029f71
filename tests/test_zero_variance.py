"""Entries that got no gradient before the freeze must not take ``lr/eps`` steps after it.

A tiny attention LM has a key bias (softmax ignores it, so its gradient is float rounding, about
1e-11) and an embedding row whose token first appears after the freeze. Adam's variance there
is (about) 0; 1-bit momentum never is. Each optimizer replaces such variances with its tensor's
mean (``fill_zero_variance_``); the same run with that rule switched off blows up.
"""

import math

import pytest
import torch
from distributed import run_ranks
from optimizer_state import temporaries
from torch import nn

import onebit

VOCAB, WIDTH, LATE_TOKEN = 16, 16, 15
STEPS, FREEZE, LR = 40, 10, 1e-2


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        scores = self.q(h) @ self.k(h).transpose(1, 2) / math.sqrt(WIDTH)
        return self.head(h + scores.softmax(-1) @ self.v(h))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of 9 tokens; ``LATE_TOKEN`` appears only after the freeze."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, LATE_TOKEN, (8, 9), generator=gen)
    if step > FREEZE + 5:
        tokens[:, ::3] = LATE_TOKEN
    return tokens[:, :-1], (tokens[:, 1:] * 7 + 3) % VOCAB


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def make(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return onebit.OnebitAdam(
            model.parameters(), warmup_compression="fp32", lr=LR, freeze_step=FREEZE
        )
    if name == "zero_one":
        return onebit.ZeroOneAdam(model.parameters(), lr=LR, var_freeze_step=FREEZE)
    return onebit.OnebitLamb(
        model.parameters(), warmup_compression="fp32", lr=LR, freeze_step=FREEZE
    )


def _train(rank, world_size, name, rule):
    if not rule:  # the rule switched off, to show what it prevents
        for module in (
            onebit.optim.adam,
            onebit.optim.zero_one_adam,
            onebit.optim.lamb_compression,
        ):
            module.fill_zero_variance_ = lambda variances, floor=0.0, out=None: (
                out is not None and [o.copy_(v) for o, v in zip(out, variances)]
            )
    model = TinyLM()
    opt = make(name, model)
    losses = []
    for step in range(1, STEPS + 1):
        x, y = batch(step, rank)
        loss = loss_of(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if name == "zero_one":
        opt.synchronize()
    return losses, model.k.bias.detach().abs().max().item()


def _adamw_losses() -> list[float]:
    """AdamW on both ranks' batches at once, which is what DDP + AdamW computes."""
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(1, STEPS + 1):
        batches = [batch(step, rank) for rank in range(2)]
        loss = sum(loss_of(model, x, y) for x, y in batches) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["adam", "zero_one", "lamb"])
def test_no_blow_up_from_entries_without_gradient(name):
    (losses, key_bias), _ = run_ranks(_train, 2, name, True, timeout=240)
    assert all(math.isfinite(x) for x in losses)
    assert key_bias < 1.0  # it started below 0.25 and has no gradient
    late = sum(losses[-10:]) / 10  # the late token is in these batches
    if name != "lamb":  # the Adams follow AdamW
        reference = sum(_adamw_losses()[-10:]) / 10
        assert late < 1.1 * reference
    else:  # LAMB is not Adam, but it learns: the loss keeps falling after the late token
        assert late < losses[FREEZE + 5]

    (blown, blown_bias), _ = run_ranks(_train, 2, name, False, timeout=240)
    blown_late = sum(blown[-10:]) / 10
    assert blown_bias > 100 * key_bias or not math.isfinite(blown_late) or blown_late > 2 * late


def test_fill_zero_variance_rule():
    v = [torch.tensor([0.0, 4.0, 2**-70, 2.0]), torch.zeros(3), torch.empty(0), torch.ones(2)]
    out = [torch.empty_like(t) for t in v]
    onebit.functional.fill_zero_variance_(v, floor=1e-16, out=out)
    assert out[0].tolist() == [3.0, 4.0, 3.0, 2.0]  # its tensor's mean of the others
    assert out[1].tolist() == [2.0] * 3  # none above: the mean over every tensor's (4, 2, 1, 1)
    assert out[3].tolist() == [1.0, 1.0] and out[2].numel() == 0
    assert v[0].tolist() == [0.0, 4.0, 2**-70, 2.0]  # the input is untouched with out=
    onebit.functional.fill_zero_variance_(v)  # in place, exact zeros only
    assert v[0][0].item() == pytest.approx(2.0) and v[0][2].item() > 0


def test_fill_zero_variance_takes_temporaries_of_a_block(monkeypatch):
    """The fill walks each tensor in blocks, so an embedding a tenth of the model does not put
    a few copies of itself on the freeze step's peak."""
    monkeypatch.setattr(onebit.functional, "_BLOCK", 1024)
    v = torch.rand(100_000)
    v[::7] = 0.0
    expected = torch.where(v == 0, v[v > 0].double().mean().float(), v)
    used = temporaries(lambda: onebit.functional.fill_zero_variance_([v]))
    assert used <= 16 * 1024 + 4096
    torch.testing.assert_close(v, expected, rtol=1e-6, atol=0)
