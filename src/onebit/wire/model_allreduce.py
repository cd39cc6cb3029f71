"""The 1-bit allreduce of every bucket of a flat layout at once, where the backend runs each pass
over all of them (the Triton kernels: :class:`~onebit.kernels.triton_model.ModelPasses`).

A bucket at a time, a step launches a few kernels and copies per bucket
(:class:`~onebit.wire.comm.CompressedAllreduce`); here each pass is one launch over the buckets laid
end to end, and each phase one collective (:class:`~onebit.wire.exchange.Exchange`) whose messages
the passes write and read in place. The bits are those of a bucket at a time: the communicators
keep their error buffers, as slices of one buffer each, and their state as before.

Callers: :class:`~onebit.wire.momentum.PackedMomentumStage` (1-bit Adam's compression step,
whose worker side is its own fused pass), the optimizers' compressed allreduce of a flat
buffer that is not a gradient (:meth:`ModelAllreduce.start`), and 0/1 Adam's sync, whose
worker pass takes its local step (:meth:`ModelAllreduce.start_from`) and whose pass after it
reads the result as it arrives (``commit(decompress=False)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import kernels
from ..kernels import fused
from ..state.layout import FlatLayout
from .comm import CompressedAllreduce
from .exchange import Exchange, part_offsets, phase_exchange
from .scales import ScaleGeometry


def bucket_runs(layout: FlatLayout, comms: list[CompressedAllreduce]) -> list[fused.BucketRuns]:
    """Each bucket of ``layout`` cut into runs (:class:`~onebit.kernels.fused.BucketRuns`): its
    parameters' parts, then its padding, each cut by the chunks; a run's scale is its piece's,
    or its chunk's where the communicator has one scale per chunk (no segments)."""
    runs = []
    for (start, end), comm in zip(layout.buckets, comms):
        segments, params, offsets = [], [], []
        for i, (o, n) in enumerate(zip(layout.offsets, layout.numels)):
            lo, hi = max(start, o), min(end, o + n)
            if lo < hi:
                segments.append(hi - lo)
                params.append(i)
                offsets.append(lo - o)
        if comm.padded_numel > end - start:
            segments.append(comm.padded_numel - (end - start))
            params.append(None)
            offsets.append(0)
        parts = segments[: len(segments) - (params[-1] is None)]
        pieces = ScaleGeometry(parts, comm.padded_numel, comm.world_size)  # as segments cut it
        runs.append(fused.BucketRuns(segments, pieces.served, comm.chunk_numel,
                                     comm.server_scale_count, params, offsets,
                                     per_chunk=comm.segments is None))  # fmt: skip
    return runs


Worker = Callable[[Tensor, Tensor, Tensor], Tensor]
"""A worker pass over every bucket: ``(errors, headers, message) -> scales``
(:meth:`ModelAllreduce.start_from`)."""


class ModelAllreduce:
    """Every bucket's compressed allreduce at once, for the communicators of a flat layout (one
    per bucket, with a scale per tensor or one per bucket).

    Args:
        layout: the optimizer's flat layout.
        comms: its communicators, one per bucket.
        runs: each bucket's runs (default: :func:`bucket_runs`).
    """

    def __init__(
        self,
        layout: FlatLayout,
        comms: list[CompressedAllreduce],
        runs: list[fused.BucketRuns] | None = None,
    ) -> None:
        self.layout, self.comms = layout, comms
        self.runs = bucket_runs(layout, comms) if runs is None else runs
        self.device = comms[0].device
        self._passes: list[Any] = []  # the backend's, made at first use
        self._errors: tuple[Tensor, list[Tensor]] | None = None  # a flat buffer's, end to end
        self._server: tuple[Tensor, list[Tensor]] | None = None  # the served chunks, end to end
        self._served: tuple[Tensor, list[Tensor]] | None = None  # the last served scales

    @staticmethod
    def applies(comms: list[CompressedAllreduce]) -> bool:
        """Whether these communicators suit it: some elements in each."""
        return bool(comms) and all(c.numel for c in comms)

    def passes(self) -> Any | None:
        """The backend's passes over every bucket at once, or ``None`` where it runs them a
        bucket at a time."""
        if not self._passes:
            backend = kernels.for_device(self.device)
            self._passes.append(backend.model_passes(self._geometry(), self.device))
        return self._passes[0]

    def _geometry(self) -> fused.ModelGeometry:
        comms = self.comms
        parts1, width1 = part_offsets([c.phase1_width for c in comms])
        parts2, width2 = part_offsets([c.phase2_width for c in comms])
        return fused.ModelGeometry(
            runs=self.runs,
            origins=[start for start, _ in self.layout.buckets],
            numels=[c.padded_numel for c in comms],
            numel=self.layout.numel,
            segment_counts=[c.worker_scale_count for c in comms],
            bounds=[c.scale_geometry.bounds for c in comms],
            served=[c.scale_geometry.served[c.rank] for c in comms],
            server_columns=[c.server_scale_count for c in comms],
            parts1=parts1,
            width1=width1,
            parts2=parts2,
            width2=width2,
            world_size=comms[0].world_size,
            header_numel=comms[0].header_numel,
        )

    # A flat buffer, reduced in place.

    def start(self, flat: Tensor, headers: Tensor, post: Tensor | None = None) -> ModelCall:
        """Worker compression of ``flat`` (``layout.padded_numel`` fp32: every bucket end to
        end, its padding taken as zeros; overwritten with ``y``), first multiplied by ``post``
        (``layout.numel`` fp32) if given, and phase 1, with the last row of ``headers``
        (``[buckets, header_numel]``)."""
        if flat.numel() != self.layout.padded_numel:
            raise ValueError(f"expected {self.layout.padded_numel} elements, got {flat.numel()}")

        def compress(errors: Tensor, headers: Tensor, message: Tensor) -> Tensor:
            scale = self.comms[0].scale
            return self.passes().compress(flat, errors, scale, headers, message, post)

        return self.start_from(flat, headers, compress)

    def start_from(self, flat: Tensor, headers: Tensor, worker: Worker) -> ModelCall:
        """:meth:`start` with the caller's own worker pass (0/1 Adam's sync takes its step in
        it): ``worker(errors, headers, message)`` writes ``y`` (``flat``'s values plus the
        worker ``errors``, every bucket end to end) over ``flat``, and its signs, scales and
        the last row of ``headers`` into the phase-1 ``message``, as
        :meth:`~onebit.kernels.triton_model.ModelPasses.compress` does; it returns the
        scales."""
        call = ModelCall(phase_exchange(self.comms, 1), flat)
        with call.exchange.filling() as exchange:
            call.scales = worker(self._worker_errors(), headers, exchange.message)
        return call

    def received(self, call: ModelCall) -> tuple[Tensor, Tensor]:
        """Wait for phase 1 of ``call``; every rank's header, ``[world_size, header_numel]``,
        and the largest of every rank's scales, finite if they all are."""
        call.received = call.exchange.received()
        call.rank_scales, headers, largest = self.passes().received(call.received)
        return headers, largest

    def commit(self, call: ModelCall, decompress: bool = True) -> tuple[Tensor, Tensor]:
        """After :meth:`received` found every scale finite: commit the worker errors, serve and
        send phase 2, and (``decompress``) write the result over ``flat``'s buckets (not its
        padding). Returns the phase-2 message as received and its scales (:meth:`serve`)."""
        passes = self.passes()
        passes.subtract(call.flat, call.scales, self._worker_errors())
        received, scales = self.serve(call)
        if decompress:
            passes.decompress(received, scales, call.flat)
        return received, scales

    def _worker_errors(self) -> Tensor:
        """Every communicator's worker error as a slice of one buffer (moved there at first)."""
        if self._errors is not None:
            errors, views = self._errors
            if all(c.kept_worker_error is v for c, v in zip(self.comms, views)):
                return errors
        dtype = self.comms[0].error_dtype
        errors = torch.zeros(self.layout.padded_numel, dtype=dtype, device=self.device)
        views = self.layout.bucket_views(errors, padded=True)
        for comm, view in zip(self.comms, views):
            if comm.kept_worker_error is not None:
                view.copy_(comm.kept_worker_error)
            comm.worker_error = view
        self._errors = (errors, views)
        return errors

    # The server, for both callers.

    def serve(self, call: ModelCall) -> tuple[Tensor, Tensor]:
        """Serve this rank's chunk of every bucket of ``call`` (after :meth:`received`) and send
        them (phase 2, one collective); return the phase-2 message as received and its scales
        (every bucket's ``[world_size, server_scale_count]``, flattened, end to end)."""
        passes, comms = self.passes(), self.comms
        store, last = self._server_store()
        with phase_exchange(comms, 2).filling() as exchange:
            sigma = passes.serve(call.received, call.rank_scales, store, last, comms[0].scale,
                                 exchange.message)  # fmt: skip
        offsets = passes.served_offsets
        served = [sigma[o : o + len(p)] for o, p in zip(offsets, passes.geometry.served)]
        self._served = (sigma, served)
        for comm, view, last_ in zip(comms, self._server[1], served):
            comm.hold_server_error(view, last_)
        received = exchange.received()
        return received, passes.momentum(received)

    def results(self, received: Tensor, scales: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each bucket's result, packed, as :meth:`~onebit.wire.comm.CompressedAllreduce.
        result_signs` gives it: views of :meth:`serve`'s message and scales."""
        g, n = self.passes().geometry, self.comms[0].world_size
        offsets = self.passes().column_offsets
        return [
            (received[:, p : p + c.chunk_numel // 8], scales[o : o + n * k].view(n, k))
            for c, p, o, k in zip(self.comms, g.parts2, offsets, g.server_columns)
        ]

    def _server_store(self) -> tuple[Tensor, Tensor | None]:
        """Every server error in one buffer, each communicator's a slice of it, and the scales
        of the last served pieces if it holds their ``z`` (:meth:`serve` left it so); a
        communicator whose buffer is elsewhere, or was settled, has its error copied in first
        and every error is settled."""
        comms = self.comms
        if self._server is None:
            numel, dtype = sum(c.chunk_numel for c in comms), comms[0].error_dtype
            store = torch.zeros(numel, dtype=dtype, device=self.device)
            self._server = (store, list(store.split([c.chunk_numel for c in comms])))
        store, views = self._server
        held = [c.server_buffers for c in comms]
        sigma, served = self._served or (None, [None] * len(comms))
        if all(b is v and last is s for (b, last), v, s in zip(held, views, served)):
            return store, sigma
        for comm, view, (buffer, _) in zip(comms, views, held):
            if buffer is not None:
                view.copy_(comm.server_error)  # settled first, where it held a z
            comm.hold_server_error(view)
        self._served = None
        return store, None


@dataclass
class ModelCall:
    """Every bucket's compressed allreduce, between its phases."""

    exchange: Exchange  # phase 1
    flat: Tensor | None = None  # the flat buffer reduced, for ModelAllreduce.start
    inputs: tuple[Any, ...] = ()  # the worker pass's arguments (PackedMomentumStage)
    keep: Sequence[Tensor] = ()  # tensors the inputs' addresses point into
    scales: Tensor | None = None  # this rank's worker scales
    received: Tensor | None = None  # the phase-1 message as received
    rank_scales: Tensor | None = None  # every rank's worker scales
