"""q4_k: native GGUF Q4_K experts (what Q4_K_M files hold for gate and up, and for most down), read in place.

Banks (slot order): ``gate_up [E, 2I, (H/256)*144]`` and ``down [E, H, (I/256)*144]``, uint8, the GGUF tensors'
bytes as they are (gate_up rows 0..I-1 are ``ffn_gate_exps``' rows, I..2I-1 ``ffn_up_exps``'). H and I must be
multiples of 256 (Qwen3-30B-A3B: H = 2048, I = 768). A row is a run of 144-byte blocks of 256 weights:

    bytes 0-1     fp16 d        (little-endian)
    bytes 2-3     fp16 dmin
    bytes 4-15    12 bytes: eight 6-bit scales sc[j] and eight 6-bit mins m[j], packed as
                  j < 4:  sc[j] = b[j] & 63,                       m[j] = b[j+4] & 63
                  j >= 4: sc[j] = (b[j+4] & 15) | (b[j-4] >> 6) << 4, m[j] = (b[j+4] >> 4) | (b[j] >> 6) << 4
    bytes 16-143  qs[128]: sub-block pair p (elements 64p .. 64p+63) in qs[32p .. 32p+31], element 64p + l in the
                  LOW nibble of byte l, element 64p + 32 + l in its HIGH nibble
    w = d * sc[j] * q - dmin * m[j]      (sub-block j = element // 32)

The float64 weights are ggml's and gguf's dequantization: d * sc and dmin * m exact in fp32, their product and
difference rounded once to fp32 (gguf.quants.dequantize's values, tested equal).

Modes:

* ``w4a8`` (default; ggml ``vec_dot_q4_K_q8_K``: the project's name for the integer-activation mode): every
  activation vector (x, and each g row) is quantized per 256-block by the Q8_0 rule (``numerics.int8_blocks``:
  d_a = amax / 127 in fp32, q = clamp(rint(x / d_a), +-127), half to even; a block holding a NaN or an inf gets
  d_a = NaN), with the int16 sums of each 16 codes (ggml's q8_K bsums). Unlike ggml's q8_K (iscale = -127 / max
  with the sign of the largest element, so that element's code is -127 or +127 either way) the scale is
  amax / 127 as in every other w4a8 mode; the same codes up to the sign convention and fp32 rounding. Per block
  the kernels take the exact integers sum_j sc[j] sum(q q_a) and sum_j m[j] (sum of the sub-block's q_a) and
  combine them as d * d_a * first - dmin * d_a * second in fp32.
* ``native`` (W4A16): activations are the bf16 values in fp32, the weights as gguf dequantizes them (one fp32
  rounding each), fp32 dot products.
"""
from __future__ import annotations

import numpy as np

from ._gguf import GgufBlockFormat, gguf_banks
from ._kquant_search import make_qkx2_quants, nearest_int

QK = 256
BLOCK_BYTES = 144
_F32 = np.float32


def _blocks(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape(a.shape[:-1] + (a.shape[-1] // BLOCK_BYTES, BLOCK_BYTES))


def scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes [..., 12] uint8 -> (sc [..., 8], m [..., 8]) uint8 in [0, 63]."""
    s = np.asarray(s, np.uint8)
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, m


def pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(sc [..., 8], m [..., 8]) in [0, 63] -> the 12 packed bytes [..., 12] (the inverse of scales_mins)."""
    sc, m = np.asarray(sc, np.uint8), np.asarray(m, np.uint8)
    out = np.empty(sc.shape[:-1] + (12,), np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((m[..., 4:8] & 15) << 4)
    return out


def nibbles(qs: np.ndarray) -> np.ndarray:
    """qs [..., 128] -> the 256 codes [..., 256] in element order."""
    q = np.asarray(qs, np.uint8).reshape(qs.shape[:-1] + (4, 32))
    return np.stack([q & 15, q >> 4], axis=-2).reshape(qs.shape[:-1] + (256,))


def pack_nibbles(L: np.ndarray) -> np.ndarray:
    """codes [..., 256] in 0..15 -> qs [..., 128] (the inverse of nibbles)."""
    Lp = np.asarray(L, np.uint8).reshape(L.shape[:-1] + (4, 2, 32))
    return (Lp[..., 0, :] | (Lp[..., 1, :] << 4)).reshape(L.shape[:-1] + (128,))


def decode_blocks(a: np.ndarray) -> np.ndarray:
    """Q4_K rows [..., nb*144] uint8 -> float64 weights [..., nb*256]: fp32(d * sc * q - dmin * m) per element."""
    b = _blocks(a)
    d = np.ascontiguousarray(b[..., 0:2]).view("<f2")[..., 0].astype(np.float64)
    dmin = np.ascontiguousarray(b[..., 2:4]).view("<f2")[..., 0].astype(np.float64)
    sc, m = scales_mins(b[..., 4:16])
    q = nibbles(b[..., 16:]).reshape(b.shape[:-1] + (8, 32)).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        w = (d[..., None] * sc)[..., None] * q - (dmin[..., None] * m)[..., None]  # exact in float64 (< 48 bits)
        w = w.astype(np.float32).astype(np.float64)  # one fp32 rounding, as ggml's and gguf's dequantize
    return w.reshape(a.shape[:-1] + (b.shape[-2] * QK,))


def search_blocks(x: np.ndarray, nmax: int, rmin: float, nstep: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The Q4_K / Q5_K block search of ggml's quantize_row_q{4,5}_K_ref: float32 rows [..., K] (K % 256 == 0, finite)
    -> per block of 256 (flattened): fp16 d [N], fp16 dmin [N], the 12 packed scale bytes [N, 12], the codes
    [N, 256] uint8 in [0, nmax].

    Per 32-element sub-block: weights av_x + |x| (av_x = sqrt(mean x^2)), make_qkx2_quants(nmax, rmin, rdelta 0.1,
    nstep steps) -> scale, min; per block d = fp16(max scale / 63), dmin = fp16(max min / 63), the 6-bit
    sc = min(63, nearest_int(63 / max scale * scale)) (likewise m), then the codes again from the stored d * sc
    and dmin * m: q = clamp(nearest_int((x + dmin m) / (d sc)), 0, nmax) (a sub-block with d * sc = 0 keeps the
    search's codes). Every fp32 operation in the C order, without fused multiply-adds (_kquant_search)."""
    xs = x.reshape(-1, 32)  # sub-blocks
    n = xs.shape[0]
    sum_x2 = np.zeros(n, _F32)
    for i in range(32):
        sum_x2 = (sum_x2 + (xs[:, i] * xs[:, i]).astype(_F32)).astype(_F32)
    av_x = np.sqrt((sum_x2 / _F32(32)).astype(_F32)).astype(_F32)
    wts = (av_x[:, None] + np.abs(xs)).astype(_F32)
    scale, mins, L = make_qkx2_quants(xs, wts, nmax, rmin, 0.1, nstep)
    scale, mins, L = scale.reshape(-1, 8), mins.reshape(-1, 8), L.reshape(-1, 8, 32)
    xb = xs.reshape(-1, 8, 32)
    # per block: the largest scale and min (first strictly greater, from 0)
    max_scale, max_min = np.zeros(scale.shape[0], _F32), np.zeros(scale.shape[0], _F32)
    for j in range(8):
        max_scale = np.where(scale[:, j] > max_scale, scale[:, j], max_scale)
        max_min = np.where(mins[:, j] > max_min, mins[:, j], max_min)
    def inv63(m):  # 63 / m where m > 0, else 0
        return np.where(m > 0, _F32(63) / np.where(m > 0, m, _F32(1)), _F32(0)).astype(_F32)

    inv_scale, inv_min = inv63(max_scale), inv63(max_min)
    ls = np.minimum(nearest_int((inv_scale[:, None] * scale).astype(_F32)) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(nearest_int((inv_min[:, None] * mins).astype(_F32)) & 0xFF, 63).astype(np.uint8)
    d16 = (max_scale / _F32(63)).astype(_F32).astype(np.float16)
    dmin16 = (max_min / _F32(63)).astype(_F32).astype(np.float16)
    d = (d16.astype(_F32)[:, None] * ls.astype(_F32)).astype(_F32)
    dm = (dmin16.astype(_F32)[:, None] * lm.astype(_F32)).astype(_F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = ((xb + dm[..., None]).astype(_F32) / np.where(d != 0, d, _F32(1))[..., None]).astype(_F32)
    L = np.where((d != 0)[..., None], np.clip(nearest_int(v), 0, nmax), L).astype(np.uint8).reshape(-1, 256)
    return d16, dmin16, pack_scales_mins(ls, lm), L


def check_rows(x: np.ndarray, fmt: str) -> np.ndarray:
    """x as float32 rows for a K-quant quantizer: ValueError naming `fmt` unless K % 256 == 0 and x is finite."""
    x = np.asarray(x, _F32)
    if x.shape[-1] % QK:
        raise ValueError(f"{fmt} rows must be a multiple of {QK} long, got {x.shape[-1]}")
    if not np.isfinite(x).all():
        raise ValueError(f"{fmt} quantize: the weights must be finite (ggml's scale search is undefined on NaN / inf)")
    return x


def quantize_rows(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q4_K_ref: float rows [..., K] (K % 256 == 0) -> [..., K/256*144] uint8: search_blocks
    with nmax 15, rmin -1, 20 steps; the codes as nibbles."""
    x = check_rows(x, "q4_k")
    K = x.shape[-1]
    d16, dmin16, scales, L = search_blocks(x, 15, -1.0, 20)
    out = np.empty((L.shape[0], BLOCK_BYTES), np.uint8)
    out[:, 0:2] = d16.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = dmin16.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 4:16] = scales
    out[:, 16:] = pack_nibbles(L)
    return out.reshape(x.shape[:-1] + (K // QK * BLOCK_BYTES,))


class Q4KFormat(GgufBlockFormat):
    QK, BLOCK_BYTES, GGUF_TYPE = QK, BLOCK_BYTES, "Q4_K"
    # |d|, |dmin| in [1, 2) * 1e-4 (normal fp16), random signs, random 6-bit scales and mins and codes:
    # weights ~0.04 rms
    RANDOM_SCALES = ((0, 1.0, 1e-4), (2, 1.0, 1e-4))
    quantize_rows = staticmethod(quantize_rows)
    decode_blocks = staticmethod(decode_blocks)


SPEC = Q4KFormat(
    name="q4_k", id=14,
    banks=gguf_banks(QK, BLOCK_BYTES),
    k_multiple=QK,
    input_weight=True,
    modes=("w4a8", "native"),
    default_mode="w4a8",
    description="GGUF Q4_K (256-element blocks: fp16 d, dmin, 6-bit scales and mins, nibbles; 144 bytes); "
                "w4a8 = ggml Q4_K x Q8_K, native = W4A16",
    kernel_tiers={"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni"),
                  "native": ("scalar", "avx2", "avx512f")},
    cpu_layout="q4_k_x16",  # 16 rows per vector: the scales and the fold once per 16 rows (docs/formats/q4_k.md)
)
