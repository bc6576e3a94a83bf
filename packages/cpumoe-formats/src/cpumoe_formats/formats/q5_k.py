"""q5_k: native GGUF Q5_K experts (what Q5_K_M files hold for gate and up, and for most down), read in place.

Banks (slot order): ``gate_up [E, 2I, (H/256)*176]`` and ``down [E, H, (I/256)*176]``, uint8, the GGUF tensors'
bytes as they are (gate_up rows 0..I-1 are ``ffn_gate_exps``' rows, I..2I-1 ``ffn_up_exps``'). H and I must be
multiples of 256 (Qwen3-30B-A3B: H = 2048, I = 768). A row is a run of 176-byte blocks of 256 weights:

    bytes 0-1     fp16 d        (little-endian)
    bytes 2-3     fp16 dmin
    bytes 4-15    12 bytes: eight 6-bit scales sc[j] and eight 6-bit mins m[j], packed as Q4_K's (q4_k.py)
    bytes 16-47   qh[32]: the codes' fifth bits, element 32j + l's in bit j of qh[l]
    bytes 48-175  qs[128]: the codes' low 4 bits as Q4_K's nibbles: sub-block pair p (elements 64p .. 64p+63) in
                  qs[32p .. 32p+31], element 64p + l in the LOW nibble of byte l, 64p + 32 + l in its HIGH nibble
    q = nibble | fifth bit << 4 (0..31),  w = d * sc[j] * q - dmin * m[j]      (sub-block j = element // 32)

The float64 weights are ggml's and gguf's dequantization: d * sc * q and dmin * m exact in fp32 (at most 22
significant bits), their difference rounded once to fp32 (gguf.quants.dequantize's values, tested equal).

Modes:

* ``w4a8`` (default; ggml ``vec_dot_q5_K_q8_K``, W5A8: the project's name for the integer-activation mode): the
  activations as q4_k's (256-blocks by the Q8_0 rule, with the int16 sums of each 16 codes). Per block the kernels
  take the exact integers sum_j sc[j] sum(q q_a) and sum_j m[j] (sum of the sub-block's q_a) and combine them as
  d * d_a * first - dmin * d_a * second in fp32.
* ``native`` (W5A16): activations are the bf16 values in fp32, the weights as gguf dequantizes them (one fp32
  rounding each), fp32 dot products.
"""
from __future__ import annotations

import numpy as np

from ._gguf import GgufBlockFormat, gguf_banks
from .q4_k import check_rows, nibbles, pack_nibbles, scales_mins, search_blocks

QK = 256
BLOCK_BYTES = 176


def _blocks(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape(a.shape[:-1] + (a.shape[-1] // BLOCK_BYTES, BLOCK_BYTES))


def codes(b: np.ndarray) -> np.ndarray:
    """Q5_K blocks [..., 176] -> the 256 codes [..., 256] in element order (0..31)."""
    b = np.asarray(b, np.uint8)
    qh = b[..., 16:48]
    fifth = np.stack([(qh >> j) & 1 for j in range(8)], axis=-2).reshape(b.shape[:-1] + (256,))
    return nibbles(b[..., 48:176]) | (fifth << 4)


def pack_codes(L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """codes [..., 256] (0..31) -> (qh [..., 32], qs [..., 128]) (the inverse of codes)."""
    L = np.asarray(L, np.uint8)
    hi = (L >> 4).reshape(L.shape[:-1] + (8, 32))
    qh = np.zeros(L.shape[:-1] + (32,), np.uint8)
    for j in range(8):
        qh |= hi[..., j, :] << j
    return qh, pack_nibbles(L & 15)


def decode_blocks(a: np.ndarray) -> np.ndarray:
    """Q5_K rows [..., nb*176] uint8 -> float64 weights [..., nb*256]: fp32(d * sc * q - dmin * m) per element."""
    b = _blocks(a)
    d = np.ascontiguousarray(b[..., 0:2]).view("<f2")[..., 0].astype(np.float64)
    dmin = np.ascontiguousarray(b[..., 2:4]).view("<f2")[..., 0].astype(np.float64)
    sc, m = scales_mins(b[..., 4:16])
    q = codes(b).reshape(b.shape[:-1] + (8, 32)).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        w = (d[..., None] * sc)[..., None] * q - (dmin[..., None] * m)[..., None]  # exact in float64 (< 48 bits)
        w = w.astype(np.float32).astype(np.float64)  # one fp32 rounding, as ggml's and gguf's dequantize
    return w.reshape(a.shape[:-1] + (b.shape[-2] * QK,))


def quantize_rows(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q5_K_ref: float rows [..., K] (K % 256 == 0) -> [..., K/256*176] uint8: q4_k's block
    search (q4_k.search_blocks) with nmax 31, rmin -0.5, 15 steps; the codes split into qh and qs."""
    x = check_rows(x, "q5_k")
    K = x.shape[-1]
    d16, dmin16, scales, L = search_blocks(x, 31, -0.5, 15)
    out = np.empty((L.shape[0], BLOCK_BYTES), np.uint8)
    out[:, 0:2] = d16.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = dmin16.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 4:16] = scales
    out[:, 16:48], out[:, 48:] = pack_codes(L)
    return out.reshape(x.shape[:-1] + (K // QK * BLOCK_BYTES,))


class Q5KFormat(GgufBlockFormat):
    QK, BLOCK_BYTES, GGUF_TYPE = QK, BLOCK_BYTES, "Q5_K"
    # |d|, |dmin| in [1, 2) * 1e-4 (normal fp16), random signs, random 6-bit scales and mins and codes:
    # weights ~0.1 rms
    RANDOM_SCALES = ((0, 1.0, 1e-4), (2, 1.0, 1e-4))
    quantize_rows = staticmethod(quantize_rows)
    decode_blocks = staticmethod(decode_blocks)


SPEC = Q5KFormat(
    name="q5_k", id=18,
    banks=gguf_banks(QK, BLOCK_BYTES),
    k_multiple=QK,
    input_weight=True,
    modes=("w4a8", "native"),
    default_mode="w4a8",
    description="GGUF Q5_K (256-element blocks: fp16 d, dmin, 6-bit scales and mins, fifth bits, nibbles; "
                "176 bytes); w4a8 = ggml Q5_K x Q8_K (W5A8), native = W5A16",
    kernel_tiers={"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni"),
                  "native": ("scalar", "avx2", "avx512f")},
    cpu_layout="q5_k_x16",  # 16 rows per vector: the scales and the fold once per 16 rows (docs/formats/q5_k.md)
)
