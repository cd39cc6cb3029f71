"""What each collective of a step waits on a link with a round trip: gloo's small messages timed
on emulated hosts.

    sudo python benchmarks/link_latency.py                   # 4 hosts, 1 Gbit/s, 50 ms each way

A compressed exchange is an ``all_to_all_single`` and an all-gather, DDP's bucket an
``all_reduce``. gloo sends a message only once its receiver has said it is ready for it, so
each message it waits on costs a round trip ``r`` of the link, however small: its all-to-all
sends every message at once (``r``), its all-gather passes them round a ring (``(n - 1) r``),
and its all-reduce reduces and then gathers round it (``2 (n - 1) r``). This prints the median
of ``--repeats`` calls of each, with a 4 KiB message per rank, beside those multiples of the
round trip.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from netem import Network, link_name, namespaces_available, parse_delay, parse_rate

PORT = 29612
COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_reduce", "barrier")


def worker(repeats: int, numel: int) -> None:
    """One host: time each collective ``repeats`` times; rank 0 prints the medians."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    n = dist.get_world_size()
    x = torch.ones(numel * n)
    calls = {
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(x, x[:numel]),
        "all_reduce": lambda: dist.all_reduce(x[:numel]),
        "barrier": dist.barrier,
    }
    for name in COLLECTIVES:
        times = []
        for _ in range(repeats + 1):  # the first opens the connections
            dist.barrier()
            start = time.perf_counter()
            calls[name]()
            times.append(time.perf_counter() - start)
        if dist.get_rank() == 0:
            print(f"{name} {statistics.median(times[1:])}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--delay", default="50ms", help="each way")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    numel = 1024  # fp32: 4 KiB a rank
    if args.worker:
        worker(args.repeats, numel)
        return
    available, why = namespaces_available()
    if not available:
        sys.exit(f"link_latency.py needs the emulated network: {why}")
    delay, bits = parse_delay(args.delay), parse_rate(args.rate)
    network = Network(args.hosts, delay, prefix="latnet")  # beside whole_run.py's
    try:
        network.setup()
        network.set_rate(bits)
        argv = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--repeats",
            str(args.repeats),
        ]
        procs = [
            subprocess.Popen(
                network.command(rank, argv),
                env=network.worker_env(rank, PORT),
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(args.hosts)
        ]
        try:
            out = procs[0].communicate(timeout=600)[0]
            codes = [p.wait(timeout=60) for p in procs]
        finally:
            for p in procs:
                p.kill()
        if any(codes):
            sys.exit(f"link_latency.py: a worker failed (exit {codes})")
    finally:
        network.close()
    n = args.hosts
    hops = {"all_to_all_single": 1, "all_gather_into_tensor": n - 1, "all_reduce": 2 * (n - 1)}
    print(f"{n} hosts, {link_name(bits, delay)}, gloo, 4 KiB a rank, median of {args.repeats}\n")
    print("| collective | measured | round trips | their time |")
    print("| --- | ---: | ---: | ---: |")
    for line in out.split("\n"):
        if not line.strip():
            continue
        name, seconds = line.split()
        k = hops.get(name)
        expected = f"| {k} | {2e3 * k * delay:.0f} ms |" if k else "| | |"
        print(f"| `{name}` | {1e3 * float(seconds):.0f} ms {expected}")


if __name__ == "__main__":
    main()
