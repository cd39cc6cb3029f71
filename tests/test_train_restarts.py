"""``onebit train`` survives a killed worker, locally (``--max-restarts``) and under torchrun
(``torchrun --max-restarts`` with ``--resume auto``), ending bit for bit where an uninterrupted run
ends; and a finished run exits 0 every time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_cli import TINY, clean_env, onebit_train, read_metrics, without_timing

from onebit.train import optim

pytestmark = pytest.mark.slow

RUN = [*TINY, "--steps", "60", "--eval-every", "20", "--freeze-step", "6", "--save-every", "5"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    out = tmp_path_factory.mktemp("runs") / "uninterrupted"
    result = onebit_train(*RUN, "--out", out, "--cache-dir", data_cache)
    assert result.returncode == 0, result.stderr
    return out


def descendants(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [d for c in children for d in (c, *descendants(c))]


def kill_a_worker(command: list[str], out: Path, is_worker, timeout: float = 300) -> tuple:
    """Start ``command``; once ``out`` has its step-10 checkpoint, SIGKILL one worker (the first
    descendant process that ``is_worker(pid)``). Return (the finished process, its stderr)."""
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=clean_env()
    )
    deadline = time.monotonic() + timeout
    try:
        while not (out / "checkpoints" / "step_000010" / "complete").exists():
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "no checkpoint at step 10"
            time.sleep(0.005)
        worker = next(pid for pid in descendants(process.pid) if is_worker(pid))
        os.kill(worker, signal.SIGKILL)
        logged = (out / "metrics.jsonl").read_text().count("\n")
        _, err = process.communicate(timeout=max(1, deadline - time.monotonic()))
    finally:
        process.kill()
    assert logged < 60, "the worker was killed before the run ended"
    return process, err


def assert_same_run(run: Path, uninterrupted: Path) -> None:
    assert without_timing(read_metrics(run)) == without_timing(read_metrics(uninterrupted))
    final, straight = torch.load(run / "model.pt"), torch.load(uninterrupted / "model.pt")
    assert final.keys() == straight.keys()
    assert all(torch.equal(final[k], straight[k]) for k in final), "bitwise the same model"


def test_local_launcher_restarts_a_killed_worker(
    tmp_path: Path, data_cache: Path, uninterrupted: Path
) -> None:
    out = tmp_path / "run"
    command = [sys.executable, "-m", "onebit.train", *RUN, "--max-restarts", "1"]
    command += ["--out", str(out), "--cache-dir", str(data_cache)]

    def is_worker(pid: int) -> bool:  # forked by the forkserver, not the server itself
        parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        return b"forkserver" in Path(f"/proc/{parent}/cmdline").read_bytes()

    process, err = kill_a_worker(command, out, is_worker)
    assert process.returncode == 0, err
    assert "was killed by SIGKILL; restart 1 of 1, from step " in err
    assert_same_run(out, uninterrupted)


def test_torchrun_restarts_a_killed_rank_with_resume_auto(
    tmp_path: Path, data_cache: Path, uninterrupted: Path
) -> None:
    out = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command = [*torchrun, "--max-restarts", "1", "-m", "onebit.train"]
    command += [*RUN, "--resume", "auto", "--out", str(out), "--cache-dir", str(data_cache)]

    def is_worker(pid: int) -> bool:
        return b"\0LOCAL_RANK=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()

    process, err = kill_a_worker(command, out, is_worker)
    assert process.returncode == 0, err
    assert "failed (exitcode: -9) local_rank: 1" in err
    assert_same_run(out, uninterrupted)


def test_six_runs_in_a_row_exit_0(tmp_path: Path, data_cache: Path) -> None:
    """The teardown once aborted about 1 run in 5 after the results were written; 6 runs catch
    that with 74% odds (20 did with 99%, at three times the time; every other test that runs
    onebit train would see it too). The runs still go through every optimizer, clipped and
    unclipped runs, and every AMP mode."""
    i = TINY.index("--freeze-step")
    base = [*TINY[:i], *TINY[i + 2 :], "--steps", "3", "--cache-dir", str(data_cache)]
    for i in range(6):
        name = optim.OPTIMIZERS[i % len(optim.OPTIMIZERS)]
        amp = [None, "bf16", "fp16"][i % 3]
        options = ["--optimizer", name, *(["--amp", amp] if amp else [])]
        options += ["--freeze-step", "2"] if optim.is_compressed(name) else []
        options += ["--grad-clip", "1.0"] if i % 2 else []
        out = tmp_path / str(i)
        result = onebit_train(*base, *options, "--out", out)
        assert result.returncode == 0, f"run {i} ({' '.join(options)}): {result.stderr}"
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["optimizer"], summary["amp"]) == (name, amp)
        assert summary["grad_clip"] == (1.0 if i % 2 else None)
