"""The tables, plot and result file of ``benchmarks/network.py``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from network_methods import METHODS

WARMUP_FRACTION = 0.15
"""The share of a whole run's steps spent in warmup, for the end-to-end columns."""


def derive(rows: dict[str, dict[str, Any]], model: str, workers: int) -> None:
    """Add the speedups (against each method's baseline), throughput and per-parameter bytes to
    ``rows[f"{model}/{method}"]``."""
    compute = rows.get(f"{model}/compute", {})
    for method, m in METHODS.items():
        r = rows.get(f"{model}/{method}")
        base = rows.get(f"{model}/{m.baseline}", {})
        if not r or "error" in r:
            continue
        r["samples_per_s"] = workers * r["batch"] / r["step_time"]
        r["bytes_per_param"] = r["tx_bytes_per_step"] / r["params"]
        if "step_time" in base:
            r["speedup"] = base["step_time"] / r["step_time"]
            r["bytes_vs_adamw"] = r["tx_bytes_per_step"] / max(base["tx_bytes_per_step"], 1)
        if "step_time" in compute:
            r["vs_compute"] = r["step_time"] / compute["step_time"]
        warm = rows.get(f"{model}/{m.warmup_stage}", {}) if m.warmup_stage else r
        if "step_time" in base and "step_time" in warm:
            run = WARMUP_FRACTION * warm["step_time"] + (1 - WARMUP_FRACTION) * r["step_time"]
            r["end_to_end_speedup"] = base["step_time"] / run
            volume = WARMUP_FRACTION * warm["tx_bytes_per_step"]
            volume += (1 - WARMUP_FRACTION) * r["tx_bytes_per_step"]
            r["end_to_end_volume_reduction"] = base["tx_bytes_per_step"] / max(volume, 1)


def print_table(rows: dict[str, dict[str, Any]], model: str, markdown: bool = False) -> str:
    """The results of one model at one rate, as aligned text or a markdown table."""
    head = [
        "method", "step s", "samples/s", "vs AdamW (DDP or HSDP)", "/ compute", "wire MB/step/host",
        "wire B/param", f"e2e speedup ({WARMUP_FRACTION:.0%} warmup)",
    ]  # fmt: skip
    table = []
    for method, m in METHODS.items():
        r = rows.get(f"{model}/{method}")
        if r is None:
            continue
        if "error" in r:
            error = re.sub(r"/\S*/(\w+\.\w+:\d+)", r"\1", r["error"].strip().split("\n")[0])
            error = error if len(error) < 150 else error[:147] + "..."
            table.append([m.label, f"failed: {error}"] + [""] * (len(head) - 2))
            continue

        def fmt(key: str, spec: str, suffix: str = "", r: dict = r) -> str:
            return format(r[key], spec) + suffix if key in r else "-"

        label = m.label + (f" ({r['skipped_steps']} skipped!)" if r.get("skipped_steps") else "")
        table.append([
            label, fmt("step_time", ".3f"), fmt("samples_per_s", ".1f"),
            fmt("speedup", ".2f", "x"), fmt("vs_compute", ".2f", "x"),
            format(r["tx_bytes_per_step"] / 1e6, ".2f"), fmt("bytes_per_param", ".3f"),
            fmt("end_to_end_speedup", ".2f", "x") if m.warmup_stage else "",
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
    """Step time against link bandwidth, one line per method, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    models = results["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        runs = [r for r in results["runs"] if r["rate_bits"] is not None]
        for method, m in METHODS.items():
            xs, ys = [], []
            for run in sorted(runs, key=lambda r: r["rate_bits"]):
                row = run["rows"].get(f"{model}/{method}")
                if row and "step_time" in row:
                    xs.append(run["rate_bits"] / 1e9)
                    ys.append(row["step_time"])
            if xs:
                style = "k--" if method == "compute" else "o-"
                ax.plot(xs, ys, style, label=m.label)
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


def write_json(results: dict[str, Any], path: Path) -> None:
    """Write ``results`` (rewritten after every rate, so that a killed run keeps what it did)."""
    path.write_text(json.dumps(results, indent=1))
