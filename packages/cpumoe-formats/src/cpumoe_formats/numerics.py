"""Float64 decoders and rounding encoders for the number formats the banks use.

Decoders follow the kernels' semantics exactly (docs/formats.md):
e4m3 codes 0x7F/0xFF decode to +-480 (no NaN), e8m0 clamps 255 to 254 and
decodes 0 to 2**-127.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)


def _e4m3_table() -> np.ndarray:
    t = np.empty(256, np.float64)
    for b in range(256):
        exp, man = (b >> 3) & 0xF, b & 7
        v = man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        t[b] = -v if b & 0x80 else v
    return t


E4M3_TABLE = _e4m3_table()  # 0x7F -> 480, 0xFF -> -480
E2M1_TABLE = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)
E8M0_TABLE = np.array([2.0 ** (min(s, 254) - 127) for s in range(256)], np.float64)


def codes(a: np.ndarray) -> np.ndarray:
    """The raw uint8 codes of a 1-byte array (uint8 or an ml_dtypes fp8 view)."""
    return np.ascontiguousarray(a).view(np.uint8)


def e4m3_decode(a) -> np.ndarray:
    return E4M3_TABLE[codes(a)]


def e8m0_decode(a) -> np.ndarray:
    return E8M0_TABLE[codes(a)]


def bf16_decode(a) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.dtype == np.uint16:
        a = a.view(BF16)
    return a.astype(np.float64)


def fp16_decode(a) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.dtype == np.uint16:
        a = a.view(np.float16)
    return a.astype(np.float64)


def to_bf16(a) -> np.ndarray:
    """Round to bf16 (nearest even). float64 goes through float32 first, as a
    kernel's fp32 value would (double rounding is what the kernels do too)."""
    return np.asarray(a, np.float32).astype(BF16)


def round_bf16(a) -> np.ndarray:
    """float64 -> fp32 -> bf16, each to nearest even, as float64: the kernels' rounding (they compute in fp32, or in
    double rounded to fp32 once, then round to bf16): to_bf16's, not ml_dtypes' float64 -> bf16 cast, which went
    through fp32 in 0.6 and rounds once in 0.7 (they differ where the fp32 value is a bf16 tie)."""
    with np.errstate(over="ignore"):  # beyond FLT_MAX: inf, as the kernels' (float) cast
        return to_bf16(np.asarray(a, np.float64)).astype(np.float64)


def ulp_bf16(a) -> np.ndarray:
    """The bf16 spacing above |a| (a bf16 value), as float64: 2^(exponent - 7); 2^-133 at zero and subnormals."""
    return np.spacing(np.abs(np.asarray(a, np.float32))).astype(np.float64) * 65536.0


def gap_bf16(g, toward) -> np.ndarray:
    """The distance from each bf16 value g to its bf16 neighbour on `toward`'s side, as float64: ulp_bf16(g) away from
    zero, and half of it toward zero from a power of two (the binade below is twice as fine; not below the smallest
    normal, whose subnormal neighbours keep its spacing)."""
    g = np.asarray(g, np.float64)
    bits = np.abs(g).astype(np.float32).view(np.uint32)
    pow2 = ((bits & 0x7F0000) == 0) & ((bits >> 23) > 1)
    u = ulp_bf16(g)
    return np.where(pow2 & (np.abs(np.asarray(toward, np.float64)) < np.abs(g)), 0.5 * u, u)


def to_e4m3(a) -> np.ndarray:
    """Round to e4m3fn, nearest even, saturating at +-448 (never NaN)."""
    return np.clip(np.asarray(a, np.float32), -448.0, 448.0).astype(E4M3)


def to_e2m1_codes(a) -> np.ndarray:
    """Round to e2m1 (nearest even, saturating at +-6); returns 4-bit codes in uint8."""
    q = np.clip(np.asarray(a, np.float32), -6.0, 6.0).astype(E2M1)
    return q.view(np.uint8) & 0xF


def e8m0_for(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Smallest power-of-two scale s with amax / s <= qmax, as e8m0 codes (uint8)."""
    amax = np.asarray(amax, np.float64)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(np.where(amax > 0, amax / qmax, 1.0)))
    return np.clip(e + 127, 0, 254).astype(np.uint8)


def pack_nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo.astype(np.uint8) & 0xF) | ((hi.astype(np.uint8) & 0xF) << 4)


def unpack_nibbles(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    b = np.asarray(b, np.uint8)
    return b & 0xF, b >> 4


def int8_blocks(v, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Activation quantization of the w4a8 modes with 32-element blocks (q4_0's Q8_0, mxfp4), bit-exact
    with the kernels' prep_act: v [K] -> (q int8 [K/block, block], d float32 [K/block]). Per block in fp32:
    d = amax / 127, id = 1 / d (0 where not finite: amax == 0 or 1/d overflows), q = clamp(rint(x * id),
    -127, 127), ties to even. A block holding a NaN or an inf: d = NaN and q = 0 (its products are NaN)."""
    x = np.asarray(v, np.float32).reshape(-1, block)
    bad = ~np.isfinite(x).all(axis=1)
    x = np.where(bad[:, None], np.float32(0), x)
    d = (np.abs(x).max(axis=1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        inv = (np.float32(1) / d).astype(np.float32)
    inv = np.where(np.isfinite(inv), inv, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((x * inv[:, None]).astype(np.float32)), -127, 127).astype(np.int8)
    return q, np.where(bad, np.float32(np.nan), d).astype(np.float32)

