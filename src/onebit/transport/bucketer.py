"""The bucketer: when each bucket of gradients is gathered, launched and completed.

It is the part of torch's DDP ``Reducer`` that a onebit optimizer needs. It owns the gradient
buffer laid out by :class:`~onebit.state.layout.FlatLayout`, the order in which buckets launch, the
calls in flight, and the overlap with backward: the parameters' post-accumulate hooks,
``no_sync()``, and the bucket-ready calls of :func:`onebit.ddp_comm_hook`.

What a bucket sends belongs to the optimizer. As DDP's ``Reducer`` calls its comm hook, the
bucketer calls one object, a :class:`Sender`, when a bucket is ready: the one ``step()`` hands
:meth:`Bucketer.launch_all`, or during backward the one the optimizer pushed to
:attr:`Bucketer.sender` after its last step. Buckets launch in a fixed order, last first as
backward produces them, on every rank, so the collectives match across ranks however early
each bucket is launched.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Variable

from ..state.layout import FlatLayout
from ..wire.exchange import Exchange, phase_exchange
from ..wire.protocol import group_size_and_rank


class Sender(Protocol):
    """What one step sends, bucket by bucket: the object the bucketer calls when a bucket is
    ready, as DDP's ``Reducer`` calls its comm hook."""

    comms: Sequence[Any]
    """Its communicators, one per bucket (:class:`~onebit.wire.protocol.Communicator`). Where
    they batch, their messages can go in one collective for every bucket
    (:func:`~onebit.wire.exchange.phase_exchange`)."""

    def send(self, k: int, exchange: tuple[Exchange, int] | None) -> Any:
        """Start bucket ``k``'s call, its gradients being final; its message goes into
        ``exchange``'s part, if given, to be sent with the others'."""
        ...

    def abandon(self, calls: dict[int, Any]) -> None:
        """Complete the phase in flight of ``calls`` (bucket index to call, as :meth:`send`
        returned them) without committing anything, and close the step."""
        ...


class Bucketer:
    """Gathers, launches and collects the buckets of one optimizer's gradients.

    Args:
        layout: the flat layout and its buckets.
        process_group: the group whose ranks each have a header slot (:meth:`header_slots`).
        header_numel: the length of one rank's header (:meth:`header_slots`).
        clip: note each bucket's squared gradient norm where :meth:`fill` is asked to (under
            ``overlap``, the buckets leave before the whole gradient's norm is known).
        overlap: launch each bucket during backward as soon as its gradients are final.

    Attributes:
        sender: what the next step sends, if the optimizer can send it during backward (set by
            the optimizer after each step), else ``None``.
        backward_passes: backward passes seen by the hooks (the header's step check).
        armed: set by the optimizer after its first step in this process. Overlap starts only
            then: by that time a DDP-wrapped model has shown itself through the comm hook, and
            DDP's ``no_sync`` rather than the optimizer's governs accumulation.
        inflight: bucket index to its call in flight.
        sending: the sender of the calls in flight (``None`` when there are none).
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
        process_group: dist.ProcessGroup | None,
        header_numel: int,
        *,
        clip: bool,
        overlap: bool,
    ) -> None:
        self.layout = layout
        self.world_size, self.rank = group_size_and_rank(process_group)
        self.header_numel = header_numel
        self.device = layout.params[0].device
        self.clip, self.overlap = clip, overlap
        self.sender: Sender | None = None
        self.sending: Sender | None = None
        self._buffer: Tensor | None = None
        self._bucket_views: list[Tensor] | None = None
        self.inflight: dict[int, Any] = {}
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
        self._index = {id(p): i for i, p in enumerate(params)}
        self._seen_versions: list[tuple[int, int] | None] | None = None
        self._hooked_by_ddp = False
        self._in_backward = False
        self.backward_passes = 0
        self.armed = False
        self.grads_as_views = False
        self._param_views: list[Tensor] | None = None
        self._install_hooks()

    def place(self, device: torch.device) -> None:
        """Work on ``device`` from now on (the optimizer's state moved there); the gradient
        buffer is made anew on first use. Only between steps."""
        if self.inflight:
            raise RuntimeError("the optimizer's state cannot move while buckets are in flight")
        self.device = device
        self.sender = None
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

    def fill(
        self, k: int, inv_scale: float | Tensor | None, norm: bool = False
    ) -> tuple[bool, Tensor | None]:
        """Copy the gradients overlapping bucket ``k`` into the gradient buffer, multiplied by
        ``inv_scale`` (a GradScaler's) if given; a missing ``.grad`` counts as zero. Returns
        whether a sparse gradient (not supported, sent as zero) was met, and with ``norm`` and
        ``clip`` the squared norm of what was copied, on the device (no sync per bucket), for
        the bucket's header to carry to every rank; else ``None``.
        """
        start, end = self.layout.buckets[k]
        sparse = self._copy_in(start, end, inv_scale, self.layout.bucket_params[k])
        if norm and self.clip:
            return sparse, torch.linalg.vector_norm(self.grads[start:end]).square()
        return sparse, None

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

    def launch(self, k: int, sender: Sender, exchange: tuple[Exchange, int] | None = None) -> None:
        """Start bucket ``k``'s call through ``sender``."""
        self.inflight[k], self.sending = sender.send(k, exchange), sender

    def launch_all(self, sender: Sender) -> list[Any]:
        """Launch every bucket not yet launched, in launch order, through ``sender``; return
        every bucket's call in bucket order, no longer in flight.

        Without ``overlap``, the messages of ``sender.comms`` go in one collective for all of
        them where they batch. With it, each bucket keeps a collective of its own: which
        buckets backward launched before ``step()`` may differ between ranks, but the sequence
        of buckets does not."""
        buckets = len(self.layout.buckets)
        waiting = [k for k in reversed(range(buckets)) if k not in self.inflight]
        exchange = None
        if waiting and sender.comms[0].batches and not self.overlap:
            exchange = phase_exchange([sender.comms[k] for k in waiting], 1)
        with nullcontext() if exchange is None else exchange.filling():
            for i, k in enumerate(waiting):
                self.launch(k, sender, None if exchange is None else (exchange, i))
        calls = [self.inflight[k] for k in range(buckets)]
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
        calls, sender = self.inflight, self.sending
        self._reset()
        if sender is not None:
            sender.abandon(calls)

    def _reset(self) -> None:
        self.inflight, self.sending = {}, None
        self._pending = list(self._bucket_sizes)

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
            self._record_versions_after_backward()
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
        sender = self.sender
        if sender is None or self._no_sync:
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
        for k in reversed(range(len(self.layout.buckets))):
            if k in self.inflight:
                continue
            if self._pending[k] > 0:
                break
            self.launch(k, sender)

    def _record_versions_after_backward(self) -> None:
        """Note each ``.grad`` and its version once backward has finished (after DDP has written
        its buckets back), so that :meth:`edited_since_backward` can tell an edit made after."""
        this = weakref.ref(self)

        def record() -> None:
            bucketer = this()
            if bucketer is not None:
                bucketer._seen_versions = _grad_versions(bucketer.layout.params)

        # A callback queued by a callback runs after every callback queued during backward.
        Variable._execution_engine.queue_callback(
            lambda: Variable._execution_engine.queue_callback(record)
        )

    def edited_since_backward(self) -> list[int]:
        """The parameters (by index) whose ``.grad`` was replaced or written in place since the
        last backward ended, by their version counters: no pass over the data. (A
        ``GradScaler``'s check for infs and its ``unscale_`` write no version.) Empty when no
        backward ran since the last step: the gradients were set by hand."""
        seen, self._seen_versions = self._seen_versions, None
        if seen is None:
            return []
        now = _grad_versions(self.layout.params)
        return [i for i, (before, after) in enumerate(zip(seen, now)) if before != after]

    def check_unsent(self, changed: list[int]) -> None:
        """Raise if any parameter of ``changed`` has a gradient that ``overlap_backward`` sent
        during backward: the edit came too late to count."""
        sent = set(self.inflight)
        if any(sent.intersection(self._buckets_of_param[i]) for i in changed):
            self.abandon()
            raise RuntimeError(
                f"{len(changed)} gradient(s) were changed after backward, but overlap_backward "
                "had already sent them. Clip with the optimizer's max_grad_norm, let the "
                "optimizer unscale (scaler.step(optimizer) without scaler.unscale_), or use "
                "overlap_backward=False"
            )


def _grad_versions(params: list[Tensor]) -> list[tuple[int, int] | None]:
    return [None if p.grad is None else (id(p.grad), p.grad._version) for p in params]
