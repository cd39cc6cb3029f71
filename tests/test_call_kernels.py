"""The public call's fused passes against the building blocks they replace, bit for bit.

``CompressedAllreduce.__call__`` with the C kernels reads its input where it is and never stores
the worker's ``y`` or the server's ``z`` (:func:`~onebit.compress.compress_input`,
:func:`~onebit.compress.commit_input_`, :func:`~onebit.compress.serve_chunk_` and, at world size
1, :func:`~onebit.compress.allreduce_one_`). Here every backend (C kernels, numpy, the torch
formulation CUDA runs) is checked against the n-rank algorithm composed from the stored-buffer
kernels, as the call ran it before: the same outputs and error buffers over several calls, so
error feedback is exercised, on sizes that are not multiples of 8, of a chunk or of a block.
"""

import pytest
import torch
from backends import BACKENDS, use_backend
from distributed import run_ranks
from heavy import slow

import onebit
from onebit import _native
from onebit.compress import (
    allreduce_one_,
    average_signs_,
    commit_input_,
    compress_,
    compress_input,
    decompress_,
    decompress_pieces_,
    padded_numel,
    segment_scales,
    serve_chunk_,
    serve_pieces_,
    server_error_,
    subtract_compressed_,
    subtract_compressed_segments_,
)
from onebit.wire.scales import ScaleGeometry

SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 1e-30, -1e-30, 3.0e18, -3.0e18]
BLOCK = 4096  # the C kernels' summation block


def values(numel: int, seed: int) -> torch.Tensor:
    """Normal values of mixed magnitudes, a fifth of them zeros, ``-0.0``, denormals, huge."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow(4) * 10
    picks = torch.randint(0, len(SPECIAL), (numel,), generator=gen)
    where = torch.rand(numel, generator=gen) < 0.2
    x[where] = torch.tensor(SPECIAL)[picks[where]]
    return x


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal bit for bit (``-0.0`` is not ``0.0``), except that any NaN matches any NaN."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return False
    nan = expected.isnan()
    a, e = actual[~nan].float().view(torch.int32), expected[~nan].float().view(torch.int32)
    return torch.equal(actual.isnan(), nan) and torch.equal(a, e)


class BlockReference:
    """The n-rank call (SPEC 2) composed from the kernels that store ``y`` and ``z``: every
    rank's padded buffer, :func:`compress_` and the error update, each server's average then
    :func:`compress_` (or :func:`serve_pieces_` with segments), then the decompression."""

    def __init__(self, numel: int, n: int, scale: str, segments: list[int] | None = None) -> None:
        self.numel, self.n, self.scale = numel, n, scale
        self.padded = padded_numel(numel, n)
        self.chunk = self.padded // n
        self.geometry = ScaleGeometry(segments, self.padded, n) if segments and numel else None
        self.worker_error = [torch.zeros(self.padded) for _ in range(n)]
        self.server_error = [torch.zeros(self.chunk) for _ in range(n)]

    def __call__(self, inputs: list[torch.Tensor]) -> torch.Tensor | None:
        """The result every rank gets from ``inputs`` (one per rank); ``None`` (nothing changed)
        if some rank's scale is not finite."""
        g, signs, scales, ys = self.geometry, [], [], []
        for r, x in enumerate(inputs):
            y = torch.zeros(self.padded)
            y[: self.numel] = x.reshape(-1)
            packed, s = compress_(y, self.worker_error[r], self.scale)
            s = s.reshape(1) if g is None else segment_scales(y, g.bounds, self.scale)
            signs.append(packed.view(self.n, -1))
            scales.append(s)
            ys.append(y)
        scales = torch.stack(scales)
        if not torch.isfinite(scales).all():
            return None
        for y, s, packed, error in zip(ys, scales, signs, self.worker_error):
            if g is None:
                subtract_compressed_(y, s[0], out=error, signs=packed.reshape(-1))
            else:
                subtract_compressed_segments_(y, s, g.bounds, error)
        served, sigmas = [], torch.zeros(self.n, 1 if g is None else g.most_pieces)
        for j, error in enumerate(self.server_error):
            received = torch.stack([packed[j] for packed in signs])
            if g is None:
                z = average_signs_(received, scales[:, 0], out=torch.empty(self.chunk))
                packed, sigma = compress_(z, error, self.scale)
                subtract_compressed_(z, sigma, out=error, signs=packed)
            else:
                bounds = g.chunk_bounds[j]
                packed, sigma = serve_pieces_(received, scales, g.served[j], bounds, error,
                                              None, self.scale)  # fmt: skip
                server_error_(error, sigma, bounds)
            served.append(packed)
            sigmas[j, : sigma.numel()] = sigma
        out = torch.empty(self.numel)
        if g is None:
            return decompress_(torch.stack(served), sigmas[:, 0], out)
        return decompress_pieces_(torch.stack(served), sigmas, g.gathered, out)


def inputs(t: int, rank: int, numel: int) -> torch.Tensor:
    """Call ``t``'s input on ``rank``: zeros first (scales of 0, so ``z`` is exactly 0), then
    :func:`values`."""
    return values(numel, 1000 * t + rank) * (1 + rank) if t else torch.zeros(numel)


def _calls_on_rank(rank, world, backend, cases, calls, bad_call):
    """Each case's outputs per call through every form of the call (a new ``out``, a given one,
    in place, fp64, a non-contiguous view), and the error buffers after the last call."""
    use_backend(backend)
    results = []
    for numel, scale, segments in cases:
        comms = [onebit.CompressedAllreduce(numel, scale=scale, segments=segments)
                 for _ in range(5)]  # fmt: skip
        outputs = []
        for t in range(calls):
            x = inputs(t, rank, numel)
            if t == bad_call and rank == world - 1 and numel:
                x[numel // 2] = float("inf")
            out, y = torch.empty(numel), x.clone()
            comms[1](x, out=out)
            comms[2](y, out=y)
            forms = [comms[0](x), out, y, comms[3](x.double()).float()]
            strided = torch.stack([x, x], 1)[:, 0]
            forms.append(comms[4](strided))
            outputs.append(forms)
        unused = [c._scratch is None and c._server_scratch is None for c in comms[:3]]
        errors = [(c.worker_error, c.server_error) for c in comms]
        results.append((outputs, errors, unused))
    return results


def _check(results, world, backend, cases, calls, bad_call):
    for i, (numel, scale, segments) in enumerate(cases):
        ref = BlockReference(numel, world, scale, segments)
        for t in range(calls):
            xs = [inputs(t, r, numel) for r in range(world)]
            if t == bad_call and numel:
                xs[-1][numel // 2] = float("inf")
            expected = ref(xs)
            for rank, rank_results in enumerate(results):
                for form, out in enumerate(rank_results[i][0][t]):
                    if expected is None:  # NaN everywhere, nothing else changed
                        assert out.isnan().all(), (numel, segments, t, rank, form)
                    else:
                        assert same_bits(out, expected), (numel, scale, segments, t, rank, form)
        for rank, rank_results in enumerate(results):
            outputs, errors, unused = rank_results[i]
            for worker_error, server_error in errors:
                assert same_bits(worker_error, ref.worker_error[rank]), (numel, segments, rank)
                assert same_bits(server_error, ref.server_error[rank]), (numel, segments, rank)
            # With the C kernels a contiguous fp32 input is read where it is, z never stored.
            if backend == "c" and numel:
                assert all(unused), (numel, segments)


def ending(sizes: list[int], total: int) -> list[int]:
    """``sizes`` and one more segment, up to ``total`` elements."""
    return [*sizes, total - sum(sizes)]


SOLO_CASES = [
    (21, "rms", None),  # padded to 24
    (64, "mean_abs", None),
    (1, "rms", None),
    (0, "rms", None),
    (2 * BLOCK + 8, "rms", None),  # a block with an odd number of 8-groups
    (3 * BLOCK + 45, "mean_abs", None),
    (70007, "rms", None),  # past numpy's chunk too
    (1000, "rms", [3, 13, 0, 1, 40, 7, 936]),
    (3 * BLOCK + 45, "mean_abs", ending([5000, 3, BLOCK + 7, 0, 12], 3 * BLOCK + 45)),
]


@pytest.mark.slow_on_triton  # the inner loop runs Triton's calls on 2 ranks, below
def test_world_size_one_matches_the_stored_buffer_formulation(backend):
    """Every case on every backend, but the 70,007 elements (numpy's chunk) on Triton: under its
    interpreter each of their 69 blocks runs the same program as the 4 of ``3 * BLOCK + 45``."""
    calls, bad_call = 5, 3
    cases = [c for c in SOLO_CASES if backend != "triton" or c[0] < 70007]
    results = [_calls_on_rank(0, 1, backend, cases, calls, bad_call)]
    _check(results, 1, backend, cases, calls, bad_call)


GROUP_CASES = [
    (1000, "rms", None),
    (37, "mean_abs", None),  # not a multiple of 8 * world
    (2 * BLOCK * 3 + 29, "rms", None),  # chunks past a block
    (1000, "mean_abs", [3, 13, 0, 1, 40, 7, 936]),
]


@pytest.mark.parametrize(
    "kernels,world",
    [(k, 2) for k in BACKENDS]
    + [slow(k, 3) for k in BACKENDS]
    + [slow(k, 4) for k in BACKENDS if k != "triton"],
)
def test_gloo_ranks_match_the_stored_buffer_formulation(world, kernels, monkeypatch):
    """Every backend on 2 and 3 ranks (chunks split evenly and not), and on 4 all but Triton,
    whose interpreted ranks would run the programs of its 2 on chunks of other sizes."""
    use_backend(kernels, monkeypatch)
    calls, bad_call = 4, 2
    results = run_ranks(_calls_on_rank, world, kernels, GROUP_CASES, calls, bad_call, timeout=300)
    _check(results, world, kernels, GROUP_CASES, calls, bad_call)


# The kernels one at a time.

INPUT_SIZES = [(0, 0), (5, 8), (8, 8), (21, 24), (BLOCK + 3, BLOCK + 8), (3 * BLOCK + 45, 12336)]


def _bounds(n: int) -> torch.Tensor:
    """Segments of ``[0, n)`` with an empty one and boundaries inside a byte and a block."""
    edges = sorted({0, n, min(3, n), n // 3, n // 2 + 1, min(BLOCK + 5, n)})
    return torch.tensor([0, *edges], dtype=torch.int64)


@pytest.mark.parametrize("nx,n", INPUT_SIZES)
@pytest.mark.parametrize("scale", ["rms", "mean_abs"])
@pytest.mark.parametrize("segmented", [False, True])
def test_compress_input_and_commit_match_a_padded_buffer(backend, nx, n, scale, segmented):
    x, error = values(nx, 1), values(n, 2)
    bounds = _bounds(n) if segmented and n else None
    buffer = torch.zeros(n)
    buffer[:nx] = x
    error_before, x_before = error.clone(), x.clone()
    want_signs, want_scale = compress_(buffer, error.clone(), scale)
    if bounds is not None:
        want_scale = segment_scales(buffer, bounds, scale)
    signs, scales = compress_input(x, error, scale, bounds)
    assert torch.equal(signs, want_signs) and same_bits(scales, want_scale)
    assert torch.equal(error, error_before) and torch.equal(x, x_before)
    want = error.clone()
    if bounds is None:
        subtract_compressed_(buffer, want_scale, out=want)
    else:
        subtract_compressed_segments_(buffer, want_scale, bounds, want)
    assert commit_input_(x, error, scales, bounds) is error
    assert same_bits(error, want) and torch.equal(x, x_before)


def test_compress_input_rejects_a_long_input():
    with pytest.raises(ValueError, match="multiple of 8"):
        compress_input(torch.zeros(9), torch.zeros(8))
    with pytest.raises(ValueError, match="multiple of 8"):
        compress_input(torch.zeros(3), torch.zeros(12))


@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("m", [1, 5, BLOCK // 8 * 2 + 1])
@pytest.mark.parametrize("scale", ["rms", "mean_abs"])
def test_serve_chunk_matches_average_then_compress(backend, k, m, scale):
    gen = torch.Generator().manual_seed(k * m)
    message = torch.randint(0, 256, (k, m + 4), generator=gen, dtype=torch.uint8)
    packed, scales = message[:, :m], torch.rand(k, generator=gen) * 3  # rows strided
    error = values(8 * m, k)
    want_error = error.clone()
    z = average_signs_(packed, scales, out=torch.empty(8 * m))
    want_signs, want_sigma = compress_(z, want_error, scale)
    subtract_compressed_(z, want_sigma, out=want_error, signs=want_signs)
    signs, sigma = serve_chunk_(packed, scales, error, scale)
    assert torch.equal(signs, want_signs) and same_bits(sigma, want_sigma)
    assert same_bits(error, want_error)


@pytest.mark.parametrize("numel", [21, 64, 2 * BLOCK + 8, 3 * BLOCK + 45])
@pytest.mark.parametrize("scale", ["rms", "mean_abs"])
def test_allreduce_one_matches_the_reference_over_calls(backend, numel, scale):
    ref = BlockReference(numel, 1, scale)
    n = ref.padded
    error, server_error = torch.zeros(n), torch.zeros(n)
    for t in range(4):
        x = inputs(t, 0, numel)
        if t == 2:
            x[numel - 1] = float("nan")
        given = x.clone()
        out = given if t % 2 else torch.full((numel,), 7.0)  # in place, or not
        before = error.clone(), server_error.clone()
        expected = ref([x])
        assert allreduce_one_(given, error, server_error, out, scale) == (expected is not None)
        if expected is None:
            assert torch.equal(error, before[0]) and torch.equal(server_error, before[1])
        else:
            assert same_bits(out, expected)
        assert same_bits(error, ref.worker_error[0])
        assert same_bits(server_error, ref.server_error[0])


def _triton_launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the Triton kernels launched from here on, in order."""
    from onebit.kernels import triton_common

    names, getitem = [], triton_common.Launched.__getitem__

    def counted(self, grid):
        names.append(self.kernel.fn.__name__)
        return getitem(self, grid)

    monkeypatch.setattr(triton_common.Launched, "__getitem__", counted)
    return names


@pytest.mark.parametrize("scale", ["rms", "mean_abs"])
def test_triton_allreduce_one_passes_over_the_buffer_twice(monkeypatch, scale):
    """Triton's call at world size 1: two passes over the buffer with the rms scale (the
    server's scale from the first pass's sums), a third for the server's mean absolute value."""
    use_backend("triton", monkeypatch)
    numel = 2 * BLOCK + 21
    error, server_error, x = (wide(n, seed) for n, seed in [(numel + 3, 1), (numel + 3, 2),
                                                          (numel, 3)])  # fmt: skip
    launched = _triton_launches(monkeypatch)
    assert allreduce_one_(x, error, server_error, torch.empty(numel), scale)
    passes = ["solo_pass"] * (2 if scale == "rms" else 3)
    assert [name for name in launched if name != "solo_scales"] == passes
    assert len(launched) == 2 * len(passes) - 1


@pytest.mark.parametrize("closeness", [1.0, 1e-3])
def test_triton_allreduce_one_rms_server_scale_is_within_the_bound(monkeypatch, closeness):
    """The server's rms scale taken from the worker pass's sums matches the one summed from the
    stored ``z``, also where ``z = ±s + e_s`` nearly cancels (``closeness``: ``|z| / s``); the
    signs and the worker error are exact, and the server error is ``z - ±σ`` with its own ``σ``.
    ``z`` is rebuilt from the reference's server error and ``σ``, so to within a unit in the
    last place of ``max(|z|, σ)``: the two ``σ`` may differ in their last bit."""
    use_backend("triton", monkeypatch)
    numel = 3 * BLOCK + 45
    ref = BlockReference(numel, 1, "rms")
    n = ref.padded
    x, error = wide(numel, 4), wide(n, 5)
    y = torch.cat([x, torch.zeros(n - numel)]) + error
    s = float(torch.linalg.vector_norm(y.double()) / n**0.5)
    noise = torch.randn(n, generator=torch.Generator().manual_seed(6)) * s * closeness
    server_error = noise - torch.where(y >= 0, s, -s) * (closeness < 1)
    ref.worker_error[0], ref.server_error[0] = error.clone(), server_error.clone()
    expected = ref([x])
    out = torch.empty(numel)
    assert allreduce_one_(x, error, server_error, out, "rms")
    assert same_bits(error, ref.worker_error[0])
    assert torch.equal(out.signbit(), expected.signbit())
    sigma, want = out.abs().unique(), expected.abs().unique()
    assert len(sigma) == len(want) == 1
    torch.testing.assert_close(sigma, want, rtol=2e-6, atol=0)
    z = ref.server_error[0][:numel].double() + expected.double()
    ulp = torch.clamp(z.abs(), min=float(sigma)) * 2.0**-23
    assert ((server_error[:numel].double() - (z - out.double())).abs() <= ulp).all()


# The scales' sums: a different order of fp32 additions rarely changes a scale's fp32 bits, so
# the C kernels' fp64 totals are compared instead, on values spanning many orders of magnitude.


def wide(numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen) * 10 ** (torch.rand(numel, generator=gen) * 8 - 4)


@pytest.mark.parametrize("nx,n", INPUT_SIZES[1:] + [(2 * BLOCK + 20, 2 * BLOCK + 24)])
@pytest.mark.parametrize("mean_abs", [0, 1])
def test_native_sums_are_taken_in_the_order_of_the_stored_kernels(nx, n, mean_abs):
    lib = _native.load()
    if lib is None:
        pytest.skip(f"native kernels unavailable: {_native.unavailable}")
    x, error, server_error = wide(nx, 1), wide(n, 2), wide(n, 3)
    y = torch.zeros(n)
    y[:nx] = x
    signs = torch.empty(n // 8, dtype=torch.uint8)
    want = lib.ob_compress(y.data_ptr(), error.data_ptr(), signs.data_ptr(), n, mean_abs)
    bits, add = torch.empty_like(signs), (x.data_ptr(), nx, error.data_ptr())
    assert lib.ob_add_signs(*add, bits.data_ptr(), n, mean_abs) == want
    bounds = _bounds(n)
    want_totals = torch.empty(len(bounds) - 1, dtype=torch.float64)
    lib.ob_sums(y.data_ptr(), bounds.data_ptr(), len(bounds) - 1, mean_abs, want_totals.data_ptr())
    totals = torch.empty_like(want_totals)
    lib.ob_add_signs_segments(*add, bounds.data_ptr(), len(totals), bits.data_ptr(), mean_abs,
                              totals.data_ptr())  # fmt: skip
    assert torch.equal(totals, want_totals) and torch.equal(bits, signs)
    # The server's z: from a received row (world size 1: the worker's own signs), or stored.
    s = torch.tensor([0.75])
    z = average_signs_(signs.view(1, -1), s, out=torch.empty(n))
    z_signs = torch.empty_like(signs)
    want = lib.ob_compress(z.data_ptr(), server_error.data_ptr(), z_signs.data_ptr(), n, mean_abs)
    total = torch.empty(1, dtype=torch.float64)
    lib.ob_serve_chunk_signs(signs.data_ptr(), n // 8, s.data_ptr(), 1, server_error.data_ptr(),
                             bits.data_ptr(), n, mean_abs, total.data_ptr())  # fmt: skip
    assert float(total) == want and torch.equal(bits, z_signs)
    error = error.clone()  # the worker error this pass commits
    solo = lib.ob_solo_commit_signs(x.data_ptr(), nx, error.data_ptr(), 0.75,
                                    server_error.data_ptr(), bits.data_ptr(), n,
                                    mean_abs)  # fmt: skip
    assert solo == want and torch.equal(bits, z_signs)
