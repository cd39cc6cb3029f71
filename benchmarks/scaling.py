"""An alpha-beta model of each method's communication, checked against measured runs of
``benchmarks/network.py``, then extrapolated to larger clusters.

    python benchmarks/scaling.py          # reads benchmarks/results/{scaling-h2,network,...}.json

Model, per step and per rank (``n`` ranks, ``beta`` payload bytes/s per link and direction,
``alpha`` seconds per message, ``P`` parameters):

* ring allreduce of ``B`` bytes (DDP fp32; fp16 hook with ``B/2``): ``2(n-1)`` messages per
  collective, ``2(n-1)/n * B`` bytes sent: ``T = c * 2(n-1) * alpha + 2(n-1)/n * B / beta`` for
  ``c`` collectives (DDP's buckets: 25 MB, the first 1 MB);
* PowerSGD (rank ``r``): three ring allreduces per DDP bucket (the tensors it leaves
  uncompressed, the ``P`` factors, ``rows * r`` per matrix, and the ``Q`` factors, ``cols * r``);
* 1-bit compressed allreduce (OnebitAdam, OnebitLamb, ZeroOneAdam phase A and syncs): per bucket
  of ``2**22`` elements an all-to-all and an all-gather of the packed signs, ``n-1`` messages
  each: ``T = c * 2(n-1) * alpha + 2(n-1)/n * (P/8 + scales) / beta``;
* ZeroOneAdam phase B: one 1-bit allreduce every ``H`` steps, so ``T / H`` per step.

At 256 ranks a 2**22-element bucket is split into 2 KiB messages and the 1-bit allreduce becomes
latency bound; the extrapolation also shows buckets of ``n * 2**18`` elements (``bucket_size``),
whose messages stay at 32 KiB.

A step takes ``T_compute + T_local + T_comm``, with no overlap of communication and computation
(pessimistic for DDP and for OnebitAdam's ``overlap_backward`` alike). ``T_compute`` is the
measured compute-only step at the same number of hosts. ``T_local`` is the method's extra local
work: for 1-bit, the kernels' time per parameter from ``benchmarks/kernels.py`` times the CPU
contention (``n`` workers on this VM's cores); for PowerSGD, calibrated once as the 4-host
10 Gbit/s step less compute-only less the model's communication, scaled by contention.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

ONEBIT_BUCKET = 2**22
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20
ETHERNET = 1448 / 1514  # TCP payload per 1514-byte frame (timestamps on)


@dataclass
class Workload:
    """What the model needs to know about a training job."""

    name: str
    params: int
    matrices: list[tuple[int, int]]  # 2-D views (rows, cols) of the weights
    vectors: int  # elements of 1-D tensors (biases, norms): PowerSGD sends them uncompressed
    compute_s: float = 0.0  # forward + backward + optimizer step, no communication
    local_s: dict[str, float] = field(default_factory=dict)  # extra local work per method


def shapes_of(name: str, model) -> Workload:
    """The shapes of a ``torch.nn.Module``'s parameters (shared ones counted once)."""
    unique = {id(p): p for p in model.parameters()}.values()
    matrices = [(p.shape[0], p.numel() // p.shape[0]) for p in unique if p.dim() >= 2]
    vectors = sum(p.numel() for p in unique if p.dim() < 2)
    return Workload(name, sum(p.numel() for p in unique), matrices, vectors)


def bert_large() -> Workload:
    """BERT-Large's shapes (335M parameters) without building it."""
    h, layers, vocab, positions = 1024, 24, 30522, 512
    matrices = [(vocab, h), (positions, h), (2, h), (h, h)]  # embeddings, pooler
    vectors = 2 * h + h  # embedding LayerNorm, pooler bias
    for _ in range(layers):
        matrices += [(h, h)] * 4 + [(4 * h, h), (h, 4 * h)]
        vectors += 4 * h + 4 * h + h + 2 * 2 * h  # biases, two LayerNorms
    params = sum(r * c for r, c in matrices) + vectors
    return Workload("BERT-Large", params, matrices, vectors)


def ddp_buckets(nbytes: float) -> int:
    """How many buckets DDP cuts ``nbytes`` of gradients into (a small first one, then 25 MiB)."""
    return 1 + max(0, math.ceil((nbytes - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES))


def ring(nbytes: float, n: int, collectives: int, alpha: float, beta: float) -> tuple[float, float]:
    """(seconds, bytes sent per rank) of ``collectives`` ring allreduces of ``nbytes`` in all."""
    if n == 1:
        return 0.0, 0.0
    sent = 2 * (n - 1) / n * nbytes
    return collectives * 2 * (n - 1) * alpha + sent / beta, sent


def onebit(
    params: int,
    n: int,
    alpha: float,
    beta: float,
    bucket: int = ONEBIT_BUCKET,
    per_bucket: bool = False,
) -> tuple[float, float]:
    """(seconds, bytes sent per rank) of one 1-bit compressed allreduce of ``params`` in buckets
    of ``bucket`` elements: each phase one collective for all buckets, as a step sends them
    (``per_bucket``: one per bucket, as onebit did before)."""
    if n == 1:
        return 0.0, 0.0
    buckets = math.ceil(params / bucket)
    sent = 2 * (n - 1) / n * params / 8 + 2 * (n - 1) * 4 * buckets  # signs + scales
    collectives = buckets if per_bucket else 1
    return collectives * 2 * (n - 1) * alpha + sent / beta, sent


def powersgd_elements(w: Workload, rank: int, min_rate: float = 2.0) -> int:
    """Elements PowerSGD allreduces per step, by the hook's own rule for what to compress."""
    total = w.vectors
    for rows, cols in w.matrices:
        r = min(rows, cols, rank)
        compress = (rows + cols) * r * min_rate < rows * cols
        total += (rows + cols) * r if compress else rows * cols
    return total


def comm(method: str, w: Workload, n: int, alpha: float, beta: float, args) -> tuple[float, float]:
    """(seconds of communication, bytes sent per rank) per step of ``method``."""
    fp32 = 4 * w.params
    if method in ("adamw", "onebit-warmup", "lamb-warmup"):
        return ring(fp32, n, ddp_buckets(fp32), alpha, beta)
    if method == "fp16":
        return ring(fp32 / 2, n, ddp_buckets(fp32 / 2), alpha, beta)
    if method in ("powersgd", "powersgd-1b"):
        buckets = 1 if method == "powersgd-1b" else ddp_buckets(fp32)
        return ring(4 * powersgd_elements(w, args.powersgd_rank), n, 3 * buckets, alpha, beta)
    # The recorded tables model a collective per bucket, as onebit sent when they were made.
    if method in ("onebit", "onebit-lamb", "zero-one-a"):
        return onebit(w.params, n, alpha, beta, per_bucket=True)
    if method == "onebit-big":  # buckets grown with n: every message at least 32 KiB
        return onebit(w.params, n, alpha, beta, max(ONEBIT_BUCKET, n * 8 * 2**15), True)
    if method == "zero-one":
        t, sent = onebit(w.params, n, alpha, beta, per_bucket=True)
        return t / args.local_steps, sent / args.local_steps
    return 0.0, 0.0


def predict(method: str, w: Workload, n: int, alpha: float, beta: float, args) -> float:
    """Predicted seconds per step."""
    kind = "powersgd" if method.startswith("powersgd") else method
    kind = "onebit" if kind == "onebit-big" else kind
    local = w.local_s.get(kind, 0.0)
    if method == "zero-one":
        local = w.local_s.get("onebit", 0.0) / args.local_steps
    return w.compute_s + local + comm(method, w, n, alpha, beta, args)[0]


def _rate(text: str) -> float:
    text = text.lower()
    for suffix, factor in (("gbit", 1e9), ("mbit", 1e6)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def load_runs(paths: list[str], model: str) -> dict[tuple[int, float], dict]:
    """``{(hosts, rate_bits): {method: row}}`` from ``network.py`` result files."""
    runs = {}
    for path in paths:
        if not Path(path).exists():
            print(f"(missing: {path})")
            continue
        data = json.loads(Path(path).read_text())
        for run in data["runs"]:
            if run["rate_bits"]:
                rows = {k.split("/", 1)[1]: v for k, v in run["rows"].items()
                        if k.startswith(model + "/") and "step_time" in v}  # fmt: skip
                runs[(data["hosts"], run["rate_bits"])] = rows
    return runs


def kernel_seconds_per_param(path: str) -> float:
    """Seconds per parameter of one rank's compress + serve + decompress, from the largest size
    of ``kernels.py --json`` (its serve share is for 4 ranks)."""
    if not Path(path).exists():
        print(f"(missing: {path}; 1-bit kernels counted as free)")
        return 0.0
    row = json.loads(Path(path).read_text())["rows"][-1]
    return sum(row[f"auto/{op}"] for op in ("compress", "decompress", "server")) / row["numel"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    results = "benchmarks/results"
    parser.add_argument(
        "--measured",
        default=f"{results}/scaling-h2.json,{results}/network.json,{results}/scaling-h8.json",
        help="network.py result files",
    )
    parser.add_argument("--kernels", default=f"{results}/kernels.json")
    parser.add_argument("--rate", default="1gbit", help="rate of the measured runs to check")
    parser.add_argument(
        "--calibration-rate",
        default="10gbit",
        help="4-host rate whose PowerSGD step calibrates its local work",
    )
    parser.add_argument("--model", default="comm", help="network.py model of the measured runs")
    parser.add_argument(
        "--alpha",
        type=float,
        default=100e-6,
        help="seconds per message in the measured runs (gloo, TCP over veth)",
    )
    parser.add_argument(
        "--alpha-cluster",
        type=float,
        default=25e-6,
        help="seconds per message in the extrapolation (TCP over Ethernet)",
    )
    parser.add_argument(
        "--cores", type=int, default=os.cpu_count() or 1, help="cores the measured workers shared"
    )
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--local-steps", type=int, default=16, help="ZeroOneAdam's H")
    parser.add_argument(
        "--bert-compute-s",
        type=float,
        default=0.25,
        help="assumed GPU compute per BERT-Large step (forward, backward, Adam)",
    )
    parser.add_argument(
        "--bert-onebit-s",
        type=float,
        default=0.005,
        help="assumed 1-bit kernel time per BERT-Large step on a GPU",
    )
    parser.add_argument(
        "--bert-powersgd-s",
        type=float,
        default=0.010,
        help="assumed PowerSGD local work per BERT-Large step on a GPU",
    )
    parser.add_argument("--json", default=f"{results}/scaling.json")
    args = parser.parse_args()  # fmt: skip

    sys.path.insert(0, str(Path(__file__).parent))
    from network_methods import LABELS, MODELS

    from onebit.train.model import ModelConfig, Transformer

    spec = MODELS[args.model]
    config = ModelConfig("gpt", spec["block_size"], spec["n_layer"], spec["n_head"], spec["n_embd"])
    shapes = shapes_of(f"{args.model} model", Transformer(config))
    runs = load_runs(args.measured.split(","), args.model)
    rate, calibration_rate = _rate(args.rate), _rate(args.calibration_rate)
    per_param = kernel_seconds_per_param(args.kernels)
    out: dict = {"assumptions": vars(args), "check": [], "extrapolation": []}

    def contention(n: int) -> float:
        return max(1.0, n / args.cores)

    # PowerSGD's local work (matrix products, orthogonalisation, error feedback) from one run.
    powersgd_local = 0.0
    calib = runs.get((4, calibration_rate), {})
    if "powersgd-1b" in calib and "compute" in calib:
        w = Workload(**{**shapes.__dict__, "compute_s": calib["compute"]["step_time"]})
        t_comm = comm("powersgd-1b", w, 4, args.alpha, calibration_rate / 8, args)[0]
        powersgd_local = max(0.0, calib["powersgd-1b"]["step_time"] - w.compute_s - t_comm)
        powersgd_local /= contention(4)
    print(
        f"calibration: 1-bit kernels {per_param * 1e9:.2f} ns/param, PowerSGD local work "
        f"{powersgd_local:.3f} s/step uncontended (from 4 hosts at {args.calibration_rate})"
    )

    print(f"\n== Model check: {args.model} model ({shapes.params / 1e6:.1f}M params) at "
          f"{args.rate}, alpha {args.alpha * 1e6:.0f} us ==")  # fmt: skip
    head = ["hosts", "method", "measured s", "predicted s", "error", "measured MB", "predicted MB"]
    print(" | ".join(head))
    methods = ["adamw", "fp16", "powersgd-1b", "onebit", "zero-one"]
    for (n, bits), rows in sorted(runs.items()):
        if bits != rate or "compute" not in rows:
            continue
        w = Workload(**{**shapes.__dict__, "compute_s": rows["compute"]["step_time"]})
        w.local_s = {"onebit": per_param * w.params * contention(n),
                     "powersgd": powersgd_local * contention(n)}  # fmt: skip
        for method in methods:
            row = rows.get(method)
            if row is None:
                continue
            t = predict(method, w, n, args.alpha, rate / 8, args)
            sent = comm(method, w, n, args.alpha, rate / 8, args)[1]
            err = t / row["step_time"] - 1
            out["check"].append({"hosts": n, "method": method, "measured_s": row["step_time"],
                                 "predicted_s": t, "measured_bytes": row["tx_bytes_per_step"],
                                 "predicted_bytes": sent})  # fmt: skip
            print(f"{n} | {LABELS[method]} | {row['step_time']:.3f} | {t:.3f} | {err:+.0%} | "
                  f"{row['tx_bytes_per_step'] / 1e6:.2f} | {sent / 1e6:.2f}")  # fmt: skip

    # Extrapolation: one worker per host and core (no contention), real Ethernet framing.
    fewest = min((n for n, b in runs if b == rate), default=None)
    ours = Workload(**{**shapes.__dict__})
    ours.compute_s = runs[(fewest, rate)]["compute"]["step_time"] if fewest else 0.3
    ours.local_s = {"onebit": per_param * ours.params, "powersgd": powersgd_local}
    bert = bert_large()
    bert.compute_s = args.bert_compute_s
    bert.local_s = {"onebit": args.bert_onebit_s, "powersgd": args.bert_powersgd_s}
    methods = ["fp16", "powersgd", "onebit", "onebit-big", "zero-one"]
    LABELS["onebit-big"] = "OnebitAdam, buckets of n x 2^18"
    print(f"\n== Predicted speedup over AdamW+DDP: alpha {args.alpha_cluster * 1e6:.0f} us, "
          f"Ethernet framing, no overlap, PowerSGD rank {args.powersgd_rank}, ZeroOneAdam "
          f"H={args.local_steps} ==")  # fmt: skip
    for w in (ours, bert):
        print(f"\n{w.name}: {w.params / 1e6:.1f}M params, compute {w.compute_s:.3f} s/step, "
              f"1-bit kernels {w.local_s['onebit'] * 1e3:.1f} ms/step, PowerSGD local "
              f"{w.local_s['powersgd'] * 1e3:.0f} ms/step")  # fmt: skip
        head = ["link", "workers", "AdamW+DDP s/step", *(LABELS[m] for m in methods),
                "OnebitAdam e2e (15% warmup, n x 2^18 buckets)"]  # fmt: skip
        print(" | ".join(head))
        for link in (10e9, 100e9):
            beta = link / 8 * ETHERNET
            for n in (16, 64, 256):
                base = predict("adamw", w, n, args.alpha_cluster, beta, args)
                entry = {"workload": w.name, "link_bits": link, "workers": n, "adamw_s": base}
                for m in methods:
                    entry[m] = base / predict(m, w, n, args.alpha_cluster, beta, args)
                warm = predict("onebit-warmup", w, n, args.alpha_cluster, beta, args)
                comp = predict("onebit-big", w, n, args.alpha_cluster, beta, args)
                entry["onebit_e2e"] = base / (0.15 * warm + 0.85 * comp)
                out["extrapolation"].append(entry)
                cells = [f"{link / 1e9:g} Gbit/s", str(n), f"{base:.3f}"]
                cells += [f"{entry[m]:.2f}x" for m in [*methods, "onebit_e2e"]]
                print(" | ".join(cells))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
