"""Data-parallel training over an emulated, bandwidth-limited network: onebit against DDP.

    sudo python benchmarks/network.py                 # 4 hosts, 100 Mbit/s, 1 and 10 Gbit/s
    sudo python benchmarks/network.py --quick         # a fast check: 1 rate, few steps
    python benchmarks/network.py --hosts 8 --rates 1gbit --models comm --methods adamw,onebit
    sudo python benchmarks/network.py --hosts 2 --shard 2 --rates 100mbit,1gbit   # HSDP

Each emulated host is a Linux network namespace (``obnet-h0``, ``obnet-h1``...) with one veth
link to a bridge in its own namespace (``obnet-br``), address ``10.77.0.(k+1)/24``; nothing is
routed anywhere else. Every link is limited to the chosen rate in both directions with ``tc tbf``:
on the host side of the veth (what the host sends) and on the bridge side (what it receives).
One training process runs in each namespace (gloo, ``GLOO_SOCKET_IFNAME=eth0``, master on host
0). The bytes each host really sent are read from its interface counters (``/proc/net/dev``
inside its namespace), so they include what our own accounting could miss (headers, gloo's
protocol, retransmissions).

Methods, all on the same model, batch and data:

* ``compute``: forward, backward and an AdamW step with no communication: the physical floor,
  measured both first and last in its launch (the median over both), since other load on the
  machine changes during a launch;
* ``adamw``: ``DistributedDataParallel`` (fp32 bucketed allreduce overlapped with backward) and
  ``torch.optim.AdamW``: what users run today;
* ``fp16``: the same with torch's ``fp16_compress_hook``;
* ``powersgd``: the same with torch's PowerSGD hook (rank ``--powersgd-rank``, error feedback,
  warm start). On gloo, with more than one DDP bucket, the hook dies of a collective mismatch
  (its second and third allreduces start from future callbacks, in an order that differs
  between ranks), so it runs in a launch of its own, and ``powersgd-1b`` runs it again with all
  gradients in one DDP bucket, where it works;
* ``onebit-warmup`` / ``onebit``: :class:`onebit.OnebitAdam` in its warmup (fp32 allreduce of
  the gradients) and in its compression stage (1-bit allreduce of the momentum);
* ``zero-one-a`` / ``zero-one``: :class:`onebit.ZeroOneAdam` in phase A (1-bit allreduce of the
  gradient, the rare fp32 variance steps left out) and in phase B at its steady state, one sync
  every ``--local-steps`` steps (timed as the mean over whole sync periods, since the median
  would be a local step);
* ``lamb-warmup`` / ``onebit-lamb``: :class:`onebit.OnebitLamb` in warmup and compression.

With ``--shard S`` every host runs ``S`` workers, and the model is sharded by FSDP2 over the
workers of a host, which talk over the host's loopback, unlimited (a node's fast link); only
traffic between hosts crosses the limited links. Its methods (the default with ``--shard``):

* ``hsdp-adamw``: torch's HSDP, ``fully_shard`` on the 2-D mesh with AdamW: reduce-scatter inside
  the host, an fp32 allreduce of each shard between hosts;
* ``hsdp-onebit-warmup`` / ``hsdp-onebit``: ``fully_shard`` inside the host and
  :class:`onebit.OnebitAdam` across hosts (:mod:`onebit.fsdp`), in its warmup and compression
  stage. Their speedups are against ``hsdp-adamw``.

Per method and rate it prints the step time (median over ``--steps`` steps after warmup),
samples/s, speedup over AdamW+DDP, ratio to compute only, wire bytes sent per step per host and
per parameter, and the end-to-end speedup of a run that spends 15% of its steps in warmup.
Writes ``--out``/network.json and a plot of step time against bandwidth per method.

Needs root for namespaces and ``tc``. Without root, or without ``ip``/``tc``, it says so and runs
all hosts over plain loopback, unlimited, where wire bytes are the loopback total divided by the
number of hosts. Namespaces are removed on exit, even on failure, and leftovers of an earlier run
are removed first.

The emulation is in ``netem.py``, the methods in ``network_methods.py``, the tables and plot in
``network_report.py``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from machine import cpu_name
from netem import INTERFACE, Network, namespaces_available, parse_rate, rate_name, tx_bytes
from network_methods import HSDP, METHODS, MODELS, build
from network_report import derive, plot, print_table, write_json

PORT = 29577


# ----------------------------------------------------------------------------------------------
# The worker: one per host.


def _measure(method: str, model_name: str, rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``method`` on ``model_name`` for its plan's steps: the step times and bytes sent."""
    import torch
    import torch.distributed as dist

    module, optimizer, plan = build(method, model_name, args)
    spec = MODELS[model_name]
    numel = sum(p.numel() for p in module.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    total = plan.warmup + plan.measured
    shape = (spec["batch"], spec["block_size"])
    batches = [
        (torch.randint(0, 256, shape, generator=gen), torch.randint(0, 256, shape, generator=gen))
        for _ in range(total)
    ]
    durations, stages = [], []
    dist.barrier()
    tx_start = tx_bytes(args.interface)
    skipped_start = 0
    for i, (x, y) in enumerate(batches):
        if i == plan.warmup:
            dist.barrier()
            tx_start = tx_bytes(args.interface)
            skipped_start = _skipped(optimizer)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        _, loss = module(x, y)
        loss.backward()
        optimizer.step()
        durations.append(time.perf_counter() - start)
        stats = getattr(optimizer, "comm_stats", None)
        stages.append(stats.last_step_stage if stats is not None else "")
    dist.barrier()
    tx = tx_bytes(args.interface) - tx_start
    measured = durations[plan.warmup :]
    result = {
        "params": numel,
        "step_times": measured,
        "stages": stages[plan.warmup :],
        "step_time": statistics.fmean(measured) if plan.mean else statistics.median(measured),
        "mean_step_time": statistics.fmean(measured),
        "tx_bytes_per_step": tx / plan.measured,
        "batch": spec["batch"],
        "skipped_steps": _skipped(optimizer) - skipped_start,  # must be 0: see network_methods.EPS
    }
    del module, optimizer, batches
    return result


def _skipped(optimizer: Any) -> int:
    """Steps the optimizer skipped or dropped for non-finite values so far."""
    return getattr(optimizer, "skipped_steps", 0) + getattr(optimizer, "local_skipped_steps", 0)


def _combine(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One result from two runs of the same method (compute-only runs first and last, so that
    the floor sees the machine's load over the whole launch, like the methods between)."""
    times = first["step_times"] + second["step_times"]
    tx = (first["tx_bytes_per_step"] + second["tx_bytes_per_step"]) / 2
    return {
        **second,
        "step_times": times,
        "stages": first["stages"] + second["stages"],
        "skipped_steps": first["skipped_steps"] + second["skipped_steps"],
        "step_time": statistics.median(times),
        "mean_step_time": statistics.fmean(times),
        "tx_bytes_per_step": tx,
    }


def worker(args: argparse.Namespace) -> None:
    """One training process: runs every (model, method) pair, writes its results as JSON."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    rank, world = args.rank, args.hosts * args.shard
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:{args.port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=args.timeout),
    )
    results: dict[str, dict[str, Any]] = {}
    try:
        for model_name in args.models.split(","):
            for method in args.methods.split(","):
                key = f"{model_name}/{method}"
                try:
                    result = _measure(method, model_name, rank, args)
                    if key in results and "error" not in results[key]:
                        result = _combine(results[key], result)
                    results[key] = result
                except NotImplementedError as err:
                    results[key] = {"error": str(err)}
                except Exception as err:  # report, e.g. a hook that gloo does not support
                    # Failures that happen alike on every rank (the usual case) leave the group
                    # usable; one that leaves a collective half done ends in the timeout.
                    results[key] = {"error": f"{type(err).__name__}: {err}"}
                    print(f"  rank {rank}: {key} failed: {results[key]['error']}", flush=True)
                if rank == 0 and "error" not in results[key]:
                    r = results[key]
                    skipped = f", {r['skipped_steps']} steps SKIPPED" if r["skipped_steps"] else ""
                    print(
                        f"  {key}: {r['step_time']:.3f} s/step, "
                        f"{r['tx_bytes_per_step'] / 1e6:.2f} MB/step sent{skipped}",
                        flush=True,
                    )
                with open(Path(args.result_dir) / f"rank{rank}.json", "w") as f:
                    json.dump(results, f)
    finally:
        with open(Path(args.result_dir) / f"rank{rank}.json", "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# The orchestrator.


def _launch(
    args: argparse.Namespace,
    network: Network | None,
    port: int,
    models: list[str],
    methods: list[str],
    result_dir: str,
) -> bool:
    """Run one worker per host on ``models`` x ``methods`` and wait; return whether all exited
    cleanly."""
    script = str(Path(__file__).resolve())
    master = Network.address(0) if network else "127.0.0.1"
    interface = INTERFACE if network else "lo"
    procs = []
    for rank in range(args.hosts * args.shard):
        k = rank // args.shard  # the host: its workers share its namespace
        argv = [
            sys.executable, script, "--worker", "--rank", str(rank), "--hosts", str(args.hosts),
            "--shard", str(args.shard),
            "--master", master, "--port", str(port), "--interface", interface,
            "--models", ",".join(models), "--methods", ",".join(methods),
            "--steps", str(args.steps),
            "--threads", str(args.threads), "--powersgd-rank", str(args.powersgd_rank),
            "--local-steps", str(args.local_steps), "--result-dir", result_dir,
            "--timeout", str(args.timeout), *([] if args.overlap else ["--no-overlap"]),
        ]  # fmt: skip
        env = dict(os.environ, GLOO_SOCKET_IFNAME=interface, OMP_NUM_THREADS=str(args.threads))
        cmd = network.command(k, argv) if network else argv
        stdout = None if rank == 0 else subprocess.DEVNULL
        with open(Path(result_dir) / f"rank{rank}.err", "w") as stderr:
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
            )
    # PowerSGD's collective mismatch may hang instead of crash: give its launches less time.
    limit = args.timeout * (1 if any(METHODS[m].launch == "alone" for m in methods) else 4)
    deadline = time.monotonic() + limit
    ok = True
    try:
        for p in procs:
            remaining = max(1.0, deadline - time.monotonic())
            if p.wait(timeout=remaining) != 0:
                ok = False
    except subprocess.TimeoutExpired:
        ok = False
        with open(Path(result_dir) / "rank0.err", "a") as f:
            f.write(f"\nError: workers hung; killed after {limit:.0f} s\n")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return ok


def _first_error(result_dir: str, hosts: int) -> str:
    """The first line of the workers' stderr that says what killed one of them."""
    for marker in ("what():", "Error"):
        for k in range(hosts):
            path = Path(result_dir) / f"rank{k}.err"
            for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
                if marker in line:
                    return line.strip()
    return "unknown (no error on stderr)"


def _launch_groups(models: list[str], methods: list[str]) -> list[tuple[list[str], list[str]]]:
    """``(models, methods)`` per launch: methods that may kill their worker (PowerSGD on gloo)
    run alone, once per model, so that a crash loses nothing else."""
    risky = [m for m in methods if METHODS[m].launch == "alone"]
    safe = [m for m in methods if m not in risky]
    if len(safe) > 1:  # the floor again at the end: see _combine
        safe += [m for m in dict.fromkeys(safe) if METHODS[m].launch == "twice"]
    groups = [(models, safe)] if safe else []
    return groups + [([model], [m]) for m in risky for model in models]


def _collect(result_dir: str, hosts: int, per_host_divisor: int) -> dict[str, dict[str, Any]]:
    """Merge the ranks' files: rank 0's timings, every host's bytes (mean and max)."""
    ranks = []
    for k in range(hosts):
        path = Path(result_dir) / f"rank{k}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else {})
    merged = {}
    for key, r0 in ranks[0].items():
        if "error" in r0:
            merged[key] = r0
            continue
        sent = [r[key]["tx_bytes_per_step"] / per_host_divisor for r in ranks if key in r]
        merged[key] = {
            **{k: v for k, v in r0.items() if k != "tx_bytes_per_step"},
            "tx_bytes_per_step": statistics.fmean(sent),
            "tx_bytes_per_step_max": max(sent),
            "step_time_ranks": [r[key]["step_time"] for r in ranks if key in r],
        }
    return merged


def main() -> None:
    """The command: parse the flags, then run as a worker, redraw the plot, or run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rates", default="100mbit,1gbit,10gbit", help="comma separated")
    parser.add_argument("--models", default="comm,gpt", help=f"of {sorted(MODELS)}")
    parser.add_argument(
        "--methods", help="comma separated (default: all but the hsdp- ones; with --shard, those)"
    )
    parser.add_argument(
        "--shard",
        type=int,
        default=1,
        metavar="S",
        help="S workers per host, the model sharded by FSDP2 over them (HSDP)",
    )
    parser.add_argument("--steps", type=int, default=5, help="measured steps per method")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument(
        "--local-steps",
        type=int,
        default=16,
        help="ZeroOneAdam's local_step_clipper H: one sync every H steps",
    )
    parser.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="do not pass overlap_backward=True to the onebit optimizers that take it",
    )
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument(
        "--timeout",
        type=float,
        default=300,
        help="seconds a collective may wait; a rate's run gets 4x this",
    )
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON and PNG")
    parser.add_argument("--tag", default="network", help="file name stem of the outputs")
    parser.add_argument("--loopback", action="store_true", help="skip namespaces even as root")
    parser.add_argument(
        "--replot", action="store_true", help="only redraw the plot from --out/--tag .json"
    )
    parser.add_argument(
        "--quick", action="store_true", help="fast check: 1 Gbit/s only, 3 steps, H=4"
    )
    # Internal: worker mode.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--interface", default="lo", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.replot:
        path = Path(args.out) / f"{args.tag}.json"
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return
    if args.quick:
        args.rates, args.steps, args.local_steps = "1gbit", 3, 4
    if args.methods is None:
        methods = ["compute", *HSDP] if args.shard > 1 else [m for m in METHODS if m not in HSDP]
        args.methods = ",".join(methods)
    for name in args.models.split(","):
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    for name in args.methods.split(","):
        if name not in METHODS:
            parser.error(f"unknown method {name!r}; choose from {list(METHODS)}")

    available, why = (False, "--loopback") if args.loopback else namespaces_available()
    network = Network(args.hosts) if available else None
    if network is None:
        print(
            f"NOTE: no emulated network ({why}): all hosts share plain loopback, unlimited; "
            "wire bytes are the loopback total divided by the number of hosts."
        )
        rates: list[float | None] = [None]
    else:
        rates = [parse_rate(r) for r in args.rates.split(",")]
        atexit.register(Network.cleanup)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *_: sys.exit(1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python", *sys.argv]),
        "hosts": args.hosts,
        "workers_per_host": args.shard,
        "models": args.models.split(","),
        "model_specs": {m: MODELS[m] for m in args.models.split(",")},
        "threads_per_worker": args.threads,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "network": "netns + veth + bridge + tbf" if network else f"loopback ({why})",
        "powersgd_rank": args.powersgd_rank,
        "local_steps": args.local_steps,
        "overlap_backward": args.overlap,
        "runs": [],
    }
    started = time.monotonic()
    try:
        if network:
            network.setup()
        for index, rate in enumerate(rates):
            if network and rate is not None:
                network.set_rate(rate)
            per_host = f" of {args.shard} workers" if args.shard > 1 else ""
            print(f"\n== {rate_name(rate)}, {args.hosts} hosts{per_host} ==", flush=True)
            rows, ok = {}, True
            groups = _launch_groups(results["models"], args.methods.split(","))
            for group, (models, methods) in enumerate(groups):
                with tempfile.TemporaryDirectory() as result_dir:
                    os.chmod(result_dir, 0o777)
                    port = args.port + 20 * index + group
                    launched = _launch(args, network, port, models, methods, result_dir)
                    workers = args.hosts * args.shard
                    part = _collect(result_dir, workers, 1 if network else workers)
                    died = "" if launched else _first_error(result_dir, workers)
                for model in models:
                    for method in methods:
                        key = f"{model}/{method}"
                        if key not in part or (not launched and "error" in part[key]):
                            part[key] = {"error": f"a worker died: {died}"}
                rows.update(part)
                ok = ok and launched
            for model in results["models"]:
                derive(rows, model, args.hosts * args.shard)
                print(f"\n{model} @ {rate_name(rate)}:")
                print(print_table(rows, model))
            results["runs"].append(
                {"rate_bits": rate, "rate": rate_name(rate), "ok": ok, "rows": rows}
            )
            write_json(results, out / f"{args.tag}.json")
    finally:
        if network:
            Network.cleanup()
    results["wall_s"] = time.monotonic() - started
    write_json(results, out / f"{args.tag}.json")
    if network and len(rates) > 1:
        plot(results, out / f"{args.tag}.png")
        print(f"\nplot: {out / f'{args.tag}.png'}")
    print(f"results: {out / f'{args.tag}.json'} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
