"""Time the 1-bit compression kernels against a plain fp32 copy of the same buffer.

    python benchmarks/kernels.py                  # CPU, 1M-64M elements, 1 thread
    python benchmarks/kernels.py --device cuda    # on a GPU: also GB/s against its copy bandwidth

For each size, one repetition times, one after the other on the same buffers:

* ``copy``: ``dst.copy_(src)`` of the fp32 buffer, the memory-speed yardstick;
* ``compress``: what a worker does per bucket: add the error, take the scale, take the signs, pack
  them 8 per byte (:func:`onebit.compress.compress_`), then update the error
  (:func:`onebit.compress.subtract_compressed_`);
* ``decompress``: rebuild the fp32 buffer from ``world`` packed chunks and their scales
  (:func:`onebit.compress.decompress_`);
* ``server``: one rank's server share for ``world`` ranks: average the ``world`` signed
  chunks of ``numel / world`` elements, add the server error, compress, update the error.

Each case is timed right after an untimed run of itself (so all start with the same warm
caches: a 1M-element copy runs from L3), and is reported as the median over repetitions and as a
ratio to the copy's median, so machine noise cancels (the 2-core VM this was tuned on is shared). ``--torch-path`` also times the
whole-tensor torch formulation that CUDA runs (on the CPU it is what the library did before the
numpy kernels). Writes ``--json`` if given.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from onebit import compress
from onebit.compress import average_signs_, compress_, decompress_, subtract_compressed_


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
def _torch_path(enabled: bool):
    saved = compress.fast_path
    if enabled:
        compress.fast_path = lambda *tensors: False
    try:
        yield
    finally:
        compress.fast_path = saved


def measure(numel: int, world: int, reps: int, device: torch.device, torch_path: bool) -> dict:
    """Median seconds of copy, compress, decompress and server on ``numel`` fp32 elements."""
    numel = -(-numel // (8 * world)) * 8 * world
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(numel, generator=gen).to(device)
    error0 = (0.1 * torch.randn(numel, generator=gen)).to(device)
    dst, buffer, error = torch.empty_like(src), torch.empty_like(src), torch.empty_like(src)
    chunk = numel // world
    packed = torch.randint(0, 256, (world, chunk // 8 + 4), generator=gen, dtype=torch.uint8)
    packed = packed.to(device)
    scales = torch.rand(world, generator=gen).to(device)
    z = torch.empty(chunk, device=device)
    server_error = torch.zeros(chunk, device=device)

    def reset() -> None:
        buffer.copy_(src)
        error.copy_(error0)

    def run_compress() -> None:
        packed, s = compress_(buffer, error)
        subtract_compressed_(buffer, s, out=error, signs=packed)

    def run_decompress() -> None:
        decompress_(packed[:, : chunk // 8], scales, dst)

    def run_server() -> None:  # one rank's share: its chunk, from every rank
        average_signs_(packed[:, : chunk // 8], scales, out=z)
        signs, sigma = compress_(z, server_error)
        subtract_compressed_(z, sigma, out=server_error, signs=signs)

    cases = {
        "copy": (lambda: dst.copy_(src), lambda: None),
        "compress": (run_compress, reset),
        "decompress": (run_decompress, lambda: None),
        "server": (run_server, lambda: server_error.zero_()),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    if torch_path:
        times.update({f"{name} (torch path)": [] for name in cases if name != "copy"})
    for rep in range(reps + 1):  # the first repetition warms up and is dropped
        for name, (fn, before) in cases.items():
            t = _timed(fn, device, before)
            if rep:
                times[name].append(t)
            if torch_path and name != "copy":
                with _torch_path(True):
                    t = _timed(fn, device, before)
                if rep:
                    times[f"{name} (torch path)"].append(t)
    return {"numel": numel, **{name: statistics.median(ts) for name, ts in times.items()}}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1M,4M,16M,64M", help="elements, K/M suffixes")
    parser.add_argument("--world", type=int, default=4, help="ranks for decompress and server")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--torch-path", action="store_true", help="also time the torch path")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = [int(float(s[:-1]) * {"K": 1 << 10, "M": 1 << 20}[s[-1]]) if s[-1] in "KM" else int(s)
             for s in args.sizes.upper().split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    print(f"device {device} ({name}), torch {torch.__version__}, {args.threads} CPU thread(s), "
          f"world {args.world}, median of {args.reps}, CPU numpy kernels: "
          f"{compress.fast_path(torch.zeros(8)) and device.type == 'cpu'}")
    rows = []
    ops = ["compress", "decompress", "server"]
    if args.torch_path:
        ops += [f"{op} (torch path)" for op in ops]
    header = f"{'elements':>9} {'copy ms':>8} {'copy GB/s':>9} " + " ".join(
        f"{op:>22}" for op in ops
    )
    print(header + "   (ratio to copy; GB/s of fp32 input)")
    for numel in sizes:
        r = measure(numel, args.world, args.reps, device, args.torch_path)
        nbytes = 4 * r["numel"]
        r["copy_GBps"] = nbytes / r["copy"] / 1e9  # fp32 bytes copied per second
        cells = []
        for op in ops:
            r[f"{op} ratio"] = r[op] / r["copy"]
            r[f"{op} GBps"] = nbytes / r[op] / 1e9
            cells.append(f"{r[op] / r['copy']:>7.2f}x {nbytes / r[op] / 1e9:>6.1f} GB/s  ")
        print(f"{r['numel']:>9} {1e3 * r['copy']:>8.3f} {r['copy_GBps']:>9.1f} " + " ".join(cells))
        rows.append(r)
    if args.json:
        meta = {"device": str(device), "name": name, "threads": args.threads, "world": args.world,
                "reps": args.reps, "torch": torch.__version__}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
