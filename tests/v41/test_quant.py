"""Pins the release's weight codecs: UE8M0 powers of two, FP8 E4M3 32x32 scales, FP4 e2m1 packed low nibble first."""

from __future__ import annotations

import pytest
import torch

from ced.deepseek_v41 import quant as Q


def test_ue8m0_is_an_exponent_byte():
    scale = torch.tensor([2.0**-127, 2.0**-3, 1.0, 2.0**5, 2.0**127])
    code = Q.ue8m0_encode(scale)
    assert code.dtype == torch.float8_e8m0fnu
    assert code.view(torch.uint8).tolist() == [0, 124, 127, 132, 254]
    assert torch.equal(Q.ue8m0_decode(code), scale)
    assert torch.equal(Q.ue8m0_decode(code.view(torch.uint8)), scale)  # raw bytes read the same
    assert Q.ue8m0_decode(torch.tensor([255], dtype=torch.uint8)).isnan().all()
    with pytest.raises(ValueError, match="powers of two"):
        Q.ue8m0_encode(torch.tensor([3.0]))


def test_pow2_scale_is_the_smallest_that_fits():
    amax = torch.tensor([448.0, 449.0, 0.0, 6.0, 6.1, 1e-3])
    assert Q.pow2_scale(amax[:3], Q.E4M3_MAX).tolist() == [1.0, 2.0, 1.0]
    assert Q.pow2_scale(amax[3:5], Q.E2M1_MAX).tolist() == [1.0, 2.0]
    assert Q.pow2_scale(amax[5:], Q.E4M3_MAX).item() == 2.0**-18  # 1e-3 / 448 = 2.2e-6 <= 2**-18


def test_e2m1_grid_exact_and_ties_to_even():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = Q.e2m1_encode(torch.cat([grid, -grid[1:]]))
    assert codes.tolist() == list(range(8)) + list(range(9, 16))
    assert torch.equal(Q.e2m1_decode(codes), torch.cat([grid, -grid[1:]]))
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -5.0])
    assert Q.e2m1_decode(Q.e2m1_encode(midpoints)).tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 0, -4]


def test_fp4_packs_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 7]], dtype=torch.uint8)  # 0.5, 1.0, -6.0, 6.0
    packed = Q.pack_fp4(codes)
    assert packed.dtype == torch.int8 and packed.view(torch.uint8).tolist() == [[0x21, 0x7F]]
    assert torch.equal(Q.unpack_fp4(packed), codes)
    values = Q.dequantize_fp4(packed, Q.ue8m0_encode(torch.tensor([[4.0]])))
    assert values.tolist() == [[2.0, 4.0, -24.0, 24.0]]


@pytest.mark.parametrize("shape", [(64, 96), (70, 100), (1, 31), (33, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_round_trip(shape, dtype):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 3
    q, scale = Q.quantize_fp8(weight)
    assert q.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (-(-shape[0] // 32), -(-shape[1] // 32))
    fast, plain = Q.dequantize_fp8(q, scale, dtype=dtype), Q.dequantize_fp8_reference(q, scale, dtype=dtype)
    assert fast.dtype == dtype and torch.equal(fast, plain)
    exact = Q.dequantize_fp8(q, scale)
    assert torch.equal(fast, exact.to(dtype))  # one rounding: float32 math, then the cast
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value, or half a subnormal step (2**-10) of its block's scale
    step = Q.ue8m0_decode(scale).repeat_interleave(32, 0)[: shape[0]].repeat_interleave(32, 1)[:, : shape[1]]
    assert ((exact - weight).abs() <= weight.abs() / 16 + step * 2.0**-10).all()
    assert torch.equal(Q.dequantize_fp8(*Q.quantize_fp8(exact)), exact)  # a fixed point


def test_fp8_row_blocks_for_engram_tables():
    weight = torch.randn(5, 256)
    q, scale = Q.quantize_fp8(weight, (1, 32))
    assert tuple(scale.shape) == (5, 8)
    assert torch.equal(Q.dequantize_fp8(q, scale, (1, 32)), Q.dequantize_fp8_reference(q, scale, (1, 32)))


@pytest.mark.parametrize("shape", [(8, 64), (5, 40), (32, 2)])
def test_fp4_round_trip(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1]))
    packed, scale = Q.quantize_fp4(weight)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (shape[0], shape[1] // 2)
    assert tuple(scale.shape) == (shape[0], -(-shape[1] // 32))
    fast = Q.dequantize_fp4(packed, scale)
    assert torch.equal(fast, Q.dequantize_fp4_reference(packed, scale))
    # nothing saturates (scale >= amax / 6), and each value is within half the widest grid step (1.0) of its scale
    step = Q.ue8m0_decode(scale).repeat_interleave(32, 1)[:, : shape[1]]
    assert ((fast - weight).abs() <= step).all()
    assert torch.equal(Q.dequantize_fp4(*Q.quantize_fp4(fast)), fast)  # a fixed point


def test_power_of_two_weights_are_exact():
    weight = torch.tensor([[2.0**k for k in range(-4, 28)]])  # one 32-block spanning 31 octaves
    assert torch.equal(Q.dequantize_fp8(*Q.quantize_fp8(weight[:, -8:])), weight[:, -8:])  # e4m3 spans 2**-9..2**8
    scaled = torch.tensor([[6.0, -3.0, 0.5, 0.0] * 8]) * 2.0**-10
    assert torch.equal(Q.dequantize_fp4(*Q.quantize_fp4(scaled)), scaled)


def test_misfit_scale_is_refused():
    q, scale = Q.quantize_fp8(torch.randn(64, 64))
    with pytest.raises(ValueError, match="does not fit"):
        Q.dequantize_fp8(q, scale[:1])
    packed, scale4 = Q.quantize_fp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="does not fit"):
        Q.dequantize_fp4(packed, scale4[:, :1])
