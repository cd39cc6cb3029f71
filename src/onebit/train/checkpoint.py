"""Checkpoints of ``onebit train``, made so that a crash at any moment loses nothing.

A checkpoint is the folder ``<run>/checkpoints/step_NNNNNN`` with one ``rankR.pt`` per rank
(model, optimizer state with its error-feedback buffers, data generator, counters) and the
marker ``complete``, which rank 0 writes last. Every file is written under a temporary name and
renamed into place, so a reader sees either the old file or the whole new one. The marker
records each rank file's size and SHA-256, so a truncated or corrupted file is found before
anything is loaded, and :func:`newest_usable` falls back to the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MARKER = "complete"


class CheckpointError(Exception):
    """A checkpoint cannot be used; the message is one line and names the file."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint folder."""

    folder: Path
    step: int
    world_size: int


def checkpoint_dir(run: Path, step: int) -> Path:
    return Path(run) / "checkpoints" / f"step_{step:06d}"


def atomic_write(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename; if ``durable``, flushed
    to disk first (not worth an fsync for a file rewritten at every step)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def to_bytes(obj: Any) -> bytes:
    """``obj`` as ``torch.save`` writes it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def save(run: Path, step: int, state: dict[str, Any], keep: int) -> None:
    """Save this rank's ``state`` as step ``step`` of ``run``; collective.

    Every rank writes its own file; rank 0 then writes the marker with every file's checksum
    and deletes all but the newest ``keep`` complete checkpoints up to this one.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    folder = checkpoint_dir(run, step)
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (folder / MARKER).unlink(missing_ok=True)
    data = to_bytes(state)
    name = f"rank{rank}.pt"
    atomic_write(folder / name, data)
    entry = {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    entries: list[Any] = [None] * world_size
    dist.all_gather_object(entries, entry)
    if rank == 0:
        marker = {"step": step, "world_size": world_size, "files": entries}
        atomic_write(folder / MARKER, (json.dumps(marker, indent=1) + "\n").encode())
        prune(run, keep, step)


def verify(folder: Path) -> Checkpoint:
    """Check a checkpoint folder against its marker; raise :class:`CheckpointError` if any file
    is missing, truncated or corrupted."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / MARKER).read_text())
        entries = marker["files"]
        step, world_size = int(marker["step"]), int(marker["world_size"])
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is not a complete checkpoint (no {MARKER} file)") from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{folder / MARKER} is unreadable or was written by an older onebit without checksums"
        ) from None
    for entry in entries:
        path = folder / entry["file"]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing") from None
        if len(data) != entry["bytes"]:
            raise CheckpointError(
                f"{path} is truncated or overwritten ({len(data)} bytes, expected {entry['bytes']})"
            )
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{path} is corrupted (its SHA-256 does not match)")
    return Checkpoint(folder, step, world_size)


def steps(run: Path, *, complete: bool = True) -> list[int]:
    """The steps of ``run``'s checkpoint folders (only those with a marker if ``complete``),
    newest first."""
    found = []
    for folder in (Path(run) / "checkpoints").glob("step_*"):
        if folder.name.removeprefix("step_").isdigit() and (
            not complete or (folder / MARKER).exists()
        ):
            found.append(int(folder.name.removeprefix("step_")))
    return sorted(found, reverse=True)


def newest_usable(run: Path, warn: Callable[[str], None]) -> Checkpoint | None:
    """The newest complete checkpoint of ``run`` that passes :func:`verify`, or ``None`` if
    ``run`` has no complete checkpoint.

    ``warn`` gets a line for each newer one skipped; if none passes, raises the newest one's
    :class:`CheckpointError`.
    """
    problems = []
    for step in steps(run):
        try:
            found = verify(checkpoint_dir(run, step))
        except CheckpointError as err:
            problems.append(str(err))
            continue
        for problem in problems:
            warn(f"{problem}; continuing from step {found.step} instead")
        return found
    if problems:
        raise CheckpointError(f"{problems[0]}, and no earlier checkpoint is usable")
    return None


def prune(run: Path, keep: int, step: int) -> None:
    """Delete every checkpoint folder of ``run`` older than the newest ``keep`` complete ones
    up to ``step``. Folders after ``step`` (from an attempt that got further) are left alone."""
    kept = [s for s in steps(run) if s <= step][:keep]
    if len(kept) < keep:
        return
    for old in steps(run, complete=False):
        if old < kept[-1]:
            shutil.rmtree(checkpoint_dir(run, old), ignore_errors=True)
