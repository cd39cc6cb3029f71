"""The three optimizers with small settings that cross their stages in a few steps, a tiny
model and per-rank data, shared by the tests of the training-loop features."""

from __future__ import annotations

import torch

import onebit

NAMES = ["adam", "zero_one", "lamb"]

# In 8 steps: OnebitAdam/OnebitLamb freeze after 3. ZeroOneAdam's phase A has variance steps
# 1, 2, 4 and compressed steps 3, 5; phase B syncs on steps 6 and 8 and is local on step 7.
SETTINGS = {
    "adam": (onebit.OnebitAdam, dict(freeze_step=3, warmup_compression="fp32")),
    "zero_one": (
        onebit.ZeroOneAdam,
        dict(
            var_freeze_step=5, var_update_scaler=1, local_step_scaler=1, warmup_compression="fp32"
        ),
    ),
    "lamb": (onebit.OnebitLamb, dict(freeze_step=3, warmup_compression="fp32")),
}


def make_optimizer(name: str, params, **kwargs) -> onebit.optim.base.CompressedOptimizer:
    cls, settings = SETTINGS[name]
    return cls(params, **{"lr": 1e-2, "bucket_size": 128, **settings, **kwargs})


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


def batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)


def loss_of(model: torch.nn.Module, step: int, rank: int, micro: int = 0) -> torch.Tensor:
    x, y = batch(step, rank, micro)
    return torch.nn.functional.mse_loss(model(x), y)


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
