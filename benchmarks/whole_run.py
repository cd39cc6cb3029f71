"""A whole ``onebit train`` run on emulated hosts over a slow network, timed end to end.

    sudo python benchmarks/whole_run.py                       # 4 hosts, 100 Mbit/s and 1 Gbit/s
    sudo python benchmarks/whole_run.py --rates 1gbit -- --steps 60     # a fast check
    sudo python benchmarks/whole_run.py --rates 1gbit --delay 50ms      # a 100 ms round trip

For each link rate, each optimizer of ``--optimizers`` (default: AdamW + DDP against
``onebit train``'s defaults, 1-bit Adam with an int4 warmup and ``freeze_step="auto"``) runs
one whole ``onebit train`` with the same seed, data and samples: one worker per emulated host
(``benchmarks/netem.py``: a network namespace each, every link limited with ``tc tbf``; with
``--delay``, every packet held that long each way by ``netem_relay.py``), started
as ``torchrun`` would start them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``), one torch thread
each. Arguments after ``--`` go to every ``onebit train`` (model, data, steps...).

It reports, per rate and optimizer: the final validation loss, the launch's wall-clock time from
start to exit (imports, data, model, every step, every validation and the final one), the
training loop's own time (``summary.json``'s ``wall_time_s``), the speedup of each over AdamW +
DDP, the most bytes one rank sent by the optimizer's own count, the bytes host 0's link
really sent, and the rounds (collectives a step waited on). It writes
``OUT/whole-run.{json,md}``; each run's folder is ``OUT/<rate>/seed-<S>/<name>`` (with
``--delay``, ``OUT/<rate>-<delay>/...``), which ``benchmarks/convergence.py OUT/<rate> --network
RESULTS.json`` reads to model the same runs from per-stage step times, for the measured speedup
to be set against the modelled one.

Needs root (namespaces, ``tc``); without it, it says so and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from netem import (
    INTERFACE,
    Network,
    link_name,
    namespaces_available,
    parse_delay,
    parse_rate,
    tx_bytes,
)

PORT = 29611
ONEBIT = [sys.executable, "-m", "onebit.train"]


def _wire_bytes(network: Network, k: int) -> int:
    """Bytes host ``k``'s link has sent so far."""
    dev = subprocess.run(
        network.command(k, ["cat", "/proc/net/dev"]), capture_output=True, text=True, check=True
    ).stdout
    return tx_bytes(INTERFACE, dev)


def run_one(
    network: Network, optimizer: str, out: Path, extra: list[str], seed: int, timeout: float
) -> dict[str, Any]:
    """One ``onebit train --optimizer optimizer`` over every host; its figures."""
    hosts = network.hosts
    argv = [*ONEBIT, "--optimizer", optimizer, "--out", str(out), "--seed", str(seed)]
    argv += ["--no-progress", "--device", "cpu", *extra]
    sent_before = _wire_bytes(network, 0)
    relay_before = network.relay_cpu_s()
    procs = []
    start = time.perf_counter()
    for rank in range(hosts):
        log = open(out.parent / f"{out.name}.rank{rank}.log", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                network.command(rank, argv),
                env=network.worker_env(rank, PORT),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        log.close()
    try:
        codes = [p.wait(timeout=max(1.0, start + timeout - time.perf_counter())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [-1]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    elapsed = time.perf_counter() - start
    if any(codes):
        log = (out.parent / f"{out.name}.rank0.log").read_text()[-3000:]
        raise RuntimeError(f"{optimizer}: a worker failed or hung (exit {codes}):\n{log}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "optimizer": optimizer,
        "final_val_loss": summary["final_val_loss"],
        "launch_s": elapsed,
        "loop_s": summary["wall_time_s"],
        "bytes_per_rank": max(summary["bytes_sent_per_rank"]),
        "rounds": summary["rounds"],
        "wire_bytes_host0": _wire_bytes(network, 0) - sent_before,
        "relay_cpu_s": network.relay_cpu_s() - relay_before,
        "folder": str(out),
    }


def table(results: dict[str, Any]) -> str:
    """The markdown table of every rate's runs, with speedups over the first optimizer."""
    lines = [
        "| link | run | final val loss | whole launch | speedup | training loop | speedup "
        "| bytes per rank (own count) | bytes host 0 sent (wire) | rounds |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for rate, runs in results["rates"].items():
        base = runs[0]
        for r in runs:
            lines.append(
                f"| {rate} | {r['optimizer']} | {r['final_val_loss']:.4f} "
                f"| {r['launch_s']:.0f} s | {base['launch_s'] / r['launch_s']:.2f}x "
                f"| {r['loop_s']:.0f} s | {base['loop_s'] / r['loop_s']:.2f}x "
                f"| {r['bytes_per_rank'] / 1e6:.1f} MB | {r['wire_bytes_host0'] / 1e6:.1f} MB "
                f"| {r['rounds']:,} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rates", default="100mbit,1gbit", help="comma separated")
    parser.add_argument(
        "--optimizers",
        default="adamw,onebit-adam",
        help="onebit train --optimizer values; the first is the speedups' baseline",
    )
    parser.add_argument(
        "--delay", default="0", help="each way, on every link (50ms: a 100 ms round trip)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--out", default="runs/whole-run")
    parser.add_argument("extra", nargs="*", help="after --: arguments for onebit train")
    args = parser.parse_args()
    available, why = namespaces_available()
    if not available:
        sys.exit(f"whole_run.py needs the emulated network: {why}")
    out = Path(args.out)
    delay = parse_delay(args.delay)
    network = Network(args.hosts, delay)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python", *sys.argv]),
        "hosts": args.hosts,
        "delay_s": delay,
        "rates": {},
    }
    try:
        network.setup()
        for rate in args.rates.split(","):
            network.set_rate(parse_rate(rate))
            name = link_name(parse_rate(rate), delay)
            runs = []
            for optimizer in args.optimizers.split(","):
                link = f"{rate}-{args.delay}" if delay else rate
                folder = out / link / f"seed-{args.seed}" / optimizer
                folder.parent.mkdir(parents=True, exist_ok=True)
                print(f"{name}: {optimizer} ...", flush=True)
                runs.append(
                    run_one(network, optimizer, folder, args.extra, args.seed, args.timeout)
                )
                print(f"  {runs[-1]['launch_s']:.0f} s, loss {runs[-1]['final_val_loss']:.4f}")
            results["rates"][name] = runs
            (out / "whole-run.json").write_text(json.dumps(results, indent=1) + "\n")
    finally:
        network.close()
    text = table(results)
    (out / "whole-run.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
