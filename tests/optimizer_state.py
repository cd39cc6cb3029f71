"""Helpers shared by the optimizer tests: checkpoint round trips and state memory."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one detached fp32 vector, in order."""
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def roundtrip(obj):
    """``obj`` saved with ``torch.save`` and loaded back, as a checkpoint would be."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def storage_bytes(opt: torch.optim.Optimizer, gradient_buffer: bool = False) -> int:
    """Bytes of every distinct tensor storage the optimizer holds (state, scratch, errors); with
    ``gradient_buffer``, the bucketer's gradient buffer too, if it holds one between steps."""
    from onebit.transport.sharding import local_tensor

    tensors = [
        local_tensor(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
    ]
    tensors += [t for t in vars(opt).values() if torch.is_tensor(t)]
    if gradient_buffer and opt.bucketer._buffer is not None:
        tensors.append(opt.bucketer._buffer)
    for comm in opt.comms:  # the buffers in use (the properties would make them)
        tensors += [e for e in (comm._worker_error, comm._server_error) if e is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def temporaries(call: Callable[[], Any], after: str | None = None) -> int:
    """``call()`` under torch's profiler: the most bytes of CPU tensors it held above what it
    still holds at its end (its temporaries, not the state it keeps), over the whole call, or
    only once the ``record_function`` range named ``after`` has ended. Exact: the allocator's
    events, not the process's memory."""
    with torch.profiler.profile(profile_memory=True) as prof:
        call()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    since = 0
    if after is not None:
        since = max(e.end_ns() for e in events if e.name() == after)
    live, peak = 0, None
    for event in events:
        if event.name() == "[memory]":
            live += event.nbytes()
            if event.start_ns() >= since:
                peak = live if peak is None else max(peak, live)
    return (peak or 0) - live
