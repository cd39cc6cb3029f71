"""The 1-bit wire format: error-compensated 1-bit allreduce over ``torch.distributed`` (SPEC
section 2), a :class:`~onebit.wire.protocol.Communicator`.

Only ``all_to_all_single`` and all-gather are used, so it runs on gloo, NCCL and MPI alike. With no
process group initialised everything acts as world size 1: the same math, no communication. Byte
counts follow :mod:`onebit.wire.protocol`'s convention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .. import host
from ..compress import (
    allreduce_one_,
    check_scale,
    commit_input_,
    compress_,
    compress_input,
    input_kernels,
    padded_numel,
    server_error_,
)
from ..kernels.errors import check_error_dtype, fp32
from ..stats import count_collective
from .exchange import Exchange, start_gather
from .protocol import TwoPhase, group_size_and_rank
from .scales import ScaleGeometry, scale_rule

_SCALE_BYTES = 4


@dataclass
class Call:
    """One compressed allreduce in flight, between its phases: what ``start`` and
    ``start_compressed`` return, and ``serve`` and ``finish`` take."""

    y: Tensor
    scale: Tensor
    received: Tensor
    work: dist.Work | None
    gathered: Tensor | None = None
    signs: Tensor | None = None  # pack_signs(y), kept for the error update
    commit: Callable[[], None] | None = None  # updates the worker error instead of y
    exchange: tuple[Exchange, int] | None = None  # the phase in flight, sent with others


class CompressedAllreduce(TwoPhase):
    """Two-phase 1-bit allreduce with worker and server error feedback (SPEC section 2).

    Calling it on a tensor of ``numel`` elements returns an approximation of the mean across
    ``group``, of the same shape and bit-for-bit identical on every rank, and updates the error
    buffers in place. What one call's compression loses is fed back into the next call, so the
    running sum of outputs tracks the running sum of true means.

    Args:
        numel: elements per call. Every rank must use the same value.
        group: process group; ``None`` means the default group, or world size 1 if there is none.
        device: where the error buffers live; use the device of the tensors you will reduce.
        scale: ``"rms"`` (default, as the reference implementation) or ``"mean_abs"``
            (minimises each call's L2 error; try it if ``"rms"`` converges slowly).
        segments: the sizes of the consecutive tensors the buffer holds (they must add up to
            ``numel``), to give each its own scale: ``None`` (default) is SPEC 2, one scale per
            buffer on the worker and one per chunk on the server. With segments, the worker takes
            one scale per segment and the server one per piece (a segment's part of its chunk),
            so no tensor's magnitude sets another's step; each costs 4 bytes per message
            (``docs/SPEC.md`` section 2).
        header_numel: fp32 values each rank may attach to a call (:meth:`start`'s ``header``).
            They travel uncompressed in the phase-1 message, after the scale, and every rank
            receives every rank's header (:meth:`headers`). The optimizers use this to check,
            at no extra collective, that all ranks are at the same step. Default 0.
        error_dtype: the dtype the error buffers are kept in: ``torch.float32`` (default) or
            ``torch.bfloat16`` (half the memory; see :data:`~onebit.kernels.errors.ERROR_DTYPES`).

    Attributes:
        worker_error: this rank's error, ``padded_numel`` elements of ``error_dtype``
            (``numel`` rounded up to a multiple of ``8 * world_size``).
        server_error: the error of the chunk this rank serves, ``padded_numel // world_size``.
        bytes_per_call: bytes this rank sends per call.

    Both error buffers are allocated (zeros) when first used, so that an optimizer's buckets
    cost no memory until its compression stage starts.

    The error buffers are state: save them with :meth:`state_dict` on every rank, or resume
    will not be exact. A non-finite input on any rank is seen by every rank through the
    exchanged scales; the call then returns NaN everywhere and leaves both errors untouched.
    """

    def __init__(
        self,
        numel: int,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        scale: str = "rms",
        segments: Sequence[int] | None = None,
        header_numel: int = 0,
        error_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.error_dtype = check_error_dtype(error_dtype)
        if not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        if segments is not None:
            segments = list(segments)
            if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in segments):
                raise ValueError(f"segments must be non-negative ints, got {segments!r}")
            if sum(segments) != numel:
                raise ValueError(f"segments add up to {sum(segments)}, not numel={numel}")
        if not isinstance(header_numel, int) or header_numel < 0:
            raise ValueError(f"header_numel must be a non-negative int, got {header_numel!r}")
        self.header_numel = header_numel
        self.scale = check_scale(scale)
        self.group = group
        self.world_size, self.rank = group_size_and_rank(group)
        self.numel = numel
        self.padded_numel = padded_numel(numel, self.world_size)
        self.chunk_numel = self.padded_numel // self.world_size
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._worker_error: Tensor | None = None
        self._server_error: Tensor | None = None
        self._server_last: Tensor | None = None  # see server_error
        self.segments = segments
        self._scales = scale_rule(segments, numel, self.padded_numel, self.world_size, self.scale)
        self._scratch: Tensor | None = None  # __call__'s padded input, made on first use
        self._server_scratch: Tensor | None = None
        self.worker_scale_count = self._scales.worker_count
        self.server_scale_count = self._scales.server_count

    @property
    def worker_error(self) -> Tensor:
        if self._worker_error is None:
            self._worker_error = self._zeros(self.padded_numel)
        return self._worker_error

    @worker_error.setter
    def worker_error(self, storage: Tensor | None) -> None:
        """Keep the worker error in ``storage`` (``padded_numel`` of :attr:`error_dtype` on
        :attr:`device`), say a buffer the caller no longer needs; its values become the error.
        ``None`` lets go of the buffer: the error is zeros until it is next used."""
        if storage is not None and (
            storage.shape != (self.padded_numel,) or storage.dtype != self.error_dtype
        ):
            raise ValueError(
                f"the worker error needs {self.padded_numel} elements of {self.error_dtype}"
            )
        self._worker_error = storage

    @property
    def kept_worker_error(self) -> Tensor | None:
        """The worker error's buffer, or ``None`` where none was made yet (the error is then
        zeros): :attr:`worker_error` without making one."""
        return self._worker_error

    @property
    def server_error(self) -> Tensor:
        """The error of the chunk this rank serves. With a scale per piece (``segments``) the
        buffer keeps the last served ``z`` between calls and the error is derived from it when
        next read (:func:`~onebit.compress.serve_pieces_`); reading it here settles it."""
        store = self._server_store()
        if self._server_last is not None:
            bounds = self.scale_geometry.chunk_bounds[self.rank]
            server_error_(store, self._server_last, bounds)
            self._server_last = None
        return store

    @property
    def server_buffers(self) -> tuple[Tensor | None, Tensor | None]:
        """The server's buffer as kept (``None`` until first used) and, where it holds the last
        served ``z`` rather than the error, each served piece's scale the error is derived
        with (``None`` otherwise; see :attr:`server_error`)."""
        return self._server_error, self._server_last

    def hold_server_error(self, storage: Tensor, last: Tensor | None = None) -> None:
        """Keep the server's buffer in ``storage`` (``chunk_numel`` of :attr:`error_dtype`): the
        error, or with ``last`` (each served piece's scale, :attr:`scale_geometry`) the served
        ``z`` it is derived from. A step that serves every bucket in one pass keeps them all in
        one buffer."""
        if storage.shape != (self.chunk_numel,) or storage.dtype != self.error_dtype:
            raise ValueError(
                f"the server error needs {self.chunk_numel} elements of {self.error_dtype}"
            )
        self._server_error, self._server_last = storage, last

    @property
    def scale_geometry(self) -> ScaleGeometry:
        """Where each scale applies: the segments' pieces, or without segments one segment of
        the whole padded buffer (SPEC 2: one worker scale, one server scale per chunk)."""
        return self._scales.geometry

    def _server_store(self) -> Tensor:
        if self._server_error is None:
            self._server_error = self._zeros(self.chunk_numel)
        return self._server_error

    def _zeros(self, numel: int) -> Tensor:
        return torch.zeros(numel, dtype=self.error_dtype, device=self.device)

    @property
    def _chunk_bytes(self) -> int:
        return self.chunk_numel // 8

    @property
    def bytes_per_call(self) -> int:
        if self.numel == 0:
            return 0
        phase1 = self._chunk_bytes + self._phase1_extra
        phase2 = self._chunk_bytes + _SCALE_BYTES * self.server_scale_count
        return (self.world_size - 1) * (phase1 + phase2)

    @property
    def _phase1_extra(self) -> int:
        return _SCALE_BYTES * self.worker_scale_count + 4 * self.header_numel

    @property
    def phase1_width(self) -> int:
        """Bytes of each row of phase 1's message (an :class:`~onebit.wire.exchange.Exchange`
        part)."""
        return self._chunk_bytes + self._phase1_extra

    @property
    def phase2_width(self) -> int:
        """Bytes of phase 2's message."""
        return self._chunk_bytes + _SCALE_BYTES * self.server_scale_count

    def __call__(self, tensor: Tensor, *, out: Tensor | None = None) -> Tensor:
        """The compressed mean of ``tensor`` (``numel`` elements, any shape and float dtype)
        across the group, written into ``out`` (default: a new tensor like ``tensor``; it may be
        ``tensor`` itself) and returned. NaN everywhere if some rank's input is non-finite.

        Every rank must call it together. A call allocates no model-sized memory: an input that
        needs a copy (another dtype or device, not contiguous) goes through a scratch buffer
        kept between calls. With the C or Triton kernels a contiguous fp32 input is read where it
        is, and neither the worker's ``y`` nor the server's chunk is ever stored: five passes over
        the buffer (worker signs, worker error, server signs, server error, the result). At world
        size 1 without segments (:func:`~onebit.compress.allreduce_one_`) the C kernels take
        three and Triton two. The bits are those of the stored-buffer kernels (:meth:`start`,
        :meth:`serve`, :meth:`finish`), but for Triton's rms server scale there, which is within
        the bound of its sum's order.
        """
        if tensor.numel() != self.numel:
            raise ValueError(f"expected {self.numel} elements, got {tensor.numel()}")
        if out is None:
            out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        elif out.shape != tensor.shape or out.dtype != tensor.dtype:
            raise ValueError(
                f"out must have the input's shape and dtype {tuple(tensor.shape)} "
                f"{tensor.dtype}, got {tuple(out.shape)} {out.dtype}"
            )
        device = self.device
        as_is = tensor.is_contiguous() and tensor.dtype == torch.float32 and tensor.device == device
        direct = out.is_contiguous() and out.dtype == torch.float32 and out.device == device
        if not self._reduce(tensor, as_is, out, direct):
            return out.fill_(float("nan"))
        if not direct:
            out.copy_(self._scratch[: self.numel].view(out.shape))
        return out

    def _reduce(self, tensor: Tensor, as_is: bool, out: Tensor, direct: bool) -> bool:
        """:meth:`__call__`'s allreduce of ``tensor`` into ``out`` if ``direct`` (contiguous fp32
        on :attr:`device`), else into the front of the scratch buffer; ``False`` if some rank's
        scale is not finite. ``as_is``: ``tensor`` can be read where it is (as ``out``)."""
        fused = input_kernels(fp32(self.worker_error[:8]))  # kernels read errors as fp32
        if fused:
            x = tensor.view(-1) if as_is else self._scratch_with(tensor)[: self.numel]
        # The input is spent once the worker error is committed: the result may overwrite it.
        target = out.view(-1) if direct else self._scratch_with(None)[: self.numel]
        if fused and self.world_size == 1 and self._scales.bounds is None:
            return allreduce_one_(x, self.worker_error, self.server_error, target, self.scale)
        if fused:
            call, z = self._start_input(x), None
        else:
            in_place = as_is and out is tensor and self.numel == self.padded_numel
            call = self.start(tensor.view(-1) if in_place else self._scratch_with(tensor))
            if self._server_scratch is None:
                self._server_scratch = torch.empty(self.chunk_numel, device=self.device)
            z = self._server_scratch
        if not host.read(torch.isfinite(self.worker_scales(call)).all()):
            return False
        self.serve(call, z=z)
        self.finish(call, target)
        return True

    def _scratch_with(self, tensor: Tensor | None) -> Tensor:
        """The scratch buffer (``padded_numel`` fp32, made on first use), with ``tensor`` copied
        into its front (``None``: as it is)."""
        if self._scratch is None:
            self._scratch = torch.empty(self.padded_numel, device=self.device)
        if tensor is not None:
            self._scratch[: self.numel].copy_(tensor.reshape(-1))
        return self._scratch

    def _start_input(self, x: Tensor) -> Call:
        """:meth:`start` of ``x`` (``numel`` fp32 elements, not padded, left untouched until
        :meth:`serve` has committed the worker error from it) by the C kernels of
        :func:`~onebit.compress.compress_input`, which never store ``y``."""
        bounds = self._scales.bounds
        error = self.worker_error
        signs, scales = compress_input(x, error, self.scale, bounds)
        return self.start_compressed(
            signs, scales, commit=lambda: commit_input_(x, error, scales, bounds)
        )

    # The three phases. reduce_compressed_ runs them over many buckets, a collective a phase.

    def start(
        self,
        buffer: Tensor,
        header: Tensor | None = None,
        exchange: tuple[Exchange, int] | None = None,
    ) -> Call:
        """Worker compression of ``buffer`` (``padded_numel`` fp32, overwritten) and phase 1.

        ``header`` (``header_numel`` fp32 values) goes to every rank with this rank's chunk.
        The worker error is not yet updated: :meth:`serve` commits it once every rank's scale is
        known to be finite. With ``exchange`` (an :class:`~onebit.wire.exchange.Exchange` of
        :attr:`phase1_width` parts, and this call's part) the message goes into its part, to be
        sent with the others; otherwise it is sent now.
        """
        buffer[self.numel :].zero_()  # the padding is zeros (SPEC 2), whatever a caller left there
        packed, scale = compress_(buffer, self.worker_error, self.scale)
        scale = self._scales.worker(buffer, scale)
        return self.start_compressed(packed, scale, header, y=buffer, exchange=exchange)

    def start_compressed(
        self,
        signs: Tensor,
        scales: Tensor,
        header: Tensor | None = None,
        *,
        y: Tensor | None = None,
        commit: Callable[[], None] | None = None,
        exchange: tuple[Exchange, int] | None = None,
    ) -> Call:
        """Phase 1 of signs and scales the caller compressed itself (``pack_signs(y)``, and the
        scale of ``y`` or of each segment), as :meth:`start` (``exchange`` too).

        :meth:`serve` then updates the worker error from ``y``, or calls ``commit()``, which
        updates :attr:`worker_error` itself (say with a fused kernel that computes ``y`` again,
        see :mod:`onebit.kernels.fused`).
        """
        n, chunk = self.world_size, self._chunk_bytes
        device = signs.device
        scales_end = chunk + _SCALE_BYTES * self.worker_scale_count
        if exchange is None:
            message = torch.empty(n, self.phase1_width, dtype=torch.uint8, device=device)
        else:
            message = exchange[0].part(exchange[1])
        if self.header_numel:
            if header is None or header.numel() != self.header_numel:
                raise ValueError(f"start() needs a header of {self.header_numel} fp32 values")
            values = header.to(device=device, dtype=torch.float32).reshape(1, -1)
            message[:, scales_end:] = values.view(torch.uint8)
        message[:, chunk:scales_end] = scales.reshape(1, -1).to(device).view(torch.uint8)
        if self.numel:
            message[:, :chunk] = signs.view(n, chunk)
        if exchange is not None:
            return Call(y, scales, message, None, signs=signs, commit=commit, exchange=exchange)
        work = None
        received = message
        if n > 1 and self.numel:
            received = torch.empty_like(message)
            count_collective()
            work = dist.all_to_all_single(received, message, group=self.group, async_op=True)
        return Call(y, scales, received, work, signs=signs, commit=commit)

    def worker_scales(self, call: Call) -> Tensor:
        """Wait for phase 1 and return every rank's worker scales, ``[world_size, count]`` in
        rank order (``count`` is 1, or the number of segments)."""
        if call.exchange is not None:
            exchange, i = call.exchange
            call.received, call.exchange = exchange.received(i), None
        if call.work is not None:
            call.work.wait()
            call.work = None
        return _scales(call.received, self._chunk_bytes, self.worker_scale_count)

    def headers(self, call: Call) -> Tensor:
        """Every rank's header of ``call``, ``[world_size, header_numel]`` fp32, after
        :meth:`worker_scales`."""
        start = self._chunk_bytes + _SCALE_BYTES * self.worker_scale_count
        return (
            call.received[:, start:]
            .clone(memory_format=torch.contiguous_format)
            .view(torch.float32)
        )

    def serve(
        self, call: Call, z: Tensor | None = None, exchange: tuple[Exchange, int] | None = None
    ) -> None:
        """Commit the worker error, compress this rank's chunk with server error, start phase 2.

        ``z`` (``chunk_numel`` fp32) is scratch for the served chunk where it must be stored: no
        segments, and not the C kernels (default: a new buffer). ``exchange``: as in
        :meth:`start`, of :attr:`phase2_width` parts.
        """
        if call.commit is not None:
            call.commit()
        else:
            self._scales.commit_worker(call.y, call.scale, call.signs, self.worker_error)
        call.signs = None
        if not self.numel:
            call.gathered = call.received
            return
        chunk = self._chunk_bytes
        received = call.received[:, :chunk]
        scales = _scales(call.received, chunk, self.worker_scale_count)
        store, last = self._server_store(), self._server_last
        packed, sigma, self._server_last = self._scales.serve(
            received, scales, self.rank, store, last, z
        )
        scales_end = self.phase2_width
        if exchange is None:
            message = torch.empty(scales_end, dtype=torch.uint8, device=self.device)
        else:
            message = exchange[0].part(exchange[1])
        message[:chunk] = packed
        message[chunk:scales_end] = sigma.reshape(-1).to(self.device).view(torch.uint8)
        if exchange is not None:
            call.exchange = exchange
            return
        if self.world_size == 1:
            call.gathered = message.view(1, -1)
            return
        gathered = message.new_empty(self.world_size, message.numel())
        count_collective()
        call.work = start_gather(gathered, message, self.group)
        call.gathered = gathered

    def finish(self, call: Call, out: Tensor | None) -> None:
        """Wait for phase 2 and write the result, ``numel`` elements, into ``out`` (``None``:
        leave it packed, for :meth:`result_signs`)."""
        if call.exchange is not None:
            exchange, i = call.exchange
            call.gathered, call.exchange = exchange.received(i), None
        if call.work is not None:
            call.work.wait()
            call.work = None
        if not self.numel or out is None:
            return
        chunk = self._chunk_bytes
        scales = _scales(call.gathered, chunk, self.server_scale_count)
        target = out if out.is_contiguous() else torch.empty_like(out)
        self._scales.decompress(call.gathered[:, :chunk], scales, target)
        if target is not out:
            out.copy_(target)

    def result_signs(self, call: Call) -> tuple[Tensor, Tensor]:
        """The result of a finished ``call``, packed: signs ``uint8 [world_size, chunk_numel / 8]``
        (rows strided) and fp32 scales ``[world_size, server_scale_count]``: element ``i`` of
        chunk ``j`` is ``±scales[j, c]`` of the piece ``c`` it falls in (one column without
        segments)."""
        chunk = self._chunk_bytes
        return call.gathered[:, :chunk], _scales(call.gathered, chunk, self.server_scale_count)

    def state_dict(self) -> dict:
        """The error buffers and the geometry they belong to."""
        return {
            "numel": self.numel,
            "world_size": self.world_size,
            "scale": self.scale,
            "worker_error": _clone(self._worker_error),
            "server_error": None if self._server_error is None else self.server_error.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the error buffers saved by :meth:`state_dict` on this rank, converted to
        :attr:`error_dtype` (rounded, where fp32 ones come into bf16).

        Raises ``ValueError`` if they were saved for another size or world size: errors
        cannot be carried across a change of geometry.
        """
        if state["numel"] != self.numel or state["world_size"] != self.world_size:
            raise ValueError(
                f"error buffers were saved for numel={state['numel']}, world_size="
                f"{state['world_size']}; this communicator has numel={self.numel}, "
                f"world_size={self.world_size}"
            )
        self._server_last = None
        for name in ("worker_error", "server_error"):
            saved = state[name]
            if saved is None:  # never used: zeros
                if getattr(self, f"_{name}") is not None:
                    getattr(self, name).zero_()
            else:
                getattr(self, name).copy_(saved)

    def reset(self) -> None:
        """Zero both error buffers (those in use)."""
        self._server_last = None
        for buffer in (self._worker_error, self._server_error):
            if buffer is not None:
                buffer.zero_()


def _clone(buffer: Tensor | None) -> Tensor | None:
    return None if buffer is None else buffer.clone()


def _scales(messages: Tensor, chunk_bytes: int, count: int) -> Tensor:
    """The ``count`` fp32 scales after the signs of each message row, ``[rows, count]``."""
    end = chunk_bytes + _SCALE_BYTES * count
    return (
        messages[:, chunk_bytes:end]
        .clone(memory_format=torch.contiguous_format)
        .view(torch.float32)
    )
