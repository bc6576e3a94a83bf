"""q5_k (GGUF Q5_K) specifics: the 5-bit codes against an element-by-element reading of ggml's dequantize_row_q5_K
loop and their packing, the quantizer against a scalar transliteration of ggml's quantize_row_q5_K_ref and its
errors. The kernels, the reference against gguf's dequantizer and the activation prep are checked with q4_k's and
q6_k's in test_kquant_kernels.py."""
import numpy as np
import pytest
from gguf_helpers import finite_random_blocks, kquant_block_scalar

from cpumoe_formats.formats import q4_k as q4
from cpumoe_formats.formats import q5_k as q5

FMT = "q5_k"
QB = q5.BLOCK_BYTES


def code_independent(blk: np.ndarray, e: int) -> int:
    """Element e's 5-bit code, written from ggml's dequantize_row_q5_K loop (ql += 32 and u1, u2 <<= 2 per 64)."""
    n, r = divmod(e, 64)
    hi, l = divmod(r, 32)
    ql, qh = blk[48 + 32 * n + l], blk[16 + l]
    u = 1 << (2 * n + hi)
    return int((ql >> 4 if hi else ql & 0xF) + (16 if qh & u else 0))


def test_codes_equal_ggml_loop(rng):
    """The codes of random blocks equal an element-by-element reading of ggml's loop and pack back to the bytes."""
    blocks = finite_random_blocks(rng, 2048, QB, [0, 2])
    c = q5.codes(blocks[:3])
    for i in range(3):
        assert [code_independent(blocks[i], e) for e in range(256)] == list(c[i])
    qh, qs = q5.pack_codes(q5.codes(blocks))
    np.testing.assert_array_equal(qh, blocks[:, 16:48])
    np.testing.assert_array_equal(qs, blocks[:, 48:])


def _q5k_block_scalar(x):
    """ggml quantize_row_q5_K_ref for one block of 256 float32, line by line (numpy float32 scalars), its packing of
    the codes into qh and ql written from the C loop (m1, m2 <<= 2 per 64)."""
    d16, dm16, ls, lm, L = kquant_block_scalar(x, 31, -0.5, 15)
    out = np.zeros(QB, np.uint8)
    out[0:2], out[2:4] = np.array([d16]).view(np.uint8), np.array([dm16]).view(np.uint8)
    out[4:16] = q4.pack_scales_mins(ls, lm)
    m1, m2 = 1, 2
    for n in range(0, 256, 64):
        for j in range(32):
            l1, l2 = int(L[n + j]), int(L[n + j + 32])
            if l1 > 15:
                l1 -= 16
                out[16 + j] |= m1
            if l2 > 15:
                l2 -= 16
                out[16 + j] |= m2
            out[48 + n // 2 + j] = l1 | (l2 << 4)
        m1, m2 = m1 << 2, m2 << 2
    return out


def test_quantizer_matches_scalar_transliteration(rng):
    """The vectorised quantizer equals a line-by-line scalar transliteration of ggml's quantize_row_q5_K_ref on
    ordinary blocks, one with a positive-only sub-block (min clamped to 0), a flat (constant negative) sub-block,
    an all-zero block and a block spanning 1e-3 to 1e3."""
    x = rng.standard_normal((6, 256)).astype(np.float32) * np.float32(0.05)
    x[1, :32] = np.abs(x[1, :32]) + np.float32(0.01)
    x[2, 32:64] = np.float32(-0.25)
    x[3] = 0
    x[4] *= np.float32(10.0) ** rng.integers(-2, 5, 256).astype(np.float32)
    got = q5.quantize_rows(x)
    for i in range(len(x)):
        np.testing.assert_array_equal(got[i], _q5k_block_scalar(x[i]), err_msg=f"block {i}")


def test_quantizer_reconstructs():
    """Quantize then dequantize on normal weights: each sub-block's largest error stays under one step of its span
    (span / 31), the rms error under 5% of the weights' (measured 3.7%; q4_k's 7.2%)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 512)).astype(np.float32) * np.float32(0.02)
    w = q5.decode_blocks(q5.quantize_rows(x))
    err = np.abs(w - x).reshape(-1, 32).max(axis=1)
    span = (x.reshape(-1, 32).max(axis=1) - np.minimum(x.reshape(-1, 32).min(axis=1), 0))
    assert np.all(err <= span / 31)
    assert np.sqrt(np.mean((w - x) ** 2)) < 0.05 * np.sqrt(np.mean(x ** 2))


def test_quantize_rows_errors():
    with pytest.raises(ValueError, match="q5_k rows must be a multiple of 256 long, got 96"):
        q5.quantize_rows(np.zeros((1, 96), np.float32))
    with pytest.raises(ValueError, match="q5_k quantize: the weights must be finite"):
        q5.quantize_rows(np.full((1, 256), np.nan, np.float32))
