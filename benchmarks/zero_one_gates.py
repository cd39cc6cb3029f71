"""0/1 Adam against 1-bit Adam and AdamW, seed by seed: loss, bytes and rounds.

    python benchmarks/zero_one_gates.py runs/zero-one/gpt runs/zero-one/cnn ...

reads each task folder's ``seed-*/{adamw,onebit-adam,zero-one-adam}/summary.json`` (``onebit
train --compare adamw,onebit-adam,zero-one-adam --seed S --out TASK/seed-S``) and prints, per
task and seed, 0/1 Adam's final validation loss against AdamW's, how many times fewer bytes and
what fraction fewer rounds it needed than 1-bit Adam over the whole run, and whether each meets
its gate (``--loss``, ``--bytes``, ``--rounds``). Writes the table to ``--out`` if given.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROWS = ("adamw", "onebit-adam", "zero-one-adam")


def seeds(task: Path) -> dict[int, dict[str, dict[str, Any]]]:
    """``{seed: {row: summary}}`` for the seeds whose three rows all finished."""
    found: dict[int, dict[str, dict[str, Any]]] = {}
    for folder in sorted(task.glob("seed-*")):
        paths = {row: folder / row / "summary.json" for row in ROWS}
        if all(p.exists() for p in paths.values()):
            seed = int(folder.name.removeprefix("seed-"))
            found[seed] = {row: json.loads(p.read_text()) for row, p in paths.items()}
    return found


def table(tasks: list[Path], loss: float, fewer_bytes: float, fewer_rounds: float) -> str:
    lines = [
        "| task | seed | 0/1 Adam vs AdamW | bytes: 1-bit Adam / 0/1 Adam | rounds: 0/1 Adam "
        "vs 1-bit Adam | 0/1 Adam: bytes fewer than fp32, rounds | 1-bit Adam: the same "
        "| gates met (loss, bytes, rounds) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for task in tasks:
        for seed, rows in seeds(task).items():
            adamw, onebit, zero_one = (rows[r] for r in ROWS)
            gap = 100 * (zero_one["final_val_loss"] / adamw["final_val_loss"] - 1)
            bytes_ratio = onebit["bytes_sent"] / zero_one["bytes_sent"]
            rounds = 100 * (zero_one["rounds"] / onebit["rounds"] - 1)
            met = (gap <= loss, bytes_ratio >= fewer_bytes, -rounds >= fewer_rounds)
            lines.append(
                f"| {task.name} | {seed} | {gap:+.2f}% | {bytes_ratio:.2f}x | {rounds:+.0f}% "
                f"| {zero_one['compression']:.1f}x, {zero_one['rounds']:,} "
                f"| {onebit['compression']:.1f}x, {onebit['rounds']:,} "
                f"| {', '.join('yes' if m else 'no' for m in met)} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tasks", nargs="+", type=Path, help="folders of seed-*/<row> runs")
    parser.add_argument("--loss", type=float, default=2.0, help="percent above AdamW at most")
    parser.add_argument("--bytes", type=float, default=2.0, help="times fewer than 1-bit Adam")
    parser.add_argument("--rounds", type=float, default=40.0, help="percent fewer than 1-bit Adam")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = table(args.tasks, args.loss, args.bytes, args.rounds)
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
