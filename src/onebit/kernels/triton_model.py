"""The packed momentum's compression step over every bucket at once, in Triton: one launch per
pass, whatever the number of buckets.

A bucket at a time (:mod:`onebit.kernels.fused`), a step makes about twenty launches and copies
per bucket: on a GPU their CPU time, not the memory traffic, sets the step's time. Here the
buckets are laid end to end, each starting a block of its own, and every per-bucket value the
kernels need (where the bucket starts, its chunk, where its part of a message lies) is read from
small tables by the block. The passes write the signs straight into the step's messages
(:class:`~onebit.wire.exchange.Exchange`) and read the received ones where they arrived, so that no
message is copied; the scales and the header go into the messages with the launch that computes
the scales, and out of them in one indexed copy per phase.

The pieces, their sums and the scales are those of the per-bucket kernels of
:mod:`onebit.kernels.triton_kernels`, in the same order, so every bit is the same.

1-bit LAMB's step after its allreduce is two more passes (:func:`~.triton_model_passes._lamb_pass`),
which round each op as torch's do, but for the square root (correctly rounded here) and its
layers' norms (sums per piece, added in fp64).

This module builds the tables and launches the passes; the kernels are in
:mod:`.triton_model_passes`.
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor

from .. import host
from .fused import DTYPES, ModelGeometry, PackedMomentum
from .triton_common import (
    BLOCK,
    Tiling,
    lerp_coefficient,
    segments_to_scales,
)
from .triton_model_passes import (
    decompress_pass,
    input_pass,
    lamb_pass,
    placed_scales,
    serve_pass,
    sync_apply_pass,
    sync_progress_pass,
    update_pass,
    worker_pass,
)


class _Blocks:
    """Buckets' tilings laid end to end: each bucket ``b`` at ``origins[b]`` of one buffer, cut
    as :class:`~onebit.kernels.triton_common.Tiling` cuts it alone, with every index made
    global (pieces, blocks, and the tilings' columns and segments by the given offsets)."""

    def __init__(
        self,
        tilings: list[Tiling],
        origins: list[int],
        column_offsets: list[int],
        segment_counts: list[int] | None = None,
    ) -> None:
        starts, ends, columns, first, segment_first, lengths = [], [], [], [], [], []
        block_starts, block_buckets = [], []
        pieces = 0
        for b, (tiling, origin, offset) in enumerate(zip(tilings, origins, column_offsets)):
            starts.append(tiling.starts + origin)
            ends.append(tiling.ends + origin)
            columns.append(tiling.columns + offset)
            first.append(tiling.first[:-1] + pieces)
            empty = 0 if segment_counts is None else segment_counts[b] - tiling.count
            ends_at = torch.full((empty,), len(tiling.starts), dtype=torch.int64)
            segment_first.append(torch.cat([tiling.segment_first[:-1], ends_at]) + pieces)
            lengths.append(torch.cat([tiling.lengths, torch.zeros(empty, dtype=torch.int64)]))
            block_starts.append(torch.arange(tiling.blocks, dtype=torch.int64) * BLOCK + origin)
            block_buckets.append(torch.full((tiling.blocks,), b, dtype=torch.int64))
            pieces += len(tiling.starts)
        end = torch.tensor([pieces])
        self.pieces = pieces
        self.blocks = sum(t.blocks for t in tilings)
        self.segments = sum(t.count for t in tilings) if segment_counts is None else sum(
            segment_counts
        )  # fmt: skip
        self.starts, self.ends, self.columns = map(torch.cat, (starts, ends, columns))
        self.first = torch.cat([*first, end])
        self.segment_first = torch.cat([*segment_first, end])
        self.lengths = torch.cat(lengths)
        self.block_starts, self.block_buckets = torch.cat(block_starts), torch.cat(block_buckets)

    def to(self, device: torch.device) -> _Blocks:
        for name, value in vars(self).items():
            if torch.is_tensor(value):
                setattr(self, name, value.to(device, copy=True))
        return self

    def table(self) -> tuple[Tensor, ...]:
        return self.starts, self.ends, self.columns, self.first, self.block_starts, \
            self.block_buckets  # fmt: skip


def _cumulative(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        out.append(total)
        total += v
    return out


def _byte_index(rows: int, row_stride: int, offsets: list[int]) -> Tensor:
    """The bytes of fp32 values at byte ``offsets`` of each row of a message of ``rows`` rows:
    ``[rows * len(offsets) * 4]`` int64, row by row."""
    at = torch.tensor(offsets, dtype=torch.int64).reshape(-1, 1) + torch.arange(4)
    return (torch.arange(rows).reshape(-1, 1, 1) * row_stride + at).reshape(-1)


class ModelPasses:
    """The Triton passes of a :class:`~onebit.kernels.fused.ModelGeometry` on ``device``: the
    tables are built and uploaded once, each pass is one launch (two with its scales)."""

    def __init__(self, geometry: ModelGeometry, device: torch.device) -> None:
        g, n = geometry, geometry.world_size
        self.geometry, self.device = g, device
        self._input_blocks: _Blocks | None = None
        buckets = range(len(g.runs))
        origins, numels, counts = g.origins, g.numels, g.segment_counts
        self.segment_offsets = _cumulative(counts)
        self.column_offsets = _cumulative([n * c for c in g.server_columns])
        run_offsets = _cumulative([len(runs.runs) for runs in g.runs])
        tilings = []
        for runs in g.runs:
            table = runs.runs
            edges = torch.cat([table[:, 0], table[-1:, 1]])
            tilings.append(Tiling(edges, torch.arange(len(table)), int(edges[-1]),
                                  torch.device("cpu"), table[:, 2]))  # fmt: skip
        worker = _Blocks(tilings, origins, run_offsets)
        self._piece_params = torch.cat([runs.run_params for runs in g.runs])[worker.columns]
        self._layer_first: Tensor | None = None  # and _layer_ones: see _layer_pieces
        self._layer_ones: Tensor | None = None
        self.worker = worker.to(device)
        run_starts, run_segments, run_columns, run_params, run_offsets_ = [], [], [], [], []
        for b, runs in enumerate(g.runs):
            table = runs.runs
            run_starts.append(table[:, 0] + origins[b])
            run_segments.append(table[:, 2] + self.segment_offsets[b])
            run_columns.append(torch.where(table[:, 3] >= 0, table[:, 3] + self.column_offsets[b],
                                           -1))  # fmt: skip
            run_params.append(runs.run_params.clamp(min=0))
            run_offsets_.append(runs.run_offsets)
        on = dict(device=device, copy=True)
        self.run_tables = tuple(
            torch.cat(t).to(**on)
            for t in (run_starts, run_columns, run_segments, run_params, run_offsets_)
        )
        chunks = [numel // n for numel in numels]
        self.chunks = torch.tensor(chunks).to(**on)
        self.parts1 = torch.tensor(g.parts1).to(**on)
        self.parts2 = torch.tensor(g.parts2).to(**on)
        self.worker_bounds = (
            torch.tensor(origins).to(**on),
            torch.tensor([o + m for o, m in zip(origins, numels)]).to(**on),
        )
        # The server: its chunk of every bucket, end to end; each served piece its own scale,
        # and the columns a bucket's other chunks have more of, scales of 0.
        served_origins = _cumulative(chunks)
        self.served_offsets = _cumulative(g.server_columns)
        served_tilings = []
        for pieces, chunk in zip(g.served, chunks):
            edges = torch.cat([pieces[:, 0], pieces[-1:, 1]])
            served_tilings.append(Tiling(edges, torch.arange(len(pieces)), chunk,
                                         torch.device("cpu")))  # fmt: skip
        self.server = _Blocks(served_tilings, served_origins, self.served_offsets,
                              g.server_columns).to(device)  # fmt: skip
        piece_segments = torch.zeros(self.server.segments, dtype=torch.int64)
        for b, pieces in zip(buckets, g.served):
            at = self.served_offsets[b]
            piece_segments[at : at + len(pieces)] = pieces[:, 2] + self.segment_offsets[b]
        self.piece_segments = piece_segments.to(**on)
        self.server_bounds = (
            torch.tensor(served_origins).to(**on),
            torch.tensor([o + c for o, c in zip(served_origins, chunks)]).to(**on),
        )
        # Where the scales and headers lie in the messages (the header: the last bucket's).
        cb = [c // 8 for c in chunks]
        scale_at = [g.parts1[b] + cb[b] + 4 * q for b in buckets for q in range(counts[b])]
        self.header_at = g.parts1[-1] + cb[-1] + 4 * counts[-1]
        header_bytes = list(range(self.header_at, self.header_at + 4 * g.header_numel, 4))
        self.segments = sum(counts)
        self.scale_places = torch.tensor(scale_at, dtype=torch.int64).to(**on)
        self.phase1_read = torch.cat([  # and 4 bytes for the largest scale (received())
            _byte_index(n, g.width1, scale_at), _byte_index(n, g.width1, header_bytes),
            _byte_index(1, 0, [0]),
        ]).to(**on)  # fmt: skip
        sigma_at = [g.parts2[b] + cb[b] + 4 * i for b in buckets
                    for i in range(g.server_columns[b])]  # fmt: skip
        self.sigma_places = torch.tensor(sigma_at, dtype=torch.int64).to(**on)
        momentum_at = [  # column C_b + j * columns_b + i: row j, column i of bucket b
            j * g.width2 + sigma_at[self.served_offsets[b] + i]
            for b in buckets for j in range(n) for i in range(g.server_columns[b])
        ]  # fmt: skip
        self.phase2_read = _byte_index(1, 0, momentum_at).to(**on)

    # The worker.

    def _worker(
        self, grads: Tensor, inv_scale: float | Tensor | None, momentum: Tensor | PackedMomentum,
        weight: float, error: Tensor | None, post: Tensor | None, dtype: torch.dtype, *,
        message: Tensor | None = None, partials: Tensor | None = None, sums: str | None = None,
        scales: Tensor | None = None, out: Tensor | None = None,
    ) -> None:  # fmt: skip
        dense = not isinstance(momentum, PackedMomentum)
        bits = momentum if dense else momentum.bits
        masks = None if dense else momentum.masks
        coeff, small = lerp_coefficient(weight)
        any_ = bits
        blocks = self.worker
        worker_pass[(blocks.blocks,)](
            grads, 1.0 if inv_scale is None else inv_scale, momentum if dense else any_, bits,
            0 if dense else bits.stride(0), any_ if dense else momentum.scales,
            any_ if masks is None else masks, coeff,
            any_ if post is None else post, any_ if error is None else error, *self.run_tables,
            blocks.starts, blocks.ends, blocks.columns, blocks.first, blocks.block_starts,
            blocks.block_buckets, *self.worker_bounds, self.chunks, self.parts1, self.parts2,
            any_ if message is None else message, 0 if message is None else message.stride(0),
            any_ if partials is None else partials, any_ if scales is None else scales,
            any_ if out is None else out,
            BLOCK=BLOCK, USE_INV=inv_scale is not None, INV_PTR=torch.is_tensor(inv_scale),
            DENSE=dense, MASKED=masks is not None, SMALL=small, HAS_POST=post is not None,
            HAS_ERROR=error is not None, SIGNS=message is not None, SUMS=sums is not None,
            MEAN_ABS=sums == "mean_abs", COMMIT=scales is not None, ELEMENT=DTYPES.index(dtype),
        )  # fmt: skip

    def signs(
        self, grads: Tensor, inv_scale: float | Tensor | None, momentum: Tensor | PackedMomentum,
        weight: float, error: Tensor | None, post: Tensor | None, scale: str, headers: Tensor,
        message: Tensor, dtype: torch.dtype = torch.float32,
    ) -> Tensor:  # fmt: skip
        """Pass 1 of every bucket, gradients of ``dtype``: the signs of ``y`` into each bucket's
        part of the phase-1 ``message`` (``[world_size, width1]`` bytes), the segments' scales
        after them in every row, and the last row of ``headers`` (``[buckets, header_numel]``
        fp32; a step's are the same in every bucket) after the last bucket's. Returns the
        scales, fp32, every bucket's segments end to end."""
        blocks = self.worker
        partials = torch.empty(blocks.pieces, dtype=torch.float32, device=self.device)
        self._worker(grads, inv_scale, momentum, weight, error, post, dtype, message=message,
                     partials=partials, sums=scale)  # fmt: skip
        return self._scales(blocks, partials, scale, message, self.scale_places, headers)

    def commit(
        self, grads: Tensor, inv_scale: float | Tensor | None, momentum: Tensor | PackedMomentum,
        weight: float, error: Tensor | None, post: Tensor | None, scales: Tensor, out: Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        """Pass 2 of every bucket: ``out = y - ±scales`` (``out`` may be ``error`` or the dense
        ``momentum``)."""
        self._worker(grads, inv_scale, momentum, weight, error, post, dtype, scales=scales,
                     out=out)  # fmt: skip

    def received(self, received: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """From the phase-1 message as received: every rank's scales, ``[world_size,
        segments]``, and header, ``[world_size, header_numel]``, fp32, and the largest of the
        scales (0-d), which lies right after the headers so that a step reads both at once."""
        n = self.geometry.world_size
        values = received.view(-1)[self.phase1_read].view(torch.float32)
        scales = values[: n * self.segments].view(n, self.segments)
        largest = torch.amax(scales, dim=(0, 1), out=values[-1])
        return scales, values[n * self.segments : -1].view(n, -1), largest

    # A flat buffer of every bucket, reduced as it is (not a momentum).

    def _inputs(self) -> _Blocks:
        """The buckets cut by their segments, as ``compress_`` and ``segment_scales`` cut one."""
        if self._input_blocks is None:
            g, cpu = self.geometry, torch.device("cpu")
            tilings = [Tiling(bounds, torch.arange(len(bounds) - 1), numel, cpu)
                       for bounds, numel in zip(g.bounds, g.numels)]  # fmt: skip
            self._input_blocks = _Blocks(tilings, g.origins, self.segment_offsets).to(self.device)
        return self._input_blocks

    def _input(
        self, x: Tensor, error: Tensor | None, nx: int, *, post: Tensor | None = None,
        store: bool = False, message: Tensor | None = None, partials: Tensor | None = None,
        sums: str | None = None, scales: Tensor | None = None, out: Tensor | None = None,
    ) -> None:  # fmt: skip
        blocks = self._inputs()
        input_pass[(blocks.blocks,)](
            x, nx, x if post is None else post, x if error is None else error,
            *blocks.table()[:4], blocks.block_starts, blocks.block_buckets, *self.worker_bounds,
            self.chunks, self.parts1, x if message is None else message,
            0 if message is None else message.stride(0), x if partials is None else partials,
            x if scales is None else scales, x if out is None else out,
            BLOCK=BLOCK, HAS_POST=post is not None, HAS_ERROR=error is not None, STORE_Y=store,
            SIGNS=message is not None, SUMS=sums is not None, MEAN_ABS=sums == "mean_abs",
            COMMIT=scales is not None,
        )  # fmt: skip

    def compress(
        self, x: Tensor, error: Tensor | None, scale: str, headers: Tensor, message: Tensor,
        post: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        """``y = x·post + error`` (``None``: ones, zeros) over the flat buffer ``x`` of every
        bucket (its padding taken as zeros, whatever it holds; ``post`` as long as the
        buckets), stored over ``x``; its signs, scales and header into the phase-1 ``message``
        as :meth:`signs` writes them. Returns the scales."""
        blocks = self._inputs()
        partials = torch.empty(blocks.pieces, dtype=torch.float32, device=self.device)
        self._input(x, error, self.geometry.numel, post=post, store=True, message=message,
                    partials=partials, sums=scale)  # fmt: skip
        return self._scales(blocks, partials, scale, message, self.scale_places, headers)

    def subtract(self, y: Tensor, scales: Tensor, out: Tensor) -> None:
        """``out = y - ±scales`` of each segment, over every bucket (the worker error)."""
        self._input(y, None, y.numel(), scales=scales, out=out)

    def decompress(self, bits: Tensor, scales: Tensor, out: Tensor) -> None:
        """The result of every bucket into the flat ``out`` (its padding left as it is), from
        the phase-2 message as received (``bits``) and its scales (:meth:`momentum`)."""
        blocks = self.worker
        decompress_pass[(blocks.blocks,)](
            bits, bits.stride(0), scales, self.run_tables[1], blocks.starts, blocks.ends,
            blocks.columns, blocks.first, blocks.block_starts, blocks.block_buckets,
            *self.worker_bounds, self.chunks, self.parts2, out, BLOCK=BLOCK,
        )  # fmt: skip

    # The server.

    def serve(
        self, received: Tensor, scales: Tensor, store: Tensor, last: Tensor | None, scale: str,
        message: Tensor,
    ) -> Tensor:  # fmt: skip
        """Serve this rank's chunk of every bucket from the phase-1 message as ``received`` and
        every rank's ``scales`` (:meth:`received`): ``z`` into ``store`` (every bucket's
        chunk end to end), the error derived from it at the next call (``last``: the scales
        this returned then, else ``store`` holds the error), its signs and scales into the
        phase-2 ``message`` (``[1, width2]`` bytes). Returns the scales of every bucket's
        served pieces, end to end, each bucket's followed by zeros up to its
        ``server_columns``."""
        blocks = self.server
        partials = torch.empty(blocks.pieces, dtype=torch.float32, device=self.device)
        n = self.geometry.world_size
        serve_pass[(blocks.blocks,)](
            received, received.stride(0), n, scales, scales.stride(0),
            store if last is None else last, store, self.piece_segments, blocks.starts,
            blocks.ends, blocks.columns, blocks.first, blocks.block_starts, blocks.block_buckets,
            *self.server_bounds, self.chunks, self.parts1, self.parts2, message, partials,
            BLOCK=BLOCK, LAST=last is not None, MEAN_ABS=scale == "mean_abs",
        )  # fmt: skip
        return self._scales(blocks, partials, scale, message, self.sigma_places)

    def momentum(self, received: Tensor) -> Tensor:
        """The result's scales from the phase-2 message as received: each bucket's
        ``[world_size, server columns]`` fp32, flattened, end to end."""
        return received.view(-1)[self.phase2_read].view(torch.float32)

    # The update.

    def update(
        self, bases: Tensor, momentum: PackedMomentum, denominator: Tensor, decay: Tensor,
        value: Tensor, dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        """Pass 3 of every bucket (``fused.update``, parameters of ``dtype``), the momentum read
        from the last phase-2 message (``momentum.bits``, as received) and its scales
        (:meth:`momentum`)."""
        blocks, masks = self.worker, momentum.masks
        update_pass[(blocks.blocks,)](
            bases, momentum.bits, momentum.bits.stride(0), momentum.scales,
            momentum.bits if masks is None else masks, denominator, decay, value,
            self.run_tables[0], self.run_tables[1], self.run_tables[3], self.run_tables[4],
            blocks.starts, blocks.ends, blocks.columns, blocks.first, blocks.block_starts,
            blocks.block_buckets, *self.worker_bounds, self.chunks, self.parts2,
            BLOCK=BLOCK, MASKED=masks is not None, ELEMENT=DTYPES.index(dtype),
        )  # fmt: skip

    # 0/1 Adam's sync step.

    def sync_progress(
        self, bases: Tensor, momentum: Tensor, denominator: Tensor, anchor: Tensor,
        since: Tensor, step: tuple[Tensor, float | None, float, Tensor, Tensor] | None,
        error: Tensor, scale: str, headers: Tensor, message: Tensor,
    ) -> Tensor:  # fmt: skip
        """0/1 Adam's sync step up to its allreduce, as :meth:`compress` of its buffer: ``y``,
        the preconditioned progress ``(p' - since·anchor)·denominator`` plus the worker
        ``error``, over ``momentum`` (the flat fp32 buffers, every bucket end to end), and its
        signs, scales and the last row of ``headers`` into the phase-1 ``message``. ``p'``: the
        parameters (at ``bases``, fp32 addresses) after the local step ``step``: ``(gradient
        addresses, inverse scale or None, lerp weight 1 - β1, decay, value)``, as
        :meth:`update` takes them (``None``: no local step). ``since``: each parameter's weight
        decay since the last sync. Returns the scales."""
        grads, inv, weight, decay, value = step or (bases, None, 0.0, since, since)
        coeff, small = lerp_coefficient(weight)
        blocks, pieces = self.worker, self._inputs()  # the same blocks, cut two ways
        partials = torch.empty(pieces.pieces, dtype=torch.float32, device=self.device)
        sync_progress_pass[(blocks.blocks,)](
            grads, 1.0 if inv is None else inv, coeff, bases, momentum, denominator, anchor,
            decay, value, since, error, self.run_tables[0], self.run_tables[1],
            self.run_tables[3], self.run_tables[4], blocks.starts, blocks.ends, blocks.columns,
            blocks.first, blocks.block_starts, blocks.block_buckets, *self.worker_bounds,
            pieces.starts, pieces.ends, pieces.first, self.chunks, self.parts1, message,
            message.stride(0), partials,
            BLOCK=BLOCK, STEP=step is not None, USE_INV=inv is not None, SMALL=small,
            MEAN_ABS=scale == "mean_abs",
        )  # fmt: skip
        return self._scales(pieces, partials, scale, message, self.scale_places, headers)

    def sync_apply(
        self, bases: Tensor, result: tuple[Tensor, Tensor] | None, momentum: Tensor,
        denominator: Tensor, anchor: Tensor, since: Tensor, factor: Tensor,
    ) -> None:  # fmt: skip
        """After 0/1 Adam's allreduce of :meth:`sync_progress`'s buffer, from its ``result``
        (the phase-2 message as received and its scales, :meth:`~onebit.wire.model_allreduce.
        ModelAllreduce.commit`), the average ``u``: the new ``anchor``, ``anchor·since + u /
        denominator``, into ``anchor`` and the parameters, and the ``momentum`` ``u·factor``;
        ``result`` ``None`` (the allreduce was not applied): the parameters go back to
        ``anchor``, the momentum to zero."""
        blocks = self.worker
        bits, scales = (anchor.view(torch.uint8).view(1, -1), anchor) if result is None else result
        sync_apply_pass[(blocks.blocks,)](
            bases, bits, bits.stride(0), scales, momentum, denominator, anchor, since, factor,
            self.run_tables[0], self.run_tables[1], self.run_tables[3], self.run_tables[4],
            blocks.starts, blocks.ends, blocks.columns, blocks.first, blocks.block_starts,
            blocks.block_buckets, *self.worker_bounds, self.chunks, self.parts2,
            BLOCK=BLOCK, APPLIED=result is not None,
        )  # fmt: skip

    # 1-bit LAMB's step after its allreduce.

    def _lamb(
        self, bases: Tensor, new: PackedMomentum, frozen: Tensor, decay: Tensor, bc1: float, *,
        sizes: Tensor | None = None, last: Tensor | PackedMomentum | None = None,
        fresh: Tensor | None = None, coefficients: tuple[float, ...] = (0.0,) * 6,
        maxima: Tensor | None = None, partials: Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        blocks, dense = self.worker, not isinstance(last, PackedMomentum)
        last_bits = frozen if last is None else last if dense else last.bits
        any_ = frozen
        lamb_pass[(blocks.blocks,)](
            bases, new.bits, new.bits.stride(0), new.scales, last_bits,
            0 if dense else last_bits.stride(0), any_ if dense else last.scales,
            any_ if new.masks is None else new.masks, any_ if fresh is None else fresh, frozen,
            decay, any_ if sizes is None else sizes, any_ if maxima is None else maxima,
            any_ if partials is None else partials, blocks.pieces, *coefficients, bc1,
            *self.run_tables[:2], *self.run_tables[3:], *blocks.table(), *self.worker_bounds,
            self.chunks, self.parts2,
            BLOCK=BLOCK, UPDATE=sizes is not None, DENSE=dense, NORMS=partials is not None,
            ELEMENT=DTYPES.index(dtype), MASKED=new.masks is not None,
        )  # fmt: skip

    def lamb_ratios(
        self, bases: Tensor, new: PackedMomentum, last: Tensor | PackedMomentum, fresh: Tensor,
        frozen: Tensor, decay: Tensor, betas: tuple[float, float],
        bias_corrections: tuple[float, float], eps: float, norms: bool,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:  # fmt: skip
        """1-bit LAMB's pass after its allreduce (:func:`lamb_pass`): ``last`` and ``new``
        momentum (over their scaling) imply the averaged gradient, which goes into the fresh
        variance ``fresh`` (flat fp32, in place). Returns, fp32 on the device, each layer's
        largest ratio of the ``frozen`` denominator to the fresh one; with ``norms``, the last
        ``2·layers`` values are each layer's ``||u||`` and ``||u + decay·p||`` (``u = new /
        frozen / bc1``, Adam's update; the parameters at ``bases``, of ``dtype``, their weight
        decays ``decay``), from a 16-byte boundary, so that the number of layers does not choose the
        variant of the kernel that writes them."""
        layers = decay.numel()
        at = -(-layers // 4) * 4
        out = torch.zeros(at + 2 * layers if norms else layers, device=self.device)
        partials = None
        if norms:
            partials = torch.empty(2 * self.worker.pieces, device=self.device)
        beta1, beta2 = betas
        bc1, bc2 = bias_corrections
        coefficients = (-beta1, 1 - beta1, beta2, 1 - beta2, math.sqrt(bc2), eps)
        self._lamb(bases, new, frozen, decay, bc1, last=last, fresh=fresh,
                   coefficients=coefficients, maxima=out, partials=partials,
                   dtype=dtype)  # fmt: skip
        if norms:  # each layer's pieces' sums, added in fp64: the square root of the total
            first, ones = self._layer_pieces(layers)
            segments_to_scales[(2 * layers,)](partials, first, ones, out[at:], CHUNK=1024,
                                           MEAN_ABS=False)  # fmt: skip
        return out

    def lamb_update(
        self, bases: Tensor, new: PackedMomentum, frozen: Tensor, decay: Tensor, sizes: Tensor,
        bc1: float, dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        """1-bit LAMB's update: ``p = p - sizes[layer]·(u + decay·p)``, ``u`` as in
        :meth:`lamb_ratios`, rounded to the parameters' ``dtype``."""
        self._lamb(bases, new, frozen, decay, bc1, sizes=sizes, dtype=dtype)

    def _layer_pieces(self, layers: int) -> tuple[Tensor, Tensor]:
        """The worker pieces of each of ``layers`` layers, twice over (two sums per piece,
        end to end), as :func:`segments_to_scales` reads segments: where each layer's start
        (padding pieces, whose sums are 0, go with a neighbour), and lengths of 1."""
        if self._layer_first is None or len(self._layer_first) != 2 * layers + 1:
            params, count = self._piece_params, len(self._piece_params)
            starts = torch.full((layers + 1,), count, dtype=torch.int64)
            real = torch.nonzero(params >= 0).reshape(-1)
            starts.scatter_reduce_(0, params[real], real, "amin")
            starts = torch.flip(torch.cummin(torch.flip(starts, (0,)), 0).values, (0,))
            starts[0] = 0
            first = torch.cat([starts[:-1], starts[:-1] + count, torch.tensor([2 * count])])
            tables = host.upload(torch.cat([first, torch.ones(2 * layers, dtype=torch.int64)]),
                                 self.device)  # fmt: skip
            self._layer_first, self._layer_ones = tables[: len(first)], tables[len(first) :]
        return self._layer_first, self._layer_ones

    def _scales(
        self, blocks: _Blocks, partials: Tensor, scale: str, message: Tensor, places: Tensor,
        headers: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        """The segments' scales from their pieces' sums, also written into each row of
        ``message`` at ``places``; and the last row of ``headers`` (``[buckets,
        header_numel]`` fp32, contiguous) at :attr:`header_at`, if given."""
        out = torch.empty(blocks.segments, dtype=torch.float32, device=self.device)
        size = 0 if headers is None else 4 * headers.shape[-1]
        placed_scales[(blocks.segments + (headers is not None),)](
            partials, blocks.segment_first, blocks.lengths, out, message, message.shape[0],
            message.stride(0), places, message if headers is None else headers.view(torch.uint8),
            0 if headers is None else headers.numel() * 4 - size, self.header_at, CHUNK=1024,
            MEAN_ABS=scale == "mean_abs", HEADER_BYTES=size,
            HEADER_SPAN=max(triton.next_power_of_2(size), 1),
        )  # fmt: skip
        return out
