"""``onebit train``'s checkpoints: checksummed, pruned to the last K, never written over by a new
run, verified on resume with a fallback, and continued on the saved run's schedule."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from train_cli import TINY, onebit_train, read_metrics, refused, without_timing

from onebit.train import checkpoint

pytestmark = pytest.mark.slow  # every test reads or resumes onebit train runs

RUN = [*TINY, "--steps", "8", "--eval-every", "4", "--save-every", "2", "--keep", "2"]


@pytest.fixture(scope="module")
def run8(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    """8 steps of 1-bit Adam, saved every 2 steps, the newest 2 checkpoints kept."""
    out = tmp_path_factory.mktemp("runs") / "run8"
    result = onebit_train(*RUN, "--out", out, "--cache-dir", data_cache)
    assert result.returncode == 0, result.stderr
    return out


def copy_run(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "copy"))


def test_checkpoints_are_checksummed_and_the_last_k_kept(run8: Path) -> None:
    folders = sorted(p.name for p in (run8 / "checkpoints").iterdir())
    assert folders == ["step_000006", "step_000008"], "--keep 2 deletes the older ones"
    for folder in (run8 / "checkpoints").iterdir():
        marker = json.loads((folder / "complete").read_text())
        assert marker["world_size"] == 2
        assert sorted(p.name for p in folder.iterdir()) == ["complete", "rank0.pt", "rank1.pt"]
        for entry in marker["files"]:
            data = (folder / entry["file"]).read_bytes()
            assert entry["bytes"] == len(data)
            assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert not list(run8.glob(".*tmp*")), "no temporary file is left behind"


def test_a_new_run_never_writes_over_a_run(run8: Path, capsys: pytest.CaptureFixture) -> None:
    before = {p: p.stat().st_mtime_ns for p in run8.rglob("*")}
    err = refused([*RUN, "--out", str(run8)], capsys)
    assert f"{run8} already holds a run (checkpoints up to step 8); continue it with " in err
    assert {p: p.stat().st_mtime_ns for p in run8.rglob("*")} == before


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "missing":
        path.unlink()
    elif how == "corrupted":
        middle = len(data) // 2
        flipped = bytes(b ^ 0xFF for b in data[middle : middle + 64])
        path.write_bytes(data[:middle] + flipped + data[middle + 64 :])
    else:
        raise AssertionError(how)


FILE_DAMAGE = {
    "truncated": "is truncated or overwritten",
    "empty": "is truncated or overwritten (0 bytes",
    "missing": "is missing",
    "corrupted": "is corrupted (its SHA-256 does not match)",
}


@pytest.mark.parametrize("how", list(FILE_DAMAGE))
def test_a_bad_checkpoint_file_is_one_line_that_names_it(
    run8: Path, tmp_path: Path, capsys: pytest.CaptureFixture, how: str
) -> None:
    run = copy_run(run8, tmp_path)
    folder = run / "checkpoints" / "step_000008"
    damage(folder / "rank1.pt", how)
    err = refused(["--resume", str(folder)], capsys)
    assert f"{folder / 'rank1.pt'} {FILE_DAMAGE[how]}" in err

    # Both checkpoints bad: nothing to fall back to.
    damage(run / "checkpoints" / "step_000006" / "rank0.pt", "corrupted")
    err = refused(["--resume", str(run)], capsys)
    assert f"{folder / 'rank1.pt'} {FILE_DAMAGE[how]}" in err
    assert err.endswith(", and no earlier checkpoint is usable\n")


def test_an_unreadable_marker_is_one_line(
    run8: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = copy_run(run8, tmp_path)
    folder = run / "checkpoints" / "step_000008"
    (folder / "complete").write_text("2\n")
    err = refused(["--resume", str(folder)], capsys)
    assert f"{folder / 'complete'} is unreadable or was written by an older onebit" in err


def test_resume_falls_back_and_continues_the_saved_schedule(run8: Path, tmp_path: Path) -> None:
    """A corrupted newest checkpoint: the resumed run warns, continues from the one before, and
    with a larger --steps follows the first launch's schedule and freeze step exactly."""
    run = copy_run(run8, tmp_path)
    damage(run / "checkpoints" / "step_000008" / "rank1.pt", "corrupted")
    result = onebit_train("--resume", run, "--steps", "12", "--keep", "3", "--no-progress")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warnings == [
        f"python -m onebit.train: warning: {run}/checkpoints/step_000008/rank1.pt is corrupted "
        "(its SHA-256 does not match); continuing from step 6 instead"
    ]
    straight, resumed = read_metrics(run8), read_metrics(run)
    assert [r["step"] for r in resumed] == list(range(1, 13))
    assert without_timing(resumed[:8]) == without_timing(straight), "steps 7-8 exactly again"
    lr = json.loads((run8 / "config.json").read_text())["lr"]
    assert [r["optim/lr"] for r in resumed[8:]] == [pytest.approx(0.1 * lr)] * 4, (
        "past the first launch's 8 steps the learning rate stays at its floor"
    )
    summaries = [json.loads((r / "summary.json").read_text()) for r in (run8, run)]
    assert summaries[1]["freeze_step"] == summaries[0]["freeze_step"] == 2
    assert summaries[1]["steps"] == 12
    assert checkpoint.steps(run) == [12, 10, 8], "--keep 3 given on resume"
    model = torch.load(run / "checkpoints" / "step_000008" / "rank0.pt")["model"]
    final = torch.load(run8 / "model.pt")
    assert all(torch.equal(model[k], final[k]) for k in final), "step 8 redone bit for bit"


def test_resume_auto_starts_continues_and_finishes(
    tmp_path: Path, data_cache: Path, capsys: pytest.CaptureFixture
) -> None:
    command = [*TINY, "--save-every", "2", "--resume", "auto", "--out", tmp_path / "run"]
    command += ["--cache-dir", data_cache]
    first = onebit_train(*command, "--steps", "4")
    assert first.returncode == 0, first.stderr
    assert checkpoint.steps(tmp_path / "run") == [4, 2]
    second = onebit_train(*command, "--steps", "6")
    assert second.returncode == 0, second.stderr
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[4]["time/elapsed_s"] > records[3]["time/elapsed_s"]
    third = onebit_train(*command, "--steps", "6")
    assert third.returncode == 0, third.stderr
    assert "already finished 6 steps" in third.stderr
    assert read_metrics(tmp_path / "run") == records

    err = refused([*map(str, command), "--lr", "0.5"], capsys)
    assert "holds a different run (--lr 0.001 there, 0.5 here); choose another --out" in err
