"""``onebit train`` refuses bad input with one line and exit status 2, before any worker starts."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch
from train_cli import refused

NUMBERS = {
    "steps 0": (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    "steps 1.5": (["--steps", "1.5"], "argument --steps: expected an integer, got '1.5'"),
    "workers 0": (["--workers", "0"], "argument --workers: must be at least 1, got 0"),
    "batch size": (["--batch-size", "0"], "argument --batch-size: must be at least 1"),
    "block size": (["--block-size", "-1"], "argument --block-size: must be at least 1"),
    "layers": (["--layers", "0"], "argument --layers: must be at least 1"),
    "heads": (["--heads", "0"], "argument --heads: must be at least 1"),
    "width": (["--width", "0"], "argument --width: must be at least 1"),
    "eval every": (["--eval-every", "0"], "argument --eval-every: must be at least 1"),
    "eval windows": (["--eval-windows", "0"], "argument --eval-windows: must be at least 1"),
    "save every": (["--save-every", "-1"], "argument --save-every: must be at least 0"),
    "keep": (["--keep", "0"], "argument --keep: must be at least 1"),
    "max restarts": (["--max-restarts", "-1"], "argument --max-restarts: must be at least 0"),
    "bucket size": (["--bucket-size", "0"], "argument --bucket-size: must be at least 1"),
    "local step scaler": (["--local-step-scaler", "0"], "--local-step-scaler: must be at least 1"),
    "seed negative": (["--seed", "-1"], "argument --seed: must be at least 0"),
    "seed too large": (["--seed", str(2**32)], "argument --seed: must be at most 4294967295"),
    "freeze step 0": (["--freeze-step", "0"], "argument --freeze-step: must be at least 1"),
    "freeze step word": (["--freeze-step", "soon"], "--freeze-step: expected an integer"),
    "lr 0": (["--lr", "0"], "argument --lr: must be above 0, got 0"),
    "lr negative": (["--lr=-1e-3"], "argument --lr: must be above 0"),
    "lr nan": (["--lr", "nan"], "argument --lr: must be a finite number, got nan"),
    "lr inf": (["--lr", "inf"], "argument --lr: must be a finite number, got inf"),
    "lr word": (["--lr", "fast"], "argument --lr: expected a number, got 'fast'"),
    "weight decay nan": (["--weight-decay", "nan"], "--weight-decay: must be a finite number"),
    "weight decay -5": (["--weight-decay", "-5"], "--weight-decay: must be at least 0, got -5"),
    "weight decay inf": (["--weight-decay", "inf"], "--weight-decay: must be a finite number"),
    "grad clip 0": (["--grad-clip", "0"], "argument --grad-clip: must be above 0"),
    "grad clip nan": (["--grad-clip", "nan"], "argument --grad-clip: must be a finite number"),
    "amp": (["--amp", "fp8"], "argument --amp: invalid choice: 'fp8'"),
    "optimizer": (["--optimizer", "sgd"], "invalid choice: 'sgd'"),
    "device": (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    "model": (["--model", "t5"], "invalid choice: 't5'"),
    "log unknown": (["--log", "jsonl,tensorbored"], "unknown backend 'tensorbored'"),
    "log empty item": (["--log", "csv,,jsonl"], "has an empty item"),
    "log twice": (["--log", "csv,csv"], "names 'csv' twice"),
}

CONTRADICTIONS = {
    "freeze at the end": (["--steps", "10", "--freeze-step", "10"], "is not below --steps 10"),
    "freeze past the end": (["--freeze-step", "400"], "--freeze-step 400 is not below --steps"),
    "freeze for adamw": (
        ["--optimizer", "adamw", "--freeze-step", "5"],
        "--freeze-step applies only to the 1-bit optimizers",
    ),
    "no error feedback for adamw": (
        ["--compare", "adamw,lamb", "--no-error-feedback"],
        "--no-error-feedback applies only to the 1-bit optimizers",
    ),
    "local step scaler for adam": (
        ["--local-step-scaler", "4"],
        "--local-step-scaler applies only to zero-one-adam",
    ),
    "compare and optimizer": (
        ["--compare", "adamw,lamb", "--optimizer", "adamw"],
        "give either --optimizer or --compare",
    ),
    "compare twice": (["--compare", "adamw,adamw"], "--compare lists a run twice"),
    "compare unknown": (["--compare", "adamw,sgd"], "unknown optimizer 'sgd'"),
    "compare unknown variant": (
        ["--compare", "onebit-adam:warmup=int9"],
        "unknown variant 'warmup=int9' of onebit-adam in --compare",
    ),
    "compare variant of adamw": (["--compare", "adamw:no-ef"], "adamw has no variants"),
    "compare warmup of lamb": (
        ["--compare", "onebit-lamb,lamb:warmup=int8"],
        "lamb has no variants",
    ),
    "compare errors of another dtype": (
        ["--compare", "onebit-adam:errors=fp16"],
        "unknown variant 'errors=fp16' of onebit-adam",
    ),
    "error dtype for adamw": (
        ["--optimizer", "adamw", "--error-dtype", "bf16"],
        "--error-dtype applies only to the 1-bit optimizers",
    ),
    "compare local of onebit-adam": (
        ["--compare", "onebit-adam:local=4"],
        "unknown variant 'local=4' of onebit-adam",
    ),
    "compare freeze past the end": (
        ["--compare", "onebit-adam:freeze=9", "--steps", "5"],
        "freeze=9 in --compare is not below --steps 5",
    ),
    "warmup compression for adamw": (
        ["--optimizer", "adamw", "--warmup-compression", "int8"],
        "--warmup-compression applies only to the 1-bit optimizers",
    ),
    "compare and resume": (
        ["--compare", "adamw,lamb", "--resume", "auto"],
        "--resume continues one run; it cannot be combined with --compare",
    ),
    "compare and restarts": (
        ["--compare", "adamw,lamb", "--max-restarts", "1", "--save-every", "5"],
        "--max-restarts continues one run",
    ),
    "restarts without checkpoints": (
        ["--max-restarts", "1"],
        "--max-restarts needs --save-every N",
    ),
    "keep without checkpoints": (["--keep", "2"], "--keep needs --save-every N"),
    "shard not dividing the workers": (
        ["--workers", "4", "--shard", "3"],
        "--shard 3 does not divide the 4 workers into nodes",
    ),
    "shard with checkpoints": (
        ["--workers", "4", "--shard", "2", "--save-every", "5"],
        "--shard runs do not checkpoint yet",
    ),
    "width and heads": (["--width", "30", "--heads", "4"], "--width 30 is not a multiple"),
    "weight decay flips weights": (
        ["--lr", "0.01", "--weight-decay", "100"],
        "lr x weight decay must be below 1",
    ),
}

FILES = {
    "out is a file": (["--out", "{tmp}/file.txt"], "--out {tmp}/file.txt is a file, not a folder"),
    "out under a file": (["--out", "{tmp}/file.txt/run"], "{tmp}/file.txt is a file, not a folder"),
    "cache is a file": (["--cache-dir", "{tmp}/file.txt"], "--cache-dir {tmp}/file.txt is a file"),
    "missing data": (["--data", "{tmp}/nowhere"], "does not exist"),
    "small data": (["--data", "{tmp}/file.txt"], "data too small"),
    "resume nothing": (["--resume", "{tmp}"], "neither a run folder nor a checkpoint folder"),
    "resume a file": (["--resume", "{tmp}/file.txt"], "neither a run folder nor a checkpoint"),
}

CASES = {**NUMBERS, **CONTRADICTIONS, **FILES}


@pytest.fixture(scope="module")
def data() -> str:
    """A small real text file, so preparing the data takes no time."""
    return inspect.getsourcefile(inspect)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_status_2(
    case: str, tmp_path: Path, data: str, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "file.txt").write_text("print('hello')\n")
    args, message = CASES[case]
    base = ["--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "o")]
    if "--resume" not in args:
        base += ["--data", data]
    err = refused([*base, *(a.format(tmp=tmp_path) for a in args)], capsys)
    assert message.format(tmp=tmp_path) in err
    assert not (tmp_path / "o").exists(), "nothing is written before the input is checked"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_refused(
    tmp_path: Path, data: str, capsys: pytest.CaptureFixture
) -> None:
    err = refused(["--device", "cuda", "--data", data, "--out", tmp_path / "o"], capsys)
    assert "--device cuda, but torch.cuda.is_available() is False" in err
    assert not (tmp_path / "o").exists()


def test_under_torchrun_restarts_are_torchrun_s(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, data: str, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    base = ["--data", data, "--cache-dir", str(tmp_path)]
    err = refused([*base, "--max-restarts", "1", "--save-every", "5"], capsys)
    assert "give torchrun --max-restarts, and onebit --resume auto" in err
    err = refused([*base, "--workers", "3"], capsys)
    assert "--workers 3 but torchrun started 2 ranks" in err


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_missing_log_backend_says_how_to_install(
    package: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, package, None)
    err = refused(["--log", f"jsonl,{package}"], capsys)
    assert f"--log {package} needs the {package} package: pip install {package}" in err


def test_missing_extras_say_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    err = refused([], capsys)
    assert "needs matplotlib: pip install matplotlib," in err
