"""The communicator: compressed allreduce over real gloo process groups (SPEC section 2)."""

import pytest
import torch
from distributed import run_ranks
from reference import RefCompressedAllreduce

import onebit
from onebit.wire.protocol import reduce_compressed_


def _inputs(step: int, rank: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(numel, generator=gen) * (1 + rank)


def _several_calls(rank, world_size, numel, calls, scale, segments=None):
    comm = onebit.CompressedAllreduce(numel, scale=scale, segments=segments)
    outputs = [comm(_inputs(t, rank, numel)) for t in range(calls)]
    return outputs, comm.worker_error, comm.server_error, comm.bytes_per_call


@pytest.mark.parametrize(
    "world_size,numel,scale", [(2, 1000, "rms"), (4, 37, "rms"), (4, 130, "mean_abs")]
)
def test_matches_reference_simulation(world_size, numel, scale):
    calls = 5
    results = run_ranks(_several_calls, world_size, numel, calls, scale)
    ref = RefCompressedAllreduce(numel, world_size, scale)
    for t in range(calls):
        expected = ref([_inputs(t, r, numel) for r in range(world_size)])
        for outputs, *_ in results:
            torch.testing.assert_close(outputs[t], expected, rtol=1e-5, atol=1e-6)
    for rank, (outputs, worker_error, server_error, nbytes) in enumerate(results):
        assert worker_error.numel() == ref.padded
        torch.testing.assert_close(worker_error, ref.worker_error[rank], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(server_error, ref.server_error[rank], rtol=1e-5, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(outputs, results[0][0]))
        # SPEC: about 2 * D/8 * (n-1)/n bytes per call, plus the scales.
        chunk_bytes = ref.padded // world_size // 8
        assert nbytes == 2 * (world_size - 1) * (chunk_bytes + 4)


# Segments that share bytes and chunks, an empty one, and one spanning several chunks.
SEGMENTS = [3, 13, 0, 1, 40, 7, 936]


@pytest.mark.parametrize("world_size,scale", [(1, "rms"), (3, "rms"), (4, "mean_abs")])
def test_segments_match_reference_simulation(world_size, scale):
    numel, calls = sum(SEGMENTS), 4
    results = run_ranks(_several_calls, world_size, numel, calls, scale, SEGMENTS)
    ref = RefCompressedAllreduce(numel, world_size, scale, SEGMENTS)
    for t in range(calls):
        expected = ref([_inputs(t, r, numel) for r in range(world_size)])
        for outputs, *_ in results:
            torch.testing.assert_close(outputs[t], expected, rtol=1e-5, atol=1e-6)
    comm = onebit.CompressedAllreduce(numel, segments=SEGMENTS)
    for rank, (outputs, worker_error, server_error, nbytes) in enumerate(results):
        torch.testing.assert_close(worker_error, ref.worker_error[rank], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(server_error, ref.server_error[rank], rtol=1e-5, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(outputs, results[0][0]))
        # 4 bytes per worker scale (a segment, the padding too) and per server scale (a piece).
        pieces = max(sum(a < b for a, b in _pieces(ref, j)) for j in range(world_size))
        chunk_bytes = ref.padded // world_size // 8
        phases = 2 * chunk_bytes + 4 * len(ref.bounds) + 4 * pieces
        assert nbytes == (world_size - 1) * phases
    assert comm.segments == SEGMENTS


def _pieces(ref: RefCompressedAllreduce, j: int) -> list[tuple[int, int]]:
    lo, hi = j * ref.chunk, (j + 1) * ref.chunk
    return [(max(a, lo), min(b, hi)) for a, b in ref.bounds]


def test_segments_keep_a_small_tensor_at_its_own_scale():
    """One scale per buffer gives a tiny tensor beside a large one the large one's steps."""
    big, small = torch.randn(800) * 100, torch.randn(200) * 1e-3
    x = torch.cat([big, small])
    per_buffer = onebit.CompressedAllreduce(1000)(x)[800:]
    per_segment = onebit.CompressedAllreduce(1000, segments=[800, 200])(x)[800:]
    assert per_buffer.abs().min() > 10  # the tiny tensor moved by about the big one's scale
    torch.testing.assert_close(per_segment.norm(), small.norm(), rtol=1e-3, atol=0)
    assert torch.equal(per_segment.sign(), small.sign())


def test_world_size_one_without_process_group_has_the_same_math():
    numel = 21
    comm = onebit.CompressedAllreduce(numel)
    ref = RefCompressedAllreduce(numel, 1)
    for t in range(4):
        x = _inputs(t, 0, numel).view(3, 7)
        out = comm(x)
        assert out.shape == (3, 7)
        torch.testing.assert_close(out.view(-1), ref([x]), rtol=1e-5, atol=1e-6)
    assert comm.bytes_per_call == 0
    torch.testing.assert_close(comm.worker_error, ref.worker_error[0])


@pytest.mark.parametrize("numel", [64, 21])  # padded_numel equal to numel, and not
def test_call_writes_into_out_or_in_place_with_the_same_bits(numel):
    fresh, into, in_place = (onebit.CompressedAllreduce(numel) for _ in range(3))
    out = torch.empty(numel, dtype=torch.float64)
    for t in range(3):
        x = _inputs(t, 0, numel).double()
        want = fresh(x)
        assert into(x, out=out) is out and torch.equal(out, want)
        y = x.float()
        assert in_place(y, out=y) is y and torch.equal(y, want.float())
    scratch = into._scratch.data_ptr()
    into(x, out=out)
    assert into._scratch.data_ptr() == scratch  # kept between calls
    with pytest.raises(ValueError, match="shape and dtype"):
        into(x, out=torch.empty(numel))
    with pytest.raises(ValueError, match="expected"):
        into(torch.zeros(numel + 1))


def _error_feedback_drift(rank, world_size, calls, numel, feedback):
    comm = onebit.CompressedAllreduce(numel)
    drift = torch.zeros(numel)
    norms = []
    for t in range(calls):
        inputs = [_inputs(t, r, numel) + 0.5 for r in range(world_size)]
        drift += comm(inputs[rank]) - torch.stack(inputs).mean(0)
        norms.append(drift.norm().item())
        if not feedback:
            comm.reset()
    return norms


def test_error_feedback_keeps_the_cumulative_error_bounded():
    calls = 400
    with_feedback = run_ranks(_error_feedback_drift, 2, calls, 256, True)[0]
    without = run_ranks(_error_feedback_drift, 2, calls, 256, False)[0]
    # Bounded: the drift late in the run is no larger than early on...
    assert max(with_feedback[300:]) < 1.5 * max(with_feedback[50:150])
    # ...while without error feedback it grows with t.
    assert without[-1] > 2 * without[150]
    assert with_feedback[-1] < 0.05 * without[-1]


def _non_finite(rank, world_size, numel):
    comm = onebit.CompressedAllreduce(numel)
    comm(_inputs(0, rank, numel))
    before = comm.state_dict()
    x = _inputs(1, rank, numel)
    if rank == 1:
        x[5] = float("inf")
    out = comm(x)
    unchanged = torch.equal(before["worker_error"], comm.worker_error) and torch.equal(
        before["server_error"], comm.server_error
    )
    return bool(out.isnan().all()), unchanged


def test_non_finite_input_on_one_rank_is_seen_by_all_and_changes_nothing():
    for all_nan, unchanged in run_ranks(_non_finite, 2, 100):
        assert all_nan and unchanged


def _overlapped_buckets(rank, world_size):
    sizes = [64, 37, 0, 200]
    comms = [onebit.CompressedAllreduce(n) for n in sizes]
    results = []
    for t in range(3):
        buffers = []
        for comm in comms:
            b = torch.zeros(comm.padded_numel)
            b[: comm.numel] = _inputs(t, rank, comm.numel)
            buffers.append(b)
        outs = [torch.empty(n) for n in sizes]
        assert reduce_compressed_(comms, buffers, outs)
        results.append(outs)
    return results


def test_many_buckets_at_once_match_one_reference_each():
    sizes = [64, 37, 0, 200]
    results = run_ranks(_overlapped_buckets, 4)
    refs = [RefCompressedAllreduce(n, 4) for n in sizes]
    for t in range(3):
        for i, (n, ref) in enumerate(zip(sizes, refs)):
            expected = ref([_inputs(t, r, n) for r in range(4)])
            for res in results:
                torch.testing.assert_close(res[t][i], expected, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_and_geometry_check():
    comm = onebit.CompressedAllreduce(50)
    comm(torch.randn(50))
    other = onebit.CompressedAllreduce(50)
    other.load_state_dict(comm.state_dict())
    x = torch.randn(50)
    assert torch.equal(comm(x), other(x))
    with pytest.raises(ValueError, match="numel=50"):
        onebit.CompressedAllreduce(51).load_state_dict(comm.state_dict())


def test_bad_input():
    with pytest.raises(ValueError, match="numel"):
        onebit.CompressedAllreduce(-1)
    with pytest.raises(ValueError, match="add up to 9, not numel=10"):
        onebit.CompressedAllreduce(10, segments=[4, 5])
    with pytest.raises(ValueError, match="non-negative ints"):
        onebit.CompressedAllreduce(10, segments=[11, -1])
    with pytest.raises(ValueError, match="scale"):
        onebit.CompressedAllreduce(8, scale="median")
    with pytest.raises(ValueError, match="expected 8 elements"):
        onebit.CompressedAllreduce(8)(torch.ones(9))


def test_empty_buffer():
    assert onebit.CompressedAllreduce(0)(torch.ones(0)).numel() == 0


def test_every_compressed_wire_format_is_a_communicator():
    from onebit.wire.protocol import Communicator
    from onebit.wire.quantized import QuantizedAllreduce

    for comm in (
        onebit.CompressedAllreduce(40),
        onebit.CompressedAllreduce(40, segments=[30, 10]),
        QuantizedAllreduce(40, segments=[40], bits="int8"),
    ):
        assert isinstance(comm, Communicator)
        x = torch.randn(comm.padded_numel)
        out = torch.empty(comm.numel)
        assert reduce_compressed_([comm], [x.clone()], [out])
        assert comm.bytes_per_call == 0  # one rank sends nothing
        assert out.isfinite().all() and (out * x[: comm.numel] >= 0).all()  # no sign flips
