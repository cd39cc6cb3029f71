"""Does ``freeze_step="auto"`` freeze at a reasonable point and reach a good fixed step's loss?

    python benchmarks/auto_freeze.py                     # 2 gloo ranks, 1500 steps, ~2 min
    python benchmarks/auto_freeze.py --world-size 4 --steps 3000

A small tanh MLP (32-256-256-10) learns to classify the outputs of a fixed random teacher
network; every rank draws its own batches. All runs share the model, the data and ``lr`` (with a
cosine decay). For OnebitAdam it sweeps fixed ``freeze_step`` values (10%, 20%, 40% of the run,
and never, which is AdamW on averaged gradients), then runs ``freeze_step="auto"`` with the
default :class:`onebit.AutoFreeze` knobs, alone and told the run's length (``total_steps``,
which caps the warmup at a fifth); the same for OnebitLamb with never (plain LAMB), 20% and the two
``"auto"``; and ZeroOneAdam (``var_freeze_step`` 20%, its local steps sized by ``total_steps``)
for comparison. For each run it prints where the variance froze, the final loss (mean training loss
of the last 10% of steps, and the loss on a held-out set), the bytes a rank sent per step on
average (``comm_stats``) and the fraction of communication rounds skipped.

The model uses tanh on purpose: with ReLU, units that die early keep ``v = 0``, and a frozen
``v = 0`` turns 1-bit Adam's never-exactly-zero momentum into steps of size ``lr / eps``.
"""

from __future__ import annotations

import argparse
import time

import torch

import onebit
from onebit.train.launch import run_ranks

IN, HIDDEN, CLASSES, BATCH = 32, 256, 10, 32
TOLD = "auto, told"
"""``freeze_step="auto"`` told the run's length: ``AutoFreeze(total_steps=steps)``."""


def _teacher() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, 64), torch.nn.Tanh(), torch.nn.Linear(64, CLASSES)
    )


def _student() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def _batch(teacher: torch.nn.Module, seed: int, size: int = BATCH) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, IN, generator=gen)
    with torch.no_grad():
        y = teacher(x).argmax(1)
    return x, y


def _optimizer(kind: str, freeze: int | str | None, params, steps: int, lr: float):
    if kind == "zero-one":
        return onebit.ZeroOneAdam(params, lr=lr, var_freeze_step=freeze, total_steps=steps)
    cls = onebit.OnebitAdam if kind == "adam" else onebit.OnebitLamb
    if freeze == TOLD:
        told = onebit.AutoFreeze(total_steps=steps)
        return cls(params, lr=lr, freeze_step="auto", auto_freeze=told)
    return cls(params, lr=lr, freeze_step=steps + 1 if freeze is None else freeze)


def _train(rank: int, world_size: int, runs: list, steps: int, lr: float) -> list[dict]:
    """One rank of every run in turn (a gloo group is up): what each run measured."""
    teacher = _teacher()
    eval_x, eval_y = _batch(teacher, seed=-1 % 2**31, size=4096)
    results = []
    for kind, freeze in runs:
        model = _student()
        opt = _optimizer(kind, freeze, model.parameters(), steps, lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=lr / 10)
        losses, start = [], time.perf_counter()
        for t in range(steps):
            x, y = _batch(teacher, seed=t * world_size + rank)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
            losses.append(loss.item())
        if kind == "zero-one":
            opt.synchronize()
        with torch.no_grad():
            eval_loss = torch.nn.functional.cross_entropy(model(eval_x), eval_y).item()
        stats = opt.comm_stats
        tail = losses[-steps // 10 :]
        results.append(
            {
                "freeze": stats.freeze_step,
                "train": sum(tail) / len(tail),
                "eval": eval_loss,
                "bytes": stats.bytes_total / steps,
                "skipped": stats.rounds_skipped / steps,
                "seconds": time.perf_counter() - start,
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()
    steps = args.steps
    runs = [
        ("adam", None),
        ("adam", steps // 10),
        ("adam", steps // 5),
        ("adam", 2 * steps // 5),
        ("adam", "auto"),
        ("adam", TOLD),
        ("lamb", None),
        ("lamb", steps // 5),
        ("lamb", "auto"),
        ("lamb", TOLD),
        ("zero-one", steps // 5),
    ]
    names = {
        "adam": "OnebitAdam",
        "lamb": "OnebitLamb",
        "zero-one": "ZeroOneAdam",
    }
    start = time.perf_counter()
    results = run_ranks(
        _train, args.world_size, runs, steps, args.lr, timeout=None, collective_timeout=600
    )[0]
    numel = sum(p.numel() for p in _student().parameters())
    print(
        f"MLP {IN}-{HIDDEN}-{HIDDEN}-{CLASSES} ({numel} parameters), {args.world_size} gloo ranks "
        f"x batch {BATCH}, {steps} steps, lr {args.lr} cosine to {args.lr / 10}"
    )
    print(
        f"{'optimizer':<12} {'freeze_step':<17} {'froze at':>8} {'train loss':>10} "
        f"{'eval loss':>9} {'bytes/step':>10} {'skipped':>7}"
    )
    for (kind, freeze), r in zip(runs, results):
        asked = str(freeze)
        if freeze is None:
            asked = "never (AdamW)" if kind == "adam" else "never (LAMB)"
        froze = "-" if r["freeze"] is None or r["freeze"] > steps else str(r["freeze"])
        if kind == "zero-one":
            asked = f"var_freeze {freeze}"
        print(
            f"{names[kind]:<12} {asked:<17} {froze:>8} {r['train']:>10.4f} {r['eval']:>9.4f} "
            f"{r['bytes']:>10.0f} {r['skipped']:>7.1%}"
        )
    print(f"total {time.perf_counter() - start:.0f} s")
    fp32 = 2 * 4 * numel * (args.world_size - 1) / args.world_size
    print(f"(an fp32 ring allreduce of the gradients sends {fp32:.0f} bytes per step)")


if __name__ == "__main__":
    main()
