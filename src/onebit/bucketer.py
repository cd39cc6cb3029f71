"""The bucketer: when each bucket of gradients is gathered, launched and completed.

It is the part of torch's DDP ``Reducer`` that a onebit optimizer needs. It owns the gradient
buffer laid out by :class:`~onebit.layout.FlatLayout`, the order in which buckets launch, the
calls in flight, and the overlap with backward: the parameters' post-accumulate hooks,
``no_sync()``, and the bucket-ready calls of :func:`onebit.ddp_comm_hook`.

What a bucket sends and what its header says belong to the optimizer, which hands them in as
callbacks (see :class:`Bucketer`). Buckets launch in a fixed order, last first as backward
produces them, on every rank, so the collectives match across ranks however early each bucket
is launched.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Variable

from .comm import MeanAllreduce, group_size_and_rank
from .exchange import Exchange, phase_exchange
from .layout import FlatLayout

Prepare = Callable[[int, str, Tensor], None]
"""``prepare(k, kind, grads)``: turn bucket ``k``'s gathered gradients, in place, into what a
``kind`` call sends (1-bit Adam sends its momentum)."""

Header = Callable[[int | None, bool, Tensor | None], Tensor]
"""``header(k, sparse, norm2)``: this rank's header for bucket ``k`` (``None``: a message that is
not a gradient), given whether gathering it met a sparse gradient and its squared norm."""


class Bucketer:
    """Gathers, launches and collects the buckets of one optimizer's gradients.

    ``kind`` names what a call sends: ``"allreduce"`` (an fp32 mean, in place in the gradient
    buffer, with every rank's header in slots after it), ``"quantized"`` (through
    ``warmup_comms``), ``"compressed"`` (through ``comms``, 1 bit) or ``"packed"`` (1 bit, the
    call started by ``start`` from ``.grad``).

    Args:
        layout: the flat layout and its buckets.
        comms: the 1-bit communicators, one per bucket.
        warmup_comms: the quantized warmup's communicators (empty for an fp32 warmup).
        process_group: the group the fp32 allreduce runs on.
        header_numel: the length of one rank's header.
        clip: note each compressed bucket's squared gradient norm for its header (under
            ``overlap``, where the buckets leave before the whole gradient's norm is known).
        overlap: launch each bucket during backward as soon as its gradients are final.
        open_step: opens the optimizer's step (idempotent); runs before any launch.
        close_step: closes it without applying anything, after :meth:`abandon`.
        header: see :data:`Header`.
        prepare: see :data:`Prepare`; ``None`` sends the gradients themselves.
        start: starts bucket ``k``'s call of kind ``"packed"`` itself, ``start(k, exchange)``:
            the optimizer's fused passes read ``.grad``, so nothing is gathered.
        next_kind: what the next step sends, if it can be launched during backward, else
            ``None``.

    Attributes:
        backward_passes: backward passes seen by the hooks (the header's step check).
        armed: set by the optimizer after its first step in this process. Overlap starts only
            then: by that time a DDP-wrapped model has shown itself through the comm hook, and
            DDP's ``no_sync`` rather than the optimizer's governs accumulation.
        inflight: bucket index to its call in flight, of :attr:`inflight_kind`.
        grads_as_views: as DDP's ``gradient_as_bucket_view``, point each fp32 ``.grad`` at its
            place in the gradient buffer once backward has accumulated it (copying it there
            the first time). The gradients then take no memory beyond the buffer, and the step
            gathers them with no copy. Off by default: the optimizer turns it on where it uses
            the buffer for nothing but the gradients between steps (1-bit Adam's warmup), and
            calls :meth:`release` when that ends, leaving the buffer to the ``.grad`` views.
    """

    def __init__(
        self,
        layout: FlatLayout,
        comms: Sequence[Any],
        warmup_comms: Sequence[Any],
        process_group: dist.ProcessGroup | None,
        header_numel: int,
        *,
        clip: bool,
        overlap: bool,
        open_step: Callable[[], None],
        close_step: Callable[[], None],
        header: Header,
        prepare: Prepare | None = None,
        start: Callable[[int, tuple[Exchange, int] | None], Any] | None = None,
        next_kind: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.layout = layout
        self.comms, self.warmup_comms = list(comms), list(warmup_comms)
        self.process_group = process_group
        self.world_size, self.rank = group_size_and_rank(process_group)
        self.header_numel = header_numel
        self.device = layout.params[0].device
        self.clip, self.overlap = clip, overlap
        self.open_step, self.close_step = open_step, close_step
        self.header, self.prepare, self.next_kind = header, prepare, next_kind
        self.start = start
        self._buffer: Tensor | None = None
        self._bucket_views: list[Tensor] | None = None
        self.inflight: dict[int, Any] = {}
        self.inflight_kind = "allreduce"
        self._no_sync = False
        params = layout.params
        self._buckets_of_param = [
            [k for k, (s, e) in enumerate(layout.buckets) if s < o + n and o < e]
            for o, n in zip(layout.offsets, layout.numels)
        ]
        self._bucket_sizes = [0] * len(layout.buckets)
        for p, buckets in zip(params, self._buckets_of_param):
            for k in buckets:
                self._bucket_sizes[k] += p.requires_grad
        self._pending = list(self._bucket_sizes)
        self._norms2: list[Tensor | None] = [None] * len(self.comms)
        self._index = {id(p): i for i, p in enumerate(params)}
        self._seen_versions: list[int | None] | None = None
        self._hooked_by_ddp = False
        self._in_backward = False
        self.backward_passes = 0
        self.armed = False
        self.grads_as_views = False
        self._param_views: list[Tensor] | None = None
        self._install_hooks()

    def place(
        self, device: torch.device, comms: Sequence[Any], warmup_comms: Sequence[Any]
    ) -> None:
        """Work on ``device`` with these communicators from now on (the optimizer's state moved
        there); the gradient buffer is made anew on first use. Only between steps."""
        if self.inflight:
            raise RuntimeError("the optimizer's state cannot move while buckets are in flight")
        self.device = device
        self.comms, self.warmup_comms = list(comms), list(warmup_comms)
        self.release()

    # The gradient buffer.

    @property
    def grads(self) -> Tensor:
        """The gradient buffer: the buckets, padded, then one header slot per rank and a value
        the step's verdict reads with them (:meth:`verdict_slot`). Made on first use, and freed
        by :meth:`release` where a stage needs none."""
        if self._buffer is None:
            slots = self.header_numel * self.world_size
            self._buffer = torch.zeros(self.layout.padded_numel + slots + 1, device=self.device)
        return self._buffer

    @property
    def buckets(self) -> list[Tensor]:
        """The gradient buffer's buckets; the last one includes its padding."""
        if self._bucket_views is None or self._buffer is None:
            self._bucket_views = self.layout.bucket_views(self.grads, padded=True)
        return self._bucket_views

    def release(self) -> None:
        """Drop the gradient buffer: a later use makes a new one. ``.grad`` views of it
        (:attr:`grads_as_views`) keep it as the parameters' gradients."""
        self._buffer = self._bucket_views = self._param_views = None

    def _point_grad_at_buffer(self, index: int) -> None:
        """Make parameter ``index``'s ``.grad`` its view of the gradient buffer, unless it is one
        or cannot be (not fp32 and dense, or part of a graph for a higher-order backward)."""
        if self._param_views is None or self._buffer is None:
            self._param_views = self.layout.views(self.grads)
        grad, view = self.layout.params[index].grad, self._param_views[index]
        if grad is view or grad is None:  # the common case, checked first: this runs per tensor
            return
        if (
            grad.layout != torch.strided
            or grad.dtype != view.dtype
            or grad.device != view.device
            or grad.requires_grad
            or grad.data_ptr() == view.data_ptr()
        ):
            return
        with torch.no_grad():
            view.copy_(grad)
        self.layout.params[index].grad = view

    def fill(self, k: int, inv_scale: float | Tensor | None, norm: bool = False) -> bool:
        """Copy the gradients overlapping bucket ``k`` into the gradient buffer, multiplied by
        ``inv_scale`` (a GradScaler's) if given; a missing ``.grad`` counts as zero. Returns
        whether a sparse gradient (not supported, sent as zero) was met.

        With ``norm`` (a compressed step) and ``clip``, also note the squared norm of what was
        copied, which the bucket's header carries to every rank.
        """
        start, end = self.layout.buckets[k]
        sparse = self._copy_in(start, end, inv_scale, self.layout.bucket_params[k])
        if norm and self.clip:  # stays on the device: no sync per bucket
            self._norms2[k] = torch.linalg.vector_norm(self.grads[start:end]).square()
        return sparse

    def gather(self, inv_scale: float | Tensor | None) -> bool:
        """:meth:`fill` every bucket, in one multi-tensor op for each of its parts whatever the
        number of buckets, noting no norm; returns whether a sparse gradient was met."""
        return self._copy_in(0, self.layout.numel, inv_scale, range(len(self.layout.params)))

    def _copy_in(
        self, start: int, end: int, inv_scale: float | Tensor | None, indices: Iterable[int]
    ) -> bool:
        """:meth:`fill`'s copy of the gradients overlapping ``[start, end)`` of the buffer: those
        of the parameters ``indices``, which hold every one that overlaps it (a bucket's own,
        so that a step's Python does not grow with buckets times parameters)."""
        layout, sparse = self.layout, False
        views = layout.views(self.grads)
        zeros, sources, targets, scaled = [], [], [], []  # one multi-tensor op each
        for i in indices:
            p, offset, numel = layout.params[i], layout.offsets[i], layout.numels[i]
            lo, hi = max(start, offset), min(end, offset + numel)
            if lo >= hi:
                continue
            whole = hi - lo == numel
            view = views[i] if whole else self.grads[lo:hi]
            grad = p.grad
            if grad is None or grad.is_sparse:
                sparse |= grad is not None
                zeros.append(view)
                continue
            if not whole:
                grad = layout.flat(i, grad)[lo - offset : hi - offset]
            if grad.data_ptr() != view.data_ptr():  # not this view already (grads_as_views)
                sources.append(grad)
                targets.append(view)
            if inv_scale is not None:  # unscaled in fp32: a low-precision product could underflow
                scaled.append(view)
        if zeros:
            torch._foreach_zero_(zeros)
        if targets:
            torch._foreach_copy_(targets, sources)
        if scaled:
            torch._foreach_mul_(scaled, inv_scale)
        return sparse

    # Launching and collecting.

    def comms_for(self, kind: str) -> list[Any]:
        """The communicators of ``kind``: the quantized warmup's, or the 1-bit ones."""
        return self.warmup_comms if kind == "quantized" else self.comms

    def launch(
        self,
        k: int,
        kind: str,
        fill: bool = True,
        inv_scale: float | Tensor | None = None,
        exchange: tuple[Exchange, int] | None = None,
    ) -> None:
        """Start bucket ``k``'s ``kind`` call; with ``fill``, gather and prepare it first. A
        compressed or quantized call's message goes into ``exchange``'s part, if given, to be
        sent with the others' (:class:`~onebit.exchange.Exchange`); otherwise it is sent now."""
        self.open_step()
        if kind == "packed":
            self.inflight[k], self.inflight_kind = self.start(k, exchange), kind
            return
        grads = self.buckets[k]
        numel = self.comms[k].numel
        sparse = False
        if fill:
            sparse = self.fill(k, inv_scale, norm=kind == "compressed")
            if self.prepare is not None:
                self.prepare(k, kind, grads[:numel])
        header = self.header(k, sparse, self._norms2[k])
        if kind == "allreduce":
            # Only the bucket sent first carries the header slots, after the padded buffer.
            last = k == len(self.comms) - 1
            buffer = self.grads[self.layout.buckets[k][0] : -1] if last else grads
            if last:
                slots = self.header_slots()
                slots.zero_()
                slots[self.rank] = header
            self.inflight[k] = MeanAllreduce(buffer, self.process_group, average=grads[:numel])
        else:
            self.inflight[k] = self.comms_for(kind)[k].start(grads, header, exchange)
        self.inflight_kind = kind

    def launch_all(
        self, kind: str, fill: bool = True, inv_scale: float | Tensor | None = None
    ) -> list[Any]:
        """Launch every bucket not yet launched, in launch order; return every bucket's call in
        bucket order, no longer in flight.

        Without ``overlap``, a compressed or quantized phase 1 is one collective for all of them.
        With it, each bucket keeps a collective of its own: which buckets backward launched
        before ``step()`` may differ between ranks, but the sequence of buckets does not."""
        waiting = [k for k in reversed(range(len(self.comms))) if k not in self.inflight]
        exchange = None
        if waiting and kind != "allreduce" and not self.overlap:
            exchange = phase_exchange([self.comms_for(kind)[k] for k in waiting], 1)
        with nullcontext() if exchange is None else exchange.filling():
            for i, k in enumerate(waiting):
                self.launch(k, kind, fill, inv_scale, None if exchange is None else (exchange, i))
        calls = [self.inflight[k] for k in range(len(self.comms))]
        self._reset()
        return calls

    def header_slots(self) -> Tensor:
        """The fp32 allreduce's header slots: ``[world_size, header_numel]`` once it is done."""
        return self.grads[self.layout.padded_numel : -1].view(self.world_size, self.header_numel)

    def verdict_slot(self) -> Tensor:
        """A 0-d fp32 slot right after :meth:`header_slots`, where a step writes the value its
        verdict reads with the headers (in one read, with no copy on the device first)."""
        return self.grads[-1]

    def abandon(self) -> None:
        """Complete the phase in flight of every launched bucket without committing anything,
        and close the step, so that raising leaves no collective half done."""
        for k, call in self.inflight.items():
            if isinstance(call, MeanAllreduce):
                call.wait()
            else:
                self.comms_for(self.inflight_kind)[k].worker_scales(call)
        self._reset()
        self.close_step()

    def _reset(self) -> None:
        self.inflight = {}
        self._pending = list(self._bucket_sizes)
        self._norms2 = [None] * len(self.comms)

    # Overlap with backward.

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without launching communication."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def _install_hooks(self) -> None:
        """Count backward passes, and with ``overlap`` launch buckets as their gradients become
        final."""
        this = weakref.ref(self)  # the hooks must not keep the optimizer alive

        def hook(index: int) -> None:
            bucketer = this()
            if bucketer is not None:
                bucketer._on_grad_accumulated(index)

        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda _, index=index: hook(index))
            for index, p in enumerate(self.layout.params)
            if p.requires_grad
        ]

    def close(self) -> None:
        """Remove the hooks from the parameters: the optimizer no longer steps them."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _on_grad_accumulated(self, index: int) -> None:
        if not self._in_backward:
            self._in_backward = True
            self.backward_passes += 1
            Variable._execution_engine.queue_callback(self._backward_done)
        if self.grads_as_views:
            self._point_grad_at_buffer(index)
        if self.overlap and not self._hooked_by_ddp and self.armed:
            self._on_grad_ready(index)

    def _backward_done(self) -> None:
        self._in_backward = False

    def ddp_bucket_ready(self, params: list[Tensor]) -> None:
        """Called by :func:`onebit.ddp_comm_hook` when DDP has a bucket of gradients ready.

        From then on DDP, not the parameters' own hooks, says when gradients are final, so that
        ``DistributedDataParallel.no_sync()`` governs accumulation.
        """
        self._hooked_by_ddp = True
        if not self.overlap:
            return
        for p in params:
            index = self._index.get(id(p))
            if index is not None and p.requires_grad:
                self._on_grad_ready(index)

    def _on_grad_ready(self, index: int) -> None:
        kind = self.next_kind()
        if kind is None or self._no_sync:
            return
        for k in self._buckets_of_param[index]:
            if k in self.inflight:
                self.abandon()
                raise RuntimeError(
                    "a gradient changed after its bucket was sent: with overlap_backward, run "
                    "every backward but the last of a step inside optimizer.no_sync() (or "
                    "DistributedDataParallel.no_sync() with onebit.ddp_comm_hook)"
                )
            self._pending[k] -= 1
        launched = bool(self.inflight)
        for k in reversed(range(len(self.comms))):
            if k in self.inflight:
                continue
            if self._pending[k] > 0:
                break
            self.launch(k, kind)
        if self.inflight and not launched:
            self._record_versions_after_backward()

    def _record_versions_after_backward(self) -> None:
        """Note each ``.grad``'s version once backward has finished (after DDP has written its
        buckets back), so that :meth:`check_unchanged` can tell an edit made after that."""
        this = weakref.ref(self)

        def record() -> None:
            bucketer = this()
            if bucketer is not None:
                bucketer._seen_versions = _grad_versions(bucketer.layout.params)

        # A callback queued by a callback runs after every callback queued during backward.
        Variable._execution_engine.queue_callback(
            lambda: Variable._execution_engine.queue_callback(record)
        )

    def check_unchanged(self) -> None:
        """Raise if a ``.grad`` sent during backward was changed since."""
        seen, self._seen_versions = self._seen_versions, None
        if not self.inflight or seen is None:
            return
        now = _grad_versions(self.layout.params)
        sent = set(self.inflight)
        changed = [
            i
            for i, (a, b) in enumerate(zip(seen, now))
            if a != b and sent.intersection(self._buckets_of_param[i])
        ]
        if changed:
            self.abandon()
            raise RuntimeError(
                f"{len(changed)} gradient(s) were changed after backward, but overlap_backward "
                "had already sent them. Clip with the optimizer's max_grad_norm, let the "
                "optimizer unscale (scaler.step(optimizer) without scaler.unscale_), or use "
                "overlap_backward=False"
            )


def _grad_versions(params: list[Tensor]) -> list[int | None]:
    return [None if p.grad is None else p.grad._version for p in params]
