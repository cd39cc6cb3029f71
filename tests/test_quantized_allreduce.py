"""QuantizedAllreduce: the bf16/int8/int4 allreduce with error feedback, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from backends import use_backend
from distributed import run_ranks
from heavy import slow

from onebit import kernels
from onebit.wire import quantize
from onebit.wire.comm import CompressedAllreduce
from onebit.wire.protocol import allreduce_bytes, finish_compressed_
from onebit.wire.quantize import BITS, pack_int4, unpack_int4
from onebit.wire.quantized import QuantizedAllreduce

# Segment sizes that are not multiples of 8 or of the block size, an empty one, and one that
# spans chunks; each segment has its own magnitude (the fifth is all zeros: scale 0).
SEGMENTS = [13, 1, 300, 0, 45, 77, 3]
FACTORS = [1.0, 100.0, 0.01, 1.0, 0.0, 3.0, 1e-3]
NUMEL = sum(SEGMENTS)
BLOCK = 32
CALLS = 4


def _inputs(step: int, rank: int, numel: int = NUMEL, segments=SEGMENTS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(numel, generator=gen) * (1 + rank)
    if segments is SEGMENTS:
        x *= torch.repeat_interleave(torch.tensor(FACTORS), torch.tensor(SEGMENTS))
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


class RefQuantizedAllreduce:
    """All ranks of the quantized allreduce in one process: plain loops over blocks, no packing,
    no messages."""

    def __init__(self, numel, world_size, bits, segments=None, block_size=256):
        n = world_size
        self.numel, self.n, self.bits = numel, n, bits
        self.padded = -(-numel // (8 * n)) * (8 * n)
        self.chunk = self.padded // n
        bounds, start = [], 0
        for size in [numel] if segments is None else segments:
            bounds.append((start, start + size))
            start += size
        bounds.append((numel, self.padded))  # the padding is a piece of its own
        self.blocks = []  # per chunk: (lo, hi) in chunk coordinates
        for j in range(n):
            c0, c1 = j * self.chunk, (j + 1) * self.chunk
            chunk_blocks = []
            for a, b in bounds:
                lo, hi = max(a, c0), min(b, c1)
                for s in range(lo, hi, block_size):
                    chunk_blocks.append((s - c0, min(s + block_size, hi) - c0))
            self.blocks.append(chunk_blocks)
        self.worker_error = [torch.zeros(self.padded) for _ in range(n)]
        self.server_error = [torch.zeros(self.chunk) for _ in range(n)]

    def roundtrip(self, x, blocks):
        """deQ(Q(x)), block by block."""
        if self.bits == "bf16":
            return x.to(torch.bfloat16).float()
        qmax = {"int8": 127, "int4": 7}[self.bits]
        out = torch.empty_like(x)
        for lo, hi in blocks:
            s = x[lo:hi].abs().max() / qmax
            if s > 0:
                q = torch.round(x[lo:hi] / s).clamp(-qmax, qmax) + 0.0  # an integer: no -0
                out[lo:hi] = q * s
            else:
                out[lo:hi] = 0.0
        return out

    def __call__(self, inputs):
        n, c = self.n, self.chunk
        deq = []
        for r in range(n):
            y = torch.zeros(self.padded)
            y[: self.numel] = inputs[r]
            y = y + self.worker_error[r]
            parts = [self.roundtrip(y[j * c : (j + 1) * c], self.blocks[j]) for j in range(n)]
            d = torch.cat(parts)
            self.worker_error[r] = y - d
            deq.append(d)
        out = torch.empty(self.padded)
        for j in range(n):
            z = deq[0][j * c : (j + 1) * c].clone()
            for r in range(1, n):
                z = z + deq[r][j * c : (j + 1) * c]
            z = z / n + self.server_error[j]
            d = self.roundtrip(z, self.blocks[j])
            self.server_error[j] = z - d
            out[j * c : (j + 1) * c] = d
        return out[: self.numel]

    def message_bytes(self, header_numel=0):
        """Phase-1 and phase-2 row bytes, by the documented layout."""
        payload = {"bf16": 2 * self.chunk, "int8": self.chunk, "int4": self.chunk // 2}[self.bits]
        scales = 0 if self.bits == "bf16" else 4 * max(map(len, self.blocks))
        return payload + scales + 4 + 4 * header_numel, payload + scales


def _comm(bits, **kwargs):
    return QuantizedAllreduce(NUMEL, segments=SEGMENTS, bits=bits, block_size=BLOCK, **kwargs)


def _drift(comm, world_size, rank, calls, feedback):
    """max |running sum of outputs - running sum of true means| after each call, for inputs
    whose quantization error is systematic (the same every call)."""

    def inputs(t, r):
        gen = torch.Generator().manual_seed(7 + 1000 * t + r)
        x = 0.05 + 0.03 * torch.arange(comm.numel).remainder(7) / 7
        x[::16] = 1.0 + r
        return x + 1e-6 * torch.randn(comm.numel, generator=gen)

    cum_out, cum_true, drift = torch.zeros(comm.numel), torch.zeros(comm.numel), []
    for t in range(calls):
        cum_out += comm(inputs(t, rank)).double()
        cum_true += sum(inputs(t, r).double() for r in range(world_size)) / world_size
        drift.append(float((cum_out - cum_true).abs().max()))
        if not feedback:
            comm.reset()
    return drift


def _scenario(rank, world_size, backend="auto"):
    """Everything the distributed tests check, on one set of ranks (spawning ranks is slow), on
    ``backend`` (``"triton"``: its kernels run the phases)."""
    use_backend(backend)
    res = {}
    for bits in BITS:
        comm = _comm(bits)
        assert (comm._kernels is not None) == (backend == "triton")
        outputs = [comm(_inputs(t, rank)) for t in range(CALLS)]
        errors = (comm.worker_error.clone(), comm.server_error.clone())
        # A non-finite value on the last rank, in chunk 0 (whose block scales only rank 0 gets).
        before = comm.state_dict()
        x = _inputs(CALLS, rank)
        if rank == world_size - 1:
            x[2] = float("inf") if bits == "int8" else float("nan")
        bad = comm(x)
        unchanged = _same_bits(before["worker_error"], comm.worker_error) and _same_bits(
            before["server_error"], comm.server_error
        )
        # Resume from a state dict on a fresh communicator.
        saved = comm.state_dict()
        go_on = [comm(_inputs(CALLS + 1 + k, rank)) for k in range(2)]
        resumed = _comm(bits)
        resumed.load_state_dict(saved)
        again = [resumed(_inputs(CALLS + 1 + k, rank)) for k in range(2)]
        res[bits] = {
            "outputs": outputs,
            "errors": errors,
            "nan": bool(bad.isnan().all()),
            "unchanged": unchanged,
            "resumed": all(map(_same_bits, go_on, again)),
            "bytes": comm.bytes_per_call,
            "big_bytes": QuantizedAllreduce(1_000_003, bits=bits).bytes_per_call,
        }
    # The phase protocol, driven by finish_compressed_ over several buckets at once (with a
    # 1-bit one among them), headers included: the same results as the calls above, whatever
    # the buffers' padding holds.
    comms = [_comm(bits, header_numel=2) for bits in BITS]
    comms.append(CompressedAllreduce(NUMEL, header_numel=2))
    buffers, outs = [], [torch.empty(NUMEL) for _ in comms]
    for comm in comms:
        buffers.append(torch.full((comm.padded_numel,), 7.0))
        buffers[-1][:NUMEL] = _inputs(0, rank)
    header = torch.tensor([float(rank), 3.5])
    calls = [comm.start(b, header) for comm, b in zip(comms, buffers)]
    res["protocol_ok"] = finish_compressed_(comms, calls, outs)
    res["protocol_outputs"] = outs[:3]
    res["headers"] = [comm.headers(call) for comm, call in zip(comms, calls)]
    if world_size == 2 and backend != "triton":  # the bits are the reference's: so is the drift
        res["drift"] = {
            bits: [_drift(_comm(bits), world_size, rank, 150, fb) for fb in (True, False)]
            for bits in BITS
        }
    return res


def _check_scenario(results, world_size):
    n = world_size
    for bits in BITS:
        ref = RefQuantizedAllreduce(NUMEL, n, bits, SEGMENTS, BLOCK)
        expected = [ref([_inputs(t, r) for r in range(n)]) for t in range(CALLS)]
        phase1, phase2 = ref.message_bytes()
        for rank, res in enumerate(results):
            got = res[bits]
            for t in range(CALLS):
                assert _same_bits(got["outputs"][t], expected[t]), (bits, rank, t)
            assert _same_bits(got["errors"][0], ref.worker_error[rank])
            assert _same_bits(got["errors"][1], ref.server_error[rank])
            assert got["nan"] and got["unchanged"], (bits, rank)
            assert got["resumed"], (bits, rank)
            assert got["bytes"] == (n - 1) * (phase1 + phase2)
            assert _same_bits(res["protocol_outputs"][BITS.index(bits)], expected[0])
        # the bytes of a large buffer, against a ring allreduce of fp32
        ratio = allreduce_bytes(4 * 1_000_003, n) / results[0][bits]["big_bytes"]
        low, high = {"bf16": (1.99, 2.0), "int8": (3.9, 4.0), "int4": (7.7, 8.0)}[bits]
        assert low < ratio <= high, (bits, ratio)
    for res in results:
        assert res["protocol_ok"]
        for headers in res["headers"]:
            expected = torch.tensor([[float(r), 3.5] for r in range(n)])
            assert torch.equal(headers.reshape(n, 2), expected)


@pytest.mark.parametrize("world_size", [2, slow(3), slow(4)])
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_ranks_match_reference_bitwise_and_agree(world_size, backend):
    if backend != "auto" and backend not in kernels.available():
        pytest.skip(f"the {backend} backend cannot run here")
    results = run_ranks(_scenario, world_size, backend, timeout=300)
    _check_scenario(results, world_size)
    if world_size == 2 and backend != "triton":
        for bits in BITS:
            with_feedback, without = results[0]["drift"][bits]
            assert with_feedback == results[1]["drift"][bits][0]  # the same on every rank
            # Bounded with error feedback: no larger late in the run than early on...
            assert max(with_feedback[75:]) <= 1.5 * max(with_feedback[:75]), bits
            # ...while without it the systematic error adds up call after call.
            assert without[-1] > 2.5 * without[49], bits
            assert with_feedback[-1] < 0.05 * without[-1], bits


# Layouts cut into many small tiles (the work runs tile by tile): runs of full blocks across
# segments, split into several tiles; short blocks gathered into tiles of mixed lengths (with a
# common divisor > 1, and of 1); int4 tiles that start in the middle of a byte.
TILED_LAYOUTS = [
    ([300, 1, 64, 64, 128, 7, 1000, 33, 512, 0, 96, 250], 32),
    ([48, 16, 32, 80, 8] * 4 + [256] * 3 + [3, 5], 64),
]
TILED_FACTORS = [1.0, 0.0, 1e-40, 100.0, 1e-3, 1e-37]  # zeros, scale underflow, subnormal scales


def _tiled_inputs(step, rank, segments):
    x = _inputs(step, rank, sum(segments), segments)
    factors = [TILED_FACTORS[(i + step) % len(TILED_FACTORS)] for i in range(len(segments))]
    return x * torch.repeat_interleave(torch.tensor(factors), torch.tensor(segments))


def _tiled_comms():
    for k, (segments, block_size) in enumerate(TILED_LAYOUTS):
        for bits in BITS:
            comm = QuantizedAllreduce(
                sum(segments), segments=segments, bits=bits, block_size=block_size
            )
            yield k, bits, comm


def _tiled_results(rank):
    res = {}
    for k, bits, comm in _tiled_comms():
        outputs = [comm(_tiled_inputs(t, rank, TILED_LAYOUTS[k][0])) for t in range(CALLS)]
        res[k, bits] = outputs, comm.worker_error.clone(), comm.server_error.clone()
    return res


def _tiled_scenario(rank, world_size, backend="auto"):
    use_backend(backend)  # Triton's kernels have no tiles: the same layouts, in its blocks
    kernels.for_device(torch.device("cpu")).tile_numel = 200  # a fresh process: nothing to restore
    quantize.MIN_RUN_NUMEL = 128
    return _tiled_results(rank)


def _check_tiled(results, world_size):
    for k, (segments, block_size) in enumerate(TILED_LAYOUTS):
        for bits in BITS:
            ref = RefQuantizedAllreduce(sum(segments), world_size, bits, segments, block_size)
            for t in range(CALLS):
                expected = ref([_tiled_inputs(t, r, segments) for r in range(world_size)])
                for rank, res in enumerate(results):
                    assert _same_bits(res[k, bits][0][t], expected), (k, bits, rank, t)
            for rank, res in enumerate(results):
                assert _same_bits(res[k, bits][1], ref.worker_error[rank]), (k, bits, rank)
                assert _same_bits(res[k, bits][2], ref.server_error[rank]), (k, bits, rank)


def test_small_tiles_match_reference_bitwise(monkeypatch):
    monkeypatch.setattr(kernels.for_device(torch.device("cpu")), "tile_numel", 200)
    monkeypatch.setattr(quantize, "MIN_RUN_NUMEL", 128)
    kinds = set()
    for _, bits, comm in _tiled_comms():
        tiles = comm._plans[0].tiles
        assert len(tiles) > 3
        for tile in tiles:
            if tile.rows is None:
                kinds.add("one row per block")
            else:
                kinds.add("mixed, width 1" if tile.width == 1 else "mixed, width > 1")
            if bits == "int4" and tile.lo % 2:
                kinds.add("int4, odd start")
    assert kinds == {"one row per block", "mixed, width 1", "mixed, width > 1", "int4, odd start"}
    _check_tiled([_tiled_results(0)], 1)


@pytest.mark.parametrize("world_size", [2, slow(3)])
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_small_tiles_on_ranks_match_reference_bitwise(world_size, backend):
    if backend != "auto" and backend not in kernels.available():
        pytest.skip(f"the {backend} backend cannot run here")
    _check_tiled(run_ranks(_tiled_scenario, world_size, backend, timeout=300), world_size)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_world_size_one_without_process_group(bits, backend):
    for segments, block_size in [(SEGMENTS, BLOCK), (None, 256)]:
        comm = QuantizedAllreduce(NUMEL, segments=segments, bits=bits, block_size=block_size)
        ref = RefQuantizedAllreduce(NUMEL, 1, bits, segments, block_size)
        for t in range(CALLS):
            x = _inputs(t, 0)
            assert _same_bits(comm(x), ref([x]))
        assert _same_bits(comm.worker_error, ref.worker_error[0])
        assert _same_bits(comm.server_error, ref.server_error[0])
        assert comm.bytes_per_call == 0
    before = comm.state_dict()
    x = _inputs(9, 0).view(1, -1)
    x[0, 5] = float("nan")
    out = comm(x)
    assert out.shape == (1, NUMEL) and out.isnan().all()
    assert _same_bits(comm.worker_error, before["worker_error"])
    assert _same_bits(comm.server_error, before["server_error"])
    other = QuantizedAllreduce(NUMEL, bits=bits)
    other.load_state_dict(before)
    assert _same_bits(comm(_inputs(10, 0)), other(_inputs(10, 0)))
    comm.reset()
    assert not comm.worker_error.any() and not comm.server_error.any()


def test_one_call_is_accurate():
    # Several ranks' worth of inputs, averaged, at world size 1: what one call loses.
    x = torch.stack([_inputs(0, r, 4096, None) for r in range(4)]).mean(0)
    limits = {"bf16": 5e-3, "int8": 1e-2, "int4": 0.2}
    for bits in BITS:
        out = QuantizedAllreduce(4096, bits=bits)(x)
        assert float((out - x).norm() / x.norm()) < limits[bits], bits


def test_int4_packing_round_trip():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.numel() == q.numel() // 2
    assert torch.equal(unpack_int4(packed), q)


def test_bad_arguments():
    with pytest.raises(ValueError, match="'bf16', 'int8', 'int4'"):
        QuantizedAllreduce(8, bits="fp8")
    with pytest.raises(ValueError, match="numel"):
        QuantizedAllreduce(-1)
    with pytest.raises(ValueError, match="add up to 9, not numel=10"):
        QuantizedAllreduce(10, segments=[4, 5])
    with pytest.raises(ValueError, match="non-negative ints"):
        QuantizedAllreduce(10, segments=[11, -1])
    with pytest.raises(ValueError, match="block_size"):
        QuantizedAllreduce(10, block_size=0)
    with pytest.raises(ValueError, match="header_numel"):
        QuantizedAllreduce(10, header_numel=-1)
    comm = QuantizedAllreduce(8, header_numel=1)
    with pytest.raises(ValueError, match="expected 8 elements"):
        comm(torch.ones(9))
    with pytest.raises(ValueError, match="header of 1"):
        comm.start(torch.ones(comm.padded_numel))
    with pytest.raises(ValueError, match="needs 8 elements"):
        comm.start(torch.ones(9), torch.ones(1))
    state = comm.state_dict()
    for other in [
        QuantizedAllreduce(9),
        QuantizedAllreduce(8, bits="int4"),
        QuantizedAllreduce(8, block_size=4),
        QuantizedAllreduce(8, segments=[3, 5]),
    ]:
        with pytest.raises(ValueError, match="saved for"):
            other.load_state_dict(state)


def test_empty_buffer():
    comm = QuantizedAllreduce(0, bits="int4")
    assert comm(torch.ones(0)).numel() == 0 and comm.bytes_per_call == 0


@pytest.mark.cuda
@pytest.mark.parametrize("bits", BITS)
def test_cuda_takes_triton_with_the_cpu_bits(bits, monkeypatch):
    monkeypatch.delenv(kernels.ENV, raising=False)
    gpu = QuantizedAllreduce(NUMEL, segments=SEGMENTS, bits=bits, block_size=BLOCK, device="cuda")
    cpu = QuantizedAllreduce(NUMEL, segments=SEGMENTS, bits=bits, block_size=BLOCK)
    assert gpu._kernels is not None and cpu._kernels is None
    for t in range(CALLS):
        x = _inputs(t, 0)
        assert _same_bits(gpu(x.cuda()).cpu(), cpu(x)), t
    assert _same_bits(gpu.worker_error.cpu(), cpu.worker_error)
    assert _same_bits(gpu.server_error.cpu(), cpu.server_error)
