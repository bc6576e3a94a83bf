"""q4_k (GGUF Q4_K) specifics: the 6-bit scale and min packing against gguf's get_scale_min, and the quantizer against
a scalar transliteration of ggml's quantize_row_q4_K_ref. The kernels, the reference against gguf's dequantizer and
the activation prep are checked with q5_k's and q6_k's in test_kquant_kernels.py."""
import numpy as np
from gguf_helpers import gguf_dequantize, kquant_block_scalar

from cpumoe_formats.formats import q4_k as q4

FMT = "q4_k"
QB = q4.BLOCK_BYTES


def test_scale_packing_round_trip():
    """Every (sc, m) pair of 6-bit values at every sub-block position packs and unpacks to itself, and the unpacking
    is gguf's get_scale_min (through dequantize of a block with d = dmin = 1 and q = 1)."""
    v = np.arange(64, dtype=np.uint8)
    sc = np.stack([np.roll(v, 7 * j) for j in range(8)], axis=-1)  # 64 blocks x 8 sub-blocks
    m = np.stack([np.roll(v[::-1], 5 * j) for j in range(8)], axis=-1)
    packed = q4.pack_scales_mins(sc, m)
    s2, m2 = q4.scales_mins(packed)
    np.testing.assert_array_equal(s2, sc)
    np.testing.assert_array_equal(m2, m)
    blk = np.zeros((64, QB), np.uint8)
    blk[:, 0:2] = np.array([1.0], "<f2").view(np.uint8)
    blk[:, 2:4] = np.array([1.0], "<f2").view(np.uint8)
    blk[:, 4:16] = packed
    blk[:, 16:] = 0x11  # every code 1
    w = gguf_dequantize(FMT, blk).reshape(64, 8, 32)
    np.testing.assert_array_equal(w[..., 0], sc.astype(np.float64) - m)


def _q4k_block_scalar(x):
    """ggml quantize_row_q4_K_ref for one block of 256 float32, line by line (numpy float32 scalars)."""
    d16, dm16, ls, lm, L = kquant_block_scalar(x, 15, -1.0, 20)
    out = np.zeros(QB, np.uint8)
    out[0:2], out[2:4] = np.array([d16]).view(np.uint8), np.array([dm16]).view(np.uint8)
    out[4:16] = q4.pack_scales_mins(ls, lm)
    for p in range(4):
        out[16 + 32 * p:48 + 32 * p] = L[64 * p:64 * p + 32] | (L[64 * p + 32:64 * p + 64] << 4)
    return out


def test_quantizer_matches_scalar_transliteration(rng):
    """The vectorised quantizer equals a line-by-line scalar transliteration of ggml's quantize_row_q4_K_ref on
    ordinary blocks, one with a positive-only sub-block (min clamped to 0), a flat (constant negative) sub-block,
    an all-zero block and a block spanning 1e-3 to 1e3."""
    x = rng.standard_normal((6, 256)).astype(np.float32) * np.float32(0.05)
    x[1, :32] = np.abs(x[1, :32]) + np.float32(0.01)
    x[2, 32:64] = np.float32(-0.25)
    x[3] = 0
    x[4] *= np.float32(10.0) ** rng.integers(-2, 5, 256).astype(np.float32)
    got = q4.quantize_rows(x)
    for i in range(len(x)):
        np.testing.assert_array_equal(got[i], _q4k_block_scalar(x[i]), err_msg=f"block {i}")


def test_quantizer_reconstructs():
    """Quantize then dequantize on normal weights: each sub-block's largest error stays under one step of its span
    (span / 15; measured up to 0.76: the weighted least-squares scale trades the ends for the bulk), the rms error
    under 10% of the weights' (measured 7.2%)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 512)).astype(np.float32) * np.float32(0.02)
    w = q4.decode_blocks(q4.quantize_rows(x))
    err = np.abs(w - x).reshape(-1, 32).max(axis=1)
    span = (x.reshape(-1, 32).max(axis=1) - np.minimum(x.reshape(-1, 32).min(axis=1), 0))
    assert np.all(err <= span / 15)
    assert np.sqrt(np.mean((w - x) ** 2)) < 0.1 * np.sqrt(np.mean(x ** 2))
