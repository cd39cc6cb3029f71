"""Each Triton kernel's GPU time at other block sizes and warps, in the steps of ``step.py``.

    python benchmarks/blocks.py              # GPT-2 medium on CUDA: the configs of BENCHMARKS.md
    python benchmarks/blocks.py --configs default,2048:8 --steps "OnebitAdam compression step"

A config ``B:W`` runs ``B`` elements a program (``triton_common.BLOCK``) and every kernel that
works per element (:data:`PER_ELEMENT`) with ``W`` warps; ``default`` is what onebit ships. The
other kernels, which loop over tables, keep their warps. Each step runs on GPT-2 medium's layout
(355M parameters in 292 tensors) at world size 1, and prints its wall time, its kernels' time
and each Triton kernel's, from torch's profiler over 5 steps. This is how ``BLOCK`` and the
warps of each kernel were chosen; the bits do not depend on them.
"""

from __future__ import annotations

import argparse
import time

import torch
from launches import built
from step import VARIANTS, _gpt_shapes
from torch.profiler import ProfilerActivity, profile

from onebit.kernels import triton_common, triton_kernels, triton_model, triton_quantized

MODULES = (triton_common, triton_kernels, triton_model, triton_quantized)  # each reads BLOCK
PER_ELEMENT = {
    "y_pass", "momentum_pass", "momentum_update_kernel", "decompress_kernel", "solo_pass",
    "worker_pass", "input_pass", "serve_pass", "update_pass", "lamb_pass", "decompress_pass",
    "_worker_quantize", "_worker_errors", "_server_quantize", "sync_progress_pass",
    "sync_apply_pass",
}  # fmt: skip
STEPS = "OnebitAdam warmup, int8;OnebitAdam compression step;OnebitLamb compression step"
CONFIGS = "4096:16,2048:8,1024:4,1024:8,default"


def _kernels() -> dict[str, triton_common.Launched]:
    return {kernel.kernel.fn.__name__: kernel for kernel in triton_common.LAUNCHED}


def _configure(block: int, warps: dict[str, int]) -> None:
    """``block`` elements a program, and each kernel's ``warps``. Only between optimizers: each
    builds its tables for the block size of then."""
    for module in MODULES:
        module.BLOCK = block
    for name, kernel in _kernels().items():
        kernel.options["num_warps"] = warps[name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=CONFIGS, help="BLOCK:WARPS or default, by commas")
    parser.add_argument("--steps", default=STEPS, help="names of step.VARIANTS, by semicolons")
    args = parser.parse_args()
    chosen = args.steps.split(";")
    shapes = _gpt_shapes(24, 1024, 50257, 1024)
    default = triton_common.BLOCK, {n: k.options["num_warps"] for n, k in _kernels().items()}
    configs = {}
    for config in args.configs.split(","):
        if config == "default":
            configs[config] = default
        else:
            block, warps = (int(x) for x in config.split(":"))
            configs[config] = block, {n: warps if n in PER_ELEMENT else w
                                      for n, w in default[1].items()}  # fmt: skip
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; GPT-2 medium, world 1")
    try:
        for name, optimizer, stage, options in VARIANTS:
            if name.strip() not in chosen:
                continue
            for config, (block, warps) in configs.items():
                _configure(block, warps)
                opt = built(shapes, optimizer, stage, options, "cuda")
                for _ in range(3):
                    opt.step()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    start = time.perf_counter()
                    for _ in range(5):
                        opt.step()
                    torch.cuda.synchronize()
                    wall = (time.perf_counter() - start) / 5 * 1e3
                times = {e.key: e.device_time_total / 5e3 for e in prof.key_averages()
                         if e.device_time_total > 0}  # fmt: skip
                ours = sorted(((ms, k) for k, ms in times.items() if k in warps), reverse=True)
                each = ", ".join(f"{k} {ms:.2f}" for ms, k in ours)
                print(f"{name.strip():28} {config:8}: wall {wall:6.2f} ms, kernels "
                      f"{sum(times.values()):6.2f}; {each}", flush=True)  # fmt: skip
                del opt
                torch.cuda.empty_cache()
    finally:
        _configure(*default)


if __name__ == "__main__":
    main()
