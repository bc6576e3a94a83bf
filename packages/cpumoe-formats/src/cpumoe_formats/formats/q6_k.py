"""q6_k: native GGUF Q6_K experts (what Q4_K_M files hold for the down projections of some layers, and Q6_K
files for all), read in place.

Banks (slot order): ``gate_up [E, 2I, (H/256)*210]`` and ``down [E, H, (I/256)*210]``, uint8, the GGUF tensors'
bytes as they are (gate_up rows 0..I-1 are ``ffn_gate_exps``' rows, I..2I-1 ``ffn_up_exps``'). H and I must be
multiples of 256. A row is a run of 210-byte blocks of 256 weights:

    bytes 0-127    ql[128]: low 4 bits of the codes
    bytes 128-191  qh[64]:  high 2 bits of the codes
    bytes 192-207  16 int8 scales sc[j], one per 16 elements
    bytes 208-209  fp16 d (little-endian)
    for half h (elements 128h ..), l < 32, with L = ql[64h ..], Q = qh[32h ..]:
      q[128h + l]      = (L[l] & 15)      | (Q[l] & 3) << 4
      q[128h + 32 + l] = (L[32 + l] & 15) | (Q[l] >> 2 & 3) << 4
      q[128h + 64 + l] = (L[l] >> 4)      | (Q[l] >> 4 & 3) << 4
      q[128h + 96 + l] = (L[32 + l] >> 4) | (Q[l] >> 6 & 3) << 4
    w = d * sc[e // 16] * (q - 32)       (exact in fp32: gguf.quants.dequantize's values, tested equal)

Modes:

* ``w4a8`` (default; ggml ``vec_dot_q6_K_q8_K``, W6A8: the project's name for the integer-activation mode):
  the activations as q4_k's (256-blocks by the Q8_0 rule). Per block the kernels take the exact integer
  sum_j sc[j] sum((q - 32) q_a) times d * d_a, summed in fp32.
* ``native`` (W6A16): activations are the bf16 values in fp32, per sub-block (d * sc) * sum((q - 32) x) in fp32.
"""
from __future__ import annotations

import numpy as np

from ._gguf import GgufBlockFormat, gguf_banks
from ._kquant_search import GROUP_MAX_EPS, make_qx_quants_rmse1, nearest_int

QK = 256
BLOCK_BYTES = 210
_F32 = np.float32


def _blocks(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape(a.shape[:-1] + (a.shape[-1] // BLOCK_BYTES, BLOCK_BYTES))


def codes(b: np.ndarray) -> np.ndarray:
    """Q6_K blocks [..., 210] -> the 256 unsigned 6-bit codes [..., 256] in element order (0..63)."""
    ql = b[..., 0:128].reshape(b.shape[:-1] + (2, 2, 32))  # [half, ql half, l]
    qh = b[..., 128:192].reshape(b.shape[:-1] + (2, 1, 32))
    lo = np.stack([ql & 15, ql >> 4], axis=-3)  # [half, nibble, ql half, l]: element 32 (2 nibble + ql half) + l
    hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-3).reshape(b.shape[:-1] + (2, 2, 2, 32))
    # qh's shift 2 (2 nibble + ql half) for element group (nibble, ql half)
    return (lo | (hi << 4)).reshape(b.shape[:-1] + (256,))


def decode_blocks(a: np.ndarray) -> np.ndarray:
    """Q6_K rows [..., nb*210] uint8 -> float64 weights [..., nb*256] (exact)."""
    b = _blocks(a)
    d = np.ascontiguousarray(b[..., 208:210]).view("<f2")[..., 0].astype(np.float64)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float64)
    q = codes(b).reshape(b.shape[:-1] + (16, 16)).astype(np.float64) - 32
    w = (d[..., None] * sc)[..., None] * q
    return w.reshape(a.shape[:-1] + (b.shape[-2] * QK,))


def pack_codes(L: np.ndarray) -> np.ndarray:
    """codes [..., 256] (0..63) -> (ql [..., 128], qh [..., 64]) (the inverse of codes)."""
    L = np.asarray(L, np.uint8).reshape(L.shape[:-1] + (2, 4, 32))  # [half, group of 32, l]
    ql = np.concatenate([(L[..., 0, :] & 15) | ((L[..., 2, :] & 15) << 4),
                         (L[..., 1, :] & 15) | ((L[..., 3, :] & 15) << 4)], axis=-1)  # [half, 64]
    qh = (L[..., 0, :] >> 4) | ((L[..., 1, :] >> 4) << 2) | ((L[..., 2, :] >> 4) << 4) | ((L[..., 3, :] >> 4) << 6)
    return ql.reshape(L.shape[:-3] + (128,)), qh.reshape(L.shape[:-3] + (64,))


def quantize_rows(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q6_K_ref: float rows [..., K] (K % 256 == 0) -> [..., K/256*210] uint8.

    Per 16-element sub-block make_qx_quants(nmax 32, rmse_type 1) -> scale; per block the scale of largest |.|
    (first on ties) gives iscale = -128 / it, d = fp16(1 / iscale), sc = min(127, nearest_int(iscale * scale)); then
    q = clamp(nearest_int(x / (d sc)), -32, 31) + 32 (a sub-block with d * sc = 0 keeps the search's codes); a
    block whose scales are all below 1e-15 is all zero bytes. Every fp32 operation in the C order, without fused
    multiply-adds (_kquant_search)."""
    x = np.asarray(x, _F32)
    K = x.shape[-1]
    if K % QK:
        raise ValueError(f"q6_k rows must be a multiple of {QK} long, got {K}")
    if not np.isfinite(x).all():
        raise ValueError("q6_k quantize: the weights must be finite (ggml's scale search is undefined on NaN / inf)")
    lead = x.shape[:-1]
    scale, L = make_qx_quants_rmse1(x.reshape(-1, 16), 32)
    scale, L = scale.reshape(-1, 16), L.reshape(-1, 16, 16)
    xb = x.reshape(-1, 16, 16)
    max_abs, max_scale = np.zeros(scale.shape[0], _F32), np.zeros(scale.shape[0], _F32)
    for j in range(16):
        a = np.abs(scale[:, j])
        bigger = a > max_abs
        max_abs = np.where(bigger, a, max_abs)
        max_scale = np.where(bigger, scale[:, j], max_scale)
    zero = max_abs < GROUP_MAX_EPS
    ms = np.where(zero, _F32(1), max_scale).astype(_F32)
    iscale = (_F32(-128) / ms).astype(_F32)
    d16 = np.where(zero, _F32(0), (_F32(1) / iscale).astype(_F32)).astype(np.float16)
    sc = np.minimum(127, nearest_int((iscale[:, None] * scale).astype(_F32))).astype(np.int8)
    d = (d16.astype(_F32)[:, None] * sc.astype(_F32)).astype(_F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = (xb / np.where(d != 0, d, _F32(1))[..., None]).astype(_F32)
    Lq = np.where((d != 0)[..., None], np.clip(nearest_int(v), -32, 31) + 32, L).astype(np.uint8).reshape(-1, 256)
    out = np.empty((Lq.shape[0], BLOCK_BYTES), np.uint8)
    out[:, 0:128], out[:, 128:192] = pack_codes(Lq)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d16.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[zero] = 0
    return out.reshape(lead + (K // QK * BLOCK_BYTES,))


class Q6KFormat(GgufBlockFormat):
    QK, BLOCK_BYTES, GGUF_TYPE = QK, BLOCK_BYTES, "Q6_K"
    # |d| in [1, 2) * 2^-14 (the smallest normal fp16 binade), random sign, random int8 scales and codes:
    # weights ~0.13 rms
    RANDOM_SCALES = ((208, 1.0, 2.0 ** -14),)
    quantize_rows = staticmethod(quantize_rows)
    decode_blocks = staticmethod(decode_blocks)


SPEC = Q6KFormat(
    name="q6_k", id=15,
    banks=gguf_banks(QK, BLOCK_BYTES),
    k_multiple=QK,
    input_weight=True,
    modes=("w4a8", "native"),
    default_mode="w4a8",
    description="GGUF Q6_K (256-element blocks: ql, qh, 16 int8 scales, fp16 d; 210 bytes); "
                "w4a8 = ggml Q6_K x Q8_K (W6A8), native = W6A16",
    kernel_tiers={"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni"),
                  "native": ("scalar", "avx2", "avx512f")},
    cpu_layout="q6_k_x16",  # 16 rows per vector: the scales and the fold once per 16 rows (docs/formats/q6_k.md)
)
