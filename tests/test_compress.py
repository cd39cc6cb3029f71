"""The compressor layer: sign packing and scales (SPEC section 1)."""

import math

import pytest
import torch

from onebit.compress import (
    compute_scale,
    pack_signs,
    padded_numel,
    subtract_compressed_,
    unpack_signs,
)


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 63, 64, 1000, 4099])
def test_pack_unpack_round_trip_with_padding(numel):
    x = torch.randn(numel)
    x[::5] = 0.0
    padded = torch.zeros(padded_numel(numel, 3))
    padded[:numel] = x
    packed = pack_signs(padded)
    assert packed.dtype == torch.uint8
    assert packed.numel() * 8 == padded.numel()
    signs = unpack_signs(packed)[:numel]
    assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0))


def test_bit_order_is_little_endian_within_each_byte():
    x = -torch.ones(16)
    x[0] = 1.0  # element 0 -> bit 0 of byte 0
    x[15] = 1.0  # element 15 -> bit 7 of byte 1
    assert pack_signs(x).tolist() == [1, 128]


def test_zero_and_negative_zero_map_to_plus_one():
    x = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 5.0, -5.0, 0.0, 0.0])
    assert unpack_signs(pack_signs(x)).tolist() == [1, 1, 1, -1, 1, -1, 1, 1]


def test_unpack_keeps_leading_dimensions():
    x = torch.randn(3, 16)
    packed = pack_signs(x).view(3, 2)
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))


def test_pack_rejects_lengths_not_multiple_of_eight():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(12))


def test_scales_follow_the_spec():
    x = torch.randn(1000, dtype=torch.float64).float()
    torch.testing.assert_close(compute_scale(x, "rms"), x.norm() / math.sqrt(1000))
    torch.testing.assert_close(compute_scale(x, "mean_abs"), x.abs().mean())
    with pytest.raises(ValueError, match="scale must be one of"):
        compute_scale(x, "max")


def test_mean_abs_scale_minimises_the_l2_error():
    x = torch.randn(4096)
    sign = torch.where(x >= 0, 1.0, -1.0)
    errors = {k: (x - compute_scale(x, k) * sign).norm() for k in ("rms", "mean_abs")}
    assert errors["mean_abs"] < errors["rms"]


def test_scale_of_non_finite_input_is_non_finite():
    for bad in (float("nan"), float("inf")):
        x = torch.randn(64)
        x[3] = bad
        assert not torch.isfinite(compute_scale(x))


def test_error_update_is_what_compression_lost():
    y = torch.randn(64)
    s = compute_scale(y)
    error = torch.empty(64)
    subtract_compressed_(y, s, out=error)
    torch.testing.assert_close(error + s * unpack_signs(pack_signs(y)), y)


def test_padded_numel_is_next_multiple_of_eight_n():
    assert padded_numel(0, 4) == 0
    assert padded_numel(1, 4) == 32
    assert padded_numel(32, 4) == 32
    assert padded_numel(33, 3) == 48
