"""Running ``onebit train`` as a user would, in a fresh process, and reading what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onebit.train import cli

TINY = [
    "--workers", "2", "--steps", "6", "--layers", "1", "--width", "32", "--heads", "2",
    "--block-size", "32", "--batch-size", "4", "--eval-windows", "16", "--eval-every", "3",
    "--freeze-step", "2", "--no-progress",
]  # fmt: skip
"""A run of a few seconds on 2 workers; later flags override these (``--steps``)."""


def onebit_train(
    *args: str | Path, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m onebit.train`` in a fresh process; a hang fails the test."""
    return subprocess.run(
        [sys.executable, "-m", "onebit.train", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean_env(), **(env or {})},
    )


def clean_env() -> dict[str, str]:
    """This environment, less what would make the CLI think it runs under torchrun."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}


def refused(argv: list[str | Path], capsys: pytest.CaptureFixture) -> str:
    """Run ``onebit train`` in this process; assert exit status 2 and a one-line error."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", *map(str, argv)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("onebit train: error: "), err
    return err


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def without_timing(records: list[dict]) -> list[dict]:
    timing = ("time/elapsed_s", "throughput/samples_per_s")
    return [{k: v for k, v in r.items() if k not in timing} for r in records]
