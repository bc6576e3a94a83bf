"""q6_k (GGUF Q6_K) specifics: the 6-bit codes against an element-by-element reading of ggml's dequantize_row_q6_K
loop and their packing, the quantizer against a scalar transliteration of ggml's quantize_row_q6_K_ref. The
kernels, the reference against gguf's dequantizer and the activation prep are checked with q4_k's and q5_k's in
test_kquant_kernels.py."""
import numpy as np
from gguf_helpers import finite_random_blocks

from cpumoe_formats.formats import q6_k as q6

FMT = "q6_k"
QB = q6.BLOCK_BYTES


def code_independent(blk: np.ndarray, e: int) -> int:
    """Element e's 6-bit code, written from ggml's dequantize_row_q6_K loop (is = l / 16; q1..q4 of each l)."""
    h, r = divmod(e, 128)
    g, l = divmod(r, 32)
    ql, qh = blk[64 * h:64 * h + 64], blk[128 + 32 * h:128 + 32 * h + 32]
    lo = [ql[l] & 0xF, ql[l + 32] & 0xF, ql[l] >> 4, ql[l + 32] >> 4][g]
    return int(lo | (((qh[l] >> (2 * g)) & 3) << 4))


def test_codes_equal_ggml_loop(rng):
    """The codes of random blocks equal an element-by-element reading of ggml's loop and pack back to the bytes."""
    blocks = finite_random_blocks(rng, 3, QB, [208])
    c = q6.codes(blocks)
    for i in range(3):
        assert [code_independent(blocks[i], e) for e in range(256)] == list(c[i])
    ql, qh = q6.pack_codes(c)
    np.testing.assert_array_equal(ql, blocks[:, 0:128])
    np.testing.assert_array_equal(qh, blocks[:, 128:192])


def _qx_scalar(x):
    """ggml make_qx_quants(16, 32, x, L, rmse_type=1, NULL) with numpy float32 scalars, line by line."""
    f = np.float32
    n, nmax = len(x), 32
    amax, mx = f(0), f(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < f(1e-15):
        return f(0), np.zeros(n, np.int8)

    def codes(isc):
        return [max(-nmax, min(nmax - 1, int(np.rint(f(isc * v))))) for v in x]

    def sums(ls):
        slx = sl2 = f(0)
        for v, li in zip(x, ls):
            w = f(v * v)
            slx, sl2 = f(slx + f(f(w * v) * f(li))), f(sl2 + f(f(w * f(li)) * f(li)))
        return slx, sl2

    L = codes(f(f(-nmax) / mx))
    slx, sl2 = sums(L)
    scale = f(slx / sl2) if sl2 != 0 else f(0)
    best = f(scale * slx)
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        ls = codes(f(f(-f(f(nmax) + f(f(0.1) * f(is_)))) / mx))
        a, b = sums(ls)
        if b > 0 and f(a * a) > f(best * b):
            L, scale = ls, f(a / b)
            best = f(scale * a)
    return scale, np.array(L, np.int32) + nmax


def _q6k_block_scalar(x):
    """ggml quantize_row_q6_K_ref for one block of 256 float32, line by line."""
    f = np.float32
    scales, L = np.zeros(16, f), np.zeros(256, np.int32)
    max_scale = max_abs = f(0)
    for j in range(16):
        scales[j], L[16 * j:16 * j + 16] = _qx_scalar(x[16 * j:16 * j + 16])
        if abs(scales[j]) > max_abs:
            max_abs, max_scale = abs(scales[j]), scales[j]
    out = np.zeros(QB, np.uint8)
    if max_abs < f(1e-15):
        return out
    iscale = f(f(-128) / max_scale)
    d16 = np.float16(f(f(1) / iscale))
    sc = np.array([min(127, int(np.rint(f(iscale * scales[j])))) for j in range(16)], np.int32).astype(np.int8)
    for j in range(16):
        d = f(f(d16) * f(sc[j]))
        if d == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, int(np.rint(f(x[16 * j + i] / d))))) + 32
    out[0:128], out[128:192] = q6.pack_codes(L.astype(np.uint8))
    out[192:208] = sc.view(np.uint8)
    out[208:210] = np.array([d16]).view(np.uint8)
    return out


def test_quantizer_matches_scalar_transliteration(rng):
    """The vectorised quantizer equals a line-by-line transliteration of ggml's quantize_row_q6_K_ref on ordinary
    blocks, one whose largest scale is negative, one with an all-zero sub-block, an all-zero block and one spanning
    1e-3 to 1e3."""
    x = rng.standard_normal((6, 256)).astype(np.float32) * np.float32(0.05)
    x[1, 7] = np.float32(-1.0)
    x[2, 16:32] = 0
    x[3] = 0
    x[4] *= np.float32(10.0) ** rng.integers(-2, 5, 256).astype(np.float32)
    got = q6.quantize_rows(x)
    for i in range(len(x)):
        np.testing.assert_array_equal(got[i], _q6k_block_scalar(x[i]), err_msg=f"block {i}")


def test_quantizer_reconstructs():
    """Quantize then dequantize on normal weights: the rms error under 5% of the weights'."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 512)).astype(np.float32) * np.float32(0.02)
    w = q6.decode_blocks(q6.quantize_rows(x))
    assert np.sqrt(np.mean((w - x) ** 2)) < 0.05 * np.sqrt(np.mean(x ** 2))
