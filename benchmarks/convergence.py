"""Convergence over several seeds, with the whole run's bytes and time, from ``onebit train``.

    python benchmarks/convergence.py runs/convergence-gpt \
        --network benchmarks/results/network-warmup.json --drift A,B

reads every run under ``RUNS/seed-*/<label>/`` (``onebit train --compare ... --seed S --out
RUNS/seed-S``; extra rows may sit in ``RUNS/seed-S-extra``) and writes
``benchmarks/results/<RUNS name>.{md,json,png}``:

* per row: the final validation loss, mean ± standard deviation over the seeds, and its gap to
  the uncompressed twin (AdamW for the Adams, LAMB for 1-bit LAMB) taken seed by seed, at equal
  samples;
* the bytes a rank sent over the whole run, how many steps ran in each stage (the first
  seed's), and the step each seed froze at;
* the whole run's time and speedup over AdamW + DDP at each link rate of the ``--network`` results
  (``benchmarks/network.py``): each stage's measured step time there, weighted by the number of
  steps the row really ran in that stage, averaged over the seeds. 0/1 Adam's variance steps
  count as 1-bit Adam's warmup steps of their compression, its local steps as compute alone
  and its syncs as 1-bit steps;
* the frozen denominators' drift: for ``--drift A,B`` (two row labels that saved a final
  checkpoint, ``--save-every``), the median and 99th percentile over all entries of
  ``|d_A - d_B| / d_B`` with ``d = sqrt(v̂_T) + eps``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from onebit.train import report

STAGE_METHODS = {
    "adamw": {"fp32": "adamw"},
    "onebit-adam": {"warmup": "onebit-warmup", "compression": "onebit"},
    "zero-one-adam": {
        "variance": "onebit-warmup",  # a full-precision allreduce and Adam's moments
        "compression": "zero-one-a",
        "sync": "zero-one-a",  # a 1-bit allreduce of the same size
        "local": "compute",  # no communication
    },
    "lamb": {"fp32": "lamb-warmup"},
    "onebit-lamb": {"warmup": "lamb-warmup", "compression": "onebit-lamb"},
}
"""For each optimizer, the ``benchmarks/network.py`` method whose step time a stage costs."""

NETWORK_MODEL = "comm"
"""The network benchmark's communication-bound model (25.5M parameters) whose step times weight
the stages: a run whose time goes into synchronising gradients, as on a slow network."""


def load_runs(root: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """``{label: {seed: {"summary": ..., "records": [...], "folder": Path}}}``."""
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for summary_path in sorted(root.glob("seed-*/*/summary.json")):
        summary = json.loads(summary_path.read_text())
        folder = summary_path.parent
        runs.setdefault(summary["label"], {})[summary["seed"]] = {
            "summary": summary,
            "records": report.read_metrics(folder),
            "folder": folder,
        }
    return runs


def stage_steps(records: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        counts[r["comm/stage"]] = counts.get(r["comm/stage"], 0) + 1
    return counts


def step_times(network: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{rate label: {method: step time}}`` of :data:`NETWORK_MODEL` in the network results."""
    times = {}
    for run in network["runs"]:
        if run.get("rate_bits") is None:
            continue
        rows = {
            key.split("/", 1)[1]: row["step_time"]
            for key, row in run["rows"].items()
            if key.startswith(NETWORK_MODEL + "/") and "step_time" in row
        }
        times[rate_label(run["rate_bits"])] = rows
    return times


def rate_label(bits: float) -> str:
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


def whole_run_time(summary: dict[str, Any], stages: dict[str, int], times: dict[str, float]):
    """The run's time in seconds on the network of ``times``: each stage's measured step time
    by the steps the run spent in it; ``None`` if a stage's method was not measured."""
    methods = dict(STAGE_METHODS[summary["optimizer"]])
    bits = summary.get("warmup_compression", "fp32")
    full = {"onebit-adam": "warmup", "onebit-lamb": "warmup", "zero-one-adam": "variance"}
    stage = full.get(summary["optimizer"])
    if stage is not None and bits != "fp32":
        methods[stage] = f"{methods[stage]}-{bits}"
    try:
        return sum(n * times[methods[stage]] for stage, n in stages.items())
    except KeyError:
        return None


def whole_run(summary, per_seed: list[dict[str, int]], times: dict[str, float]):
    """``(seconds, speedup over AdamW + DDP)`` of the run, averaged over the seeds (whose
    stages differ where the freeze step is chosen while training), or ``None``."""
    seconds = [whole_run_time(summary, stages, times) for stages in per_seed]
    if None in seconds or "adamw" not in times:
        return None
    speedups = [sum(stages.values()) * times["adamw"] / t for stages, t in zip(per_seed, seconds)]
    return statistics.fmean(seconds), statistics.fmean(speedups)


def frozen_denominators(folder: Path) -> torch.Tensor:
    """``sqrt(v̂_T) + eps`` of every parameter, from the run's last checkpoint (rank 0)."""
    checkpoints = sorted((folder / "checkpoints").glob("step_*"))
    state = torch.load(checkpoints[-1] / "rank0.pt", map_location="cpu", weights_only=True)
    opt = state["optimizer"]
    freeze = opt["onebit"]["freeze_step"]
    group = opt["param_groups"][0]
    beta2, eps = group["betas"][1], group["eps"]
    v = torch.cat([s["exp_avg_sq"].reshape(-1) for _, s in sorted(opt["state"].items())])
    return (v / (1 - beta2**freeze)).sqrt() + eps


def drift(runs, a: str, b: str) -> dict[str, Any]:
    """Median and 99th percentile of ``|d_a - d_b| / d_b`` per seed both rows share."""
    out = {}
    for seed in sorted(set(runs.get(a, {})) & set(runs.get(b, {}))):
        try:
            da = frozen_denominators(runs[a][seed]["folder"])
            db = frozen_denominators(runs[b][seed]["folder"])
        except (IndexError, FileNotFoundError, KeyError):
            continue
        rel = ((da - db).abs() / db).double()
        out[seed] = {
            "median": float(rel.median()),
            "p99": float(torch.quantile(rel, 0.99)),
            "freeze_steps": [runs[x][seed]["summary"]["freeze_step"] for x in (a, b)],
        }
    return out


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(runs, times) -> list[dict[str, Any]]:
    rows = []
    labels = set(runs)
    for label, seeds in runs.items():
        first = next(iter(seeds.values()))["summary"]
        losses = [s["summary"]["final_val_loss"] for s in seeds.values()]
        ref = report.reference_of(first, labels)
        gaps = [
            100
            * (s["summary"]["final_val_loss"] / runs[ref][seed]["summary"]["final_val_loss"] - 1)
            for seed, s in seeds.items()
            if ref is not None and seed in runs[ref]
        ]
        per_seed = [stage_steps(s["records"]) for s in seeds.values()]
        stages = per_seed[0]
        row = {
            "label": label,
            "optimizer": first["optimizer"],
            "seeds": sorted(seeds),
            "final_val_loss": mean_sd(losses),
            "reference": ref,
            "gap_pct": mean_sd(gaps) if gaps else None,
            "gap_pct_per_seed": gaps,
            "bytes_sent": statistics.fmean(s["summary"]["bytes_sent"] for s in seeds.values()),
            "compression": first["compression"],
            "stages": stages,
            "freeze_steps": [s["summary"]["freeze_step"] for s in seeds.values()],
            "whole_run": {rate: whole_run(first, per_seed, t) for rate, t in times.items()},
        }
        rows.append(row)
    order = list(STAGE_METHODS)
    rows.sort(key=lambda r: (order.index(r["optimizer"]), r["label"]))
    return rows


def markdown(rows: list[dict[str, Any]], times: dict[str, dict[str, float]], first) -> str:
    rates = list(times)
    head = (
        "| run | seeds | final val loss | vs reference, per seed (mean) | bytes per rank "
        "| fewer bytes | steps per stage | freeze step, per seed | "
        + " | ".join(f"whole run at {r} (vs AdamW+DDP)" for r in rates)
        + " |"
    )
    lines = [
        f"{first['model']} model, {first['parameters']:,} parameters, {first['workers']} workers, "
        f"{first['steps']} steps of {first['batch_size']} x {first['block_size']} bytes per "
        f"worker ({first['samples']:,} samples). Losses: mean ± standard deviation over the seeds.",
        "",
        head,
        "|" + "|".join([" --- "] + [" ---: "] * (7 + len(rates))) + "|",
    ]
    for r in rows:
        loss, sd = r["final_val_loss"]
        vs = ""
        if r["gap_pct"] is not None:
            seeds = ", ".join(f"{g:+.2f}" for g in r["gap_pct_per_seed"])
            vs = f"{seeds}% ({r['gap_pct'][0]:+.2f}) vs {r['reference']}"
        stages = ", ".join(f"{n} {stage}" for stage, n in r["stages"].items())
        freezes = ", ".join(str(f) for f in r["freeze_steps"] if f is not None)
        speed = [_time_and_speedup(r["whole_run"].get(rate)) for rate in rates]
        lines.append(
            f"| {r['label']} | {len(r['seeds'])} | {loss:.4f} ± {sd:.4f} | {vs} | "
            f"{report.human_bytes(r['bytes_sent'])} | {r['compression']:.1f}x | {stages} | "
            f"{freezes} |" + "".join(f" {x} |" for x in speed)
        )
    return "\n".join(lines) + "\n"


def _time_and_speedup(measured: tuple[float, float] | None) -> str:
    if measured is None:
        return ""
    seconds, speedup = measured
    return f"{seconds / 60:.0f} min ({speedup:.2f}x)"


def plot(runs, rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(12, 4.4))
    for row in rows:
        seeds = runs[row["label"]]
        curves = []
        for seed in sorted(seeds):
            vals = [r for r in seeds[seed]["records"] if "loss/val" in r]
            curves.append(([r["samples"] for r in vals], [r["loss/val"] for r in vals]))
        xs = curves[0][0]
        mean = [statistics.fmean(c[1][i] for c in curves) for i in range(len(xs))]
        style = "--" if "no-ef" in row["label"] else "-"
        ax_loss.plot(xs, mean, style, label=row["label"])
        ref = row["reference"]
        if ref is not None:
            gaps = []
            for seed in sorted(seeds):
                if seed not in runs[ref]:
                    continue
                ours = [r["loss/val"] for r in seeds[seed]["records"] if "loss/val" in r]
                theirs = [r["loss/val"] for r in runs[ref][seed]["records"] if "loss/val" in r]
                gaps.append([100 * (a / b - 1) for a, b in zip(ours, theirs)])
            gap = [statistics.fmean(g[i] for g in gaps) for i in range(len(gaps[0]))]
            ax_gap.plot(xs[: len(gap)], gap, style, label=f"{row['label']} vs {ref}")
    ax_loss.set(xlabel="samples seen", ylabel="validation loss (nats/byte), mean over seeds")
    ax_loss.set_ylim(top=min(ax_loss.get_ylim()[1], 3.5))
    ax_gap.set(xlabel="samples seen", ylabel="gap to the uncompressed twin (%), mean")
    ax_gap.set_ylim(-5, 15)
    ax_gap.axhline(0, color="k", lw=0.8)
    for ax in (ax_loss, ax_gap):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="folder of seed-*/ compare folders")
    parser.add_argument("--network", type=Path, help="benchmarks/network.py results (JSON)")
    parser.add_argument("--drift", action="append", default=[], metavar="A,B")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    runs = load_runs(args.runs)
    if not runs:
        parser.error(f"no runs under {args.runs}/seed-*/")
    times = step_times(json.loads(args.network.read_text())) if args.network else {}
    rows = summarize(runs, times)
    first = next(iter(next(iter(runs.values())).values()))["summary"]
    table = markdown(rows, times, first)
    drifts = {pair: drift(runs, *pair.split(",")) for pair in args.drift}
    for pair, result in drifts.items():
        for seed, d in result.items():
            table += (
                f"\nFrozen denominator of {pair.split(',')[0]} against {pair.split(',')[1]} "
                f"(seed {seed}, freeze steps {d['freeze_steps']}): relative difference median "
                f"{d['median']:.2%}, 99th percentile {d['p99']:.2%}.\n"
            )
    name = args.runs.name
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text(table)
    (args.out / f"{name}.json").write_text(
        json.dumps({"rows": rows, "drift": drifts, "step_times": times}, indent=1, default=str)
        + "\n"
    )
    plot(runs, rows, args.out / f"{name}.png", f"onebit train --model {first['model']}")
    print(table)
    if any(math.isnan(r["final_val_loss"][0]) for r in rows):
        print("warning: a row ended with a NaN loss")


if __name__ == "__main__":
    main()
