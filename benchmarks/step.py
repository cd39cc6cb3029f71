"""Optimizer step and backward cost at world size 1, against torch.optim.AdamW(fused=True).

Measures, side by side in one run on the same parameters:

* ``step()`` of AdamW(fused=True), and of OnebitAdam in warmup (fp32 and int8) and in the
  compression stage (a scale per tensor, the default, which runs the fused passes of
  :mod:`onebit.momentum` on a CPU; one per bucket; with ``max_grad_norm``), of ZeroOneAdam's
  1-bit sync step and OnebitLamb's compression step;
* forward + backward of the same model with and without OnebitAdam's gradient hooks (they count
  backward passes for the step check).

Two models: few large tensors (the kernels dominate) and many small ones (the per-tensor Python
work dominates). Prints medians in ms and ratios to AdamW; each step is timed in turns with
AdamW's, and its ratio is to those AdamW steps (the AdamW row is the median of them).

    python benchmarks/step.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time

import torch
from machine import cpu_name

import onebit

VARIANTS = [
    ("OnebitAdam warmup step", "OnebitAdam", "warmup", {}),
    ("OnebitAdam warmup, int8", "OnebitAdam", "warmup", {"warmup_compression": "int8"}),
    ("OnebitAdam compression step", "OnebitAdam", "compression", {}),
    ("  ... one scale per bucket", "OnebitAdam", "compression", {"scale_per": "bucket"}),
    ("  ... + clip", "OnebitAdam", "compression", {"max_grad_norm": 1.0}),
    ("ZeroOneAdam 1-bit sync step", "ZeroOneAdam", "compression", {}),
    ("OnebitLamb compression step", "OnebitLamb", "compression", {}),
]
"""The steps measured: name, optimizer, stage, constructor options (defaults otherwise)."""


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "large":  # 16.8M parameters in 4 tensors
        return torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 2048))
    layers = [torch.nn.Linear(64, 64) for _ in range(150)]  # 300 tensors, 0.6M parameters
    return torch.nn.Sequential(*layers)


def _optimizer(name: str, params, freeze: int, options: dict) -> torch.optim.Optimizer:
    """``name`` with its warmup ending after ``freeze`` steps (0/1 Adam: a sync every step)."""
    if name == "ZeroOneAdam":
        return onebit.ZeroOneAdam(params, lr=1e-4, var_freeze_step=freeze,
                                  local_step_scaler=10**9, **options)  # fmt: skip
    return getattr(onebit, name)(params, lr=1e-4, freeze_step=freeze, **options)


def _alternated_ms(fns, repeats: int) -> list[float]:
    """Each of ``fns`` timed ``repeats`` times, in turns, so that drifts in the machine's speed
    (its memory bandwidth moves by 30% between minutes here) cancel: their medians in ms."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return [1e3 * statistics.median(samples) for samples in times]


def _set_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {cpu_name()}")
    print("model  | what                          | median ms | / AdamW fused")
    for kind in ("large", "many"):
        base = _model(kind)
        rows = {}  # name: (median ms, ratio to AdamW timed in turns with it)
        adamw_model = copy.deepcopy(base)
        _set_grads(adamw_model)
        adamw = torch.optim.AdamW(adamw_model.parameters(), lr=1e-4, fused=True)
        adamw_ms = []
        for name, optimizer, stage, options in VARIANTS:
            model = copy.deepcopy(base)
            _set_grads(model)
            opt = _optimizer(optimizer, model.parameters(), 10**9 if stage == "warmup" else 1,
                             options)  # fmt: skip
            opt.step()
            reference, ms = _alternated_ms([adamw.step, opt.step], args.repeats)
            rows[name] = ms, f"{ms / reference:.2f}"
            adamw_ms.append(reference)
        x = torch.randn(64, base[0].in_features)
        plain, hooked = copy.deepcopy(base), copy.deepcopy(base)
        onebit.OnebitAdam(hooked.parameters(), freeze_step=10)  # installs its hooks

        def backward(model, x=x):
            model.zero_grad(set_to_none=False)
            model(x).sum().backward()

        passes = [functools.partial(backward, plain), functools.partial(backward, hooked)]
        without, with_hooks = _alternated_ms(passes, args.repeats)
        adamw_row = f"{'AdamW(fused=True) step':29} | {statistics.median(adamw_ms):9.2f} | 1.00"
        print(f"{kind:6} | {adamw_row}")
        rows["forward+backward, no hooks"] = without, ""
        rows["forward+backward, onebit hooks"] = with_hooks, ""
        for name, (ms, ratio) in rows.items():
            print(f"{kind:6} | {name:29} | {ms:9.2f} | {ratio}")
        print(f"{kind:6} | backward with hooks / without: {with_hooks / without:.3f}")


if __name__ == "__main__":
    main()
