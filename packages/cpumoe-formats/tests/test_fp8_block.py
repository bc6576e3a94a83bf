"""fp8_block (128x128 block FP8, W8A16) kernels vs the float64 reference, every tier forced in turn.

Tolerance (TOL = 5e-3 on rel = max|y - ref| / max|ref|), derived:
- Weight decode is exact in every tier (e4m3 -> fp32/bf16 is exact, and the decode tests
  below check every code through the kernel), and x, g are bf16 values in both kernel and
  reference, so there is no quantization error to budget for: act_in is the identity.
- Products are exact in fp32: e4m3 (4 significant bits) x bf16 x (8) x bf16 scale (8). The
  only kernel rounding before the epilogues is the fp32 summation over K <= 2560 in 8..16
  independent chains: |err| <= ~(K/16) 2^-24 sum|terms|, and with zero-mean data
  sum|terms| ~ sqrt(K) |sum|, so <= ~6e-4 relative worst case, ~2e-5 typical.
- y is stored as bf16 (8 significant bits): |bf16(v) - v| <= 2^-8 |v| / (1 + f) for
  v = 2^e (1 + f), i.e. up to 2^-8 = 3.9e-3 of max|ref| when the largest output sits just
  above a power of two (measured: up to 3.5e-3 with y == bf16(ref) in every element).
- g is rounded to bf16 on both sides; where the fp32 gate/up straddles a rounding boundary
  (probability ~ fp32 error / bf16 ulp ~ 1e-4 per element) one g element differs by one
  bf16 ulp, moving y by well under 1e-3 of max|ref| unless that single term dominates.
So rel <= 2^-8 + ~1e-3: TOL = 5e-3 (the reference executor's float64 bound was also 5e-3,
measured 3.45e-3). The decode tests are EXACT: a one-code-per-row layout makes every output
element a single product that bf16 represents exactly.
"""
import numpy as np
import pytest
from conftest import rel_err, routes, run_forced, tier_cases

import cpumoe_formats as cf
from cpumoe_formats.formats.fp8_block import fp8_block_scale_pad, nb
from cpumoe_formats.numerics import BF16, E4M3, E4M3_TABLE

FMT = "fp8_block"
SPEC = cf.get_format(FMT)
TOL = 5e-3
ACTS = ["silu", "gelu", "gelu_tanh", "swigluoai", "swiglu_clamp"]
CASES = tier_cases(FMT)


def _bf16(a):
    return np.asarray(a, np.float32).astype(BF16)


def _float_weights(rng, E, H, I, scale=0.1):  # noqa: E741
    gu = rng.standard_normal((E, 2 * I, H)).astype(np.float32) * scale
    dn = rng.standard_normal((E, H, I)).astype(np.float32) * scale
    return gu, dn


# ---------------------------------------------------------------- real shapes, batch sizes
@pytest.mark.parametrize("mode,tier", CASES)
@pytest.mark.parametrize("T", [1, 3, 8])
def test_qwen36_35b_a3b_shape(rng, mode, tier, T):
    E, H, I, K = 4, 2048, 512, 8  # noqa: E741 - Qwen3.6-35B-A3B-FP8 expert geometry, top_k 8
    banks = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)  # duplicated experts in a token and a -1 route
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, banks, x, w, ids)
    assert rel_err(y, ref) < TOL


@pytest.mark.parametrize("mode,tier", CASES)
def test_qwen38_padded_scale_banks(rng, mode, tier):
    E, H, I, K, T = 3, 2560, 640, 4, 3  # noqa: E741
    gu, dn = _float_weights(rng, E, H, I)
    banks = cf.quantize(FMT, gu, dn)
    assert banks["down_scale"].shape == (E, 20, 6)  # nb(I) = 5 padded to 6 (20*5*2 = 200 B, not 16-aligned)
    assert banks["gate_up_scale"].shape == (E, 10, 20)
    # the padding column is never read: poison it
    banks["down_scale"][:, :, 5:] = _bf16(np.nan)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, banks, x, w, ids)
    assert rel_err(y, ref) < TOL


# ---------------------------------------------------------------- ragged dims, activations
@pytest.mark.parametrize("mode,tier", CASES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("on_input", [False, True])
def test_ragged_activations(rng, mode, tier, act, on_input):
    E, H, I, K, T = 5, 259, 257, 4, 3  # noqa: E741 - partial 128-blocks and K tails in both passes
    gu, dn = _float_weights(rng, E, H, I)
    banks = cf.quantize(FMT, gu, dn)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    kw = {"activation": act, "apply_router_weight_on_input": on_input}
    if act.startswith("swiglu"):
        kw.update(alpha=1.702, limit=1.5)  # a limit the data actually crosses
    y = run_forced(FMT, banks, x, w, ids, mode, tier, **kw)
    ref = cf.reference.moe(FMT, banks, x, w, ids, **kw)
    assert rel_err(y, ref) < TOL


@pytest.mark.parametrize("mode,tier", CASES)
@pytest.mark.parametrize("H,I", [(1, 1), (31, 7), (128, 128), (200, 96), (130, 300)])  # noqa: E741
def test_small_shapes(rng, mode, tier, H, I):  # noqa: E741
    E, K, T = 3, 2, 3
    gu, dn = _float_weights(rng, E, H, I)
    banks = cf.quantize(FMT, gu, dn)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, banks, x, w, ids)
    assert rel_err(y, ref) < TOL


# ---------------------------------------------------------------- float64 parity, full e4m3 range
def _full_range_banks(rng, E, H, I, code_set):  # noqa: E741
    """Weights tiled from `code_set` (mixed sign), randomly permuted; bf16 scales in [0.01, 0.1]."""
    def codes(shape):
        n = int(np.prod(shape))
        c = np.resize(rng.permutation(code_set), n)
        return cf.aligned_copy(rng.permutation(c).astype(np.uint8).reshape(shape).view(E4M3))

    def scales(R, K):
        s = cf.aligned_empty((E, nb(R), fp8_block_scale_pad(nb(R), nb(K))), BF16)
        s[...] = _bf16(rng.uniform(0.01, 0.1, s.shape))
        return s

    return {"gate_up": codes((E, 2 * I, H)), "gate_up_scale": scales(2 * I, H),
            "down": codes((E, H, I)), "down_scale": scales(H, I)}


FINITE = np.array([c for c in range(256) if c not in (0x7F, 0xFF)])
SUBNORMAL = np.array([s | m for s in (0, 0x80) for m in range(8)])


@pytest.mark.parametrize("mode,tier", CASES)
@pytest.mark.parametrize("codeset", ["full", "subnormal"])
def test_float64_parity_full_range(rng, mode, tier, codeset):
    E, H, I, K, T = 4, 259, 257, 4, 3  # noqa: E741
    banks = _full_range_banks(rng, E, H, I, FINITE if codeset == "full" else SUBNORMAL)
    x = rng.standard_normal((T, H), dtype=np.float32)  # zero mean: the sums cancel
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, banks, x, w, ids)
    assert rel_err(y, ref) < TOL


@pytest.mark.parametrize("mode,tier", CASES)
def test_large_activations_and_scales(rng, mode, tier):
    """|x * scale| far above 2^7: the avx2/avx512f pre-scaling guard lowers its 2^120 factor."""
    E, H, I, K, T = 3, 300, 200, 2, 2  # noqa: E741
    gu, dn = _float_weights(rng, E, H, I, scale=3000.0)  # block scales ~ 30
    banks = cf.quantize(FMT, gu, dn)
    x = rng.standard_normal((T, H), dtype=np.float32) * 1e4
    w, ids = routes(rng, T, K, E)
    kw = {"activation": "gelu"}  # grows roughly linearly: y stays far from fp32/bf16 overflow
    y = run_forced(FMT, banks, x, w, ids, mode, tier, **kw)
    ref = cf.reference.moe(FMT, banks, x, w, ids, **kw)
    assert np.abs(ref).max() > 1e12
    assert rel_err(y, ref) < TOL


# ---------------------------------------------------------------- exact decode through the kernel
E4M3_16 = 0x58  # e4m3 16.0
E4M3_1 = 0x38  # e4m3 1.0
E4M3_1_16 = 0x18  # e4m3 0.0625


def _pow2_scales(rng, shape, lo=-2, hi=2):
    """Distinct-ish power-of-two scales (bf16 exact), so every product stays exactly representable."""
    return _bf16(2.0 ** rng.integers(lo, hi + 1, size=shape))


def _padded(s, extra, poison=True):
    """Scale bank with `extra` more columns than given, padding poisoned with NaN."""
    out = cf.aligned_empty(s.shape[:2] + (s.shape[2] + extra,), BF16)
    out[...] = _bf16(np.nan) if poison else _bf16(0)
    out[:, :, :s.shape[2]] = s
    return out


@pytest.mark.parametrize("mode,tier", CASES)
def test_all_codes_exact_through_gate_up(rng, mode, tier):
    """Up row i holds code i alone (at a column spread over lanes, blocks and the K tail);
    gate row i holds 16 / scale, so gate == 16, silu(16) / 16 = 1 - 1.1e-7 and
    g_i = bf16(16 * up_i) = 16 * up_i exactly; down is the identity, so y[h] = 16 * e4m3(h) * s.
    All 256 codes, incl. 0x7F/0xFF = +-480 and the subnormals m * 2^-9, must come out exact, and
    the scale must be read at [row // 128][k // 128] (4 x 3 grid of distinct powers of two)."""
    E, H, I = 1, 300, 256  # noqa: E741
    gu = np.zeros((E, 2 * I, H), np.uint8)
    gsc = _pow2_scales(rng, (E, nb(2 * I), nb(H)))
    gs = gsc.astype(np.float64)
    cg = (np.arange(I) * 37) % H
    cu = (np.arange(I) * 53 + 11) % H
    assert cu.max() >= 256  # codes in the partial last K block
    for i in range(I):
        sg = gs[0, i // 128, cg[i] // 128]
        gu[0, i, cg[i]] = np.float32(16.0 / sg).astype(E4M3).view(np.uint8)
        assert E4M3_TABLE[gu[0, i, cg[i]]] * sg == 16.0
        gu[0, I + i, cu[i]] = i
    dn = np.zeros((E, H, I), np.uint8)
    dn[0, np.arange(I), np.arange(I)] = E4M3_1
    dsc = _bf16(np.ones((E, nb(H), nb(I))))
    banks = {"gate_up": cf.aligned_copy(gu.view(E4M3)), "gate_up_scale": _padded(gsc, 3),
             "down": cf.aligned_copy(dn.view(E4M3)), "down_scale": _padded(dsc, 1)}
    x = np.ones((1, H), np.float32)
    y = run_forced(FMT, banks, x, np.ones((1, 1), np.float32), np.zeros((1, 1), np.int32), mode, tier)
    su = np.array([gs[0, (I + i) // 128, cu[i] // 128] for i in range(I)])
    want = np.zeros(H)
    want[:I] = 16.0 * E4M3_TABLE[np.arange(I)] * su
    np.testing.assert_array_equal(y[0], want)
    assert want[0x7F] == 16 * 480 * su[0x7F] and want[0xFF] == -16 * 480 * su[0xFF]
    # the transposed index [k // 128][row // 128] would give different numbers here
    assert gs.shape[1] != gs.shape[2]


@pytest.mark.parametrize("mode,tier", CASES)
def test_all_codes_exact_through_down(rng, mode, tier):
    """g == 1 everywhere (gate 16, up 1/16); down row h holds code h alone at column
    (7h) % I, so y[h] = e4m3(h) * down_scale[h // 128][col // 128] exactly (2 x 3 grid)."""
    E, H, I = 1, 256, 300  # noqa: E741
    gu = np.zeros((E, 2 * I, H), np.uint8)
    for i in range(I):
        gu[0, i, i % H] = E4M3_16
        gu[0, I + i, (3 * i + 1) % H] = E4M3_1_16
    gsc = _bf16(np.ones((E, nb(2 * I), nb(H))))
    dn = np.zeros((E, H, I), np.uint8)
    col = (np.arange(H) * 7) % I
    dn[0, np.arange(H), col] = np.arange(H)
    dsc = _pow2_scales(rng, (E, nb(H), nb(I)), -3, 3)
    banks = {"gate_up": cf.aligned_copy(gu.view(E4M3)), "gate_up_scale": _padded(gsc, 2),
             "down": cf.aligned_copy(dn.view(E4M3)), "down_scale": _padded(dsc, 5)}
    x = np.ones((1, H), np.float32)
    y = run_forced(FMT, banks, x, np.ones((1, 1), np.float32), np.zeros((1, 1), np.int32), mode, tier)
    ds = dsc.astype(np.float64)[0]
    want = E4M3_TABLE[np.arange(H)] * ds[np.arange(H) // 128, col // 128]
    np.testing.assert_array_equal(y[0], want)


# ---------------------------------------------------------------- bank views: padding and strides
@pytest.mark.parametrize("mode,tier", CASES)
def test_padded_and_strided_banks_give_same_result(rng, mode, tier):
    """Scale banks padded to 2x their columns (padding = NaN) and every bank a slice of a bigger
    array (expert stride != expert size) must give bit-identical output: the kernel takes the
    strides from the bank views and never reads padding."""
    E, H, I, K, T = 3, 259, 257, 3, 3  # noqa: E741
    gu, dn = _float_weights(rng, E, H, I)
    base = cf.quantize(FMT, gu, dn, scale_pad=False)
    assert base["down_scale"].shape == (E, nb(H), nb(I))

    def strided(a, pad_cols=0):
        big = cf.aligned_empty((2 * E,) + a.shape[1:2] + (a.shape[2] + pad_cols,), a.dtype)
        big.view(np.uint8 if a.dtype.itemsize == 1 else np.uint16)[...] = 0x7FC1 if a.dtype.itemsize == 2 else 0x7F
        v = big[1::2]
        v[:, :, :a.shape[2]] = a
        return v

    other = {"gate_up": strided(base["gate_up"]), "gate_up_scale": strided(base["gate_up_scale"], nb(H)),
             "down": strided(base["down"]), "down_scale": strided(base["down_scale"], nb(I))}
    assert other["gate_up"].strides[0] == 2 * base["gate_up"].strides[0]
    assert other["down_scale"].shape[2] == 2 * nb(I)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    y0 = run_forced(FMT, base, x, w, ids, mode, tier)
    y1 = run_forced(FMT, other, x, w, ids, mode, tier)
    np.testing.assert_array_equal(y0, y1)
    ref = cf.reference.moe(FMT, other, x, w, ids)
    assert rel_err(y1, ref) < TOL


# ---------------------------------------------------------------- quantizer and dequantizer
def _decode_e4m3(c: int) -> float:
    """Independent per-element e4m3fn decode (0x7F/0xFF -> +-480, no NaN)."""
    s = -1.0 if c & 0x80 else 1.0
    e, m = (c >> 3) & 15, c & 7
    return s * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def test_e4m3_table_matches_independent_decode():
    for c in range(256):
        assert E4M3_TABLE[c] == _decode_e4m3(c)
    assert E4M3_TABLE[0x7F] == 480 and E4M3_TABLE[0xFF] == -480
    assert E4M3_TABLE[1] == 2.0**-9 and E4M3_TABLE[0x87] == -7 * 2.0**-9


def test_dequantizer_exact_per_element(rng):
    E, H, I = 2, 131, 200  # noqa: E741
    banks = _full_range_banks(rng, E, H, I, np.arange(256))
    gu, dn = cf.reference.dequantize(FMT, banks)
    for name, d, R, K in (("gate_up", gu, 2 * I, H), ("down", dn, H, I)):
        c = banks[name].view(np.uint8)
        s = banks[name + "_scale"].astype(np.float64)
        idx = [(e, r, k) for e in range(E) for r in rng.integers(0, R, 40) for k in rng.integers(0, K, 40)]
        idx += [(E - 1, R - 1, K - 1), (0, 0, 0), (0, R - 1, 0), (0, 0, K - 1)]
        for e, r, k in idx:
            assert d[e, r, k] == _decode_e4m3(int(c[e, r, k])) * s[e, r // 128, k // 128]


def test_quantizer_roundtrip_and_scales(rng):
    E, H, I = 2, 300, 130  # noqa: E741 - partial blocks on both axes
    gu, dn = _float_weights(rng, E, H, I)
    gu[0, :128, :128] = 0  # an all-zero block: scale 1, codes 0
    banks = cf.quantize(FMT, gu, dn)
    for name, w in (("gate_up", gu), ("down", dn)):
        R, K = w.shape[1:]
        s = banks[name + "_scale"]
        assert s.shape == (E, nb(R), fp8_block_scale_pad(nb(R), nb(K)))
        assert (s.view(np.uint16)[:, :, nb(K):] == 0).all()
        for e in range(E):
            for rb in range(nb(R)):
                for kb in range(nb(K)):
                    blk = w[e, rb * 128:(rb + 1) * 128, kb * 128:(kb + 1) * 128]
                    amax = np.abs(blk).max()
                    want = _bf16(np.float32(amax) / np.float32(448)) if amax > 0 else _bf16(1.0)
                    assert s[e, rb, kb].view(np.uint16) == want.view(np.uint16)
                    sf = np.float32(s[e, rb, kb])
                    codes = banks[name][e, rb * 128:(rb + 1) * 128, kb * 128:(kb + 1) * 128]
                    np.testing.assert_array_equal(codes.view(np.uint8),
                                                  np.clip(blk / sf, -448, 448).astype(E4M3).view(np.uint8))
    assert (banks["gate_up"][0, :128, :128].view(np.uint8) == 0).all()
    assert banks["gate_up_scale"][0, 0, 0] == 1.0
    dgu, ddn = cf.reference.dequantize(FMT, banks)
    for w, d, name in ((gu, dgu, "gate_up"), (dn, ddn, "down")):
        R, K = w.shape[1:]
        sfull = np.repeat(np.repeat(banks[name + "_scale"].astype(np.float64)[:, :, :nb(K)], 128, 1)[:, :R],
                          128, 2)[:, :, :K]
        # e4m3 RNE: half an ulp (2^-4 relative) for normals, 2^-10 * scale in the subnormal range;
        # a bf16 scale rounded below amax/448 can saturate the block max at 448: < 2^-8 relative
        assert (np.abs(d - w) <= np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * sfull) * (1 + 1e-6)).all()


def test_quantizer_options():
    gu = np.zeros((1, 2 * 640, 2560), np.float32)
    dn = np.zeros((1, 2560, 640), np.float32)
    b = cf.quantize(FMT, gu, dn, scale_pad=False)
    assert b["down_scale"].shape == (1, 20, 5) and b["gate_up_scale"].shape == (1, 10, 20)
    with pytest.raises(TypeError):
        cf.quantize(FMT, gu, dn, block=64)
    with pytest.raises(TypeError):
        cf.quantize(FMT, gu, dn, scale_pad="yes")


def test_scale_pad_rule_and_bytes_per_expert():
    assert fp8_block_scale_pad(20, 5) == 6 and fp8_block_scale_pad(10, 20) == 20
    assert fp8_block_scale_pad(5, 3) == 8 and fp8_block_scale_pad(16, 4) == 4
    for rows in range(1, 40):
        for cols in range(1, 40):
            p = fp8_block_scale_pad(rows, cols)
            assert p >= cols and rows * p * 2 % 16 == 0
            assert all(rows * c * 2 % 16 for c in range(cols, p))
    assert SPEC.bytes_per_expert(2048, 512) == 3_146_112  # spec table, Qwen3.5/3.6-35B-A3B-FP8
    assert SPEC.bytes_per_expert(2560, 640) == 3 * 2560 * 640 + 2 * (10 * 20 + 20 * 6)


def test_bank_validation(rng):
    E, H, I = 2, 259, 257  # noqa: E741
    gu, dn = _float_weights(rng, E, H, I)
    b = cf.quantize(FMT, gu, dn)
    raw = {"gate_up": b["gate_up"].view(np.uint8), "gate_up_scale": b["gate_up_scale"].view(np.uint16),
           "down": b["down"].view(np.uint8), "down_scale": b["down_scale"].view(np.uint16)}
    assert cf.validate_banks(FMT, raw) == (E, H, I)  # uint8 / uint16 accepted
    bad = dict(b, down_scale=b["down_scale"][:, :, :nb(I) - 1])
    with pytest.raises(ValueError, match="down_scale"):
        cf.validate_banks(FMT, bad)
    with pytest.raises(TypeError, match="gate_up_scale"):
        cf.validate_banks(FMT, dict(b, gate_up_scale=b["gate_up_scale"].astype(np.float32)))
    with pytest.raises(ValueError):
        cf.validate_banks(FMT, dict(b, down=b["down"][:, :-1]))
