"""q4_0: native GGUF Q4_0 experts (gemma-4 GGUF), read in place.

Banks (slot order): ``gate_up [E, 2I, (H/32)*18]`` and ``down [E, H, (I/32)*18]``, uint8.
gate_up rows 0..I-1 are gate, I..2I-1 up. Each row is a run of 18-byte blocks of 32 weights:

    bytes 0-1   fp16 d (little-endian)
    bytes 2-17  qs: byte j holds element j in its LOW nibble and element j+16 in its HIGH
                nibble (natural halves, not even/odd)
    w = (nibble - 8) * d

Modes:

* ``w4a8`` (default; llama.cpp ``vec_dot_q4_0_q8_0``): every activation vector (x, and each g row)
  is quantized per 32-block to Q8_0 in fp32: ``d_a = amax / 127``, ``id = 1 / d_a``,
  ``q = clamp(rint(x * id), -127, 127)`` (round half to even). Where ``id`` is not finite
  (amax == 0, or amax < ~127 * 2**-128 so that 1/d_a overflows) ``id = 0``: the block's q are all
  zero and it contributes exactly 0. Unlike llama.cpp, d_a stays fp32 (it is never rounded to fp16).
  Per block the kernel takes the exact integer ``sum((nib - 8) * q)`` times ``fp32(fp16(d) * d_a)``
  and sums in fp32. ``act_in`` reproduces the quantization bit-exactly with numpy float32 ops.
* ``native`` (W4A16): activations are the bf16 values in fp32, weights decoded exactly,
  per block ``d * sum((nib - 8) * x)`` accumulated in fp32.
"""
from __future__ import annotations

import numpy as np

from ..numerics import int8_blocks
from ._gguf import GgufBlockFormat, gguf_banks

QK = 32  # elements per block
BLOCK_BYTES = 18  # fp16 d + 16 bytes of nibbles
_F32 = np.float32


def _blocks(a: np.ndarray) -> np.ndarray:
    """[..., nb*18] uint8 -> [..., nb, 18] view."""
    a = np.ascontiguousarray(a)
    return a.reshape(a.shape[:-1] + (a.shape[-1] // BLOCK_BYTES, BLOCK_BYTES))


def decode_blocks(a: np.ndarray) -> np.ndarray:
    """Q4_0 rows [..., nb*18] uint8 -> float64 weights [..., nb*32] (exact)."""
    b = _blocks(a)
    d = np.ascontiguousarray(b[..., 0:2]).view("<f2")[..., 0].astype(np.float64)
    qs = b[..., 2:]
    nib = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.float64)  # natural halves
    w = (nib - 8.0) * d[..., None]
    return w.reshape(a.shape[:-1] + (b.shape[-2] * QK,))


def quantize_rows(x: np.ndarray) -> np.ndarray:
    """llama.cpp quantize_row_q4_0_ref, vectorised: float rows [..., K] (K % 32 == 0) -> [..., K/32*18] uint8.

    Per block: max = the element of largest |x| (first one on ties, sign kept; +0.0 if all are zero, so an
    all-zero block stores d = -0.0 exactly as llama.cpp does); d = max / -8;
    id = 1/d (0 if d == 0); q = min(15, trunc(x*id + 8.5)) in fp32; d stored as fp16 (RNE).
    """
    x = np.asarray(x, _F32)
    K = x.shape[-1]
    if K % QK:
        raise ValueError(f"q4_0 rows must be a multiple of {QK} long, got {K}")
    xb = x.reshape(x.shape[:-1] + (K // QK, QK))
    i = np.abs(xb).argmax(axis=-1)[..., None]
    mx = np.take_along_axis(xb, i, axis=-1)[..., 0]
    mx = np.where(np.abs(mx) > 0, mx, _F32(0))  # llama's max starts at +0.0 and moves only on a larger |x|
    d = (mx / _F32(-8)).astype(_F32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, _F32(1) / np.where(d != 0, d, _F32(1)), _F32(0)).astype(_F32)
    v = (xb * inv[..., None]).astype(_F32) + _F32(8.5)
    q = np.minimum(np.trunc(v), 15).astype(np.uint8)  # v >= 0.5 > 0: trunc == llama's (int8_t) cast
    out = np.empty(xb.shape[:-1] + (BLOCK_BYTES,), np.uint8)
    out[..., 0:2] = d.astype("<f2")[..., None].view(np.uint8)
    out[..., 2:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(x.shape[:-1] + (K // QK * BLOCK_BYTES,))


def q8_0_quantize(v) -> tuple[np.ndarray, np.ndarray]:
    """The w4a8 activation quantization (numerics.int8_blocks, shared with the other 32-block mode)."""
    return int8_blocks(v, 32)


class Q40Format(GgufBlockFormat):
    QK, BLOCK_BYTES, GGUF_TYPE = QK, BLOCK_BYTES, "Q4_0"
    # |d| in [0.5, 1.5) * 0.0025 (normal fp16), random sign: weights ~ 0.01 rms
    RANDOM_SCALES = ((0, 0.5, 0.0025),)
    quantize_rows = staticmethod(quantize_rows)
    decode_blocks = staticmethod(decode_blocks)


SPEC = Q40Format(
    name="q4_0", id=4,
    banks=gguf_banks(QK, BLOCK_BYTES),
    k_multiple=QK,
    input_weight=True,
    modes=("w4a8", "native"),
    default_mode="w4a8",
    description="GGUF Q4_0 (fp16 d + 32 nibbles per 18-byte block); w4a8 = llama.cpp Q4_0 x Q8_0, native = W4A16",
    kernel_tiers={"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni", "amx"),
                  "native": ("scalar", "avx2", "avx512f")},
    opt_in_tiers=("amx",),  # AMX int8 tiles: for batches that share experts (docs/formats/q4_0.md)
    cpu_layout="q4_0_x16",  # 16 rows per vector: ~2x less compute per token (docs/formats/q4_0.md "q4_0_x16")
    cpu_layout_min_tier="avx2",  # Zen 3, 2 threads: batch 1 688 against ~815 us, shared batch 8 ~2x faster
)
