"""Time the 1-bit compression kernels against a plain fp32 copy of the same buffer.

    python benchmarks/kernels.py                          # the kernels the library picks
    python benchmarks/kernels.py --paths auto,numpy,torch # and the fallbacks, side by side
    python benchmarks/kernels.py --device cuda            # on a GPU (GB/s vs its own copy)

For each size, one repetition times, one after the other on the same buffers:

* ``copy``: ``dst.copy_(src)`` of the fp32 buffer, the memory-speed yardstick;
* ``compress``: what a worker does per bucket: add the error, take the scale, take the signs, pack
  them 8 per byte (:func:`onebit.compress.compress_`), then update the error
  (:func:`onebit.compress.subtract_compressed_`);
* ``decompress``: rebuild the fp32 buffer from ``world`` packed chunks and their scales
  (:func:`onebit.compress.decompress_`);
* ``server``: one rank's server share for ``world`` ranks: average the ``world`` signed
  chunks of ``numel / world`` elements, add the server error, compress, update the error;
* ``call``: the public ``CompressedAllreduce(numel)(src, out=dst)`` at world size 1 (no process
  group, whatever ``--world`` says): the worker's and the server's whole share and the result
  (with the C kernels, three passes that read ``src`` where it is:
  :func:`onebit.compress.allreduce_one_`).

Each case is timed right after an untimed run of itself (so all start with the same warm
caches: a 1M-element copy runs from L3), and is reported as the median over repetitions and as a
ratio to the copy's median, so machine noise cancels (the 2-core VM this was tuned on is shared).
GB/s are bytes of the fp32 buffer processed per second, for the copy too, so ``100 / ratio`` is
the percentage of the copy's bandwidth.

Paths (``ONEBIT_BACKEND``'s backends): ``auto`` is what the library runs (the fused C kernels
on x86-64 CPUs, the Triton kernels on CUDA, see :mod:`onebit.kernels`), ``c``, ``numpy`` (the
fallback without a C compiler), ``triton`` and ``torch`` (the whole-tensor reference, which CUDA
ran before the Triton kernels; on a CPU about what the library did before). On a GPU compare
``--paths auto,torch``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from machine import cpu_name

from onebit import CompressedAllreduce, kernels
from onebit.compress import average_signs_, compress_, decompress_, subtract_compressed_

OPS = ("compress", "decompress", "server", "call")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, before: Callable[[], object]) -> float:
    """One timed call of ``fn``, after an untimed one: every case starts with warm caches."""
    before()
    fn()
    before()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


@contextmanager
def kernel_path(path: str) -> Iterator[None]:
    """Force one backend (``ONEBIT_BACKEND``; ``auto``: the library's choice) while open."""
    saved = os.environ.get(kernels.ENV)
    os.environ[kernels.ENV] = path
    try:
        yield
    finally:
        if saved is None:
            del os.environ[kernels.ENV]
        else:
            os.environ[kernels.ENV] = saved


def path_name(path: str, device: torch.device) -> str:
    """What ``path`` runs on ``device``."""
    with kernel_path(path):
        return kernels.for_device(device).name


def measure(numel: int, world: int, reps: int, device: torch.device, paths: list[str]) -> dict:
    """Median seconds of copy and of each op under each path, on ``numel`` fp32 elements."""
    numel = -(-numel // (8 * world)) * 8 * world
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(numel, generator=gen).to(device)
    error0 = (0.1 * torch.randn(numel, generator=gen)).to(device)
    dst, buffer, error = torch.empty_like(src), torch.empty_like(src), torch.empty_like(src)
    chunk = numel // world
    packed = torch.randint(0, 256, (world, chunk // 8 + 4), generator=gen, dtype=torch.uint8)
    packed = packed.to(device)[:, : chunk // 8]  # rows strided, as in a received message
    scales = torch.rand(world, generator=gen).to(device)
    z = torch.empty(chunk, device=device)
    server_error = torch.zeros(chunk, device=device)

    def reset() -> None:
        buffer.copy_(src)
        error.copy_(error0)

    def run_compress() -> None:
        signs, s = compress_(buffer, error)
        subtract_compressed_(buffer, s, out=error, signs=signs)

    def run_server() -> None:  # one rank's share: its chunk, from every rank
        average_signs_(packed, scales, out=z)
        signs, sigma = compress_(z, server_error)
        subtract_compressed_(z, sigma, out=server_error, signs=signs)

    comm = CompressedAllreduce(numel, device=device)  # world size 1: no process group here
    cases = {
        "compress": (run_compress, reset),
        "decompress": (lambda: decompress_(packed, scales, dst), lambda: None),
        "server": (run_server, server_error.zero_),
        "call": (lambda: comm(src, out=dst), lambda: None),
    }
    times: dict[str, list[float]] = {"copy": []}
    for rep in range(reps + 1):  # the first repetition warms up and is dropped
        t = _timed(lambda: dst.copy_(src), device, lambda: None)
        if rep:
            times["copy"].append(t)
        for path in paths:
            with kernel_path(path):
                for op, (fn, before) in cases.items():
                    t = _timed(fn, device, before)
                    if rep:
                        times.setdefault(f"{path}/{op}", []).append(t)
    return {"numel": numel, **{key: statistics.median(ts) for key, ts in times.items()}}


def _size(text: str) -> int:
    text = text.strip().upper()
    if text[-1] in "KM":
        return int(float(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]])
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1M,4M,16M,64M", help="elements, K/M suffixes")
    parser.add_argument("--world", type=int, default=4, help="ranks for decompress and server")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--paths", default="auto", help="of auto, c, numpy, triton, torch")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    paths = args.paths.split(",")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(
        f"device {device} ({name}), torch {torch.__version__}, {args.threads} CPU thread(s), "
        f"world {args.world}, median of {args.reps}; "
        + ", ".join(f"{p} = {path_name(p, device)}" for p in paths if p == "auto")
    )
    print(f"{'elements':>9} {'copy ms':>8} {'copy GB/s':>9}  {'path':<7}" + "".join(
        f"{op:>22}" for op in OPS
    ) + "   (ratio to copy, GB/s)")  # fmt: skip
    rows = []
    for numel in map(_size, args.sizes.split(",")):
        r = measure(numel, args.world, args.reps, device, paths)
        nbytes = 4 * r["numel"]
        r["copy_GBps"] = nbytes / r["copy"] / 1e9
        for i, path in enumerate(paths):
            cells = []
            for op in OPS:
                t = r[f"{path}/{op}"]
                r[f"{path}/{op} ratio"] = t / r["copy"]
                r[f"{path}/{op} GBps"] = nbytes / t / 1e9
                cells.append(f"{t / r['copy']:>12.2f}x {nbytes / t / 1e9:>5.1f} GB/s")
            lead = (
                f"{r['numel']:>9} {1e3 * r['copy']:>8.3f} {r['copy_GBps']:>9.1f}"
                if i == 0
                else " " * 28
            )
            print(f"{lead}  {path_name(path, device):<7}" + "".join(cells))
        rows.append(r)
    if args.json:
        meta = {
            "device": str(device),
            "name": name,
            "threads": args.threads,
            "world": args.world,
            "reps": args.reps,
            "torch": torch.__version__,
            "paths": {p: path_name(p, device) for p in paths},
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
