"""An alpha-beta model of each method's communication, checked against measured runs, then
extrapolated to larger clusters.

    python benchmarks/scaling.py                      # model check + predictions
    python benchmarks/scaling.py --measured a.json,b.json --alpha 100e-6

Model, per step and per rank (``n`` ranks, link ``beta`` bytes/s each way, ``alpha`` seconds of
latency per message, ``P`` parameters):

* ring allreduce of ``B`` bytes (DDP fp32, fp16 hook): ``2(n-1)`` messages per collective,
  ``2(n-1)/n * B`` bytes: ``T = c * 2(n-1) * alpha + 2(n-1)/n * B / beta`` for ``c``
  collectives (DDP buckets: 25 MB, the first 1 MB);
* PowerSGD (rank ``r``): three ring allreduces per DDP bucket: the tensors it does not compress,
  the ``P`` factors (``rows * r`` per matrix) and the ``Q`` factors (``cols * r``);
* 1-bit compressed allreduce (OnebitAdam, OnebitLamb, ZeroOneAdam's syncs): per bucket of
  ``2**22`` elements an all-to-all (``n-1`` messages) and an all-gather (``n-1``) of the packed
  signs: ``T = c * 2(n-1) * alpha + 2(n-1)/n * (P/8 + scales) / beta``;
* ZeroOneAdam phase B: one 1-bit allreduce every ``H`` steps: ``T / H`` per step.

A step takes ``T_compute + T_local + T_comm``: no overlap of communication with computation is
assumed, which is pessimistic for DDP and for OnebitAdam's ``overlap_backward`` alike.
``T_compute`` is the measured compute-only step (forward, backward, AdamW) at the same ``n``;
``T_local`` is the extra local work of compression (the 1-bit kernels, from
``benchmarks/kernels.py``; PowerSGD's small matrix products are left out). Bytes on the wire
include TCP/IP/Ethernet headers: ``beta`` is the link rate times ``--efficiency`` (1448 payload
bytes per 1514-byte frame).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

ONEBIT_BUCKET = 2**22
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20


@dataclass
class Workload:
    """What the model needs to know about a training job."""

    name: str
    params: int
    matrices: list[tuple[int, int]]  # 2-D views (rows, cols) of the weight tensors
    vectors: int  # elements in 1-D tensors (biases, norms): PowerSGD sends them uncompressed
    compute_s: float  # forward + backward + optimizer step, no communication
    onebit_local_s: float  # 1-bit kernels per step (compress, serve, decompress)
    note: str = ""


def workload_from_model(name: str, model, compute_s: float, onebit_local_s: float) -> Workload:
    """The shapes of a ``torch.nn.Module``'s parameters (shared ones once)."""
    seen, matrices, vectors, params = set(), [], 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += p.numel()
        if p.dim() >= 2:
            matrices.append((p.shape[0], p.numel() // p.shape[0]))
        else:
            vectors += p.numel()
    return Workload(name, params, matrices, vectors, compute_s, onebit_local_s)


def bert_large(compute_s: float, onebit_local_s: float) -> Workload:
    """BERT-Large's shapes (340M parameters) without building it."""
    h, layers, vocab, positions = 1024, 24, 30522, 512
    matrices = [(vocab, h), (positions, h), (2, h)]
    vectors = 4 * h  # embedding LayerNorm, pooler bias...
    for _ in range(layers):
        matrices += [(h, h)] * 4 + [(4 * h, h), (h, 4 * h)]
        vectors += 4 * h + 4 * h + h + 4 * h  # biases and two LayerNorms
    matrices.append((h, h))  # pooler
    params = sum(r * c for r, c in matrices) + vectors
    return Workload("BERT-Large", params, matrices, vectors, compute_s, onebit_local_s)


def _ddp_buckets(nbytes: float) -> int:
    return 1 + max(0, math.ceil((nbytes - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES))


def ring(nbytes: float, n: int, collectives: int, alpha: float, beta: float) -> tuple[float, float]:
    """(seconds, bytes sent per rank) of ``collectives`` ring allreduces totalling ``nbytes``."""
    if n == 1:
        return 0.0, 0.0
    sent = 2 * (n - 1) / n * nbytes
    return collectives * 2 * (n - 1) * alpha + sent / beta, sent


def onebit(params: int, n: int, alpha: float, beta: float) -> tuple[float, float]:
    """(seconds, bytes sent per rank) of one 1-bit compressed allreduce of ``params`` elements."""
    if n == 1:
        return 0.0, 0.0
    buckets = math.ceil(params / ONEBIT_BUCKET)
    sent = 2 * (n - 1) / n * params / 8 + 2 * (n - 1) * 4 * buckets  # signs + scales
    return buckets * 2 * (n - 1) * alpha + sent / beta, sent


def powersgd_elements(w: Workload, rank: int, min_rate: float = 2.0) -> float:
    """Elements PowerSGD allreduces per step: uncompressed tensors plus the P and Q factors."""
    total = w.vectors
    for rows, cols in w.matrices:
        r = min(rows, cols, rank)
        if (rows + cols) * r * min_rate < rows * cols:
            total += (rows + cols) * r
        else:
            total += rows * cols
    return total


def comm(method: str, w: Workload, n: int, alpha: float, beta: float, args) -> tuple[float, float]:
    """(seconds of communication, bytes sent per rank) per step of ``method``."""
    fp32 = 4 * w.params
    if method in ("adamw", "onebit-warmup", "lamb-warmup"):
        return ring(fp32, n, _ddp_buckets(fp32), alpha, beta)
    if method == "fp16":
        return ring(fp32 / 2, n, _ddp_buckets(fp32 / 2), alpha, beta)
    if method == "powersgd":
        return ring(4 * powersgd_elements(w, args.powersgd_rank), n, 3 * _ddp_buckets(fp32),
                    alpha, beta)  # fmt: skip
    if method in ("onebit", "onebit-lamb", "zero-one-a"):
        return onebit(w.params, n, alpha, beta)
    if method == "zero-one":
        t, sent = onebit(w.params, n, alpha, beta)
        return t / args.local_steps, sent / args.local_steps
    return 0.0, 0.0


def local(method: str, w: Workload, args) -> float:
    if method in ("onebit", "onebit-lamb", "zero-one-a"):
        return w.onebit_local_s
    if method == "zero-one":
        return w.onebit_local_s / args.local_steps
    return 0.0


def predict(method: str, w: Workload, n: int, alpha: float, beta: float, args) -> float:
    return w.compute_s + local(method, w, args) + comm(method, w, n, alpha, beta, args)[0]


def _rate(text: str) -> float:
    text = text.lower()
    for suffix, factor in (("gbit", 1e9), ("mbit", 1e6)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def _load_runs(paths: list[str], rate_bits: float, model: str) -> dict[int, dict]:
    """``{hosts: rows}`` of the measured runs at ``rate_bits`` for ``model``."""
    runs = {}
    for path in paths:
        if not Path(path).exists():
            print(f"(missing: {path})")
            continue
        data = json.loads(Path(path).read_text())
        for run in data["runs"]:
            if run["rate_bits"] and abs(run["rate_bits"] - rate_bits) < 1:
                rows = {k.split("/", 1)[1]: v for k, v in run["rows"].items()
                        if k.startswith(model + "/")}  # fmt: skip
                runs[data["hosts"]] = rows
    return dict(sorted(runs.items()))


def _kernel_seconds_per_param(path: str) -> float | None:
    """Seconds per parameter of compress + serve + decompress from ``kernels.py --json``
    (largest size, the serve share for 4 ranks as measured)."""
    if not Path(path).exists():
        return None
    data = json.loads(Path(path).read_text())
    row = data["rows"][-1]
    path_key = "auto"
    t = sum(row[f"{path_key}/{op}"] for op in ("compress", "decompress", "server"))
    return t / row["numel"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--measured",
        default="benchmarks/results/scaling-h2.json,"
        "benchmarks/results/network.json,benchmarks/results/scaling-h8.json",
    )
    parser.add_argument("--kernels", default="benchmarks/results/kernels.json")
    parser.add_argument("--rate", default="1gbit", help="rate of the measured runs to check")
    parser.add_argument("--model", default="comm", help="model of the measured runs")
    parser.add_argument(
        "--alpha",
        type=float,
        default=100e-6,
        help="seconds per message in the measured runs (TCP via veth, 2 cores)",
    )
    parser.add_argument(
        "--alpha-cluster",
        type=float,
        default=25e-6,
        help="seconds per message for the extrapolation (TCP over Ethernet)",
    )
    parser.add_argument("--efficiency", type=float, default=1448 / 1514)
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--local-steps", type=int, default=16, help="ZeroOneAdam's H")
    parser.add_argument(
        "--compute-s",
        type=float,
        default=None,
        help="compute per step of the benchmark model for the extrapolation "
        "(default: measured compute-only at the fewest hosts)",
    )
    parser.add_argument(
        "--bert-compute-s",
        type=float,
        default=0.25,
        help="assumed GPU compute per step of BERT-Large for the extrapolation",
    )
    parser.add_argument(
        "--bert-local-s",
        type=float,
        default=0.005,
        help="assumed 1-bit kernel time per step on a GPU for BERT-Large",
    )
    parser.add_argument("--json", default="benchmarks/results/scaling.json")
    args = parser.parse_args()  # fmt: skip

    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from network import LABELS, MODELS  # noqa: E402

    from onebit.train.model import ModelConfig, Transformer

    spec = MODELS[args.model]
    model = Transformer(
        ModelConfig("gpt", spec["block_size"], spec["n_layer"], spec["n_head"], spec["n_embd"])
    )
    kernel_s = _kernel_seconds_per_param(args.kernels)
    runs = _load_runs(args.measured.split(","), _rate(args.rate), args.model)
    beta = _rate(args.rate) / 8 * args.efficiency
    methods = ["adamw", "fp16", "powersgd", "onebit", "zero-one"]
    output: dict = {"assumptions": vars(args), "check": [], "extrapolation": []}

    print(f"== Model check: {args.model} model, {args.rate}, alpha {args.alpha * 1e6:.0f} us, "
          f"beta {beta * 8 / 1e6:.0f} Mbit/s of payload ==")  # fmt: skip
    head = ("hosts", "method", "measured s", "predicted s", "error", "measured MB", "predicted MB")
    print("  ".join(f"{h:>12}" for h in head))
    for n, rows in runs.items():
        compute = rows.get("compute", {}).get("step_time")
        if compute is None:
            continue
        # On this VM the 1-bit kernels share 2 cores with n workers: scale by the contention.
        contention = max(1.0, n / 2)
        local_s = (kernel_s or 0.0) * contention * model_params(model)
        w = workload_from_model(args.model, model, compute, local_s)
        for method in methods:
            row = rows.get(method)
            if not row or "step_time" not in row:
                continue
            t_pred = predict(method, w, n, args.alpha, beta, args)
            _, sent = comm(method, w, n, args.alpha, beta, args)
            sent_wire = sent / args.efficiency
            err = t_pred / row["step_time"] - 1
            output["check"].append({
                "hosts": n, "method": method, "measured_s": row["step_time"],
                "predicted_s": t_pred, "measured_bytes": row["tx_bytes_per_step"],
                "predicted_bytes": sent_wire,
            })  # fmt: skip
            print(f"{n:>12}  {method:>12}  {row['step_time']:>12.3f}  {t_pred:>12.3f}  "
                  f"{err:>+11.0%}  {row['tx_bytes_per_step'] / 1e6:>12.2f}  "
                  f"{sent_wire / 1e6:>12.2f}")  # fmt: skip

    fewest = min(runs) if runs else None
    compute_s = args.compute_s
    if compute_s is None and fewest is not None:
        compute_s = runs[fewest].get("compute", {}).get("step_time")
    compute_s = compute_s or 0.3
    local_s = (kernel_s or 1e-9) * model_params(model)
    workloads = [
        workload_from_model(f"{args.model} model", model, compute_s, local_s),
        bert_large(args.bert_compute_s, args.bert_local_s),
    ]
    print(f"\n== Predicted speedup over AdamW+DDP (alpha {args.alpha_cluster * 1e6:.0f} us, "
          f"no overlap, ZeroOneAdam H={args.local_steps}, PowerSGD rank "
          f"{args.powersgd_rank}) ==")  # fmt: skip
    for w in workloads:
        print(f"\n{w.name}: {w.params / 1e6:.1f}M params, compute {w.compute_s:.3f} s/step, "
              f"1-bit kernels {w.onebit_local_s * 1e3:.1f} ms/step")  # fmt: skip
        head = ["link", "workers", "AdamW step s"] + [LABELS[m] for m in methods[1:]]
        print(" | ".join(head))
        for link in (10e9, 100e9):
            b = link / 8 * args.efficiency
            for n in (16, 64, 256):
                base = predict("adamw", w, n, args.alpha_cluster, b, args)
                cells = [f"{link / 1e9:g} Gbit/s", str(n), f"{base:.3f}"]
                entry = {"workload": w.name, "link_bits": link, "workers": n, "adamw_s": base}
                for m in methods[1:]:
                    t = predict(m, w, n, args.alpha_cluster, b, args)
                    cells.append(f"{base / t:.2f}x")
                    entry[m] = base / t
                # OnebitAdam over a run with 15% fp32 warmup
                warm = predict("onebit-warmup", w, n, args.alpha_cluster, b, args)
                comp = predict("onebit", w, n, args.alpha_cluster, b, args)
                entry["onebit_e2e_15pct"] = base / (0.15 * warm + 0.85 * comp)
                output["extrapolation"].append(entry)
                print(" | ".join(cells) + f"  (OnebitAdam e2e {entry['onebit_e2e_15pct']:.2f}x)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(output, indent=1))


def model_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


if __name__ == "__main__":
    main()
