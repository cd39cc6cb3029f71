"""The ``--log`` metric backends, written and read back with the real packages."""

from __future__ import annotations

import csv
import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onebit.train import loggers
from onebit.train.loggers import KEYS, LoggerUnavailable, MetricLogger

STAGES = {1: "warmup", 2: "warmup", 3: "compression", 4: "compression", 5: "compression"}


def record(step: int, attempt: int = 0) -> dict:
    """A record as the training loop makes it; ``attempt`` shifts the loss so a resumed attempt's
    values are told apart from the first one's. Step 2 and 4 are evaluation steps."""
    r = {
        "step": step,
        "samples": 8 * step,
        "loss/train": 5.0 - step + attempt / 10,
        "optim/lr": 1e-3 * step,
        "optim/skipped_steps": 0,
        "comm/stage": STAGES.get(step, "compression"),
        "comm/bytes": 100 * step,
        "comm/bytes_total": 100 * step * (step + 1) // 2,
        "throughput/samples_per_s": 50.0,
        "time/elapsed_s": 0.5 * step,
    }
    if step % 2 == 0:
        r["loss/val"] = 5.5 - step + attempt / 10
    return {k: r[k] for k in KEYS if k in r}


def run(out: Path, backends: tuple[str, ...], steps, kept=(), start_step=0, attempt=0) -> None:
    with MetricLogger(
        backends, out, kept=list(kept), start_step=start_step, config={"lr": 1e-3}, name="t"
    ) as logger:
        for step in steps:
            logger.log(record(step, attempt))


def read_jsonl(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_parse_backends():
    assert loggers.parse_backends("jsonl") == ("jsonl",)
    assert loggers.parse_backends("csv") == ("jsonl", "csv")
    assert loggers.parse_backends("tensorboard, csv,jsonl") == ("jsonl", "tensorboard", "csv")
    assert loggers.parse_backends("jsonl,csv,tensorboard,wandb") == loggers.BACKENDS
    with pytest.raises(ValueError, match=r"unknown backend 'mlflow'; choose from jsonl, csv"):
        loggers.parse_backends("csv,mlflow")
    with pytest.raises(ValueError, match="empty item"):
        loggers.parse_backends("csv,,wandb")
    with pytest.raises(ValueError, match="empty item"):
        loggers.parse_backends("")
    with pytest.raises(ValueError, match="'csv' twice"):
        loggers.parse_backends("csv,wandb,csv")


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_check_available_missing_package(monkeypatch, name):
    monkeypatch.setenv("WANDB_MODE", "offline")
    loggers.check_available(("jsonl", name))
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(LoggerUnavailable) as e:
        loggers.check_available(("jsonl", "csv", name))
    assert str(e.value) == f"--log {name} needs the {name} package: pip install {name}"
    loggers.check_available(("jsonl", "csv"))


def test_check_available_wandb_online_needs_a_key(monkeypatch, tmp_path):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    with pytest.raises(LoggerUnavailable, match="no W&B API key") as e:
        loggers.check_available(("jsonl", "wandb"))
    assert "`wandb login`" in str(e.value) and "WANDB_MODE=offline" in str(e.value)
    assert "\n" not in str(e.value)

    for mode in ("offline", "disabled", "dryrun"):
        monkeypatch.setenv("WANDB_MODE", mode)
        loggers.check_available(("jsonl", "wandb"))
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(LoggerUnavailable):
        loggers.check_available(("jsonl", "wandb"))

    (tmp_path / "netrc").write_text("machine example.com login user password x\n")
    with pytest.raises(LoggerUnavailable):
        loggers.check_available(("jsonl", "wandb"))
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40)
    loggers.check_available(("jsonl", "wandb"))
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    with pytest.raises(LoggerUnavailable):
        loggers.check_available(("jsonl", "wandb"))
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    loggers.check_available(("jsonl", "wandb"))


def test_import_does_not_import_the_optional_packages():
    code = (
        "import sys\n"
        "from onebit.train import loggers\n"
        "loggers.check_available(('jsonl', 'csv'))\n"
        "heavy = {'tensorboard', 'torch.utils.tensorboard', 'wandb'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_jsonl_and_csv_rewrite_kept_records_on_resume(tmp_path):
    run(tmp_path, ("jsonl", "csv"), range(1, 6))
    first = read_jsonl(tmp_path)
    assert first == [record(step) for step in range(1, 6)]
    assert list(first[1]) == list(KEYS)
    assert list(first[0]) == [k for k in KEYS if k != "loss/val"]

    # Resume after step 3: the earlier attempt's steps 4 and 5 are replaced.
    run(tmp_path, ("jsonl", "csv"), [4, 5, 6], kept=first[:3], start_step=3, attempt=1)
    records = read_jsonl(tmp_path)
    assert records == first[:3] + [record(step, attempt=1) for step in (4, 5, 6)]

    with (tmp_path / "metrics.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(KEYS)
    assert [int(row[0]) for row in rows[1:]] == [1, 2, 3, 4, 5, 6]
    for row, r in zip(rows[1:], records):
        assert row == ["" if r.get(k) is None else str(r[k]) for k in KEYS]
    assert not list(tmp_path.glob("*.tmp"))


def test_jsonl_lines_are_on_disk_before_close(tmp_path):
    logger = MetricLogger(("csv",), tmp_path, kept=[], start_step=0, config={}, name="t")
    logger.log(record(1))
    logger.log(record(2))
    assert read_jsonl(tmp_path) == [record(1), record(2)]
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 3
    with pytest.raises(ValueError, match="keys from KEYS"):
        logger.log({**record(3), "loss/other": 1.0})
    logger.close()
    logger.close()


def tensorboard_scalars(log_dir: Path) -> tuple[dict[str, dict[int, float]], dict[int, str]]:
    """``{tag: {step: value}}`` of the scalars and ``{step: text}`` of ``comm/stage``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    stages = {
        e.step: e.tensor_proto.string_val[0].decode()
        for e in acc.Tensors("comm/stage/text_summary")
    }
    return scalars, stages


def test_tensorboard_scalars_and_resume_purge(tmp_path):
    pytest.importorskip("tensorboard")
    run(tmp_path, ("jsonl", "tensorboard"), range(1, 6))
    scalars, stages = tensorboard_scalars(tmp_path / "tensorboard")
    assert set(scalars) == set(KEYS) - {"step", "comm/stage"}
    assert scalars["loss/train"] == {s: pytest.approx(5.0 - s) for s in range(1, 6)}
    assert scalars["loss/val"] == {2: pytest.approx(3.5), 4: pytest.approx(1.5)}
    assert scalars["comm/bytes_total"] == {s: 50 * s * (s + 1) for s in range(1, 6)}
    assert stages == {1: "warmup", 3: "compression"}

    # Resume after step 3: TensorBoard forgets the first attempt's steps 4 and 5, even before
    # the resumed attempt logs a step.
    kept = read_jsonl(tmp_path)[:3]
    run(tmp_path, ("jsonl", "tensorboard"), [], kept=kept, start_step=3, attempt=1)
    scalars, _ = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["loss/train"] == pytest.approx({1: 4.0, 2: 3.0, 3: 2.0})
    run(tmp_path, ("jsonl", "tensorboard"), [4, 5, 6], kept=kept, start_step=3, attempt=1)
    scalars, _ = tensorboard_scalars(tmp_path / "tensorboard")
    expected = {s: 5.0 - s + (0.1 if s > 3 else 0) for s in range(1, 7)}
    assert scalars["loss/train"] == pytest.approx(expected)
    assert scalars["loss/val"] == pytest.approx({2: 3.5, 4: 1.6, 6: -0.4})

    # A run resumed into a new folder gets the kept records too.
    moved = tmp_path / "moved"
    moved.mkdir()
    run(moved, ("jsonl", "tensorboard"), [4], kept=kept, start_step=3, attempt=1)
    scalars, _ = tensorboard_scalars(moved / "tensorboard")
    assert scalars["loss/train"] == pytest.approx({1: 4.0, 2: 3.0, 3: 2.0, 4: 1.1})


def wandb_history(run_dir: Path, rows: int) -> list[dict]:
    """The history rows of an offline W&B run, waiting up to 20 s for ``rows`` of them: W&B's
    separate ``wandb-core`` process may still be writing the file after ``finish()``."""
    deadline = time.monotonic() + 20
    while len(history := _read_wandb_history(run_dir)) < rows and time.monotonic() < deadline:
        time.sleep(0.1)
    return history


def _read_wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline W&B run, read from its ``.wandb`` file with W&B's own
    protobuf messages (W&B writes no ``wandb-summary.json`` offline and has no public reader).
    The file is a LevelDB log: a 7-byte header, then 32 KiB blocks of chunks, each with a
    7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last). A record that
    ``wandb-core`` is still writing ends the rows read so far; the caller reads again."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    paths = list(run_dir.glob("run-*.wandb"))
    data = paths[0].read_bytes() if len(paths) == 1 else b""
    if data[:4] != b":W&B":
        return []
    rows, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (length == 0 and kind == 0) or pos + 7 + length > len(data):
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            try:
                rec = wandb_internal_pb2.Record.FromString(pending)
            except DecodeError:
                break
            pending = b""
            if rec.WhichOneof("record_type") == "history":
                items = {"/".join(i.nested_key) or i.key: i.value_json for i in rec.history.item}
                rows.append({k: json.loads(v) for k, v in items.items() if not k.startswith("_")})
    return rows


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    home = tmp_path / "wandb-home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    for var in ("CONFIG", "CACHE", "DATA", "ARTIFACT"):
        monkeypatch.setenv(f"WANDB_{var}_DIR", str(home / var.lower()))
    out = tmp_path / "run"
    out.mkdir()
    return out


def test_wandb_offline_one_run_across_attempts(wandb_offline):
    out = wandb_offline
    loggers.check_available(("jsonl", "wandb"))
    run(out, ("jsonl", "wandb"), range(1, 6))
    run_id = (out / "wandb_id").read_text().strip()
    (first,) = (out / "wandb").glob(f"offline-run-*-{run_id}*")
    history = wandb_history(first, 5)
    assert [row["loss/train"] for row in history] == [5.0 - s for s in range(1, 6)]
    assert history[1] == {k: v for k, v in record(2).items() if k != "step"}
    assert history[-1]["comm/stage"] == "compression"

    # Resume after step 3: same W&B run; steps 4 and 5 are already there, so only 6 and 7 go.
    kept = read_jsonl(out)[:3]
    run(out, ("jsonl", "wandb"), [4, 5, 6, 7], kept=kept, start_step=3, attempt=1)
    assert (out / "wandb_id").read_text().strip() == run_id
    (second,) = set((out / "wandb").glob(f"offline-run-*-{run_id}*")) - {first}
    history = wandb_history(second, 2)
    assert [(row["samples"], row["loss/train"]) for row in history] == [(48, -0.9), (56, -1.9)]


def test_wandb_offline_new_run_gets_the_kept_records(wandb_offline):
    out = wandb_offline
    kept = [record(step) for step in (1, 2, 3)]
    run(out, ("jsonl", "wandb"), [4], kept=kept, start_step=3, attempt=1)
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    assert [row["loss/train"] for row in wandb_history(run_dir, 4)] == [4.0, 3.0, 2.0, 1.1]
