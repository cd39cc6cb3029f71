"""What every wire format is: a :class:`Communicator`, and what runs many of them at once.

A wire format is how one bucket's gradients travel, and each is a :class:`Communicator`: the
fp32 mean (:class:`~onebit.wire.mean.MeanAllreduce`), the quantized exchange of a compressed
warmup (bf16, int8, int4: :class:`~onebit.wire.quantized.QuantizedAllreduce`) and the 1-bit
two-phase allreduce (:class:`~onebit.wire.comm.CompressedAllreduce`). A step starts one call per
bucket, checks them all at once (:meth:`Communicator.received`) and commits them only if every
rank may (:func:`commit_compressed_`). The compressed ones have two phases and error feedback
(:class:`TwoPhase`), so that the functions here and :class:`~onebit.wire.exchange.Exchange` run
many buckets of either of them in one collective per phase.

Byte counts follow the usual bus-bandwidth convention: the bytes a bandwidth-optimal implementation
of the collective sends from this rank (``(n-1)/n`` of an all-to-all buffer, ``n-1`` chunks of an
all-gather, ``2(n-1)/n`` of an allreduce buffer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from .. import host
from .exchange import Exchange, phase_exchange


@runtime_checkable
class Communicator(Protocol):
    """One bucket's allreduce in one wire format. The compressed formats have two phases, with
    error feedback: each rank compresses its buffer and sends chunk ``j`` to rank ``j`` (phase
    1, an all-to-all); each rank then averages the chunk it serves and sends it to every rank
    (phase 2, an all-gather). The fp32 mean is one ``all_reduce``, whose phase 2 is empty.

    A call starts (:meth:`start`), is checked (:meth:`worker_scales`: every rank's scales are
    finite, and :meth:`headers` agree; :meth:`received` for a step's buckets at once) and only
    then committed (:meth:`serve` updates the error buffers, :meth:`finish` writes the mean), so
    a step that some rank cannot take changes nothing on any rank. The error buffers are the
    state (:meth:`state_dict`).

    Attributes:
        numel, padded_numel: elements per call, and as the buffer holds them (padded so that
            every rank's chunk is whole).
        world_size, group, device: the group it averages over, and where its buffers are.
        header_numel: fp32 values each rank attaches to a call, which every rank receives.
        batches: whether the calls of many buckets send each phase in one collective (an
            :class:`~onebit.wire.exchange.Exchange`); the fp32 mean's are collectives of their
            own.
        phase1_width, phase2_width: bytes of a row of each phase's message (an
            :class:`~onebit.wire.exchange.Exchange` part).
        bytes_per_call: bytes this rank sends per call.
    """

    numel: int
    padded_numel: int
    world_size: int
    group: dist.ProcessGroup | None
    device: torch.device
    header_numel: int
    batches: bool

    @property
    def phase1_width(self) -> int: ...

    @property
    def phase2_width(self) -> int: ...

    @property
    def bytes_per_call(self) -> int: ...

    def start(
        self,
        buffer: Tensor,
        header: Tensor | None = None,
        exchange: tuple[Exchange, int] | None = None,
    ) -> Any:
        """Compress ``buffer`` (``padded_numel`` fp32, overwritten) and send phase 1, or write
        it into part ``exchange[1]`` of ``exchange[0]``; returns the call in flight."""
        ...

    def worker_scales(self, call: Any) -> Tensor:
        """Wait for phase 1; every rank's scales (finite if its input was)."""
        ...

    def headers(self, call: Any) -> Tensor:
        """Every rank's header, ``[world_size, header_numel]`` fp32."""
        ...

    @classmethod
    def received(cls, comms: Sequence[Any], calls: Sequence[Any]) -> tuple[Tensor, Tensor]:
        """Wait for phase 1 of a step's calls, one per bucket of ``comms`` (communicators of
        this class, in bucket order; the last bucket's message leaves first). Returns every
        rank's step header, ``[world_size, header_numel]``: the last bucket's, with the status
        that any bucket found; and a tensor that is finite (or true) if every rank's values
        were (:meth:`~onebit.transport.header.OpenStep.verdict` reads the two)."""
        ...

    def serve(self, call: Any, *, exchange: tuple[Exchange, int] | None = None) -> None:
        """Commit the worker error, compress the chunk this rank serves with the server error,
        send phase 2 (or write it into ``exchange``)."""
        ...

    def finish(self, call: Any, out: Tensor | None) -> None:
        """Wait for phase 2 and write the mean, ``numel`` elements, into ``out``."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def reset(self) -> None:
        """Zero the error buffers."""
        ...


class TwoPhase:
    """What the two-phase compressed formats share: their calls batch, and a step's check is
    every call's worker scales and the headers of all of them."""

    batches = True

    @classmethod
    def received(cls, comms: Sequence[Any], calls: Sequence[Any]) -> tuple[Tensor, Tensor]:
        """:meth:`Communicator.received`: the scales of every call (:func:`scales_finite`)."""
        finite = scales_finite(comms, calls)
        headers = torch.stack([c.headers(call) for c, call in zip(comms, calls)])
        first = headers[-1].clone()  # the bucket sent first; any bucket's status counts
        first[:, 2] = headers[:, :, 2].amax(0)
        return first, finite


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """World size and rank in ``group``; ``(1, 0)`` when no process group is initialised."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce of an ``nbytes`` buffer."""
    return 2 * nbytes * (world_size - 1) // world_size


def reduce_compressed_(
    comms: Sequence[Communicator], buffers: Sequence[Tensor], outputs: Sequence[Tensor | None]
) -> bool:
    """Run several compressed allreduces at once, all or nothing.

    ``buffers[i]`` (``comms[i].padded_numel`` fp32, overwritten) is reduced into ``outputs[i]``.
    Each phase is one collective for all of them (:class:`~onebit.wire.exchange.Exchange`). If any
    rank's scale in any bucket is non-finite, returns ``False`` on every rank, with the error
    buffers and ``outputs`` untouched.
    """
    if not comms:
        return True
    with phase_exchange(comms, 1).filling() as exchange:
        calls = [
            comm.start(buffer, exchange=(exchange, i))
            for i, (comm, buffer) in enumerate(zip(comms, buffers))
        ]
    return finish_compressed_(comms, calls, outputs)


def finish_compressed_(
    comms: Sequence[Communicator], calls: Sequence[Any], outputs: Sequence[Tensor | None]
) -> bool:
    """Complete calls begun by :meth:`Communicator.start`, as :func:`reduce_compressed_`."""
    if not host.read(scales_finite(comms, calls)):
        return False
    commit_compressed_(comms, calls, outputs)
    return True


def scales_finite(comms: Sequence[Communicator], calls: Sequence[Any]) -> Tensor:
    """Wait for phase 1 of every call; whether every rank's worker scales are finite, as a
    boolean tensor on the device."""
    scales = [comm.worker_scales(call).reshape(-1) for comm, call in zip(comms, calls)]
    if not scales:
        return torch.ones((), dtype=torch.bool)
    return torch.isfinite(torch.cat(scales)).all()


def commit_compressed_(
    comms: Sequence[Communicator], calls: Sequence[Any], outputs: Sequence[Tensor | None]
) -> None:
    """Serve and finish calls whose phase 1 is done and whose scales are all finite: phase 2 of
    every call in one collective (:class:`~onebit.wire.exchange.Exchange`) where they batch."""
    if not comms:
        return
    if not comms[0].batches:
        for comm, call, out in zip(comms, calls, outputs):
            comm.serve(call)
            comm.finish(call, out)
        return
    with phase_exchange(comms, 2).filling() as exchange:
        for i, (comm, call) in enumerate(zip(comms, calls)):
            comm.serve(call, exchange=(exchange, i))
    for comm, call, out in zip(comms, calls, outputs):
        comm.finish(call, out)
