"""A quantized allreduce with error feedback: 16, 8 or 4 bits per element instead of 32.

It averages gradients during the fp32 warmup of the optimizers. The exchange is the two-phase one
of :class:`~onebit.comm.CompressedAllreduce` (SPEC section 2) with block-wise quantization ``Q``
in place of the 1-bit compressor, and it has the same phase methods (``start``,
``worker_scales``, ``headers``, ``serve``, ``finish``), so :func:`onebit.comm.finish_compressed_`
and the optimizers drive either one unchanged.

The module has two layers: small pure functions that quantize, dequantize and pack (the
compressor layer), and :class:`QuantizedAllreduce` on top, which owns the error buffers and the
communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import finish_compressed_, group_size_and_rank
from .compress import padded_numel

BITS = ("bf16", "int8", "int4")
_QMAX = {"int8": 127, "int4": 7}
_FLOAT_BYTES = 4
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# The compressor layer: pure functions of tensors.


def check_bits(bits: str) -> str:
    """``bits`` if it is one of :data:`BITS`, else ``ValueError`` naming the choices."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {', '.join(map(repr, BITS))}; got {bits!r}")
    return bits


def payload_bytes(numel: int, bits: str) -> int:
    """Bytes of ``numel`` quantized values: 2 each in bf16, 1 in int8, a half in int4."""
    return {"bf16": 2 * numel, "int8": numel, "int4": numel // 2}[bits]


def block_lengths(pieces: Sequence[int], block_size: int) -> list[int]:
    """Split each piece into blocks of ``block_size`` elements, the last block of a piece shorter.

    A block never crosses from one piece into the next, so no tensor's (or chunk's) magnitude
    sets another's quantization step.
    """
    lengths = []
    for size in pieces:
        full, rest = divmod(size, block_size)
        lengths += [block_size] * full + ([rest] if rest else [])
    return lengths


def block_absmax(x: Tensor, block_id: Tensor, num_blocks: int) -> Tensor:
    """``max |x|`` over each block (``block_id[i]`` is the block of ``x[i]``), fp32.

    A NaN or infinity in a block makes its absmax non-finite, which is how a non-finite input is
    detected. Blocks with no element get 0.
    """
    out = torch.zeros(num_blocks, device=x.device, dtype=torch.float32)
    return out.scatter_reduce_(0, block_id, x.abs(), "amax", include_self=True)


def quantize(x: Tensor, block_id: Tensor, num_blocks: int, bits: str) -> tuple[Tensor, Tensor]:
    """Quantize fp32 ``x``; return the values and the per-block fp32 scales.

    int8 and int4 are symmetric: ``scale = absmax(block) / qmax`` with qmax 127 or 7, and
    ``q = round(x / scale)`` (half to even), clamped to ``[-qmax, qmax]``, as int8; a block whose
    scale is 0 gets ``q = 0``. bf16 is ``x`` rounded to nearest even bfloat16, with no scales.
    """
    if bits == "bf16":
        return x.to(torch.bfloat16), x.new_empty(0)
    qmax = _QMAX[bits]
    scales = block_absmax(x, block_id, num_blocks) / qmax
    step = scales[block_id]
    ratio = torch.where(step > 0, x / step, torch.zeros_like(x))
    return ratio.round_().clamp_(-qmax, qmax).to(torch.int8), scales


def dequantize(q: Tensor, scales: Tensor, block_id: Tensor, bits: str) -> Tensor:
    """The fp32 values that :func:`quantize`'s ``q`` and ``scales`` stand for."""
    if bits == "bf16":
        return q.float()
    return q.float() * scales[block_id]


def pack_int4(q: Tensor) -> Tensor:
    """Two int4 values (in ``[-8, 7]``) per byte, the first in the low nibble. ``q`` has an even
    number of elements."""
    nibbles = (q.to(torch.int16) + 8).to(torch.uint8).view(-1, 2)
    return nibbles[:, 0] | (nibbles[:, 1] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """The int8 values that :func:`pack_int4` packed, in order."""
    nibbles = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)
    return nibbles.to(torch.int8) - 8


def encode(q: Tensor, bits: str) -> Tensor:
    """The bytes (uint8) that carry :func:`quantize`'s values: :func:`payload_bytes` of them."""
    if bits == "int4":
        return pack_int4(q)
    return q.contiguous().view(torch.uint8)


def decode(payload: Tensor, bits: str) -> Tensor:
    """The values carried by ``payload`` (uint8, as :func:`encode` made them)."""
    payload = payload.contiguous()
    if bits == "int4":
        return unpack_int4(payload)
    return payload.view(torch.bfloat16 if bits == "bf16" else torch.int8)


def _floats(raw: Tensor) -> Tensor:
    """uint8 bytes read as fp32 values along the last dimension (copied, so any alignment works)."""
    if raw.numel() == 0:
        return torch.zeros(*raw.shape[:-1], raw.shape[-1] // 4, device=raw.device)
    return raw.clone(memory_format=torch.contiguous_format).view(torch.float32)


# The communicator.


@dataclass
class _Call:
    """One quantized allreduce in flight, between its phases."""

    y: Tensor  # the worker's input plus error (the caller's buffer)
    q: Tensor  # y quantized, kept for the worker error update
    scales: Tensor  # the scales of q, every block of the buffer
    received: Tensor  # phase 1: one row from each rank, [world_size, phase-1 bytes]
    work: dist.Work | None
    gathered: Tensor | None = None  # phase 2: one row from each server, [world_size, bytes]


class QuantizedAllreduce:
    """Two-phase quantized allreduce with worker and server error feedback.

    SPEC section 2 with block-wise quantization ``Q`` (bf16, int8 or int4) in place of the 1-bit
    compressor. Rank r sends ``Q(y_r)``, ``y_r = b_r + we_r``; rank j serves chunk j:
    ``z_j = (sum in rank order of deQ(Q(y_r)[chunk j])) / n + se_j`` and gathers ``Q(z_j)`` to
    every rank. The error buffers keep what quantization lost (``we_r = y_r - deQ(Q(y_r))``,
    ``se_j = z_j - deQ(Q(z_j))``) and add it back next call, so the running sum of outputs tracks
    the running sum of true means. The result is bit-for-bit the same on every rank.

    Args:
        numel: elements per call. Every rank must use the same value (and the same other args).
        segments: sizes of the consecutive tensors the buffer holds (they add up to ``numel``);
            ``None`` is one segment. Blocks never straddle a segment or chunk boundary.
        bits: ``"bf16"``, ``"int8"`` (default) or ``"int4"``.
        group: process group; ``None`` means the default group, or world size 1 if there is none.
        device: where the error buffers live; use the device of the tensors you will reduce.
        block_size: elements per scale (int8, int4); each piece (a segment's part of a chunk) is
            split into blocks of this size, the last one shorter.
        header_numel: fp32 values each rank may attach to a call (:meth:`start`'s ``header``);
            every rank receives every rank's header (:meth:`headers`).

    Messages, as bytes, with ``P`` the payload bytes of one chunk (:func:`payload_bytes`), ``S``
    the most blocks in any chunk (0 for bf16; a chunk with fewer blocks pads its scales with
    zeros) and ``h`` the header length:

    * phase 1 (all-to-all, the row for rank j): chunk j's payload ``P``, its ``S`` fp32 scales,
      one fp32 absmax of this rank's whole ``y_r``, the header ``h`` fp32.
    * phase 2 (all-gather, from server j): ``Q(z_j)``'s payload ``P`` and its ``S`` fp32 scales.

    The whole-buffer absmax is in every row because rank j only receives the scales of chunk j:
    it is what lets every rank see a non-finite value anywhere on any rank, and so all agree to
    return NaN and leave both errors untouched (:func:`~onebit.comm.finish_compressed_`).

    Attributes:
        worker_error: this rank's error, ``padded_numel`` elements (``numel`` rounded up to a
            multiple of ``8 * world_size``).
        server_error: the error of the chunk this rank serves, ``chunk_numel`` elements.
        bytes_per_call: bytes this rank sends per call.

    Save the error buffers with :meth:`state_dict` on every rank, or resume will not be exact.
    """

    def __init__(
        self,
        numel: int,
        *,
        segments: Sequence[int] | None = None,
        bits: str = "int8",
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        block_size: int = 256,
        header_numel: int = 0,
    ) -> None:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        segments = [numel] if segments is None else list(segments)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in segments):
            raise ValueError(f"segments must be non-negative ints, got {segments!r}")
        if sum(segments) != numel:
            raise ValueError(f"segments add up to {sum(segments)}, not numel={numel}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if isinstance(header_numel, bool) or not isinstance(header_numel, int) or header_numel < 0:
            raise ValueError(f"header_numel must be a non-negative int, got {header_numel!r}")
        self.bits = check_bits(bits)
        self.segments = segments
        self.block_size = block_size
        self.header_numel = header_numel
        self.group = group
        self.world_size, self.rank = group_size_and_rank(group)
        self.numel = numel
        self.padded_numel = padded_numel(numel, self.world_size)
        self.chunk_numel = self.padded_numel // self.world_size
        device = torch.device("cpu") if device is None else torch.device(device)
        self.worker_error = torch.zeros(self.padded_numel, device=device)
        self.server_error = torch.zeros(self.chunk_numel, device=device)
        self._blocks_per_chunk, self._block_id = self._block_geometry(device)
        chunk = slice(self.rank * self.chunk_numel, (self.rank + 1) * self.chunk_numel)
        self._chunk_block_id = self._block_id[chunk] - self.rank * self._blocks_per_chunk
        self._payload = payload_bytes(self.chunk_numel, bits)
        self._scale_count = 0 if bits == "bf16" else self._blocks_per_chunk

    def _block_geometry(self, device: torch.device) -> tuple[int, Tensor]:
        """The most blocks in a chunk, ``B``, and the block of each element of the padded buffer:
        chunk j's blocks are numbered ``j*B`` on, in order (scale slots a chunk does not use stay
        0)."""
        ends, start = [], 0
        for size in [*self.segments, self.padded_numel - self.numel]:  # the padding is a piece
            start += size
            ends.append(start)
        chunks = []
        for j in range(self.world_size):
            lo, hi = j * self.chunk_numel, (j + 1) * self.chunk_numel
            cuts = sorted({lo, hi, *(e for e in ends if lo < e < hi)})
            chunks.append(block_lengths([b - a for a, b in zip(cuts, cuts[1:])], self.block_size))
        most = max(map(len, chunks))
        ids = [
            torch.arange(j * most, j * most + len(lengths)).repeat_interleave(torch.tensor(lengths))
            for j, lengths in enumerate(chunks)
            if lengths
        ]
        block_id = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
        return most, block_id.to(device)

    @property
    def _phase1_row(self) -> int:
        return self._payload + _FLOAT_BYTES * (self._scale_count + 1 + self.header_numel)

    @property
    def _phase2_row(self) -> int:
        return self._payload + _FLOAT_BYTES * self._scale_count

    @property
    def bytes_per_call(self) -> int:
        """Bytes this rank sends per call: ``(n-1) * (phase-1 row + phase-2 row)``."""
        if self.numel == 0:
            return 0
        return (self.world_size - 1) * (self._phase1_row + self._phase2_row)

    def __call__(self, tensor: Tensor) -> Tensor:
        """The quantized mean of ``tensor`` across the group, same shape and dtype; NaN
        everywhere (errors untouched) if any rank had a non-finite value."""
        if tensor.numel() != self.numel:
            raise ValueError(f"expected {self.numel} elements, got {tensor.numel()}")
        device = self.worker_error.device
        buffer = torch.zeros(self.padded_numel, device=device)
        buffer[: self.numel] = tensor.reshape(-1)
        out = torch.empty(self.numel, device=device)
        header = torch.zeros(self.header_numel, device=device) if self.header_numel else None
        if not finish_compressed_([self], [self.start(buffer, header)], [out]):
            out.fill_(float("nan"))
        return out.view(tensor.shape).to(tensor.dtype)

    # The phases, as CompressedAllreduce's, so finish_compressed_ can drive many buckets at once.

    def start(self, buffer: Tensor, header: Tensor | None = None) -> _Call:
        """Worker quantization of ``buffer`` (``padded_numel`` fp32, overwritten) and phase 1.

        ``header`` (``header_numel`` fp32 values) goes to every rank. The worker error is not yet
        updated: :meth:`serve` commits it once every rank's scales are known to be finite.
        """
        if buffer.numel() != self.padded_numel:
            raise ValueError(f"start() needs {self.padded_numel} elements, got {buffer.numel()}")
        if self.header_numel and (header is None or header.numel() != self.header_numel):
            raise ValueError(f"start() needs a header of {self.header_numel} fp32 values")
        buffer[self.numel :].zero_()  # the padding is zeros, whatever a caller left there
        y = buffer.add_(self.worker_error)
        n, per_chunk = self.world_size, self._blocks_per_chunk
        q, scales = quantize(y, self._block_id, n * per_chunk, self.bits)
        absmax = y.abs().amax() if self.numel else y.new_zeros(())
        message = torch.empty(n, self._phase1_row, dtype=torch.uint8, device=y.device)
        p, s = self._payload, self._payload + _FLOAT_BYTES * self._scale_count
        message[:, :p] = encode(q, self.bits).view(n, p)
        if self._scale_count:
            message[:, p:s] = scales.view(n, per_chunk).view(torch.uint8)
        message[:, s : s + _FLOAT_BYTES] = absmax.reshape(1, 1).view(torch.uint8)
        if self.header_numel:
            values = header.to(device=y.device, dtype=torch.float32).reshape(1, -1)
            message[:, s + _FLOAT_BYTES :] = values.view(torch.uint8)
        if n == 1 or not self.numel:
            return _Call(y, q, scales, message, None)
        received = torch.empty_like(message)
        work = dist.all_to_all_single(received, message, group=self.group, async_op=True)
        return _Call(y, q, scales, received, work)

    def worker_scales(self, call: _Call) -> Tensor:
        """Wait for phase 1; return every rank's block scales of this rank's chunk and its
        whole-buffer absmax, flattened in rank order: non-finite iff some rank's input was."""
        if call.work is not None:
            call.work.wait()
            call.work = None
        end = self._payload + _FLOAT_BYTES * (self._scale_count + 1)
        return _floats(call.received[:, self._payload : end]).reshape(-1)

    def headers(self, call: _Call) -> Tensor:
        """Every rank's header, ``[world_size, header_numel]`` fp32, after :meth:`worker_scales`."""
        start = self._payload + _FLOAT_BYTES * (self._scale_count + 1)
        return _floats(call.received[:, start:])

    def serve(self, call: _Call) -> None:
        """Commit the worker error, average and requantize this rank's chunk with server error,
        start phase 2."""
        self.worker_error.copy_(call.y - dequantize(call.q, call.scales, self._block_id, self.bits))
        call.q = call.scales = None
        if not self.numel:
            call.gathered = call.received
            return
        p, s = self._payload, self._payload + _FLOAT_BYTES * self._scale_count
        z = None
        for row in call.received:  # summed in rank order, as every rank would
            values = decode(row[:p], self.bits)
            part = dequantize(values, _floats(row[p:s]), self._chunk_block_id, self.bits)
            z = part if z is None else z.add_(part)
        z = z.div_(self.world_size).add_(self.server_error)
        q, scales = quantize(z, self._chunk_block_id, self._blocks_per_chunk, self.bits)
        torch.sub(z, dequantize(q, scales, self._chunk_block_id, self.bits), out=self.server_error)
        message = torch.empty(self._phase2_row, dtype=torch.uint8, device=z.device)
        message[:p] = encode(q, self.bits)
        message[p:s] = scales[: self._scale_count].view(torch.uint8)
        if self.world_size == 1:
            call.gathered = message.view(1, -1)
            return
        gathered = message.new_empty(self.world_size * message.numel())
        call.work = _all_gather_single(gathered, message, group=self.group, async_op=True)
        call.gathered = gathered.view(self.world_size, -1)

    def finish(self, call: _Call, out: Tensor) -> None:
        """Wait for phase 2 and write the result, ``numel`` elements, into ``out``."""
        if call.work is not None:
            call.work.wait()
            call.work = None
        if not self.numel:
            return
        p, s = self._payload, self._payload + _FLOAT_BYTES * self._scale_count
        q = decode(call.gathered[:, :p].reshape(-1), self.bits)
        scales = torch.zeros(self.world_size, self._blocks_per_chunk, device=out.device)
        scales[:, : self._scale_count] = _floats(call.gathered[:, p:s])
        result = dequantize(q, scales.view(-1), self._block_id, self.bits)
        out.copy_(result[: self.numel].view(out.shape))

    def state_dict(self) -> dict:
        """The error buffers and the geometry they belong to."""
        return {
            "numel": self.numel,
            "world_size": self.world_size,
            "bits": self.bits,
            "block_size": self.block_size,
            "segments": list(self.segments),
            "worker_error": self.worker_error.clone(),
            "server_error": self.server_error.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the error buffers saved by :meth:`state_dict` on this rank.

        Raises ``ValueError`` if they were saved for another geometry (size, world size, bits,
        block size or segments): errors cannot be carried across such a change.
        """
        ours = self.state_dict()
        for key in ("numel", "world_size", "bits", "block_size", "segments"):
            if state.get(key) != ours[key]:
                raise ValueError(
                    f"error buffers were saved for {key}={state.get(key)!r}; this communicator "
                    f"has {key}={ours[key]!r}"
                )
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])

    def reset(self) -> None:
        """Zero both error buffers."""
        self.worker_error.zero_()
        self.server_error.zero_()
