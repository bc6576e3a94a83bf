"""Seeded random weights and their encodings, byte for byte as the files hold them.

Every float tensor is drawn from its own generator, seeded by (seed, the tensor's Hugging Face name), so each
output written from one seed (GGUF, FP8, bf16) quantizes the same float weights. Matrices are N(0, 0.02), as
`initializer_range` 0.02 initializes them; norm weights are 1 + N(0, 0.02); biases N(0, 0.02); gpt-oss's sinks
N(0, 0.5).

Encoders take float32 [R, C] and return what is stored:
- GGUF Q4_0, Q8_0, BF16: gguf.quants.quantize (uint8 [R, C / 32 * block bytes]);
- GGUF Q4_K, Q5_K, Q6_K: gguf-py implements no quantizer for them, so their blocks are drawn directly (see
  `q4_k_blocks`, `q5_k_blocks`, `q6_k_blocks`) at the magnitude of a quantized N(0, 0.02) matrix; the tests decode them
  with gguf.quants.dequantize;
- FP8 block (DeepSeek-V3 / Qwen FP8): e4m3 codes and float32 `weight_scale_inv` [ceil(R/128), ceil(C/128)] =
  block amax / 448 (the factor that dequantizes);
- MXFP4 (gpt-oss): `_blocks` uint8 [R, C/32, 16] (two E2M1 codes a byte, the even element in the low nibble) and
  `_scales` uint8 [R, C/32] (e8m0: exponent + 127, the smallest with amax / 2^e <= 6)."""
from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np

STD = 0.02
ROW_CHUNK = 8192  # rows drawn per call, so a [151936, 2048] embedding never needs its float32 copy (1.2 GB) at once


def rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, zlib.crc32(name.encode())]))


def normal(seed: int, name: str, shape: tuple[int, ...], std: float = STD, mean: float = 0.0) -> np.ndarray:
    """float32 N(mean, std^2) of `shape`, the same for the same (seed, name)."""
    a = rng(seed, name).standard_normal(shape, dtype=np.float32)
    a *= np.float32(std)
    if mean:
        a += np.float32(mean)
    return a


def normal_rows(seed: int, name: str, shape: tuple[int, int], std: float = STD):
    """(row0, float32 chunk) for a large [R, C] matrix, drawn ROW_CHUNK rows at a time from one generator."""
    g = rng(seed, name)
    R, C = shape
    for r0 in range(0, R, ROW_CHUNK):
        a = g.standard_normal((min(ROW_CHUNK, R - r0), C), dtype=np.float32)
        a *= np.float32(std)
        yield r0, a


# ---- GGUF ---------------------------------------------------------------------------------------------------------
def gguf_quantize(x: np.ndarray, qtype) -> np.ndarray:
    """float32 [..., C] -> the GGUF bytes of type `qtype` (uint8 [..., C / block * block bytes])."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    if qtype == T.BF16:  # the same bits as gguf's BF16 (round to nearest even), without its float64 detour
        return np.ascontiguousarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint8)
    return quantize(np.ascontiguousarray(x, np.float32), qtype)


def _fp16_bytes(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(*a.shape, 2)


def q4_k_blocks(g: np.random.Generator, rows: int, cols: int, std: float = STD) -> np.ndarray:
    """Random Q4_K blocks for an [rows, cols] matrix: uint8 [rows, cols / 256 * 144].

    Block (ggml block_q4_K): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and eight 6-bit mins, 128 bytes of
    nibbles; value = d * scale * q - dmin * min. Scales, mins and codes are uniform random bytes (every 6-bit and
    4-bit code occurs); dmin = 7.5 d centres the values (E[scale * q] = 7.5 E[min]), and d is set so their standard
    deviation is ~`std`: with scale, min uniform on 0..63 and q on 0..15, std = d * 258.3 (from the three uniform laws:
    Var(scale q) + 7.5^2 Var(min) = 47532 + 19195), times a per-block factor uniform on [0.75, 1.25]."""
    if cols % 256:
        raise ValueError(f"Q4_K needs rows of a multiple of 256 values, got {cols}")
    nb = rows * (cols // 256)
    out = np.empty((nb, 144), np.uint8)
    d = (std / 258.3) * g.uniform(0.75, 1.25, nb)
    out[:, 0:2] = _fp16_bytes(d)
    out[:, 2:4] = _fp16_bytes(7.5 * d)
    out[:, 4:] = g.integers(0, 256, (nb, 140), dtype=np.uint8)
    return out.reshape(rows, -1)


def q5_k_blocks(g: np.random.Generator, rows: int, cols: int, std: float = STD) -> np.ndarray:
    """Random Q5_K blocks for an [rows, cols] matrix: uint8 [rows, cols / 256 * 176].

    Block (ggml block_q5_K): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and eight 6-bit mins (as Q4_K's),
    32 bytes qh (the codes' fifth bits), 128 bytes of nibbles; value = d * scale * q - dmin * min, q on 0..31. Scales,
    mins, qh and nibbles are uniform random bytes (every 6-bit scale and 5-bit code occurs); dmin = 15.5 d centres the
    values (E[scale * q] = 15.5 E[min]), and d is set so their standard deviation is ~`std`: std = d * 526.9 (from
    the three uniform laws: Var(scale q) + 15.5^2 Var(min) = 195666 + 81985), times a per-block factor uniform on
    [0.75, 1.25]. d is ~3.8e-5, an fp16 subnormal, as Q6_K's."""
    if cols % 256:
        raise ValueError(f"Q5_K needs rows of a multiple of 256 values, got {cols}")
    nb = rows * (cols // 256)
    out = np.empty((nb, 176), np.uint8)
    d = (std / 526.9) * g.uniform(0.75, 1.25, nb)
    out[:, 0:2] = _fp16_bytes(d)
    out[:, 2:4] = _fp16_bytes(15.5 * d)
    out[:, 4:] = g.integers(0, 256, (nb, 172), dtype=np.uint8)
    return out.reshape(rows, -1)


def q4_0_blocks(g: np.random.Generator, rows: int, cols: int, std: float = STD) -> np.ndarray:
    """Random Q4_0 blocks (`random_codes`: no float weights to quantize, ~20x faster for a full-size file): uint8
    [rows, cols / 32 * 18]. Block: fp16 d, 16 bytes of nibbles, value = d * (q - 8); q uniform on 0..15 has standard
    deviation 4.61 about its mean 7.5, so d = std / 4.61 times a per-block factor uniform on [0.75, 1.25]."""
    if cols % 32:
        raise ValueError(f"Q4_0 needs rows of a multiple of 32 values, got {cols}")
    nb = rows * (cols // 32)
    out = np.empty((nb, 18), np.uint8)
    out[:, 0:2] = _fp16_bytes((std / 4.61) * g.uniform(0.75, 1.25, nb))
    out[:, 2:] = g.integers(0, 256, (nb, 16), dtype=np.uint8)
    return out.reshape(rows, -1)


def q8_0_blocks(g: np.random.Generator, rows: int, cols: int, std: float = STD) -> np.ndarray:
    """Random Q8_0 blocks: uint8 [rows, cols / 32 * 34]. Block: fp16 d, 32 int8; q uniform on -127..127 has
    standard deviation 73.6, so d = std / 73.6 times a per-block factor uniform on [0.75, 1.25]."""
    if cols % 32:
        raise ValueError(f"Q8_0 needs rows of a multiple of 32 values, got {cols}")
    nb = rows * (cols // 32)
    out = np.empty((nb, 34), np.uint8)
    out[:, 0:2] = _fp16_bytes((std / 73.6) * g.uniform(0.75, 1.25, nb))
    out[:, 2:] = g.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)
    return out.reshape(rows, -1)


def q6_k_blocks(g: np.random.Generator, rows: int, cols: int, std: float = STD) -> np.ndarray:
    """Random Q6_K blocks: uint8 [rows, cols / 256 * 210].

    Block (ggml block_q6_K): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales, fp16 d;
    value = d * scale * (q - 32). Codes and scales are uniform random bytes (q uniform on 0..63, scale on
    -128..127: rms 73.9); d is set so the values' standard deviation is ~`std` (std = d * 73.9 * 18.47), times a
    per-block factor uniform on [0.75, 1.25]. d is ~1.5e-5, an fp16 subnormal, as in real Q6_K files."""
    if cols % 256:
        raise ValueError(f"Q6_K needs rows of a multiple of 256 values, got {cols}")
    nb = rows * (cols // 256)
    out = np.empty((nb, 210), np.uint8)
    out[:, :208] = g.integers(0, 256, (nb, 208), dtype=np.uint8)
    out[:, 208:210] = _fp16_bytes((std / (73.9 * 18.47)) * g.uniform(0.75, 1.25, nb))
    return out.reshape(rows, -1)


# ---- FP8 block (DeepSeek-V3 / Qwen FP8) -----------------------------------------------------------------------------
FP8_BLOCK = 128
E4M3_MAX = 448.0


def fp8_block(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [R, C] -> (e4m3 codes [R, C], float32 weight_scale_inv [ceil(R/128), ceil(C/128)])."""
    R, C = x.shape
    rb, cb = -(-R // FP8_BLOCK), -(-C // FP8_BLOCK)
    pad = np.zeros((rb * FP8_BLOCK, cb * FP8_BLOCK), np.float32)
    pad[:R, :C] = np.abs(x)
    amax = pad.reshape(rb, FP8_BLOCK, cb, FP8_BLOCK).max(axis=(1, 3))
    s = np.maximum(amax / np.float32(E4M3_MAX), np.float32(1e-12)).astype(np.float32)
    inv = np.repeat(np.repeat(np.float32(1.0) / s, FP8_BLOCK, 0), FP8_BLOCK, 1)[:R, :C]
    return (x * inv).astype(ml_dtypes.float8_e4m3fn), s


def _normal_codes() -> np.ndarray:
    """256 e4m3 codes (uint8): the N(0, 1) quantiles (i + 0.5) / 256 at FP8_CODES_PER_STD a sigma (+-2.9 sigma ->
    +-324, inside e4m3's 448)."""
    from statistics import NormalDist

    q = np.array([NormalDist().inv_cdf((i + 0.5) / 256) for i in range(256)], np.float32) * FP8_CODES_PER_STD
    return q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


FP8_CODES_PER_STD = 112.0


def fp8_block_codes(seed: int, name: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Random FP8 block codes drawn directly, for full-size files in minutes (the float draw and the block amax of
    fp8_block take ~10x longer): one random byte a weight through _normal_codes' table, every block's
    weight_scale_inv STD / FP8_CODES_PER_STD, so the weights are ~N(0, STD^2) at e4m3's resolution. Never 0x7F /
    0xFF (the table holds no NaN code)."""
    R, C = shape
    lut = _normal_codes()
    codes = lut[np.frombuffer(rng(seed, name).bytes(R * C), np.uint8)].reshape(R, C)
    sc = np.full((-(-R // FP8_BLOCK), -(-C // FP8_BLOCK)), STD / FP8_CODES_PER_STD, np.float32)
    return codes.view(ml_dtypes.float8_e4m3fn), sc


# ---- MXFP4 (gpt-oss) ------------------------------------------------------------------------------------------------
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
_E2M1_MID = (E2M1[1:] + E2M1[:-1]) / 2


def mxfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [R, C] -> (blocks uint8 [R, C/32, 16], scales uint8 [R, C/32]), nearest E2M1 code per value."""
    R, C = x.shape
    if C % 32:
        raise ValueError(f"MXFP4 needs rows of a multiple of 32 values, got {C}")
    b = x.reshape(R, C // 32, 32)
    amax = np.maximum(np.abs(b).max(-1), np.float32(2.0 ** -126))
    m, k = np.frexp(amax / np.float32(6.0))  # amax / 6 = m 2^k, m in [0.5, 1): ceil(log2) = k, or k - 1 at m = 0.5
    e = np.clip(k - (m == 0.5), -127, 127).astype(np.int32)
    q = np.ldexp(b, (-e)[..., None])
    a = np.abs(q)
    mag = np.zeros(a.shape, np.uint8)
    for t in _E2M1_MID:  # the code of the nearest magnitude (ties to the smaller): 9x numpy's searchsorted here
        mag += a > t
    codes = mag | (((q < 0) & (mag > 0)).astype(np.uint8) << 3)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (e + 127).astype(np.uint8)
