"""Every kernel backend, op by op, against the straightforward formulation, bit for bit.

Every op in :mod:`onebit.compress` runs on each backend that runs here (the C kernels and numpy
chunks on the CPU, the torch reference that every other device runs), chosen through
``ONEBIT_BACKEND``; signs, packing and error updates must be exact, and scales within the bound
their reduction order allows.
"""

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from heavy import slow_on_triton

from onebit import compress, kernels
from onebit.compress import (
    average_signs_,
    average_signs_pieces_,
    compress_,
    compute_scale,
    decompress_,
    decompress_pieces_,
    pack_signs,
    segment_scales,
    subtract_compressed_,
    subtract_compressed_segments_,
    unpack_signs,
)
from onebit.kernels import interface
from onebit.kernels.numpy_chunks import CHUNK, NumpyKernels
from onebit.kernels.reference import TorchKernels

SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 1e-30, -1e-30, 3.0e38, -3.0e38, 1.0, -1.0]
NON_FINITE = [float("inf"), float("-inf"), float("nan")]


# The straightforward formulation, as the library had it before the kernels.


def ref_pack(x):
    bits = (x.reshape(-1, 8) >= 0).to(torch.uint8)
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(dim=1, dtype=torch.uint8)


def ref_unpack(packed):
    bits = (packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8).to(torch.float32).mul_(2).sub_(1)


def ref_error(y, s):
    return torch.where(y >= 0, y - s, y + s)


def ref_scale(x, kind):
    x = x.double()
    if kind == "rms":
        return x.norm() / math.sqrt(x.numel())
    return x.abs().sum() / x.numel()


def assert_same_bits(actual, expected):
    """Equal bit for bit, except that any NaN matches any NaN."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan)
    a, e = actual[~nan], expected[~nan]
    assert torch.equal(a.view(torch.int32), e.view(torch.int32))


def values(numel, seed=0, special=True, non_finite=False, huge=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow(4) * 10
    pool = [v for v in SPECIAL if huge or abs(v) < 1e38] + (NON_FINITE if non_finite else [])
    if special and numel:
        picks = torch.randint(0, len(pool), (numel,), generator=gen)
        where = torch.rand(numel, generator=gen) < 0.2
        x[where] = torch.tensor(pool)[picks[where]]
    return x


PAST_CHUNK = [slow_on_triton(n) for n in (CHUNK, CHUNK + 8, 2 * CHUNK + 40)]
SIZES = [8, 16, 24, 1000, 8 * 1001, *PAST_CHUNK]


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("non_finite", [False, True])
def test_pack_and_unpack(backend, numel, non_finite):
    x = values(numel, numel, non_finite=non_finite)
    packed = pack_signs(x)
    assert torch.equal(packed, ref_pack(x))
    assert torch.equal(unpack_signs(packed), ref_unpack(packed))
    assert torch.equal(unpack_signs(packed.view(-1, 1)), ref_unpack(packed.view(-1, 1)))


def test_sign_conventions(backend):
    x = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1, -1])
    # zero and -0.0 are +1; NaN fails x >= 0, so -1
    assert unpack_signs(pack_signs(x)).tolist() == [1, 1, -1, -1, 1, -1, 1, -1]


@pytest.mark.parametrize("numel", [1, 7, 13, *SIZES, slow_on_triton(CHUNK + 5)])
@pytest.mark.parametrize("kind", ["rms", "mean_abs"])
def test_scale(backend, numel, kind):
    x = values(numel, numel, huge=False)
    s = compute_scale(x, kind)
    assert s.dtype == torch.float32 and s.shape == ()
    # fp32 reduction order: the chunked backend is accurate to a few ulp; torch's CPU norm less so
    rtol = 1e-4 if backend == "torch" else 2e-6
    torch.testing.assert_close(s.double(), ref_scale(x, kind), rtol=rtol, atol=0)
    for bad in NON_FINITE:
        y = x.clone()
        y[numel // 2] = bad
        assert not torch.isfinite(compute_scale(y, kind))


def test_scale_overflows_like_torch(backend):
    x = torch.full((64,), 3.0e38)
    assert torch.isinf(compute_scale(x, "rms"))  # sum of squares overflows fp32, as in torch
    assert torch.isinf(torch.linalg.vector_norm(x))


@pytest.mark.parametrize("numel", [1, 7, 13, *SIZES, slow_on_triton(CHUNK + 5)])
@pytest.mark.parametrize("scale_value", [0.0, 0.37, 3.0e38, float("inf"), float("nan")])
def test_error_update(backend, numel, scale_value):
    y = values(numel, numel + 1, non_finite=True)
    s = torch.tensor(scale_value)
    out = torch.full_like(y, 123.0)
    subtract_compressed_(y, s, out=out)
    assert_same_bits(out, ref_error(y, s))
    in_place = y.clone()
    subtract_compressed_(in_place, s, out=in_place)
    assert_same_bits(in_place, ref_error(y, s))
    if numel % 8 == 0:  # with the packed signs at hand, as the communicator does
        out = torch.full_like(y, 123.0)
        subtract_compressed_(y, s, out=out, signs=pack_signs(y))
        assert_same_bits(out, ref_error(y, s))


@pytest.mark.parametrize("numel", [0, *SIZES])
@pytest.mark.parametrize("kind", ["rms", "mean_abs"])
def test_compress(backend, numel, kind):
    buffer, error = values(numel, 1, huge=False), values(numel, 2, huge=False)
    y = buffer + error
    error_before = error.clone()
    packed, s = compress_(buffer, error, kind)
    assert_same_bits(buffer, y)
    assert torch.equal(error, error_before)  # committed later, by the caller
    assert torch.equal(packed, ref_pack(y))
    assert s.dtype == torch.float32 and s.shape == ()
    if numel:
        rtol = 1e-4 if backend == "torch" else 2e-6
        torch.testing.assert_close(s.double(), ref_scale(y, kind), rtol=rtol, atol=0)
        subtract_compressed_(buffer, s, out=error, signs=packed)
        assert_same_bits(error, ref_error(y, s))


def test_compress_non_finite_gives_non_finite_scale(backend):
    for bad in NON_FINITE:
        buffer, error = values(CHUNK + 8, 3), torch.zeros(CHUNK + 8)
        buffer[CHUNK + 3] = bad
        packed, s = compress_(buffer, error)
        assert not torch.isfinite(s)
        assert torch.equal(packed, ref_pack(buffer))


def test_compress_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 8"):
        compress_(torch.zeros(12), torch.zeros(12))
    with pytest.raises(ValueError, match="error"):
        compress_(torch.zeros(16), torch.zeros(8))
    with pytest.raises(ValueError, match="scale must be one of"):
        compress_(torch.zeros(16), torch.zeros(16), "max")


def _message(k, m, seed):
    """``[k, m + 4]`` uint8 rows as received from the wire: packed signs then a scale."""
    gen = torch.Generator().manual_seed(seed)
    message = torch.randint(0, 256, (k, m + 4), generator=gen, dtype=torch.uint8)
    scales = torch.rand(k, generator=gen) * 3
    scales[0] = 0.0
    message[:, m:] = scales.view(torch.uint8).view(k, 4)
    return message[:, :m], scales


@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("m", [1, 5, 130, slow_on_triton(CHUNK // 8 + 3)])
def test_decompress(backend, k, m):
    packed, scales = _message(k, m, k * m)
    expected = (ref_unpack(packed) * scales[:, None]).view(-1)
    for numel in {8 * k * m, 8 * k * m - 1, max(8 * k * m - 8 * m - 5, 1), 3}:
        out = torch.full((numel,), 7.0)
        decompress_(packed, scales, out)
        assert_same_bits(out, expected[:numel])
    shaped = torch.empty(2, 4 * k * m)
    decompress_(packed, scales, shaped)
    assert_same_bits(shaped.view(-1), expected)


def test_decompress_non_finite_scales(backend):
    packed, scales = _message(4, 9, 0)
    scales[1:] = torch.tensor([float("inf"), float("nan"), 3.0e38])
    out = torch.empty(4 * 9 * 8)
    decompress_(packed, scales, out)
    assert_same_bits(out, (ref_unpack(packed) * scales[:, None]).view(-1))


def test_decompress_rejects_short_input():
    packed, scales = _message(2, 1, 0)
    with pytest.raises(ValueError, match="more than"):
        decompress_(packed, scales, torch.empty(17))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 6, 130, slow_on_triton(CHUNK // 8 + 3)])
def test_average_signs(backend, k, m):
    packed, scales = _message(k, m, 100 * k + m)
    out = torch.full((8 * m,), 5.0)
    average_signs_(packed, scales, out)
    sequential = ref_unpack(packed[0]) * scales[0]
    for r in range(1, k):
        sequential = sequential + ref_unpack(packed[r]) * scales[r]
    assert_same_bits(out, sequential / k)  # rank order, then the division
    # Tensor.sum(0) may reorder the terms: equal up to fp32 rounding.
    expected = (ref_unpack(packed) * scales[:, None]).sum(0).div_(k)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)


# Scales per segment (CompressedAllreduce(segments=...)): boundaries anywhere, inside a byte too.


def _bounds(numel, seed):
    """Segment boundaries of ``[0, numel)``: some empty, some inside a byte, one long."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, numel + 1, (max(1, numel // 50),), generator=gen).tolist()
    return torch.tensor(sorted({0, numel, *cuts, min(3, numel), min(3, numel)}))


def _per_element(scales, bounds):
    return torch.repeat_interleave(scales, bounds.diff())


@pytest.mark.parametrize("numel", [8, 1000, slow_on_triton(CHUNK + 13)])
@pytest.mark.parametrize("kind", ["rms", "mean_abs"])
def test_segment_scales(backend, numel, kind):
    y, bounds = values(numel, numel, special=False), _bounds(numel, 1)
    bounds = torch.cat([bounds[:2], bounds[1:2], bounds[2:]])  # an empty segment
    scales = segment_scales(y, bounds, kind)
    edges = bounds.tolist()
    for q, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        expected = ref_scale(y[a:b], kind).float() if b > a else torch.tensor(0.0)
        torch.testing.assert_close(scales[q], expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("numel", [8, 1000, slow_on_triton(CHUNK + 13)])
def test_error_update_segments(backend, numel):
    y, bounds = values(numel, numel + 1), _bounds(numel, 2)
    scales = torch.rand(len(bounds) - 1) * 2
    out = torch.empty(numel)
    subtract_compressed_segments_(y, scales, bounds, out)
    assert_same_bits(out, ref_error(y, _per_element(scales, bounds)))


@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("m", [1, 6, 130, slow_on_triton(CHUNK // 8 + 3)])
def test_average_signs_pieces(backend, k, m):
    packed, _ = _message(k, m, 7 * k + m)
    bounds = _bounds(8 * m, m)
    pieces = torch.stack([bounds[:-1], bounds[1:], torch.arange(len(bounds) - 1).flip(0)], 1)
    scales = torch.rand(k, len(pieces) + 2) * 3
    out = torch.full((8 * m,), 5.0)
    average_signs_pieces_(packed, scales, pieces, out)
    per_element = torch.stack([_per_element(scales[r, pieces[:, 2]], bounds) for r in range(k)])
    sequential = ref_unpack(packed[0]) * per_element[0]
    for r in range(1, k):
        sequential = sequential + ref_unpack(packed[r]) * per_element[r]
    assert_same_bits(out, sequential / k)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 5, 130, slow_on_triton(CHUNK // 8 + 3)])
def test_decompress_pieces(backend, k, m):
    packed, _ = _message(k, m, 11 * k + m)
    rows, expected_rows = [], []
    scales = torch.rand(k, 6) * 3
    for j in range(k):
        bounds = _bounds(8 * m, j)[:7]
        bounds[-1] = 8 * m
        columns = torch.arange(len(bounds) - 1) % 6
        rows += [(j, a, b, c) for a, b, c in zip(bounds[:-1], bounds[1:], columns)]
        expected_rows.append(ref_unpack(packed[j]) * _per_element(scales[j, columns], bounds))
    pieces = torch.tensor(rows, dtype=torch.int64)
    expected = torch.cat(expected_rows)
    for numel in {8 * k * m, 8 * k * m - 1, max(8 * k * m - 8 * m - 5, 1), 3}:
        out = torch.full((numel,), 7.0)
        decompress_pieces_(packed, scales, pieces, out)
        assert_same_bits(out, expected[:numel])


def test_the_cpu_takes_the_c_kernels_and_anything_else_the_reference(monkeypatch):
    """``for_tensors`` is the one place a backend is chosen: by the tensors' device, or by
    ``ONEBIT_BACKEND``."""
    monkeypatch.delenv(kernels.ENV, raising=False)
    cpu = kernels.for_tensors(torch.zeros(8), torch.zeros(2, dtype=torch.uint8))
    assert cpu.name == kernels.available()[0]
    assert kernels.for_tensors(torch.zeros(8, device="meta")).name == "torch"
    assert kernels.for_tensors(torch.zeros(8), torch.zeros(8, device="meta")).name == "torch"
    x = torch.zeros(8, 2).t()  # not contiguous: the backend falls back to the reference
    assert torch.equal(pack_signs(x), ref_pack(x.contiguous()))
    x = torch.zeros(8, requires_grad=True)
    assert torch.equal(pack_signs(x), ref_pack(x.detach()))


@pytest.mark.parametrize("name", kernels.BACKENDS[1:])
def test_each_backend_defines_or_names_every_operation(name):
    """A backend takes no operation of the torch reference by omission: each is its own or
    named (``op = TorchKernels.op``), and the fused momentum passes with ``packs_momentum``;
    the reference defines every operation of the interface."""
    backend = kernels._by_name(name)
    if backend.unavailable() is not None:
        pytest.skip(f"the {name} backend cannot be imported here")
    assert kernels.undeclared(type(backend)) == []
    assert all(op in vars(TorchKernels) for op in interface.OPERATIONS)


def test_a_forgotten_operation_is_found():
    class Forgetful(NumpyKernels):
        packs_momentum = True

        def momentum_signs(self, *args):
            return None

    assert kernels.undeclared(Forgetful) == ["momentum_commit", "momentum_update"]
    assert "unpack_signs" in kernels.undeclared(type("Bare", (TorchKernels,), {}))


@pytest.mark.parametrize(
    "value, device, message",
    [
        ("cuda", "cpu", "'cuda' is not a backend: use one of auto, c, numpy, triton, torch"),
        (
            "triton",
            "meta",
            "ONEBIT_BACKEND=triton cannot run here: it does not take tensors on meta",
        ),
        ("c", "meta", "ONEBIT_BACKEND=c cannot run here: it does not take tensors on meta"),
        ("numpy", "meta", "ONEBIT_BACKEND=numpy cannot run here: it does not take tensors on meta"),
    ],
)
def test_a_backend_that_cannot_run_is_a_clear_error(monkeypatch, value, device, message):
    monkeypatch.setenv(kernels.ENV, value)
    with pytest.raises(ValueError, match=message):
        kernels.for_tensors(torch.zeros(8, device=device))


def test_triton_without_a_gpu_or_the_interpreter_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code = "import torch, onebit.compress as c; c.compress_(torch.zeros(8), torch.zeros(8))"
    env = {**os.environ, kernels.ENV: "triton", "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode != 0
    assert "ONEBIT_BACKEND=triton cannot run here: there is no CUDA GPU" in run.stderr


def test_triton_that_cannot_be_imported_leaves_the_cpu_as_it_was(monkeypatch):
    monkeypatch.setattr(kernels, "_TRITON", None)
    monkeypatch.setitem(sys.modules, "onebit.kernels.triton_kernels", None)
    monkeypatch.setenv(kernels.ENV, "triton")
    with pytest.raises(ValueError, match="ONEBIT_BACKEND=triton cannot run here: Triton cannot"):
        compress.compress_(torch.zeros(8), torch.zeros(8))
    monkeypatch.setenv(kernels.ENV, "auto")
    assert "triton" not in kernels.available()
    assert kernels.for_tensors(torch.zeros(8, device="meta")).name == "torch"


@pytest.mark.parametrize("why", ["not importable", "interpreted"])
def test_auto_on_cuda_says_once_why_triton_cannot_run(monkeypatch, why):
    """Where Triton cannot run on CUDA, ``auto`` takes the torch reference, far slower, and
    warns once with the reason instead of doing it silently."""
    monkeypatch.setattr(kernels, "_WARNED", set())
    monkeypatch.setenv(kernels.ENV, "auto")
    if why == "not importable":
        monkeypatch.setattr(kernels, "_TRITON", None)
        monkeypatch.setitem(sys.modules, "onebit.kernels.triton_kernels", None)
        reason = "Triton cannot be imported"
    else:
        triton_kernels = pytest.importorskip("onebit.kernels.triton_kernels")
        monkeypatch.setattr(triton_kernels, "INTERPRETED", True)
        monkeypatch.setattr(kernels, "_TRITON", triton_kernels.TritonKernels())
        reason = "TRITON_INTERPRET=1 is set"
    cuda, said = torch.device("cuda"), f"the triton kernels cannot run on cuda here .{reason}"
    with pytest.warns(RuntimeWarning, match=said):
        assert kernels.for_device(cuda).name == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.for_device(cuda).name == "torch"


def test_a_backend_that_is_not_built_names_onebit_backend(monkeypatch):
    from onebit import _native

    monkeypatch.setattr(_native, "_tried", True)
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "unavailable", "ONEBIT_NATIVE=0")
    monkeypatch.setenv(kernels.ENV, "c")
    with pytest.raises(ValueError, match="ONEBIT_BACKEND=c cannot run here: the C kernels"):
        compress.compress_(torch.zeros(8), torch.zeros(8))
    monkeypatch.setenv(kernels.ENV, "auto")
    monkeypatch.setattr(kernels, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="the c kernels cannot run on cpu here .the C kernels"):
        assert kernels.for_tensors(torch.zeros(8)).name == "numpy"


def test_triton_binds_every_launched_kernels_arguments_as_passed(monkeypatch):
    """On a GPU, Triton binds a launch's arguments in generated code whose own names (such as
    ``params``) shadow a kernel's arguments of the same name; the interpreter binds none, so
    only a GPU would fail. Each argument must reach Triton's specialization as it was passed."""
    jit = pytest.importorskip("triton.runtime.jit")
    from onebit.kernels import triton_common, triton_kernels  # noqa: F401 (defines them all)

    seen = []
    monkeypatch.setattr(jit, "native_specialize_impl", lambda _, arg, *a: seen.append(arg) or (0,))
    launched = triton_common.LAUNCHED
    assert len(launched) >= 8
    for kernel in launched:
        fn = jit.JITFunction(kernel.kernel.fn)
        binder = jit.create_function_from_signature(fn.signature, fn.params, None)
        args = [object() for _ in fn.params]
        seen.clear()
        bound, _, _ = binder(*args)
        assert list(bound.values()) == args, fn.__name__
        assert seen == [a for a, p in zip(args, fn.params) if not p.is_constexpr], fn.__name__


@pytest.mark.cuda
def test_cuda_takes_triton_and_its_bits_are_the_references(monkeypatch):
    """On a GPU, every op of a bucket with segments, on CUDA tensors (Triton), against the torch
    reference on the CPU: the same signs, errors and results, scales within fp32 rounding."""
    monkeypatch.delenv(kernels.ENV, raising=False)
    cuda = torch.device("cuda")
    assert kernels.for_device(cuda).name == "triton"
    numel, k = 5 * 4096 + 40, 4
    x, error = values(numel - 13, 1, huge=False), values(numel, 2, huge=False) * 0.1
    bounds = _bounds(numel, 3)

    def both(fn):
        on_gpu = fn(lambda t: t.to(cuda, copy=True))
        monkeypatch.setenv(kernels.ENV, "torch")
        on_cpu = fn(lambda t: t.clone())
        monkeypatch.delenv(kernels.ENV)
        return [t.cpu() for t in on_gpu], on_cpu

    (signs, scales), (want_signs, want_scales) = both(
        lambda to: compress.compress_input(to(x), to(error), "rms", bounds)
    )
    assert torch.equal(signs, want_signs)
    torch.testing.assert_close(scales, want_scales, rtol=1e-5, atol=0)
    (committed,), (want,) = both(
        lambda to: [compress.commit_input_(to(x), to(error), to(want_scales), bounds)]
    )
    assert_same_bits(committed, want)

    m = numel // (8 * k)
    packed, _ = _message(k, m, 5)
    chunk_bounds = _bounds(8 * m, 4)
    pieces = torch.stack(
        [chunk_bounds[:-1], chunk_bounds[1:], torch.arange(len(chunk_bounds) - 1)], 1
    )
    row_scales = torch.rand(k, len(pieces)) * 3
    store = values(8 * m, 6, huge=False)
    last = torch.rand(len(pieces))
    (served, sigma, z), (want_served, want_sigma, want_z) = both(
        lambda to: [
            *compress.serve_pieces_(
                to(packed), to(row_scales), pieces, chunk_bounds, s := to(store), to(last), "rms"
            ),
            s,
        ]  # fmt: skip
    )
    assert torch.equal(served, want_served)
    assert_same_bits(z, want_z)
    torch.testing.assert_close(sigma, want_sigma, rtol=1e-5, atol=0)
    rows = torch.tensor([(j, a, b, c) for j in range(k) for a, b, c in pieces.tolist()])
    (out,), (want_out,) = both(
        lambda to: [
            decompress_pieces_(to(packed), to(row_scales), rows, to(torch.empty(numel - 9)))
        ]
    )
    assert_same_bits(out, want_out)


def test_triton_refuses_a_buffer_its_32_bit_offsets_cannot_index():
    triton_common = pytest.importorskip("onebit.kernels.triton_common")
    with pytest.raises(ValueError, match="fewer than 2..31 elements, got 2147483648"):
        triton_common.Tiling(torch.tensor([0, 2**31]), torch.arange(1), 2**31, torch.device("cpu"))
