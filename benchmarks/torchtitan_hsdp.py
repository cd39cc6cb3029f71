"""torchtitan's HSDP with AdamW against onebit's trainer with 1-bit Adam, on emulated hosts over a
slow network: step times before and after the freeze, and bytes across the replicate dimension.

    sudo python benchmarks/torchtitan_hsdp.py                      # 4 hosts, 1 Gbit/s, 2 x 2
    sudo python benchmarks/torchtitan_hsdp.py --ranks-per-host 2 --hosts 2   # nodes of 2 ranks
    python benchmarks/torchtitan_hsdp.py --local --device cuda --ranks-per-host 2 --shards 1

Each rank runs torchtitan's own ``Trainer`` (AdamW, HSDP on the 2-D mesh) or onebit's
``OnebitTrainer`` (FSDP2 on the shard mesh, 1-bit Adam across replicas) on torchtitan's debug
Llama (6.2M parameters, sequences of 64, 2 a rank), with the same seed and data, inside an
emulated host (``benchmarks/netem.py``: a network namespace, its link limited with ``tc tbf``).
Ranks of one host share it, as the GPUs of a node share its fast link. The mesh is
``--hosts * --ranks-per-host / --shards`` replicas x ``--shards`` shards, rank-major, so that a
host's ranks hold one replica's shards whenever ``--shards`` equals ``--ranks-per-host``.

It reports each run's mean step time over the warmup's steps and over the compression stage's
(the first two steps of each left out), with AdamW's over the same steps; the bytes one rank sent
across replicas (onebit's own count; AdamW's is its fp32 shard per step); and the bytes host 0's
link sent. torchtitan runs on the CPU with the tests' shims (``tests/torchtitan_cpu.py``). Needs
root (namespaces, ``tc``), except with ``--local``: every rank on this machine's loopback, with no
emulated network, on ``--device cuda`` ranks sharing the one GPU over gloo (what
``benchmarks/gpu_check.py``'s ``torchtitan`` part runs).
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

from netem import INTERFACE, Network, namespaces_available, parse_rate, rate_name, tx_bytes

PORT = 29631
ROOT = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> None:
    """One rank: build the run's config, train, and (rank 0) write what each step did."""
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "tests"))
    import torchtitan_cpu

    dist.init_process_group("gloo")
    torchtitan_cpu.patch_for_the_cpu(cpu=args.device == "cpu")
    world = dist.get_world_size()
    replicas = world // args.shards
    options: dict[str, Any] = {"replicas": replicas, "shards": args.shards, "steps": args.steps}
    if args.optimizer == "onebit-adam":
        from onebit.integrations.torchtitan import OnebitTrainer, onebit_optimizer

        optimizer = onebit_optimizer("OnebitAdam", freeze_step=args.freeze)
        options.update(optimizer=optimizer, trainer=OnebitTrainer)
    config = torchtitan_cpu.debug_config(Path(args.assets), args.dump, **options)
    config.metrics.log_freq = args.steps

    def observe(trainer: Any) -> dict[str, Any]:
        seen: dict[str, Any] = {"time": time.perf_counter()}
        if hasattr(trainer.optimizers, "onebit"):
            stats = trainer.optimizers.onebit.comm_stats
            seen.update(stage=stats.last_step_stage, bytes=stats.bytes_total)
            seen.update(fp32_bytes=stats.fp32_bytes_total)
        return seen

    start = time.perf_counter()
    steps = torchtitan_cpu.train(config, observe)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"start": start, "steps": steps}))
    dist.destroy_process_group()


def _wire_bytes(network: Network, k: int) -> int:
    dev = subprocess.run(
        network.command(k, ["cat", "/proc/net/dev"]), capture_output=True, text=True, check=True
    ).stdout
    return tx_bytes(INTERFACE, dev)


def run_one(network: Network | None, args: argparse.Namespace, optimizer: str, out: Path) -> dict:
    """One run of every rank (on ``network``'s hosts, or all here); rank 0's steps and host 0's
    wire bytes."""
    world = args.hosts * args.ranks_per_host
    result = out / f"{optimizer}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--optimizer", optimizer]
    argv += ["--assets", str(out / "assets"), "--dump", str(out / optimizer), "--result"]
    argv += [str(result), "--steps", str(args.steps), "--freeze", str(args.freeze)]
    argv += ["--shards", str(args.shards), "--device", args.device]
    sent_before = _wire_bytes(network, 0) if network else 0
    procs = []
    for rank in range(world):
        host = rank // args.ranks_per_host
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank % args.ranks_per_host),
            WORLD_SIZE=str(world),
            MASTER_ADDR=Network.address(0) if network else "127.0.0.1",
            MASTER_PORT=str(PORT),
            OMP_NUM_THREADS="1",
        )
        if network:
            env["GLOO_SOCKET_IFNAME"] = INTERFACE
        log = open(out / f"{optimizer}.rank{rank}.log", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                network.command(host, argv) if network else argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        log.close()
    deadline = time.perf_counter() + args.timeout
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.perf_counter())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [-1]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if any(codes):
        tail = (out / f"{optimizer}.rank0.log").read_text()[-3000:]
        raise RuntimeError(f"{optimizer}: a rank failed or hung (exit {codes}):\n{tail}")
    run = json.loads(result.read_text())
    run["wire_bytes_host0"] = _wire_bytes(network, 0) - sent_before if network else 0
    return run


def _mean_step(run: dict, first: int, last: int) -> float:
    """Mean seconds of steps ``first`` to ``last - 1`` (0-based; each step's time is from the
    end of the one before)."""
    times = [run["start"]] + [s["time"] for s in run["steps"]]
    return (times[last] - times[first]) / (last - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", default="adamw", help=argparse.SUPPRESS)
    parser.add_argument("--assets", help=argparse.SUPPRESS)
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--shards", type=int, default=2, help="ranks that shard one replica")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--freeze", type=int, default=16, help="1-bit Adam's freeze_step")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--out", default="runs/torchtitan-hsdp")
    parser.add_argument("--local", action="store_true", help="no emulated network")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    available, why = namespaces_available()
    if not available and not args.local:
        sys.exit(f"torchtitan_hsdp.py needs the emulated network (or --local): {why}")
    sys.path.insert(0, str(ROOT / "tests"))
    import torchtitan_cpu

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    torchtitan_cpu.write_assets(out / "assets")
    network = None if args.local else Network(args.hosts)
    try:
        if network:
            network.setup()
            network.set_rate(parse_rate(args.rate))
        runs = {name: run_one(network, args, name, out) for name in ("adamw", "onebit-adam")}
    finally:
        if network:
            Network.cleanup()
    world = args.hosts * args.ranks_per_host
    layout = f"{world // args.shards} replicas x {args.shards} shards"
    warm, frozen = (2, args.freeze), (args.freeze + 2, args.steps)
    adamw, ours = runs["adamw"], runs["onebit-adam"]
    sent = {"adamw": ours["steps"][-1]["fp32_bytes"], "onebit-adam": ours["steps"][-1]["bytes"]}
    lines = [
        f"{'loopback' if args.local else rate_name(parse_rate(args.rate))}, {args.device}, "
        f"{args.hosts} hosts x {args.ranks_per_host} "
        f"ranks, {layout}, {args.steps} steps, 1-bit Adam frozen at {args.freeze}",
        "",
        "| run | step, warmup | step, compression | sent across replicas, one rank "
        "| host 0's link sent |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, run in runs.items():
        lines.append(
            f"| {name} | {_mean_step(run, *warm) * 1e3:.0f} ms "
            f"| {_mean_step(run, *frozen) * 1e3:.0f} ms | {sent[name] / 1e6:.1f} MB "
            f"| {run['wire_bytes_host0'] / 1e6:.1f} MB |"
        )
    lines += [
        "",
        "AdamW's bytes across replicas are its fp32 shards, one a step (onebit's count of what an "
        "fp32 all-reduce sends). Speedup of a step: "
        f"{_mean_step(adamw, *warm) / _mean_step(ours, *warm):.2f}x in the warmup, "
        f"{_mean_step(adamw, *frozen) / _mean_step(ours, *frozen):.2f}x after the freeze; "
        f"{sent['adamw'] / sent['onebit-adam']:.1f}x fewer bytes across replicas.",
    ]
    text = "\n".join(lines) + "\n"
    (out / "torchtitan-hsdp.md").write_text(text)
    (out / "torchtitan-hsdp.json").write_text(json.dumps({"args": vars(args), "runs": runs}))
    print(text)


if __name__ == "__main__":
    main()
