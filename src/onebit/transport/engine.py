"""A step's exchange of the gradient buckets: what goes out, in which wire format, and the
verdict before anything is committed.

An optimizer's stage asks its :class:`Engine` for one exchange per step: the fp32 or quantized
average of the gradients (:meth:`Engine.average_gradients`), the 1-bit allreduce of the
gradient buffer (:meth:`Engine.compressed_allreduce`) or of a flat buffer of its own
(:meth:`Engine.reduce_compressed`), or the packed momentum's (:meth:`Engine.packed_allreduce`).
A stage names the wire format by its communicators, one per bucket
(:class:`~onebit.wire.protocol.Communicator`): :attr:`Engine.full_precision` (the fp32 mean's or
the quantized warmup's) or :attr:`Engine.comms` (the 1-bit ones). The engine starts the buckets
through the :class:`~onebit.transport.bucketer.Bucketer` (each through a :class:`Sender`, the
bucketer's one hook), or every bucket at once where the backend's passes can
(:class:`~onebit.wire.model_allreduce.ModelAllreduce`), reads the ranks' headers and returns the
verdict (:class:`~onebit.transport.header.OpenStep`), and commits only where every rank may.

It reaches up to its optimizer once: a bucket launched during backward opens the step
(``open_step``), since the step's hyperparameters are read when its first message leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import host
from ..kernels.fused import DTYPES, gradient_addresses
from ..state.layout import FlatLayout
from ..wire.comm import CompressedAllreduce
from ..wire.exchange import Exchange, phase_exchange
from ..wire.mean import MeanAllreduce
from ..wire.model_allreduce import ModelAllreduce, ModelCall
from ..wire.model_quantized import ModelQuantized
from ..wire.momentum import PackedMomentumStage, fused_parameters
from ..wire.protocol import Communicator, commit_compressed_
from ..wire.quantized import QuantizedAllreduce
from .bucketer import Bucketer
from .clipping import Clipping
from .header import HEADER_NUMEL, OpenStep, gradient_factor
from .sharding import Replicated

Prepare = Callable[[int, Tensor], None]
"""``prepare(k, grads)``: turn bucket ``k``'s gathered gradients, in place, into what its call
sends (1-bit Adam sends its momentum)."""


def bucket_communicators(
    layout: FlatLayout,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    scale_per: str,
    warmup_compression: str,
    error_dtype: torch.dtype,
) -> tuple[list[CompressedAllreduce], list[QuantizedAllreduce]]:
    """Each bucket's 1-bit communicator (a scale per tensor, or per bucket: ``scale_per``), and
    its quantized warmup communicator (none for an ``"fp32"`` ``warmup_compression``)."""
    buckets = [(k, end - start) for k, (start, end) in enumerate(layout.buckets)]
    segments = layout.segments if scale_per == "tensor" else lambda k: None
    comms = [
        CompressedAllreduce(
            numel,
            group=group,
            device=device,
            segments=segments(k),
            header_numel=HEADER_NUMEL,
            error_dtype=error_dtype,
        )
        for k, numel in buckets
    ]
    if warmup_compression == "fp32":
        return comms, []
    warmup_comms = [
        QuantizedAllreduce(
            numel,
            segments=layout.segments(k),
            bits=warmup_compression,
            group=group,
            device=device,
            header_numel=HEADER_NUMEL,
        )
        for k, numel in buckets
    ]
    return comms, warmup_comms


def mean_communicators(
    layout: FlatLayout,
    header_numel: int,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> list[MeanAllreduce]:
    """Each bucket's fp32 mean. The last bucket's, which leaves first, carries the step's
    headers (``header_numel`` values a rank) in the gradient buffer's slots after it
    (:meth:`Bucketer.header_slots`)."""
    last = len(layout.buckets) - 1
    return [
        MeanAllreduce(
            end - start,
            padded_numel=layout.padded_numel - start if k == last else None,
            group=group,
            device=device,
            header_numel=header_numel if k == last else 0,
        )
        for k, (start, end) in enumerate(layout.buckets)
    ]


class Engine:
    """The exchanges of one optimizer's steps over its buckets.

    Args:
        layout: the flat layout and its buckets.
        bucketer: gathers and launches the buckets.
        comms: each bucket's 1-bit :class:`~onebit.wire.comm.CompressedAllreduce`.
        warmup_comms: each bucket's :class:`~onebit.wire.quantized.QuantizedAllreduce` (empty for
            an fp32 warmup).
        process_group: the data-parallel group.
        shards: the parameters' shards (their verdicts and norms combine across the shard
            group).
        device: the parameters' device.
        backend: the kernels' backend (``"triton"`` takes gradient factors on the device).
        overlap: whether buckets go out during backward (``overlap_backward``).
        clipping: the optimizer's :class:`~onebit.transport.clipping.Clipping`.
        open_step: opens the step if it is not open, and returns it.

    Attributes:
        means: each bucket's fp32 :class:`~onebit.wire.mean.MeanAllreduce`.
    """

    def __init__(
        self,
        layout: FlatLayout,
        bucketer: Bucketer,
        comms: list[CompressedAllreduce],
        warmup_comms: list[QuantizedAllreduce],
        *,
        process_group: dist.ProcessGroup | None,
        shards: Replicated,
        device: torch.device,
        backend: str,
        overlap: bool,
        clipping: Clipping,
        open_step: Callable[[], OpenStep],
    ) -> None:
        self.layout, self.bucketer = layout, bucketer
        self.comms, self.warmup_comms = comms, warmup_comms
        self.process_group, self.shards = process_group, shards
        self.device, self.backend = device, backend
        self.overlap, self.clipping = overlap, clipping
        self._open_step = open_step
        self.means = mean_communicators(layout, HEADER_NUMEL, group=process_group, device=device)
        self._grad_addresses = host.Uploaded(torch.int64)
        self._bucket_grad_addresses: dict[int, host.Uploaded] = {}  # see _start_packed
        self._model: ModelAllreduce | None | bool = False  # False: not made yet
        self._quantized: ModelQuantized | None | bool = False

    @property
    def step(self) -> OpenStep:
        """The open step (opened now if it is not)."""
        return self._open_step()

    @property
    def grads(self) -> Tensor:
        """The bucketer's gradient buffer, up to the parameters' end: after a full-precision
        allreduce it holds the averaged gradient, and steps use it as scratch."""
        return self.bucketer.grads[: self.layout.numel]

    def gather_grads(self) -> Tensor:
        """Copy (and unscale, and clip: :meth:`clip_own_gradient`) every ``.grad`` into the flat
        gradient buffer; ``None`` counts as zero."""
        step = self.step
        if self.bucketer.gather(step.inv_scale):
            step.status = 1
        return self.grads

    def clip_own_gradient(self) -> None:
        """Open a 1-bit gradient step with clipping: :meth:`Clipping.own_gradient`."""
        if self.clipping.max_norm is None:
            return
        grads = [p.grad for p in self.layout.params]
        self.clipping.own_gradient(grads, self.shards, self.step, self.backend)

    def read_grad_scale(self, step: OpenStep, grad_scale: Tensor | float | None) -> None:
        """Take ``grad_scale``, which ``torch.amp.GradScaler.step`` set (``None`` once
        ``scaler.unscale_`` has unscaled ``.grad``), as ``step``'s gradient factor. A scaler's
        step raises where buckets already left during backward, scaled."""
        if self.bucketer.inflight:
            self.bucketer.abandon()
            raise RuntimeError(
                "overlap_backward sends gradients during backward, before torch.amp.GradScaler "
                "unscales them or passes its scale to step(): use overlap_backward=False with a "
                "GradScaler"
            )
        if grad_scale is not None:
            scale = torch.as_tensor(grad_scale, device=self.device)
            step.inv_scale = gradient_factor(scale.double().reciprocal().float(), self.backend)

    def end_warmup(self) -> None:
        """At the freeze: free the quantized warmup's error buffers, which tracked gradients
        that the compression stage no longer sends (they come back as zeros if used again)."""
        for comm in self.warmup_comms:
            comm.release()
        if self._quantized:  # its buffer held every bucket's errors
            self._quantized = False

    # Full precision: an fp32 or quantized average, bucket by bucket or every bucket at once.

    @property
    def full_precision(self) -> Sequence[Communicator]:
        """The communicators of a full-precision average: the quantized warmup's where the
        optimizer has them, else the fp32 mean's."""
        return self.warmup_comms or self.means

    def average_gradients(self) -> tuple[bool, int]:
        """Average the gradients at full precision into the gradient buffer
        (:attr:`full_precision`: every bucket at once where the backend quantizes them so) and
        clip the average; return (applied, bytes sent)."""
        g = self.grads
        model = None if self.overlap else self._model_quantized()
        if model is not None:
            self.gather_grads()
            applied, nbytes = self._reduce_quantized(model, g)
        else:
            applied, nbytes = self.communicate(self.full_precision, g)
        if applied:
            self.clipping.clip_averaged_(g, self.layout, self.shards)
        return applied, nbytes

    def communicate(
        self,
        comms: Sequence[Communicator],
        out: Tensor,
        *,
        fill: bool = True,
        prepare: Prepare | None = None,
        clip_norms: bool = False,
    ) -> tuple[bool, int]:
        """Launch every bucket not yet launched through ``comms`` (one per bucket, of one wire
        format), then complete them all into the flat buffer ``out`` (which may be the
        gradient buffer: in place).

        With ``fill`` the gradients are first gathered from ``.grad``: without ``overlap`` and
        ``prepare`` all at once, else each bucket as it launches, passed through ``prepare``;
        without it the caller has filled the gradient buffer. ``clip_norms``: see
        :meth:`sender`. Returns (applied, bytes sent); not applied means some rank had a
        non-finite value and nothing but the gradient buffer changed. Raises on every rank,
        before anything is committed, if the ranks' headers disagree.
        """
        if fill and prepare is None and not self.overlap:
            self.gather_grads()  # one multi-tensor copy, not one per bucket
            fill = False
        sender = _CommSender(self, comms, fill, prepare, clip_norms)
        calls = self.bucketer.launch_all(sender)
        return self._finish(comms, calls, self.layout.bucket_views(out), clip_norms)

    def _model_quantized(self) -> ModelQuantized | None:
        """The quantized warmup allreduce of every bucket at once (made at first use), where
        the backend has it; ``None`` where it runs a bucket at a time."""
        if self._quantized is False:
            self._quantized = ModelQuantized.build(self.layout, self.warmup_comms)
        return self._quantized

    def _reduce_quantized(self, model: ModelQuantized, out: Tensor) -> tuple[bool, int]:
        """The quantized average of the gradient buffer, every bucket at once, into ``out``
        (the buffer's buckets, or as long); returns (applied, bytes sent)."""
        flat = self.bucketer.grads[: self.layout.padded_numel]
        exchange = model.start(flat, self.step.all_headers())
        applied, _ = self.step.verdict(*model.received(exchange))
        if applied:
            model.commit(exchange, flat)
            if out.data_ptr() != flat.data_ptr():
                out.copy_(flat[: self.layout.numel])
        return applied, sum(c.bytes_per_call for c in self.warmup_comms)

    # 1-bit: the gradient buffer or a flat buffer of the optimizer's, with headers.

    def model_allreduce(self) -> ModelAllreduce | None:
        """The compressed allreduce of every bucket at once (made at first use), where the
        backend has it; ``None`` where it runs a bucket at a time."""
        if self._model is False:
            model = None
            if ModelAllreduce.applies(self.comms):
                model = ModelAllreduce(self.layout, self.comms)
                model = model if model.passes() is not None else None
            self._model = model
        return self._model

    def at_once(self) -> bool:
        """Whether a compressed allreduce of the gradient buffer sends every bucket at once: on
        the Triton kernels (:meth:`model_allreduce`), unless buckets go out during backward."""
        return not self.overlap and self.model_allreduce() is not None

    def compressed_allreduce(self) -> tuple[bool, int]:
        """Compressed allreduce, in place, of the flat gradient buffer that
        :meth:`gather_grads` filled (then changed as the step sends it); return
        (applied, bytes sent). Not applied means some rank had a non-finite value, and nothing
        but the buffer changed. Every bucket at once where :meth:`at_once`, else a bucket at
        a time, bit for bit the same."""
        if self.at_once():
            flat = self.bucketer.grads[: self.layout.padded_numel]  # y keeps the padding
            return self.reduce_compressed(flat)
        return self.communicate(self.comms, self.grads, fill=False)

    def reduce_compressed(self, flat: Tensor, post: Tensor | None = None) -> tuple[bool, int]:
        """Compressed allreduce, in place, of the flat buffer ``flat`` (``layout.padded_numel``:
        every bucket with its padding) times ``post`` (``layout.numel``, if given: multiplied
        in the worker's pass where the backend can), with headers; returns (applied, bytes
        sent). Not applied leaves the error buffers as they were and ``flat`` holding what it
        sent plus the error.

        ``flat`` holds gradients, what a compressed step sends in their place (1-bit Adam's
        momentum), or values that are not gradients (0/1 Adam's sync)."""
        step = self.step
        model = self.model_allreduce()
        if model is not None:  # every bucket at once
            applied, call = self.phase1_at_once(
                model, lambda headers: model.start(flat, headers, post)
            )
            if applied:
                model.commit(call)
            return applied, sum(c.bytes_per_call for c in self.comms)
        if post is not None:
            flat[: self.layout.numel].mul_(post)
        buffers = self.layout.bucket_views(flat, padded=True)
        with phase_exchange(self.comms, 1).filling() as exchange:
            calls = [
                comm.start(buffers[k], step.header_for(k), (exchange, k))
                for k, comm in enumerate(self.comms)
            ]
        outputs = self.layout.bucket_views(flat[: self.layout.numel])
        return self._finish(self.comms, calls, outputs)

    def phase1_at_once(
        self, model: ModelAllreduce, start: Callable[[Tensor], ModelCall]
    ) -> tuple[bool, ModelCall]:
        """Phase 1 of every bucket at once, ``start(headers)``, and its verdict: whether every
        rank's scales are finite and the headers agree. The caller commits."""
        step = self.step
        call = start(step.all_headers())
        applied, _ = step.verdict(*model.received(call))
        return applied, call

    def _finish(
        self,
        comms: Sequence[Communicator],
        calls: list[Any],
        outputs: Sequence[Tensor | None],
        clip_norms: bool = False,
    ) -> tuple[bool, int]:
        """Complete calls started with headers: check the headers and values of every bucket
        (:meth:`~onebit.wire.protocol.Communicator.received`), then serve and finish them
        (:func:`~onebit.wire.protocol.commit_compressed_`). With ``clip_norms``, where the
        bucketer clips, note the mean of the ranks' gradient norms that clipping scales the
        result by."""
        headers, finite = comms[0].received(comms, calls)
        norms2 = None
        if clip_norms and self.bucketer.clip:
            rows = torch.stack([c.headers(call)[:, 3] for c, call in zip(comms, calls)])
            # each rank's buckets summed in a row, as reduce_compressed sums its own
            norms2 = self.shards.sum_(rows.T.contiguous().sum(1))
        applied, norms2 = self.step.verdict(headers, finite, norms2)
        if applied:
            commit_compressed_(comms, calls, outputs)
        if applied and norms2 is not None:
            self.clipping.norm = float(norms2.sqrt().mean())
        return applied, sum(c.bytes_per_call for c in comms)

    # The packed momentum of 1-bit Adam and 1-bit LAMB (onebit.wire.momentum).

    def packed_allreduce(
        self,
        stage: PackedMomentumStage,
        scaling: Tensor | None = None,
        sender: Sender | None = None,
    ) -> tuple[bool, int, list[Any] | None]:
        """The compressed allreduce of a packed-momentum step: every bucket's fused passes read
        ``.grad`` (see :meth:`PackedMomentumStage.start`, ``scaling`` included); returns
        (applied, bytes sent, the calls to finish, or ``None`` where the backend's passes over
        every bucket at once made the results the momentum already). Under ``overlap``,
        ``sender`` (:meth:`packed_sender`) sends the buckets that backward did not launch."""
        if self.overlap:  # buckets that backward did not launch go now, one by one
            if sender is None:
                raise ValueError("overlap_backward: packed_allreduce needs the step's sender")
            calls = self.bucketer.launch_all(sender)
            applied, nbytes = self._finish(self.comms, calls, [None] * len(calls), True)
            return applied, nbytes, calls
        step, layout = self.step, self.layout
        addresses, keep, sparse = gradient_addresses(layout.params, layout.strides)
        grads = self._grad_addresses(addresses, self.device)
        if sparse:
            step.status = 1
        nbytes, beta1 = sum(c.bytes_per_call for c in self.comms), step.hyper.beta1
        if stage.passes() is not None:  # every bucket at once
            call = stage.start_all(grads, step.inv_scale, beta1, step.all_headers(), scaling, keep)
            applied, _ = step.verdict(*stage.model.received(call))
            if applied:
                stage.commit_all(call)
            return applied, nbytes, None
        calls: list[Any] = [None] * len(self.comms)
        with phase_exchange(self.comms, 1).filling() as exchange:
            for k in reversed(range(len(self.comms))):  # the bucketer's launch order
                calls[k] = stage.start(k, grads, step.inv_scale, beta1, step.header_for(k),
                                       scaling, (exchange, k), keep)  # fmt: skip
        applied, nbytes = self._finish(self.comms, calls, [None] * len(calls), True)
        return applied, nbytes, calls

    def _start_packed(
        self, stage: PackedMomentumStage, k: int, exchange: tuple[Exchange, int] | None
    ) -> Any:
        """Bucket ``k``'s fused pass 1 and phase 1 during backward, from the ``.grad`` of its
        parameters as soon as they are final (see :meth:`packed_allreduce`)."""
        layout, bucket, step = self.layout, self.layout.bucket_params[k], self.step
        found, keep, sparse = gradient_addresses([layout.params[i] for i in bucket],
                                                 [layout.strides[i] for i in bucket])  # fmt: skip
        addresses = [0] * len(layout.params)
        for i, address in zip(bucket, found):
            addresses[i] = address
        uploaded = self._bucket_grad_addresses.setdefault(k, host.Uploaded(torch.int64))
        grads = uploaded(addresses, self.device)
        header = step.header_for(k, sparse)
        return stage.start(k, grads, step.inv_scale, step.hyper.beta1, header, None, exchange,
                           keep)  # fmt: skip

    # Senders: what the bucketer calls when a bucket is ready.

    def sender(
        self,
        comms: Sequence[Communicator],
        *,
        prepare: Prepare | None = None,
        clip_norms: bool = False,
    ) -> Sender:
        """What the bucketer calls to send each bucket's gradients, gathered from ``.grad``,
        through ``comms`` (one per bucket), passed first through ``prepare`` if given. With
        ``clip_norms``, where the bucketer clips, each bucket's header carries its squared
        norm, by whose mean over the ranks a 1-bit mean of gradients sent during backward is
        clipped (SPEC 6; a full-precision average is clipped by its own norm)."""
        return _CommSender(self, comms, True, prepare, clip_norms)

    def packed_sender(self, stage: PackedMomentumStage, unpacked: Sender) -> Sender:
        """What the bucketer calls to send each bucket of a packed-momentum step: ``stage``'s
        fused passes, reading ``.grad`` (:meth:`packed_allreduce`), or ``unpacked`` where the
        parameters stopped suiting the fused kernels."""
        return _PackedSender(self, stage, unpacked)


class Sender:
    """What one step sends of each bucket: the :class:`~onebit.transport.bucketer.Sender` the
    bucketer calls when a bucket is ready. Its first call opens the step (during backward, with
    ``overlap_backward``), whose loss scale it gathers the gradients by."""

    comms: Sequence[Communicator] = ()

    def __init__(self, engine: Engine, fill: bool = True) -> None:
        self.engine, self.fill = engine, fill

    opened: OpenStep | None = None
    """The step its first call opened (or found open), which :meth:`abandon` closes."""

    def send(self, k: int, exchange: tuple[Exchange, int] | None) -> Any:
        self.opened = self.engine.step
        return self._start(k, exchange)

    def _start(self, k: int, exchange: tuple[Exchange, int] | None) -> Any:
        raise NotImplementedError

    def abandon(self, calls: dict[int, Any]) -> None:
        for k, call in calls.items():
            self.comms[k].worker_scales(call)
        if self.opened is not None:
            self.opened.close()


class _CommSender(Sender):
    """Each bucket's gradients through ``comms``, what ``prepare`` makes of them if given; where
    ``clip_norms`` and the bucketer clips, a header carries its bucket's squared norm."""

    def __init__(
        self,
        engine: Engine,
        comms: Sequence[Communicator],
        fill: bool,
        prepare: Prepare | None,
        clip_norms: bool,
    ) -> None:
        super().__init__(engine, fill)
        self.comms, self.prepare, self.clip_norms = comms, prepare, clip_norms

    def _start(self, k: int, exchange: tuple[Exchange, int] | None) -> Any:
        bucketer, comm, step = self.engine.bucketer, self.comms[k], self.opened
        sparse, norm2 = False, None
        if self.fill:
            sparse, norm2 = bucketer.fill(k, step.inv_scale, self.clip_norms)
            if self.prepare is not None:
                self.prepare(k, bucketer.buckets[k][: comm.numel])
        buffer = bucketer.buckets[k]
        if comm.padded_numel != buffer.numel():  # a mean's header slots follow its bucket
            start = self.engine.layout.buckets[k][0]
            buffer = bucketer.grads[start : start + comm.padded_numel]
        return comm.start(buffer, step.header_for(k, sparse, norm2), exchange)


class _PackedSender(Sender):
    """The packed momentum's fused pass 1 and phase 1, reading ``.grad``: nothing is gathered.
    Where the parameters stopped suiting the fused kernels (checked at the first bucket),
    ``unpacked``, a sender of the gathered gradients whose ``prepare`` unpacks the momentum."""

    fused: bool | None = None
    """Whether its buckets go through the fused passes (``None`` until the first is sent)."""

    def __init__(self, engine: Engine, stage: PackedMomentumStage, unpacked: Sender) -> None:
        super().__init__(engine)
        self.comms, self.stage, self.unpacked = engine.comms, stage, unpacked

    def _start(self, k: int, exchange: tuple[Exchange, int] | None) -> Any:
        engine = self.engine
        if self.fused is None:
            self.fused = fused_parameters(engine.layout, DTYPES)
        if not self.fused:
            return self.unpacked.send(k, exchange)
        return engine._start_packed(self.stage, k, exchange)
