"""The release's two weight codecs, as plain torch: FP8 E4M3 with UE8M0 block scales, and FP4 e2m1 packed two per byte.

* **UE8M0** (safetensors `F8_E8M0`, torch `float8_e8m0fnu`) is an exponent alone: byte b means 2**(b - 127), b = 255 is
  NaN, there is no zero and no sign. A scale must therefore be a power of two; `pow2_scale` picks the smallest one
  that brings a block's largest magnitude inside the code's range (so nothing saturates).
* **FP8** (`float8_e4m3fn`, safetensors `F8_E4M3`): dense weights, one UE8M0 scale per 32 x 32 block (the release's
  `weight_block_size`); the scale grid is [ceil(out/32), ceil(in/32)], the last row/column of blocks may be partial.
  `block=(1, 32)` gives the per-row layout the Engram tables use ([N, 256] with a [N, 8] scale).
* **FP4 e2m1** (routed experts): values {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives; bit 3 is the sign, bits 0-2
  index that grid. Two values per int8 byte, **the even column in the low nibble, the odd column in the high nibble**
  (byte = lo | hi << 4; the order transformers' FP4 dequantiser reads). One UE8M0 scale per 32 values along the input
  dimension: weight [out, in] is stored as [out, in/2] `I8` plus a [out, ceil(in/32)] scale.

Quantising rounds to nearest, ties to the even code, as the hardware formats do. Every decode has a plain reference
(`*_reference`, elementwise through `repeat_interleave` or a lookup per element) and the one the loader uses
(reshapes and broadcasting); tests/v41/test_quant.py checks that they agree bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

BLOCK = 32                      # the release's weight_block_size is [32, 32]; FP4 experts use 32 along `in`
E4M3_MAX = 448.0                # the largest finite float8_e4m3fn
E2M1_MAX = 6.0                  # the largest e2m1 magnitude
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude codes 0..7
UE8M0_BIAS = 127
UE8M0_DTYPE = torch.float8_e8m0fnu  # torch >= 2.7; safetensors >= 0.6 stores it as F8_E8M0


# --- UE8M0 scales -------------------------------------------------------------------------------------------------

def pow2_scale(amax: Tensor, qmax: float) -> Tensor:
    """The smallest power of two s with amax / s <= qmax, per element (float32); 1 where amax is 0, clamped to the
    exponents UE8M0 can hold (2**-127 .. 2**127)."""
    amax = amax.float()
    ratio = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    exponent = torch.ceil(torch.log2(ratio))
    # log2 of a float32 can land a hair under an exact power of two: never let the scaled block exceed qmax
    exponent = torch.where(amax / torch.exp2(exponent) > qmax, exponent + 1, exponent)
    return torch.exp2(exponent.clamp(-UE8M0_BIAS, UE8M0_BIAS))


def ue8m0_encode(scale: Tensor) -> Tensor:
    """Powers of two (float) -> `float8_e8m0fnu`, built from the exponent byte itself (torch's own cast rounds a
    non-power upwards silently; here one is an error)."""
    scale = scale.float()
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    if not bool(((mantissa == 0.5) & (scale > 0)).all()):
        raise ValueError("UE8M0 holds only positive powers of two")
    byte = exponent.to(torch.int32) - 1 + UE8M0_BIAS
    if int(byte.min()) < 0 or int(byte.max()) > 254:
        raise ValueError("UE8M0 holds exponents -127..127 only")
    return byte.to(torch.uint8).view(UE8M0_DTYPE)


def ue8m0_decode(code: Tensor) -> Tensor:
    """`float8_e8m0fnu` (or its raw uint8 bytes) -> float32 powers of two; byte 255 -> NaN."""
    byte = code.view(torch.uint8) if code.dtype == UE8M0_DTYPE else code
    if byte.dtype != torch.uint8:
        raise TypeError(f"a UE8M0 scale is float8_e8m0fnu or uint8, not {byte.dtype}")
    value = torch.exp2(byte.float() - UE8M0_BIAS)
    return torch.where(byte == 255, torch.full_like(value, float("nan")), value)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a 2-D weight: one entry per (possibly partial) block."""
    rows, cols = shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def _block_amax(weight: Tensor, block: tuple[int, int]) -> Tensor:
    rows, cols = weight.shape
    grid = scale_shape((rows, cols), block)
    padded = weight.new_zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight.abs()
    return padded.view(grid[0], block[0], grid[1], block[1]).amax(dim=(1, 3))  # (R, C)


def _expand(scale: Tensor, shape: tuple[int, int], block: tuple[int, int]) -> Tensor:
    """The scale grid broadcast back to the weight's shape (reference form)."""
    return scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


# --- FP8 E4M3 with block scales -----------------------------------------------------------------------------------

def quantize_fp8(weight: Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[Tensor, Tensor]:
    """weight [out, in] (any float dtype) -> (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/b0), ceil(in/b1)])."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantisation takes a 2-D weight, not shape {list(weight.shape)}")
    weight = weight.float()
    scale = pow2_scale(_block_amax(weight, block), E4M3_MAX)
    scaled = (weight / _expand(scale, tuple(weight.shape), block)).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn), ue8m0_encode(scale)


def dequantize_fp8_reference(weight: Tensor, scale: Tensor, block: tuple[int, int] = (BLOCK, BLOCK),
                             dtype: torch.dtype = torch.float32) -> Tensor:
    """Plain form: every element times its block's scale, in float32, then cast."""
    expanded = _expand(ue8m0_decode(scale), tuple(weight.shape), block)
    return (weight.float() * expanded).to(dtype)


def dequantize_fp8(weight: Tensor, scale: Tensor, block: tuple[int, int] = (BLOCK, BLOCK),
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """The loader's form: blocks as a view, one broadcast multiply (a copy only for partial edge blocks)."""
    rows, cols = weight.shape
    grid = scale_shape((rows, cols), block)
    if tuple(scale.shape) != grid:
        raise ValueError(f"scale shape {list(scale.shape)} does not fit weight {[rows, cols]} in {block} blocks "
                         f"(expected {list(grid)})")
    values = weight.float()
    if rows % block[0] or cols % block[1]:
        padded = values.new_zeros(grid[0] * block[0], grid[1] * block[1])
        padded[:rows, :cols] = values
        values = padded
    blocks = values.view(grid[0], block[0], grid[1], block[1]) * ue8m0_decode(scale)[:, None, :, None]
    return blocks.view(grid[0] * block[0], grid[1] * block[1])[:rows, :cols].to(dtype)


# --- FP4 e2m1, two per byte, scales per 32 along `in` -------------------------------------------------------------

def e2m1_encode(values: Tensor) -> Tensor:
    """Already-scaled float values -> 4-bit codes (uint8 0..15): nearest grid point, ties to the even code, beyond
    +-6 saturates. Zero is always +0 (code 0)."""
    grid = torch.tensor(E2M1_GRID)
    midpoints = (grid[1:] + grid[:-1]) / 2                               # (7,)
    magnitude = values.float().abs()
    index = torch.bucketize(magnitude, midpoints)                        # a value on a midpoint gets the lower code
    on_midpoint = (index < 7) & (magnitude == midpoints[index.clamp(max=6)])
    index = torch.where(on_midpoint & (index % 2 == 1), index + 1, index)  # ... unless that code is odd
    sign = (values < 0) & (index > 0)
    return (index | (sign.to(index.dtype) << 3)).to(torch.uint8)


def e2m1_decode(codes: Tensor) -> Tensor:
    """4-bit codes (uint8 0..15) -> float32."""
    table = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID))
    return table[codes.long()]


def pack_fp4(codes: Tensor) -> Tensor:
    """[..., 2n] codes -> [..., n] int8: column 2j in the low nibble, column 2j+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, not {codes.shape[-1]}")
    pairs = codes.view(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def unpack_fp4(packed: Tensor) -> Tensor:
    """[..., n] int8 -> [..., 2n] codes (uint8)."""
    byte = packed.view(torch.uint8)
    return torch.stack((byte & 0xF, byte >> 4), dim=-1).flatten(-2)


def quantize_fp4(weight: Tensor, group: int = BLOCK) -> tuple[Tensor, Tensor]:
    """weight [out, in] -> (int8 [out, in/2], float8_e8m0fnu [out, ceil(in/group)])."""
    if weight.dim() != 2:
        raise ValueError(f"FP4 quantisation takes a 2-D weight, not shape {list(weight.shape)}")
    weight = weight.float()
    scale = pow2_scale(_block_amax(weight, (1, group)), E2M1_MAX)
    codes = e2m1_encode(weight / _expand(scale, tuple(weight.shape), (1, group)))
    return pack_fp4(codes), ue8m0_encode(scale)


def dequantize_fp4_reference(packed: Tensor, scale: Tensor, group: int = BLOCK,
                             dtype: torch.dtype = torch.float32) -> Tensor:
    """Plain form: one byte at a time through the 16-entry table, times its group's scale."""
    out, half = packed.shape
    byte = packed.view(torch.uint8).tolist()
    grid = E2M1_GRID + tuple(-v for v in E2M1_GRID)
    values = torch.tensor([[grid[b >> s & 0xF] for b in row for s in (0, 4)] for row in byte]).view(out, 2 * half)
    return (values * _expand(ue8m0_decode(scale), (out, 2 * half), (1, group))).to(dtype)


def dequantize_fp4(packed: Tensor, scale: Tensor, group: int = BLOCK, dtype: torch.dtype = torch.float32) -> Tensor:
    """The loader's form: unpack with shifts, look up, one broadcast multiply per group."""
    out, half = packed.shape
    cols = 2 * half
    grid = (out, math.ceil(cols / group))
    if tuple(scale.shape) != grid:
        raise ValueError(f"scale shape {list(scale.shape)} does not fit packed weight {[out, half]} "
                         f"({cols} values per row, {group} per scale; expected {list(grid)})")
    values = e2m1_decode(unpack_fp4(packed))                                          # (out, in)
    if cols % group:
        padded = values.new_zeros(out, grid[1] * group)
        padded[:, :cols] = values
        values = padded
    values = values.view(out, grid[1], group) * ue8m0_decode(scale)[:, :, None]
    return values.view(out, grid[1] * group)[:, :cols].to(dtype)
