"""Training text: the Python standard library's source by default, or any file or folder.

The text is read as bytes, split deterministically into train and validation sets, and cached as
two flat byte files, so every worker, every optimizer in a comparison and a resumed run all read
exactly the same data. Batches are random windows drawn from a ``torch.Generator`` per rank,
whose state is saved in checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .model import MASK_TOKEN

VAL_EVERY = 10
"""One block of text in this many goes to the validation set."""

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


class DataError(ValueError):
    """The data cannot be used: missing, not text, or too small. Its message is user-facing."""


def stdlib_path() -> Path:
    """The installed Python standard library's source folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(source: Path) -> list[Path]:
    """The files to read from ``source``, in a fixed order.

    A file is itself. For a folder: every ``.py`` file if it is the standard library (its test
    suites and installed packages left out), otherwise every non-hidden file that is not binary.
    """
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise DataError(f"data path {source} does not exist")
    stdlib = source.resolve() == stdlib_path().resolve()
    files = []
    for dirpath, dirnames, filenames in os.walk(source):
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and not (stdlib and d in _SKIP_DIRS)
        )
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.startswith(".") or not path.is_file():
                continue
            if stdlib and not name.endswith(".py"):
                continue
            if not stdlib and _is_binary(path):
                continue
            files.append(path)
    return files


@dataclass
class Dataset:
    """Train and validation bytes (uint8 tensors) and where they are cached."""

    train: Tensor
    val: Tensor
    folder: Path
    digest: str

    def check_context(self, block_size: int) -> None:
        """Raise :class:`DataError` unless both splits hold a window of ``block_size + 1``."""
        for name, split in (("train", self.train), ("validation", self.val)):
            if len(split) <= block_size + 1:
                raise DataError(
                    f"data too small: the {name} split has {len(split)} bytes, the context "
                    f"length needs more than {block_size + 1} (use more text or a smaller "
                    "--block-size)"
                )


def prepare(source: Path | None, cache_dir: Path) -> Dataset:
    """Read ``source`` (default: the standard library), split it and cache the two splits.

    Files are joined in path order, then cut into blocks of at most 64 KiB (at least 20 blocks);
    every ``VAL_EVERY``-th block is validation text, the rest is training text. The cache key is
    the file list with sizes and modification times, so an edited source is read again.
    """
    source = stdlib_path() if source is None else Path(source)
    files = source_files(source)
    if not files:
        raise DataError(f"no text files found in {source}")
    fingerprint = hashlib.sha256(str(source.resolve()).encode())
    for path in files:
        stat = path.stat()
        fingerprint.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    folder = Path(cache_dir) / "data" / fingerprint.hexdigest()[:16]
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        text = b"\n".join(path.read_bytes() for path in files)
        block = max(1, min(2**16, len(text) // 20))
        blocks = [text[i : i + block] for i in range(0, len(text), block)]
        val = b"".join(blocks[VAL_EVERY - 1 :: VAL_EVERY])
        train = b"".join(b for i, b in enumerate(blocks) if i % VAL_EVERY != VAL_EVERY - 1)
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(folder / "train.bin", train)
        _write_atomic(folder / "val.bin", val)
        meta = {
            "source": str(source),
            "files": len(files),
            "train_bytes": len(train),
            "val_bytes": len(val),
            "digest": hashlib.sha256(train + val).hexdigest(),
        }
        _write_atomic(meta_path, json.dumps(meta, indent=1).encode())
    meta = json.loads(meta_path.read_text())
    return Dataset(
        train=_read_bytes(folder / "train.bin"),
        val=_read_bytes(folder / "val.bin"),
        folder=folder,
        digest=meta["digest"],
    )


def _is_binary(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" in f.read(8192)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file, so concurrent writers and readers never see half a file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read_bytes(path: Path) -> Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


def read_split(folder: Path, split: str) -> Tensor:
    """The cached ``"train"`` or ``"val"`` bytes in ``folder``, as made by :func:`prepare`."""
    return _read_bytes(Path(folder) / f"{split}.bin")


def get_batch(
    data: Tensor, batch_size: int, block_size: int, kind: str, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """A batch of random windows: ``(inputs, targets)`` of shape ``(batch_size, block_size)``.

    For ``kind="gpt"``, ``"cnn"`` or ``"rnn"`` the targets are the inputs shifted by one byte. For
    ``kind="bert"`` 15% of the positions are chosen; of those 80% become ``[MASK]``, 10% a random
    byte, 10% stay; targets are the original bytes there and -100 elsewhere.
    """
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    return windows(data, starts, block_size, kind, generator)


def windows(
    data: Tensor, starts: Tensor, block_size: int, kind: str, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Inputs and targets for the windows of ``data`` beginning at ``starts`` (see get_batch)."""
    index = starts[:, None] + torch.arange(block_size + 1)
    chunk = data[index].long()
    if kind != "bert":
        return chunk[:, :-1], chunk[:, 1:]
    x = chunk[:, :-1].clone()
    chosen = torch.rand(x.shape, generator=generator) < 0.15
    action = torch.rand(x.shape, generator=generator)
    noise = torch.randint(256, x.shape, generator=generator)
    targets = torch.where(chosen, x, torch.full_like(x, -100))
    x = torch.where(chosen & (action < 0.8), torch.full_like(x, MASK_TOKEN), x)
    x = torch.where(chosen & (action >= 0.8) & (action < 0.9), noise, x)
    return x, targets


def val_starts(data: Tensor, count: int, block_size: int) -> Tensor:
    """``count`` window starts evenly spread over ``data``: a fixed validation set."""
    last = len(data) - block_size - 1
    return torch.linspace(0, last, count).long()
