"""q8_0: native GGUF Q8_0 experts (the high-quality GGUF files), read in place.

Banks (slot order): ``gate_up [E, 2I, (H/32)*34]`` and ``down [E, H, (I/32)*34]``, uint8, the bytes of the
GGUF tensors as they are: gate_up's rows 0..I-1 are ``ffn_gate_exps``' rows, I..2I-1 ``ffn_up_exps``'. A row is a
run of 34-byte blocks of 32 weights:

    bytes 0-1   fp16 d (little-endian)
    bytes 2-33  qs: 32 int8 codes, element order
    w = q * d

Modes:

* ``w4a8`` (default; ggml ``vec_dot_q8_0_q8_0``, W8A8: the project's name for the integer-activation mode, whatever
  the weight width): every activation vector (x, and each g row) is quantized per 32-block by q4_0's Q8_0 rule
  (``numerics.int8_blocks``: d_a = amax / 127 in fp32, q = clamp(rint(x / d_a), +-127), half to even; a block
  holding a NaN or an inf gets d_a = NaN). Per block the kernels take the exact integer ``sum(q_w * q_a)`` times
  ``fp32(fp16(d)) * d_a`` and sum in fp32. Unlike ggml, d_a stays fp32 (ggml rounds it to fp16) and ties round
  half to even (ggml's scalar reference rounds them away from zero, its AVX2 quantizer to even).
* ``native`` (W8A16): activations are the bf16 values in fp32, per block ``d * sum(q * x)`` in fp32.
"""
from __future__ import annotations

import numpy as np

from ._gguf import GgufBlockFormat, gguf_banks

QK = 32  # elements per block
BLOCK_BYTES = 34  # fp16 d + 32 int8
_F32 = np.float32


def _blocks(a: np.ndarray) -> np.ndarray:
    """[..., nb*34] uint8 -> [..., nb, 34] view."""
    a = np.ascontiguousarray(a)
    return a.reshape(a.shape[:-1] + (a.shape[-1] // BLOCK_BYTES, BLOCK_BYTES))


def decode_blocks(a: np.ndarray) -> np.ndarray:
    """Q8_0 rows [..., nb*34] uint8 -> float64 weights [..., nb*32] (exact; gguf.quants.dequantize's values)."""
    b = _blocks(a)
    d = np.ascontiguousarray(b[..., 0:2]).view("<f2")[..., 0].astype(np.float64)
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.float64)
    return (q * d[..., None]).reshape(a.shape[:-1] + (b.shape[-2] * QK,))


def quantize_rows(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_0_ref, vectorised: float rows [..., K] (K % 32 == 0) -> [..., K/32*34] uint8.

    Per block in fp32: d = amax / 127, id = 1/d (0 if d == 0), q = roundf(x * id) (half away from zero), d stored
    as fp16 (round to nearest even). Bit-identical to gguf.quants.quantize(..., Q8_0) (tested)."""
    x = np.asarray(x, _F32)
    K = x.shape[-1]
    if K % QK:
        raise ValueError(f"q8_0 rows must be a multiple of {QK} long, got {K}")
    xb = x.reshape(x.shape[:-1] + (K // QK, QK))
    d = (np.abs(xb).max(axis=-1) / _F32(127)).astype(_F32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, _F32(1) / np.where(d != 0, d, _F32(1)), _F32(0)).astype(_F32)
    v = (xb * inv[..., None]).astype(_F32)
    a = np.abs(v)
    q = (np.sign(v) * (np.floor(a) + (a - np.floor(a) >= _F32(0.5)))).astype(np.int8)  # roundf, exactly
    out = np.empty(xb.shape[:-1] + (BLOCK_BYTES,), np.uint8)
    out[..., 0:2] = d.astype("<f2")[..., None].view(np.uint8)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(x.shape[:-1] + (K // QK * BLOCK_BYTES,))


class Q80Format(GgufBlockFormat):
    QK, BLOCK_BYTES, GGUF_TYPE = QK, BLOCK_BYTES, "Q8_0"
    # |d| in [1, 2) * 1e-4 (normal fp16), random sign: weights ~ 0.011 rms (uniform int8 codes)
    RANDOM_SCALES = ((0, 1.0, 1e-4),)
    quantize_rows = staticmethod(quantize_rows)
    decode_blocks = staticmethod(decode_blocks)


SPEC = Q80Format(
    name="q8_0", id=13,
    banks=gguf_banks(QK, BLOCK_BYTES),
    k_multiple=QK,
    input_weight=True,
    modes=("w4a8", "native"),
    default_mode="w4a8",
    description="GGUF Q8_0 (fp16 d + 32 int8 per 34-byte block); w4a8 = ggml Q8_0 x Q8_0 (W8A8), native = W8A16",
    kernel_tiers={"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni"),
                  "native": ("scalar", "avx2", "avx512f")},
    cpu_layout="q8_0_x16",  # 16 rows per vector: the scales and the fold once per 16 rows (docs/formats/q8_0.md)
)
