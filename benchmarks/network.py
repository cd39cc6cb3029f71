"""Data-parallel training over an emulated, bandwidth-limited network: onebit against DDP.

    sudo python benchmarks/network.py                 # 4 hosts, 100 Mbit/s, 1 and 10 Gbit/s
    sudo python benchmarks/network.py --quick         # a fast check: 1 rate, few steps
    python benchmarks/network.py --hosts 8 --rates 1gbit --models comm --methods adamw,onebit

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

Per method and rate it prints the step time (median over ``--steps`` steps after warmup),
samples/s, speedup over AdamW+DDP, ratio to compute only, wire bytes sent per step per host and
per parameter, and the end-to-end speedup of a run that spends 15% of its steps in warmup.
Writes ``--out``/network.json and a plot of step time against bandwidth per method.

Needs root for namespaces and ``tc``. Without root, or without ``ip``/``tc``, it says so and runs
all hosts over plain loopback, unlimited, where wire bytes are the loopback total divided by the
number of hosts. Namespaces are removed on exit, even on failure, and leftovers of an earlier run
are removed first.
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from machine import cpu_name

PREFIX = "obnet"
SUBNET = "10.77.0"
BRIDGE_NS = f"{PREFIX}-br"
PORT = 29577
WARMUP_FRACTION = 0.15

MODELS: dict[str, dict[str, Any]] = {
    # Communication-bound: 25M parameters, 2 sequences of 32 tokens per worker.
    "comm": dict(block_size=32, n_layer=2, n_head=16, n_embd=1024, batch=2),
    # The same with 16 tokens per worker: communication-bound even at 1 Gbit/s.
    "comm-b1": dict(block_size=16, n_layer=2, n_head=16, n_embd=1024, batch=1),
    # The default `onebit train` model (0.84M parameters) and batch (16 x 128 tokens per worker).
    "gpt": dict(block_size=128, n_layer=4, n_head=4, n_embd=128, batch=16),
}

METHODS = [
    "compute",
    "adamw",
    "fp16",
    "powersgd",
    "powersgd-1b",
    "onebit-warmup",
    "onebit-warmup-bf16",
    "onebit-warmup-int8",
    "onebit-warmup-int4",
    "onebit",
    "zero-one-a",
    "zero-one",
    "lamb-warmup",
    "onebit-lamb",
]

LABELS = {
    "compute": "compute only (no comm)",
    "adamw": "AdamW + DDP (fp32)",
    "fp16": "DDP + fp16_compress_hook",
    "powersgd": "DDP + PowerSGD hook",
    "powersgd-1b": "DDP (1 bucket) + PowerSGD",
    "onebit-warmup": "OnebitAdam warmup",
    "onebit-warmup-bf16": "OnebitAdam warmup, bf16",
    "onebit-warmup-int8": "OnebitAdam warmup, int8",
    "onebit-warmup-int4": "OnebitAdam warmup, int4",
    "onebit": "OnebitAdam compression",
    "zero-one-a": "ZeroOneAdam phase A (1-bit)",
    "zero-one": "ZeroOneAdam phase B (local)",
    "lamb-warmup": "OnebitLamb warmup",
    "onebit-lamb": "OnebitLamb compression",
}

CLASSES = {
    "onebit-warmup": "OnebitAdam",
    "onebit-warmup-bf16": "OnebitAdam",
    "onebit-warmup-int8": "OnebitAdam",
    "onebit-warmup-int4": "OnebitAdam",
    "onebit": "OnebitAdam",
    "zero-one-a": "ZeroOneAdam",
    "zero-one": "ZeroOneAdam",
    "lamb-warmup": "OnebitLamb",
    "onebit-lamb": "OnebitLamb",
}

# Which stage a run of 15% warmup and 85% compression is made of, per method. 0/1 Adam's phase
# A mixes fp32 variance steps with 1-bit ones in proportions that depend on the run's length:
# benchmarks/convergence.py weights every stage by the steps real runs spent in it.
END_TO_END = {
    "onebit": ("onebit-warmup", "onebit"),
    "onebit-lamb": ("lamb-warmup", "onebit-lamb"),
}


def parse_rate(text: str) -> float:
    """``"100mbit"``, ``"1gbit"``, ``"2.5gbit"`` or bits/s as a number, to bits per second."""
    text = text.strip().lower()
    for suffix, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def rate_name(bits: float | None) -> str:
    if bits is None:
        return "loopback"
    if bits >= 1e9:
        return f"{bits / 1e9:g} Gbit/s"
    return f"{bits / 1e6:g} Mbit/s"


# ----------------------------------------------------------------------------------------------
# The emulated network (root only).


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Network:
    """``hosts`` namespaces on one bridge, each link limited with tbf in both directions."""

    def __init__(self, hosts: int) -> None:
        self.hosts = hosts
        self.namespaces = [f"{PREFIX}-h{k}" for k in range(hosts)]

    @staticmethod
    def cleanup() -> None:
        """Remove every namespace and stray veth of this benchmark (also an earlier run's)."""
        listing = _run("ip", "netns", "list", check=False).stdout.split("\n")
        for line in listing:
            name = line.split(" ")[0]
            if name.startswith(f"{PREFIX}-"):
                _run("ip", "netns", "pids", name, check=False)
                _run("ip", "netns", "del", name, check=False)
        links = _run("ip", "-o", "link", "show", check=False).stdout.split("\n")
        for line in links:
            parts = line.split(": ")
            if len(parts) > 1 and parts[1].split("@")[0].startswith(("obh", "obp")):
                _run("ip", "link", "del", parts[1].split("@")[0], check=False)

    def setup(self) -> None:
        self.cleanup()
        _run("ip", "netns", "add", BRIDGE_NS)
        _run("ip", "-n", BRIDGE_NS, "link", "set", "lo", "up")
        _run("ip", "-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", BRIDGE_NS, "link", "set", "br0", "up")
        for k, ns in enumerate(self.namespaces):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", f"obh{k}", "type", "veth", "peer", "name", f"obp{k}")
            _run("ip", "link", "set", f"obh{k}", "netns", ns)
            _run("ip", "link", "set", f"obp{k}", "netns", BRIDGE_NS)
            _run("ip", "-n", ns, "link", "set", f"obh{k}", "name", "eth0")
            _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{k + 1}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", BRIDGE_NS, "link", "set", f"obp{k}", "master", "br0")
            _run("ip", "-n", BRIDGE_NS, "link", "set", f"obp{k}", "up")

    def set_rate(self, bits: float) -> None:
        """Limit every link to ``bits``/s each way: tbf on both ends of each veth."""
        rate_bytes = bits / 8
        # The bucket must hold a GSO super-packet (64 KiB) and a few ms at the rate.
        burst = max(128 * 1024, int(rate_bytes * 0.004))
        args = ["root", "tbf", "rate", f"{int(bits)}bit", "burst", str(burst), "latency", "100ms"]
        for k, ns in enumerate(self.namespaces):
            _run("tc", "-n", ns, "qdisc", "replace", "dev", "eth0", *args)
            _run("tc", "-n", BRIDGE_NS, "qdisc", "replace", "dev", f"obp{k}", *args)

    def command(self, k: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[k], *argv]


def namespaces_available() -> tuple[bool, str]:
    """Whether this process can build the emulated network, and why not."""
    if os.geteuid() != 0:
        return False, "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' not found (apt-get install iproute2)"
    probe = f"{PREFIX}-probe"
    _run("ip", "netns", "del", probe, check=False)
    result = _run("ip", "netns", "add", probe, check=False)
    _run("ip", "netns", "del", probe, check=False)
    if result.returncode:
        return False, f"ip netns add failed: {result.stderr.strip()}"
    return True, ""


# ----------------------------------------------------------------------------------------------
# The worker: one per host.


def _tx_bytes(interface: str) -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == interface:
                return int(fields.split()[8])
    raise RuntimeError(f"interface {interface} not in /proc/net/dev")


@dataclass
class Plan:
    """How many steps to run before measuring, how many to measure, and how to summarise."""

    warmup: int
    measured: int
    mean: bool = False  # mean over the measured steps (whole sync periods) instead of median


def _build(method: str, model_name: str, world: int, args: argparse.Namespace):
    """``(module to run, optimizer, plan)`` for ``method``; the model is seeded identically on
    every rank."""
    import torch
    from torch import nn

    import onebit
    from onebit.train.model import ModelConfig, Transformer

    spec = MODELS[model_name]
    torch.manual_seed(0)
    config = ModelConfig("gpt", spec["block_size"], spec["n_layer"], spec["n_head"], spec["n_embd"])
    model = Transformer(config)
    params = model.parameters()
    # The variance is frozen after 1-4 steps here, to reach each stage quickly. Embedding rows
    # no batch has touched yet then have v = 0, and eps = 1e-8 would divide their later momentum
    # by 1e-8 until the weights overflow and steps are skipped. eps = 1e-3 keeps every update
    # finite; it changes no byte sent and no kernel's cost.
    steps, lr, eps = args.steps, 1e-4, 1e-3
    if method in ("compute", "adamw", "fp16", "powersgd", "powersgd-1b"):
        optimizer = torch.optim.AdamW(params, lr=lr, eps=eps)
        if method == "compute":
            return model, optimizer, Plan(1, steps)
        one_bucket = {"bucket_cap_mb": 1 << 14} if method == "powersgd-1b" else {}
        ddp = nn.parallel.DistributedDataParallel(model, **one_bucket)
        if method == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        if method in ("powersgd", "powersgd-1b"):
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=args.powersgd_rank,
                start_powerSGD_iter=2,
                use_error_feedback=True,
                warm_start=True,
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            return ddp, optimizer, Plan(3, steps)
        return ddp, optimizer, Plan(2, steps)
    cls = getattr(onebit, CLASSES[method], None)
    if cls is None:
        raise NotImplementedError(f"onebit.{CLASSES[method]} does not exist in this version")
    # Overlap communication with backward where the optimizer offers it, as DDP does.
    extra: dict[str, Any] = {"eps": eps}
    if args.overlap and "overlap_backward" in inspect.signature(cls).parameters:
        extra["overlap_backward"] = True
    if method.startswith("onebit-warmup"):
        bits = method.removeprefix("onebit-warmup").lstrip("-") or "fp32"
        optimizer = cls(params, lr=lr, freeze_step=10**9, warmup_compression=bits, **extra)
        return model, optimizer, Plan(1 if bits == "fp32" else 2, steps)
    if method == "onebit":  # step 1 is the warmup; steps 2-3 warm the compression stage up
        return model, cls(params, lr=lr, freeze_step=1, **extra), Plan(3, steps)
    if method == "lamb-warmup":
        return model, cls(params, lr=lr, freeze_step=10**9, **extra), Plan(1, steps)
    if method == "onebit-lamb":
        return model, cls(params, lr=lr, freeze_step=1, **extra), Plan(3, steps)
    if method == "zero-one-a":
        # var_interval doubles after every variance step: fp32 at steps 1, 2, 4, 8; 5-7 are 1-bit.
        optimizer = cls(params, lr=lr, var_freeze_step=10**9, var_update_scaler=1, **extra)
        return model, optimizer, Plan(4, min(steps, 3))
    if method == "zero-one":
        # Phase B from step 2; the local interval doubles every step up to H, so from step 2H on
        # every H-th step is a sync. Measure whole periods, each ending with its sync.
        h = args.local_steps
        optimizer = cls(
            params, lr=lr, var_freeze_step=1, local_step_scaler=1, local_step_clipper=h, **extra
        )
        warmup = h * -(-max(h, 2) // h)  # the interval is h by step h (h >= 2): syncs at k*h
        return model, optimizer, Plan(warmup, h * max(1, -(-steps // h)), mean=True)
    raise ValueError(f"unknown method {method!r}")


def _measure(method: str, model_name: str, rank: int, world: int, args) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    module, optimizer, plan = _build(method, model_name, world, args)
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
    tx_start = _tx_bytes(args.interface)
    skipped_start = 0
    for i, (x, y) in enumerate(batches):
        if i == plan.warmup:
            dist.barrier()
            tx_start = _tx_bytes(args.interface)
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
    tx = _tx_bytes(args.interface) - tx_start
    measured = durations[plan.warmup :]
    result = {
        "params": numel,
        "step_times": measured,
        "stages": stages[plan.warmup :],
        "step_time": statistics.fmean(measured) if plan.mean else statistics.median(measured),
        "mean_step_time": statistics.fmean(measured),
        "tx_bytes_per_step": tx / plan.measured,
        "batch": spec["batch"],
        "skipped_steps": _skipped(optimizer) - skipped_start,  # must be 0: see _build's eps
    }
    del module, optimizer, batches
    return result


def _skipped(optimizer) -> int:
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
    rank, world = args.rank, args.hosts
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
                    result = _measure(method, model_name, rank, world, args)
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
    args,
    network: Network | None,
    port: int,
    models: list[str],
    methods: list[str],
    result_dir: str,
) -> bool:
    """Run one worker per host on ``models`` x ``methods`` and wait; return whether all exited
    cleanly."""
    script = str(Path(__file__).resolve())
    master = f"{SUBNET}.1" if network else "127.0.0.1"
    interface = "eth0" if network else "lo"
    procs = []
    for k in range(args.hosts):
        argv = [
            sys.executable, script, "--worker", "--rank", str(k), "--hosts", str(args.hosts),
            "--master", master, "--port", str(port), "--interface", interface,
            "--models", ",".join(models), "--methods", ",".join(methods),
            "--steps", str(args.steps),
            "--threads", str(args.threads), "--powersgd-rank", str(args.powersgd_rank),
            "--local-steps", str(args.local_steps), "--result-dir", result_dir,
            "--timeout", str(args.timeout), *([] if args.overlap else ["--no-overlap"]),
        ]  # fmt: skip
        env = dict(os.environ, GLOO_SOCKET_IFNAME=interface, OMP_NUM_THREADS=str(args.threads))
        cmd = network.command(k, argv) if network else argv
        stdout = None if k == 0 else subprocess.DEVNULL
        with open(Path(result_dir) / f"rank{k}.err", "w") as stderr:
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
            )
    # PowerSGD's collective mismatch may hang instead of crash: give its launches less time.
    limit = args.timeout * (1 if any(m.startswith("powersgd") for m in methods) else 4)
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
    risky = [m for m in methods if m.startswith("powersgd")]
    safe = [m for m in methods if m not in risky]
    if "compute" in safe and len(safe) > 1:
        safe.append("compute")  # the floor again at the end: see _combine
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


def derive(rows: dict[str, dict[str, Any]], model: str, hosts: int) -> None:
    """Add the speedups, throughput and per-parameter bytes to ``rows[f"{model}/{method}"]``."""
    base = rows.get(f"{model}/adamw", {})
    compute = rows.get(f"{model}/compute", {})
    for method in METHODS:
        r = rows.get(f"{model}/{method}")
        if not r or "error" in r:
            continue
        r["samples_per_s"] = hosts * r["batch"] / r["step_time"]
        r["bytes_per_param"] = r["tx_bytes_per_step"] / r["params"]
        if "step_time" in base:
            r["speedup"] = base["step_time"] / r["step_time"]
            r["bytes_vs_adamw"] = r["tx_bytes_per_step"] / max(base["tx_bytes_per_step"], 1)
        if "step_time" in compute:
            r["vs_compute"] = r["step_time"] / compute["step_time"]
        stages = END_TO_END.get(method)
        warm = rows.get(f"{model}/{stages[0]}", {}) if stages else r
        if "step_time" in base and "step_time" in warm:
            run = WARMUP_FRACTION * warm["step_time"] + (1 - WARMUP_FRACTION) * r["step_time"]
            r["end_to_end_speedup"] = base["step_time"] / run
            volume = WARMUP_FRACTION * warm["tx_bytes_per_step"]
            volume += (1 - WARMUP_FRACTION) * r["tx_bytes_per_step"]
            r["end_to_end_volume_reduction"] = base["tx_bytes_per_step"] / max(volume, 1)


def print_table(rows: dict[str, dict[str, Any]], model: str, markdown: bool = False) -> str:
    """The results of one model at one rate, as aligned text or a markdown table."""
    head = [
        "method", "step s", "samples/s", "vs AdamW+DDP", "/ compute", "wire MB/step/host",
        "wire B/param", "e2e speedup (15% warmup)",
    ]  # fmt: skip
    table = []
    for method in METHODS:
        r = rows.get(f"{model}/{method}")
        if r is None:
            continue
        if "error" in r:
            error = re.sub(r"/\S*/(\w+\.\w+:\d+)", r"\1", r["error"].strip().split("\n")[0])
            error = error if len(error) < 150 else error[:147] + "..."
            table.append([LABELS[method], f"failed: {error}"] + [""] * (len(head) - 2))
            continue

        def fmt(key: str, spec: str, suffix: str = "", r: dict = r) -> str:
            return format(r[key], spec) + suffix if key in r else "-"

        label = LABELS[method] + (
            f" ({r['skipped_steps']} skipped!)" if r.get("skipped_steps") else ""
        )
        table.append([
            label, fmt("step_time", ".3f"), fmt("samples_per_s", ".1f"),
            fmt("speedup", ".2f", "x"), fmt("vs_compute", ".2f", "x"),
            format(r["tx_bytes_per_step"] / 1e6, ".2f"), fmt("bytes_per_param", ".3f"),
            fmt("end_to_end_speedup", ".2f", "x") if method in END_TO_END else "",
        ])  # fmt: skip
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in table])
    fine = [row for row in [head, *table] if not row[1].startswith("failed")]
    widths = [max(len(row[i]) for row in fine) for i in range(len(head))]
    lines = []
    for row in [head, *table]:
        if row[1].startswith("failed"):
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
        else:
            cells = [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
            lines.append("  ".join([row[0].ljust(widths[0]), *cells]))
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    models = results["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        runs = [r for r in results["runs"] if r["rate_bits"] is not None]
        for method in METHODS:
            xs, ys = [], []
            for run in sorted(runs, key=lambda r: r["rate_bits"]):
                row = run["rows"].get(f"{model}/{method}")
                if row and "step_time" in row:
                    xs.append(run["rate_bits"] / 1e9)
                    ys.append(row["step_time"])
            if xs:
                style = "k--" if method == "compute" else "o-"
                ax.plot(xs, ys, style, label=LABELS[method])
        params = next(
            (r["rows"][k]["params"] for r in runs for k in r["rows"]
             if k.startswith(model + "/") and "params" in r["rows"][k]), 0,
        )  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="link bandwidth per host (Gbit/s)",
               ylabel="step time (s)",
               title=f"{model}: {params / 1e6:.1f}M params, {results['hosts']} hosts")  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rates", default="100mbit,1gbit,10gbit", help="comma separated")
    parser.add_argument("--models", default="comm,gpt", help=f"of {sorted(MODELS)}")
    parser.add_argument("--methods", default=",".join(METHODS))
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
    for name in args.models.split(","):
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    for name in args.methods.split(","):
        if name not in METHODS:
            parser.error(f"unknown method {name!r}; choose from {METHODS}")

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
            print(f"\n== {rate_name(rate)}, {args.hosts} hosts ==", flush=True)
            rows, ok = {}, True
            groups = _launch_groups(results["models"], args.methods.split(","))
            for group, (models, methods) in enumerate(groups):
                with tempfile.TemporaryDirectory() as result_dir:
                    os.chmod(result_dir, 0o777)
                    port = args.port + 20 * index + group
                    launched = _launch(args, network, port, models, methods, result_dir)
                    part = _collect(result_dir, args.hosts, 1 if network else args.hosts)
                    died = "" if launched else _first_error(result_dir, args.hosts)
                for model in models:
                    for method in methods:
                        key = f"{model}/{method}"
                        if key not in part or (not launched and "error" in part[key]):
                            part[key] = {"error": f"a worker died: {died}"}
                rows.update(part)
                ok = ok and launched
            for model in results["models"]:
                derive(rows, model, args.hosts)
                print(f"\n{model} @ {rate_name(rate)}:")
                print(print_table(rows, model))
            results["runs"].append(
                {"rate_bits": rate, "rate": rate_name(rate), "ok": ok, "rows": rows}
            )
            (out / f"{args.tag}.json").write_text(json.dumps(results, indent=1))
    finally:
        if network:
            Network.cleanup()
    results["wall_s"] = time.monotonic() - started
    (out / f"{args.tag}.json").write_text(json.dumps(results, indent=1))
    if network and len(rates) > 1:
        plot(results, out / f"{args.tag}.png")
        print(f"\nplot: {out / f'{args.tag}.png'}")
    print(f"results: {out / f'{args.tag}.json'} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
