"""Every value that crosses between the host and the optimizer's device during a step.

On a GPU, reading a device value on the host (``.item()``, ``bool(t)``, ``.tolist()``,
``.cpu()``) waits for every kernel queued before it: the CPU stops feeding the GPU until the
queue drains. A step therefore reads the device once for its verdict (the ranks' headers,
whether their values were finite, the gradient norm it clips with), whatever the number of
buckets; 0/1 Adam's sync step (its local step's verdict) and 1-bit LAMB (its layers' ratios)
read once more. A ``GradScaler``'s inverse scale stays on the device for Triton's passes,
which load it (:func:`~onebit.transport.header.gradient_factor`). Values the host computes
(headers, addresses, learning rates) go up with :func:`upload`, from pinned memory without
waiting.

Every read and upload of a step goes through :func:`read` and :func:`upload`, which count
themselves for :func:`counted`: ``benchmarks/launches.py`` prints the counts per step, and the
tests fail when a step reads a device value any other way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Transfers:
    """How many host reads (each one a synchronisation on a GPU) and uploads were made."""

    reads: int = 0
    uploads: int = 0


_COUNTERS: list[Transfers] = []


@contextlib.contextmanager
def counted() -> Iterator[Transfers]:
    """Count the reads and uploads made inside the ``with`` block (nested blocks count too)."""
    transfers = Transfers()
    _COUNTERS.append(transfers)
    try:
        yield transfers
    finally:
        _COUNTERS.remove(transfers)


def read(tensor: Tensor) -> Tensor:
    """``tensor``'s values on the host, in one copy: the only way a step reads the device."""
    for transfers in _COUNTERS:
        transfers.reads += 1
    return tensor.detach().to("cpu", copy=True)


def read_all(parts: Sequence[Tensor]) -> Tensor:
    """The values of ``parts`` (tensors of one dtype on one device) end to end on the host, in
    one :func:`read`. Where they already lie end to end in one buffer (a step that laid them
    out so), that span is read as it is, with no copy on the device first."""
    flat = [part.reshape(-1) for part in parts]
    whole = span(flat)
    return read(whole if whole is not None else torch.cat(flat))


def span(parts: list[Tensor]) -> Tensor | None:
    """The one flat view that ``parts`` (flat tensors) make up where each begins where the
    last ends in the same storage; else ``None``."""
    first = parts[0]
    storage, at = first.untyped_storage().data_ptr(), first.data_ptr()
    for part in parts:
        strided = part.numel() > 1 and part.stride(0) != 1
        moved = part.untyped_storage().data_ptr() != storage or part.data_ptr() != at
        if part.dtype != first.dtype or strided or moved:
            return None
        at += part.numel() * part.element_size()
    return first.as_strided((sum(part.numel() for part in parts),), (1,))


def upload(
    values: Tensor | Sequence | float, device: torch.device, dtype: torch.dtype | None = None
) -> Tensor:
    """``values`` (a host tensor, or numbers in nested sequences) as a tensor on ``device``, in
    one copy that does not wait for the device (from pinned memory on a GPU)."""
    for transfers in _COUNTERS:
        transfers.uploads += 1
    values = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


def upload_rows(
    rows: Sequence[Sequence[float]], device: torch.device, dtype: torch.dtype
) -> list[Tensor]:
    """Rows of numbers, all of one length, as tensors on ``device`` in one :func:`upload`, each
    starting on a 16-byte boundary. Triton compiles a variant of a kernel per alignment of its
    pointer arguments: rows end to end would make the number of values choose the variant."""
    width = len(rows[0])
    per = 16 // torch.empty((), dtype=dtype).element_size()
    padded = -(-width // per) * per
    table = upload([[*row, *[0] * (padded - width)] for row in rows], device, dtype)
    return [row[:width] for row in table]


class Uploaded:
    """Values on a device, uploaded again only when they change: the addresses of parameters
    (and usually of their gradients) and per-layer settings keep theirs from step to step."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._values: list | None = None
        self._tensor: Tensor | None = None

    def __call__(self, values: list, device: torch.device) -> Tensor:
        """``values`` on ``device``: the tensor of the last call if they are the same."""
        if self._tensor is None or values != self._values or self._tensor.device != device:
            self._tensor, self._values = upload(values, device, self.dtype), list(values)
        return self._tensor


def moved(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device`` (the host or the optimizer's device): itself if it is there,
    else a copy made by :func:`read` or :func:`upload`."""
    if tensor.device == device:
        return tensor
    return read(tensor) if device.type == "cpu" else upload(tensor, device)
