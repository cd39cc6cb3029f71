"""Reading metrics back, one-line summaries, comparison tables and plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .optim import REFERENCE


def read_metrics(run: Path) -> list[dict[str, Any]]:
    """The records of ``run/metrics.jsonl``, one per step, in order."""
    with (Path(run) / "metrics.jsonl").open() as f:
        return [json.loads(line) for line in f if line.strip()]


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def describe(summary: dict[str, Any]) -> str:
    """One line for the end of a run: loss, bytes and rounds, time."""
    ratio = summary["compression"]
    fewer = f", {ratio:.1f}x fewer than an fp32 allreduce" if ratio and ratio > 1.05 else ""
    return (
        f"{summary['label']}: final val loss {summary['final_val_loss']:.4f} after "
        f"{summary['samples']} samples; sent {human_bytes(summary['bytes_sent'])} per rank"
        f"{fewer}, in {summary.get('rounds', 0):,} rounds; {summary['wall_time_s']:.0f} s, "
        f"{summary['samples_per_s']:.1f} samples/s"
    )


def reference_of(summary: dict[str, Any], labels: set[str]) -> str | None:
    """The label of the uncompressed run this one is measured against, if it is in ``labels``."""
    reference = REFERENCE.get(summary["optimizer"])
    return reference if reference in labels and reference != summary["label"] else None


def write_comparison(
    out: Path, summaries: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]]
) -> str:
    """Write ``comparison.md``, ``comparison.json`` and ``comparison.png`` to ``out``; return the
    markdown table."""
    by_label = {s["label"]: s for s in summaries}
    rows = []
    for s in summaries:
        ref = reference_of(s, set(by_label))
        delta = None
        if ref is not None:
            delta = 100 * (s["final_val_loss"] / by_label[ref]["final_val_loss"] - 1)
        rows.append({**s, "reference": ref, "val_loss_vs_reference_pct": delta})
    first = summaries[0]
    lines = [
        f"{first['model']} model, {first['parameters']:,} parameters, {first['workers']} workers, "
        f"{first['steps']} steps of {first['batch_size']} x {first['block_size']} bytes per "
        f"worker ({first['samples']:,} samples), seed {first['seed']}.",
        "",
        "| run | final val loss | vs reference | bytes sent per rank | fewer bytes than fp32 "
        "| rounds | wall time | samples/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        vs = (
            ""
            if r["reference"] is None
            else (f"{r['val_loss_vs_reference_pct']:+.2f}% vs {r['reference']}")
        )
        ratio = f"{r['compression']:.1f}x" if r["compression"] else ""
        lines.append(
            f"| {r['label']} | {r['final_val_loss']:.4f} | {vs} | {human_bytes(r['bytes_sent'])} "
            f"| {ratio} | {r.get('rounds', 0):,} | {r['wall_time_s']:.0f} s "
            f"| {r['samples_per_s']:.1f} |"
        )
    table = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.md").write_text(table)
    (out / "comparison.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot_runs(runs, out / "comparison.png", first["model"])
    return table


def plot_runs(runs: dict[str, list[dict[str, Any]]], path: Path, title: str = "") -> None:
    """Validation loss and cumulative bytes sent per rank, both against samples seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, records in runs.items():
        vals = [r for r in records if "loss/val" in r]
        style = "--" if label.endswith("no-ef") else "-"
        ax_loss.plot(
            [r["samples"] for r in vals], [r["loss/val"] for r in vals], style, label=label
        )
        ax_bytes.plot(
            [r["samples"] for r in records],
            [r["comm/bytes_total"] / 1e6 for r in records],
            style,
            label=label,
        )
    ax_loss.set(xlabel="samples seen", ylabel="validation loss (nats/byte)", title="convergence")
    ax_bytes.set(
        xlabel="samples seen", ylabel="MB sent per rank (log)", title="communication", yscale="log"
    )
    for ax in (ax_loss, ax_bytes):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(f"onebit train --model {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
