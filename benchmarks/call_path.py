"""Trace the Python calls of one optimizer step through onebit's modules: how many files a
gradient's path crosses, and how many calls go from one file to another.

A measure of the structure, not of speed: each call from a function in one of onebit's files
to one in another is an edge; the fewer files and edges, the less of the library a reader must
hold to follow a step. ``--step`` picks the stage (after the freeze by default); the model is a
small MLP on one process, with the backend that ``ONEBIT_BACKEND`` or ``auto`` gives.

    python benchmarks/call_path.py
    python benchmarks/call_path.py --optimizer lamb --edges
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

import onebit

ROOT = Path(onebit.__file__).resolve().parent
OPTIMIZERS = {
    "adam": lambda p: onebit.OnebitAdam(p, lr=1e-3, freeze_step=2, bucket_size=256),
    "lamb": lambda p: onebit.OnebitLamb(p, lr=1e-3, freeze_step=2, bucket_size=256),
    "zero_one": lambda p: onebit.ZeroOneAdam(p, lr=1e-3, var_freeze_step=2, bucket_size=256),
}


def _module(code) -> str | None:
    path = Path(code.co_filename).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else None


def trace(call) -> collections.Counter:
    """``call()`` under a profiler: ``(caller file, caller, callee file, callee)`` -> how often,
    for every call from one of onebit's files into another."""
    edges: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = _module(frame.f_code), _module(frame.f_back.f_code)
        if callee and caller and callee != caller:
            key = (caller, frame.f_back.f_code.co_qualname, callee, frame.f_code.co_qualname)
            edges[key] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return edges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    parser.add_argument("--steps", type=int, default=4, help="steps before the traced one")
    parser.add_argument("--edges", action="store_true", help="print every cross-file call")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = OPTIMIZERS[args.optimizer](model.parameters())

    def backward() -> None:
        opt.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()

    for _ in range(args.steps):
        backward()
        opt.step()
    backward()
    stage = opt.stage
    edges = trace(opt.step)
    files = {f for caller, _, callee, _ in edges for f in (caller, callee)}
    pairs = collections.Counter(frozenset((a, b)) for a, _, b, _ in edges)
    print(f"{type(opt).__name__}, {stage} step ({opt.backend} kernels): {len(files)} files, "
          f"{len(edges)} distinct cross-file calls ({sum(edges.values())} made)")  # fmt: skip
    for pair, count in pairs.most_common(5):
        a, b = sorted(pair)
        up = sum(1 for x, _, y, _ in edges if (x, y) == (b, a))
        print(f"  {a} <-> {b}: {count} distinct calls ({count - up} {a} -> {b}, {up} back)")
    if args.edges:
        for (caller, f, callee, g), n in sorted(edges.items()):
            print(f"  {caller}:{f} -> {callee}:{g}  x{n}")


if __name__ == "__main__":
    main()
