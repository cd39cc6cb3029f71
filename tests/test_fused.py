"""The fused compression-step passes against the unfused torch formulation, bit for bit, on each
backend that has them (the C kernels, Triton)."""

import pytest
import torch
from backends import use_backend

from onebit.compress import (
    decompress_pieces_,
    pack_signs,
    padded_numel,
    segment_scales,
    subtract_compressed_segments_,
)
from onebit.kernels import fused
from onebit.wire.scales import ScaleGeometry


@pytest.fixture(params=["c", "triton"])
def packing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each backend with the fused passes, through ``ONEBIT_BACKEND``."""
    use_backend(request.param, monkeypatch)
    return request.param


SIZES = [5, 0, 300, 1, 17, 2 * 4096 + 9, 64, 3]  # odd sizes, an empty one, one past blocks
"""At 2 ranks each rank's chunk is longer than a Triton block, so blocks span two rows of the
packed momentum; at 3 and 4 a block holds several rows."""


def _bucket(world: int, gen: torch.Generator):
    numel = sum(SIZES)
    padded = padded_numel(numel, world)
    present = [s for s in SIZES if s]  # as FlatLayout.segments gives them
    geometry = ScaleGeometry(present, padded, world)
    sizes = present + ([padded - numel] if padded > numel else [])
    params = [i for i, s in enumerate(SIZES) if s] + ([None] if padded > numel else [])
    runs = fused.BucketRuns(sizes, geometry.served, padded // world, geometry.most_pieces,
                            params, [0] * len(sizes))  # fmt: skip
    tensors = [torch.randn(s, generator=gen) for s in SIZES]
    return geometry, runs, tensors, numel, padded


def _packed(geometry: ScaleGeometry, world: int, padded: int, gen: torch.Generator):
    chunk = padded // world
    message = torch.randint(0, 256, (world, chunk // 8 + 4 * geometry.most_pieces + 3),
                            generator=gen, dtype=torch.uint8)  # fmt: skip
    scales = torch.rand(world, geometry.most_pieces, generator=gen)
    bits = message[:, : chunk // 8]
    dense = torch.empty(padded)
    decompress_pieces_(bits, scales, geometry.gathered, dense)
    return fused.PackedMomentum(bits, scales.reshape(-1), chunk), dense


def _addresses(runs: fused.BucketRuns, tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """Each parameter's address, as the passes take them (0: no tensor)."""
    return torch.tensor([0 if t is None else t.data_ptr() for t in tensors], dtype=torch.int64)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("inv_scale", [None, 2.0**-7])
@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_signs_and_commit_match_the_torch_formulation(packing, world, packed, inv_scale, beta1):
    gen = torch.Generator().manual_seed(world)
    geometry, runs, grads, numel, padded = _bucket(world, gen)
    grads[2] = None  # a parameter without a gradient: zeros
    grads[4][3] = float("-0.0")
    if packed:
        momentum, m = _packed(geometry, world, padded, gen)
    else:
        m = momentum = torch.randn(padded, generator=gen)
    error = torch.randn(padded, generator=gen) * 0.1
    weight = 1 - beta1

    g = torch.cat([torch.zeros(s) if t is None else t for s, t in zip(SIZES, grads)])
    if inv_scale is not None:
        g = torch.mul(g, inv_scale)
    y = torch.zeros(padded)
    torch.lerp(m[:numel], g, weight, out=y[:numel])
    y += error
    want_scales = segment_scales(y, geometry.bounds)

    addresses = _addresses(runs, grads)
    bits = torch.full((padded // 8,), 0xA5, dtype=torch.uint8)  # stale bits are overwritten
    scales = fused.signs(runs, addresses, inv_scale, momentum, weight, error, bits)
    assert torch.equal(bits, pack_signs(y))
    # Equal where the pieces are summed in the same order (C); else within fp32 rounding.
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    want_error = subtract_compressed_segments_(y, scales, geometry.bounds, torch.empty(padded))
    fused.commit(runs, addresses, inv_scale, momentum, weight, error, scales, out=error)
    assert torch.equal(error, want_error)


def test_no_error_is_zeros_and_the_momentum_buffer_can_take_the_error(packing):
    gen = torch.Generator().manual_seed(0)
    geometry, runs, grads, numel, padded = _bucket(2, gen)
    m = torch.randn(padded, generator=gen)
    addresses = _addresses(runs, grads)
    bits = torch.empty(padded // 8, dtype=torch.uint8)
    zeros = torch.zeros(padded)
    want_bits = bits.clone()
    want_scales = fused.signs(runs, addresses, None, m, 0.1, zeros, want_bits)
    want_error = torch.empty(padded)
    fused.commit(runs, addresses, None, m, 0.1, zeros, want_scales, out=want_error)

    scales = fused.signs(runs, addresses, None, m, 0.1, None, bits)
    assert torch.equal(bits, want_bits) and torch.equal(scales, want_scales)
    fused.commit(runs, addresses, None, m, 0.1, None, scales, out=m)  # in place over m
    assert torch.equal(m[:numel], want_error[:numel])


@pytest.mark.parametrize("packed", [False, True])
def test_bf16_errors_give_the_bits_of_their_fp32_copies_rounded(packing, packed):
    """An error kept in bf16, read (the C kernels read it in place) and written back in place
    or into the fp32 momentum: the signs, scales and new error of the fp32 copy, the error
    rounded to nearest even once written."""
    gen = torch.Generator().manual_seed(6)
    geometry, runs, grads, numel, padded = _bucket(3, gen)
    if packed:
        momentum, _ = _packed(geometry, 3, padded, gen)
    else:
        momentum = torch.randn(padded, generator=gen)
    error = (torch.randn(padded, generator=gen) * 0.1).bfloat16()
    addresses = _addresses(runs, grads)
    results = []
    for e in (error.clone(), error.float()):
        bits = torch.empty(padded // 8, dtype=torch.uint8)
        scales = fused.signs(runs, addresses, 2.0**-7, momentum, 0.1, e, bits)
        into_fp32 = torch.empty(padded)
        fused.commit(runs, addresses, 2.0**-7, momentum, 0.1, e, scales, out=into_fp32)
        fused.commit(runs, addresses, 2.0**-7, momentum, 0.1, e, scales, out=e)
        results.append((bits, scales, into_fp32, e))
    (bits, scales, into_fp32, e), (want_bits, want_scales, want_fp32, want_e) = results
    assert e.dtype == torch.bfloat16 and into_fp32.dtype == torch.float32
    assert torch.equal(bits, want_bits) and torch.equal(scales, want_scales)
    assert torch.equal(into_fp32, want_fp32)
    assert torch.equal(e.view(torch.int16), want_e.bfloat16().view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_give_the_bits_of_their_fp32_values(packing, dtype):
    """bf16 and fp16 gradients read in place: the signs, scales and error of the same values
    in fp32 (which the test above checks against the torch formulation)."""
    gen = torch.Generator().manual_seed(5)
    geometry, runs, grads, numel, padded = _bucket(3, gen)
    low = [g.to(dtype) for g in grads]
    momentum, _ = _packed(geometry, 3, padded, gen)
    error = torch.randn(padded, generator=gen) * 0.1
    results = []
    for given, kind in ((low, dtype), ([g.float() for g in low], torch.float32)):
        addresses, e = _addresses(runs, given), error.clone()
        bits = torch.empty(padded // 8, dtype=torch.uint8)
        scales = fused.signs(runs, addresses, 2.0**-7, momentum, 0.1, e, bits, dtype=kind)
        fused.commit(runs, addresses, 2.0**-7, momentum, 0.1, e, scales, out=e, dtype=kind)
        results.append((bits, scales, e))
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_update_matches_adamw_update(packing, world, weight_decay, dtype):
    """Parameters in fp32, bf16 or fp16, each result rounded to their dtype as torch rounds it:
    ``_foreach_mul_`` takes its factor in the parameters' dtype on the CPU (the C kernels), in
    fp32 on CUDA (Triton)."""
    gen = torch.Generator().manual_seed(world)
    geometry, runs, params, numel, padded = _bucket(world, gen)
    params = [p.to(dtype) for p in params]
    momentum, m = _packed(geometry, world, padded, gen)
    denominator = torch.rand(numel, generator=gen) + 1e-3
    lrs = [1e-3 * (1 + i) for i in range(len(SIZES))]  # a "param group" per tensor
    step_scale = 1 / (1 - 0.9**7)
    want = [p.clone() for p in params]
    ms = list(m[:numel].split(SIZES))
    denoms = list(denominator.split(SIZES))
    for i, lr in enumerate(lrs):
        if weight_decay and packing == "c":
            torch._foreach_mul_(want[i : i + 1], 1 - lr * weight_decay)
        elif weight_decay:
            factor = torch.tensor(1 - lr * weight_decay)  # fp32, as CUDA's foreach takes it
            want[i].copy_(want[i].float() * factor)
        torch._foreach_addcdiv_(want[i : i + 1], ms[i : i + 1], denoms[i : i + 1],
                                value=-lr * step_scale)  # fmt: skip

    decay = torch.tensor([1 - lr * weight_decay for lr in lrs], dtype=torch.float32)
    value = torch.tensor([-lr * step_scale for lr in lrs], dtype=torch.float32)
    addresses = _addresses(runs, params)
    fused.update(runs, addresses, momentum, denominator, decay, value, dtype)
    for p, q in zip(params, want):
        assert torch.equal(p, q)


@pytest.mark.cuda
def test_triton_passes_on_cuda_give_the_cpu_bits(monkeypatch):
    """On a GPU the passes run in Triton, on CUDA tensors read through their addresses: the
    signs, error and parameters of the C kernels on the same values, scales within rounding."""
    monkeypatch.delenv("ONEBIT_BACKEND", raising=False)
    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    geometry, runs, grads, numel, padded = _bucket(3, gen)
    momentum, _ = _packed(geometry, 3, padded, gen)
    error = torch.randn(padded, generator=gen) * 0.1
    params = [torch.randn(s, generator=gen) for s in SIZES]
    denominator = torch.rand(numel, generator=gen) + 1e-3
    decay = torch.full((len(SIZES),), 0.999)
    value = torch.full((len(SIZES),), -1e-3)

    def passes(device, commit_scales=None):
        to = lambda t: t.to(device, copy=True)  # noqa: E731
        m = fused.PackedMomentum(to(momentum.bits), to(momentum.scales), momentum.chunk)
        g, e, p = [to(t) for t in grads], to(error), [to(t) for t in params]
        bits = torch.empty(padded // 8, dtype=torch.uint8, device=device)
        scales = fused.signs(runs, _addresses(runs, g), 2.0**-7, m, 0.1, e, bits)
        used = scales if commit_scales is None else to(commit_scales)
        fused.commit(runs, _addresses(runs, g), 2.0**-7, m, 0.1, e, used, out=e)
        fused.update(runs, _addresses(runs, p), m, to(denominator), decay, value)
        return bits.cpu(), scales.cpu(), e.cpu(), torch.cat(p).cpu()

    bits, scales, e, p = passes(cuda)
    use_backend("c", monkeypatch)
    want_bits, want_scales, want_e, want_p = passes(torch.device("cpu"), commit_scales=scales)
    assert torch.equal(bits, want_bits)
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    assert torch.equal(e, want_e)
    assert torch.equal(p, want_p)
