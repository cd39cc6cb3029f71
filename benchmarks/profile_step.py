"""Where a step's GPU time goes: each step variant of ``step.py`` on CUDA, its wall time, the
time its kernels ran, and its costliest kernels, from torch's profiler.

    python benchmarks/profile_step.py                # GPT-2 medium's layout, 355M parameters
    python benchmarks/profile_step.py --top 8 --bucket-size 16384

A step whose kernels run for much less than its wall time waits on the CPU (launches, host
reads); one whose kernels fill it is bound by them, and the list says which.
"""

from __future__ import annotations

import argparse
import time

import torch
from launches import built
from step import VARIANTS, _gpt_shapes
from torch.profiler import ProfilerActivity, profile

from onebit.optim.options import DEFAULT_BUCKET_SIZE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=6, help="kernels listed per step")
    parser.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    shapes = _gpt_shapes(24, 1024, 50257, 1024)
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {numel / 1e6:.0f}M "
          f"parameters in {len(shapes)} tensors, bucket size {args.bucket_size}")  # fmt: skip
    for name, optimizer, stage, options in VARIANTS:
        opt = built(shapes, optimizer, stage, {**options, "bucket_size": args.bucket_size}, "cuda")
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(args.repeats):
                opt.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / args.repeats * 1e3
        kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in kernels) / args.repeats / 1e3
        print(f"\n{name.strip()}: {wall:.2f} ms a step, its kernels {total:.2f} ms "
              f"({total / wall:.0%})")  # fmt: skip
        for e in sorted(kernels, key=lambda e: -e.device_time_total)[: args.top]:
            ms = e.device_time_total / args.repeats / 1e3
            print(f"  {ms:7.2f} ms  {e.count // args.repeats:4d}x  {e.key[:90]}")
        del opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
