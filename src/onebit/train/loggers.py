"""Where ``onebit train --log`` writes each step's metrics: JSON lines, CSV, TensorBoard, W&B.

Only rank 0 logs. ``metrics.jsonl`` is always written because the summary, the plots and
``--resume`` read it back; the other backends get the same records under the same keys.
TensorBoard and W&B are optional packages, imported only when chosen, and
:func:`check_available` says what is missing before any worker starts.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import netrc
import os
import secrets
import string
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

from .checkpoint import atomic_write

BACKENDS = ("jsonl", "csv", "tensorboard", "wandb")

KEYS = (
    "step",
    "samples",
    "loss/train",
    "loss/val",
    "optim/lr",
    "optim/skipped_steps",
    "comm/stage",
    "comm/bytes",
    "comm/bytes_total",
    "throughput/samples_per_s",
    "time/elapsed_s",
)

# W&B modes that never talk to a server, so need no API key.
_LOCAL_WANDB_MODES = ("offline", "disabled", "dryrun")
# TensorBoard buffers events; flush at least this often so a crash or a live view loses little.
_TENSORBOARD_FLUSH_EVERY = 50


class LoggerUnavailable(ValueError):
    """A chosen ``--log`` backend cannot work here; the message says how to fix it."""


def parse_backends(text: str) -> tuple[str, ...]:
    """The backends named in ``--log``'s comma-separated ``text``, ``jsonl`` always first.

    ``jsonl`` is added when missing because the summary, the plots and ``--resume`` read
    ``metrics.jsonl``. Raises ``ValueError`` with a one-line message for an unknown name, an
    empty item or a repeated one.
    """
    names = [item.strip() for item in text.split(",")]
    chosen: list[str] = []
    for name in names:
        if not name:
            raise ValueError(f"--log {text!r} has an empty item; choose from {', '.join(BACKENDS)}")
        if name not in BACKENDS:
            raise ValueError(f"--log: unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
        if name in chosen:
            raise ValueError(f"--log names {name!r} twice")
        chosen.append(name)
    return ("jsonl", *(name for name in chosen if name != "jsonl"))


def check_available(backends: tuple[str, ...]) -> None:
    """Raise :class:`LoggerUnavailable` if a chosen backend cannot work here.

    Meant to run before any worker starts, so a missing package or W&B login fails in a second
    instead of after the data is prepared. Looks packages up without importing them.
    """
    for name in ("tensorboard", "wandb"):
        if name in backends and importlib.util.find_spec(name) is None:
            raise LoggerUnavailable(f"--log {name} needs the {name} package: pip install {name}")
    if "wandb" in backends and not _wandb_is_local() and not _wandb_has_credentials():
        raise LoggerUnavailable(
            "--log wandb finds no W&B API key: run `wandb login` or set WANDB_API_KEY, "
            "or set WANDB_MODE=offline to log locally and `wandb sync` later"
        )


def _wandb_is_local() -> bool:
    return os.environ.get("WANDB_MODE", "").strip().lower() in _LOCAL_WANDB_MODES


def _wandb_has_credentials() -> bool:
    """Whether W&B would find credentials: an API key, an identity token, or a netrc login for
    the W&B host (``WANDB_BASE_URL``, by default api.wandb.ai), where ``wandb login`` puts it."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    if netrc_env := os.environ.get("NETRC"):
        candidates = [Path(netrc_env).expanduser()]
    else:
        candidates = [Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()]
    for path in candidates:
        try:
            login = netrc.netrc(path).authenticators(host)
        except (OSError, netrc.NetrcParseError):
            continue
        if login and login[2]:
            return True
    return False


class MetricLogger:
    """Writes each record to every chosen backend, under the same keys.

    ``out`` is the run folder. ``kept`` are the records of an earlier attempt of this run up to
    and including ``start_step``, the step training resumes after (``[]`` and 0 for a fresh run):
    the file backends are rewritten with them, TensorBoard drops what an earlier attempt logged
    after ``start_step``, and W&B continues the same run. ``config`` and ``name`` label the
    W&B run. ``metrics.jsonl`` is written even if ``backends`` leaves it out, since the run's
    summary reads it back. Usable as a context manager.
    """

    def __init__(
        self,
        backends: tuple[str, ...],
        out: Path,
        *,
        kept: list[dict],
        start_step: int,
        config: dict,
        name: str,
    ) -> None:
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown logging backends {unknown}; choose from {BACKENDS}")
        out = Path(out)
        self._backends: list[_Backend] = []
        self._closed = False
        try:
            for backend in dict.fromkeys(("jsonl", *backends)):
                if backend == "jsonl":
                    self._backends.append(_Jsonl(out / "metrics.jsonl", kept))
                elif backend == "csv":
                    self._backends.append(_Csv(out / "metrics.csv", kept))
                elif backend == "tensorboard":
                    self._backends.append(_TensorBoard(out / "tensorboard", kept, start_step))
                else:
                    self._backends.append(_Wandb(out, kept, config, name))
        except BaseException:
            self.close()
            raise

    def log(self, record: dict) -> None:
        """Write one step's ``record`` (keys from :data:`KEYS`, ``step`` required) everywhere."""
        unknown = [key for key in record if key not in KEYS]
        if unknown or "step" not in record:
            raise ValueError(f"metric record needs 'step' and keys from KEYS; got {list(record)}")
        if self._closed:
            raise RuntimeError("MetricLogger.log after close")
        for backend in self._backends:
            backend.log(record)

    def close(self) -> None:
        """Flush and close every backend (all of them, even if one fails); idempotent."""
        if self._closed:
            return
        self._closed = True
        error: BaseException | None = None
        for backend in self._backends:
            try:
                backend.close()
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Backend:
    def log(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _rewrite(
    path: Path,
    write: Callable[[TextIO, Iterable[dict[str, Any]]], None],
    records: Iterable[dict[str, Any]],
) -> TextIO:
    """Replace ``path`` atomically with ``records`` (so a crash here keeps the old file), then
    return it opened for appending."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        write(f, records)
    os.replace(tmp, path)
    return path.open("a", newline="")


class _Jsonl(_Backend):
    """``metrics.jsonl``: one JSON object per line, flushed per record."""

    def __init__(self, path: Path, kept: list[dict[str, Any]]) -> None:
        self._file = _rewrite(path, self._write, kept)

    @staticmethod
    def _write(f: TextIO, records: Iterable[dict[str, Any]]) -> None:
        for record in records:
            f.write(json.dumps(record) + "\n")

    def log(self, record: dict[str, Any]) -> None:
        self._write(self._file, [record])
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class _Csv(_Backend):
    """``metrics.csv``: a ``KEYS`` header, one row per record, empty cells for missing keys."""

    def __init__(self, path: Path, kept: list[dict[str, Any]]) -> None:
        self._file = _rewrite(path, self._write_with_header, kept)
        self._writer = csv.DictWriter(self._file, fieldnames=KEYS, extrasaction="ignore")

    @staticmethod
    def _write_with_header(f: TextIO, records: Iterable[dict[str, Any]]) -> None:
        writer = csv.DictWriter(f, fieldnames=KEYS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)

    def log(self, record: dict[str, Any]) -> None:
        self._writer.writerow(record)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class _TensorBoard(_Backend):
    """Event files under ``tensorboard/``: numbers as scalars, strings as text when they change.

    On resume the writer purges the earlier attempt's steps after ``start_step``. A fresh log
    folder (say a run resumed into a new folder) gets the ``kept`` records first instead.
    """

    def __init__(self, log_dir: Path, kept: list[dict[str, Any]], start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        has_events = log_dir.is_dir() and any(log_dir.glob("events.out.tfevents.*"))
        purge_step = start_step + 1 if start_step and has_events else None
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        self._last_text: dict[str, str] = {}
        self._unflushed = 0
        if not has_events:
            for record in kept:
                self.log(record)

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key == "step" or value is None:
                continue
            if isinstance(value, str):
                if self._last_text.get(key) != value:
                    self._writer.add_text(key, value, global_step=step)
                    self._last_text[key] = value
            else:
                self._writer.add_scalar(key, value, global_step=step)
        self._unflushed += 1
        if "loss/val" in record or self._unflushed >= _TENSORBOARD_FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        self._writer.flush()
        self._unflushed = 0

    def close(self) -> None:
        self._writer.close()


class _Wandb(_Backend):
    """A W&B run whose id is kept in ``out/wandb_id``, so every attempt of a run is one W&B run.

    W&B cannot rewrite history and drops (with a warning per record) any step lower than the
    last one it has, so records up to the last step logged to this W&B run, kept in
    ``out/wandb_step``, are skipped: a resumed attempt's W&B charts keep the earlier attempt's
    values up to there and continue with the new ones after. The ``kept`` records are offered
    too, so a new W&B run (say a run resumed into a new folder) gets the whole history.
    """

    def __init__(self, out: Path, kept: list[dict[str, Any]], config: dict, name: str) -> None:
        import wandb

        id_file, self._step_file = out / "wandb_id", out / "wandb_step"
        self._last_step = -1
        if id_file.exists():
            run_id = id_file.read_text().strip()
            if self._step_file.exists():
                self._last_step = int(self._step_file.read_text())
        else:
            alphabet = string.ascii_lowercase + string.digits
            run_id = "".join(secrets.choice(alphabet) for _ in range(8))
            atomic_write(id_file, f"{run_id}\n".encode())
            self._step_file.unlink(missing_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "onebit"),
            dir=str(out),
            name=name,
            config=config,
            id=run_id,
            resume="allow",
        )
        for record in kept:
            self.log(record)

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if step <= self._last_step:
            return
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)
        self._last_step = step
        atomic_write(self._step_file, f"{step}\n".encode(), durable=False)

    def close(self) -> None:
        self.run.finish()
