"""Optimizer step and backward cost at world size 1, against torch.optim.AdamW(fused=True).

Measures, side by side in one run on the same parameters:

* ``step()`` of AdamW(fused=True), and of OnebitAdam in warmup (fp32 and int8) and in the
  compression stage (a scale per tensor, the default, which runs the fused passes of
  :mod:`onebit.wire.momentum`; one per bucket; with ``max_grad_norm``; with bf16 errors; with an
  ``exp_avg_mask``; on bf16 parameters),
  of ZeroOneAdam's 1-bit sync step and OnebitLamb's compression step (each also with bf16
  errors);
* forward + backward of the same model with and without OnebitAdam's gradient hooks (they count
  backward passes for the step check).

Layouts (``--models``): on the CPU, few large tensors (the kernels dominate) and many small ones
(the per-tensor Python work dominates); on a GPU, two large ones: 269M parameters in 16
tensors, and a GPT-2 medium layout (24 layers, d=1024, 355M parameters in 292 tensors). Prints
medians in ms and ratios to AdamW; each step is timed in turns with AdamW's, and its ratio is to
those AdamW steps (the AdamW row is the median of them). On CUDA it also prints, per optimizer,
its state and the peak memory a step allocates above the model and its gradients, in MB.

    python benchmarks/step.py [--repeats 30]
    python benchmarks/step.py --device cuda              # the GPU layouts, Triton kernels
    ONEBIT_BACKEND=torch python benchmarks/step.py --device cuda   # the torch reference on CUDA
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import statistics
import time

import torch
from machine import cpu_name

import onebit

VARIANTS = [
    ("OnebitAdam warmup step", "OnebitAdam", "warmup", {"warmup_compression": "fp32"}),
    ("OnebitAdam warmup, int8", "OnebitAdam", "warmup", {"warmup_compression": "int8"}),
    ("OnebitAdam warmup, int4", "OnebitAdam", "warmup", {"warmup_compression": "int4"}),
    ("OnebitAdam compression step", "OnebitAdam", "compression", {}),
    ("  ... one scale per bucket", "OnebitAdam", "compression", {"scale_per": "bucket"}),
    ("  ... + clip", "OnebitAdam", "compression", {"max_grad_norm": 1.0}),
    ("  ... errors in bf16", "OnebitAdam", "compression", {"error_dtype": torch.bfloat16}),
    ("  ... exp_avg_mask", "OnebitAdam", "compression", {"exp_avg_mask": "first"}),
    ("  ... bf16 parameters", "OnebitAdam", "compression", {"dtype": torch.bfloat16}),
    ("ZeroOneAdam 1-bit sync step", "ZeroOneAdam", "compression", {}),
    ("ZeroOneAdam, bf16 errors", "ZeroOneAdam", "compression", {"error_dtype": torch.bfloat16}),
    ("OnebitLamb compression step", "OnebitLamb", "compression", {}),
    ("OnebitLamb, bf16 errors", "OnebitLamb", "compression", {"error_dtype": torch.bfloat16}),
    ("OnebitLamb + clip", "OnebitLamb", "compression", {"max_grad_norm": 1.0}),
]
"""The steps measured: name, optimizer, stage, constructor options (defaults otherwise;
``exp_avg_mask`` ``"first"``: a mask of alternate ones and zeros on the first parameter;
``dtype``: the parameters and gradients cast to it, the ratio still to AdamW on fp32)."""


def _gpt_shapes(layers: int, d: int, vocab: int, context: int) -> list[tuple[int, ...]]:
    """The parameter shapes of a GPT-2 (tied embedding)."""
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,),
             (d, 4 * d), (d,)]  # fmt: skip
    return [(vocab, d), (context, d), *block * layers, (d,), (d,)]


LAYOUTS = {
    "large": "16.8M parameters in 4 tensors (2 Linear layers)",
    "many": "0.6M parameters in 300 tensors (150 Linear(64, 64))",
    "16-tensors": "269M parameters in 16 tensors (8 Linear layers, 4096 <-> 8192)",
    "gpt-medium": "355M parameters in 292 tensors (GPT-2 medium)",
    "gpt-tiny": "0.03M parameters in 28 tensors (a 2-layer GPT, d=32: a smoke test)",
}


def _model(kind: str, device: torch.device) -> torch.nn.Module:
    """The parameters of layout ``kind`` on ``device``: a Sequential of Linear layers (whose
    forward and backward are timed too), or a ParameterList of a GPT's shapes."""
    torch.manual_seed(0)
    if kind == "large":
        model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 2048))
    elif kind == "many":
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(150)])
    elif kind == "16-tensors":
        widths = [4096, 8192] * 4 + [4096]
        model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    else:
        medium = kind == "gpt-medium"
        layers, d, vocab, context = (24, 1024, 50257, 1024) if medium else (2, 32, 128, 32)
        shapes = _gpt_shapes(layers, d, vocab, context)
        model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes])
    return model.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _megabytes(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


def _peak_mb(step, device: torch.device) -> float:
    """The most memory one ``step()`` allocates above what was allocated before it, in MB."""
    if device.type != "cuda":
        return 0.0
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def _optimizer(name: str, params, freeze: int, options: dict) -> torch.optim.Optimizer:
    """``name`` with its warmup ending after ``freeze`` steps (0/1 Adam: a sync every step)."""
    if "dtype" in options:
        options = dict(options)
        dtype = options.pop("dtype")
        params = list(params)
        for p in params:
            p.data, p.grad = p.data.to(dtype), p.grad.to(dtype)
    if options.get("exp_avg_mask") == "first":
        params = list(params)
        mask = torch.ones_like(params[0]).view(-1)
        mask[::2] = 0
        options = {**options, "exp_avg_mask": {params[0]: mask.view_as(params[0])}}
    if name == "ZeroOneAdam":
        return onebit.ZeroOneAdam(params, lr=1e-4, var_freeze_step=freeze,
                                  local_step_scaler=10**9, **options)  # fmt: skip
    return getattr(onebit, name)(params, lr=1e-4, freeze_step=freeze, **options)


def _alternated_ms(fns, repeats: int, device: torch.device) -> list[float]:
    """Each of ``fns`` timed ``repeats`` times, in turns, so that drifts in the machine's speed
    (its memory bandwidth moves by 30% between minutes here) cancel: their medians in ms."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            samples.append(time.perf_counter() - start)
    return [1e3 * statistics.median(samples) for samples in times]


def _set_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--models", help=f"of {', '.join(LAYOUTS)} (default: by device)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    models = args.models.split(",") if args.models else (
        ["16-tensors", "gpt-medium"] if cuda else ["large", "many"]
    )  # fmt: skip
    torch.set_num_threads(1)
    where = torch.cuda.get_device_name(device) if cuda else f"1 thread, {cpu_name()}"
    print(f"torch {torch.__version__}, {where}, kernels: {onebit.kernels.for_device(device).name}")
    memory = " | state MB | step peak MB" if cuda else ""
    print(f"model  | what                          | median ms | / AdamW fused{memory}")
    for kind in models:
        print(f"{kind}: {LAYOUTS[kind]}")
        base = _model(kind, device)
        adamw_model = copy.deepcopy(base)
        _set_grads(adamw_model)
        before = _megabytes(device)
        adamw = torch.optim.AdamW(adamw_model.parameters(), lr=1e-4, fused=True)
        adamw_peak = _peak_mb(adamw.step, device)
        adamw_memory = f" | {_megabytes(device) - before:8.0f} | {adamw_peak:12.0f}"
        adamw_ms = []
        for name, optimizer, stage, options in VARIANTS:
            model = copy.deepcopy(base)
            _set_grads(model)
            before = _megabytes(device)
            opt = _optimizer(optimizer, model.parameters(), 10**9 if stage == "warmup" else 1,
                             options)  # fmt: skip
            if cuda:  # the peak of a later step: the first builds the state
                opt.step()
            peak = _peak_mb(opt.step, device)
            used = f" | {_megabytes(device) - before:8.0f} | {peak:12.0f}" if cuda else ""
            reference, ms = _alternated_ms([adamw.step, opt.step], args.repeats, device)
            print(f"{kind:6} | {name:29} | {ms:9.2f} | {ms / reference:13.2f}{used}", flush=True)
            adamw_ms.append(reference)
            del model, opt
            gc.collect()  # the next row's state is measured from what is allocated then
        adamw_row = f"{'AdamW(fused=True) step':29} | {statistics.median(adamw_ms):9.2f} | "
        print(f"{kind:6} | {adamw_row}{1:13.2f}{adamw_memory if cuda else ''}")
        if isinstance(base, torch.nn.Sequential):
            for name, (ms, ratio) in _backward_rows(base, args.repeats, device).items():
                print(f"{kind:6} | {name:29} | {ms:9.2f} | {ratio}")
        del base, adamw_model, adamw


def _backward_rows(base: torch.nn.Sequential, repeats: int, device: torch.device) -> dict:
    """Forward + backward of ``base`` with and without OnebitAdam's gradient hooks."""
    x = torch.randn(64, base[0].in_features, device=device)
    plain, hooked = copy.deepcopy(base), copy.deepcopy(base)
    onebit.OnebitAdam(hooked.parameters(), freeze_step=10)  # installs its hooks

    def backward(model, x=x):
        model.zero_grad(set_to_none=False)
        model(x).sum().backward()

    passes = [functools.partial(backward, plain), functools.partial(backward, hooked)]
    without, with_hooks = _alternated_ms(passes, repeats, device)
    ratio = f"{with_hooks / without:13.3f} (with / without hooks)"
    return {"forward+backward, no hooks": (without, ""),
            "forward+backward, onebit hooks": (with_hooks, ratio)}  # fmt: skip


if __name__ == "__main__":
    main()
