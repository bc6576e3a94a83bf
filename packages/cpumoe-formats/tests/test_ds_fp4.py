"""ds_fp4 kernels (DeepSeek-V4-Flash) vs the float64 reference, every tier forced in turn.

Tolerances:
- Whole MoE step (rel = max|y - ref| / max|ref|):
      tol = 2^-8 + 2^-7 * max|route term| / max|ref| + 1e-3.
  The reference models every defined rounding exactly (bf16 x, the FP8 round trip of x
  and g via act_in, bf16 gate/up, bf16 g, bf16 route terms), so what is left is:
  (a) the bf16 output rounding, up to half an ulp = 2^-8 of the value at the bottom of
  a binade; (b) a route term whose fp32 value lies within the fp32 accumulation error
  (~sqrt(K) 2^-24 relative) of a bf16 rounding boundary rounds the other way: one ulp,
  at most 2^-7 of that term. The chance is ~1e-5 per term, so a step of T*top_k*H
  terms may see a few flips, but two on one output element practically never; the
  test allows one flip of the largest term (measured per test from single-route
  reference runs); (c) flips of g / gate / up: one bf16 ulp on a few of the I
  elements, each moving y by ~2^-8 / sqrt(I) of its size: 1e-3 covers them. A flip at a block maximum can
  move a whole 128-block through the FP8 scale, or in w4a8 a 32-block through its int8 scale, repeated by
  duplicated experts: flip_effect adds exactly what the kernel's own g flips do (0 when none happened).
  Measured: <= 3.6e-3 over 40 seeds (the output rounding; flips are rarer still).
- Work-item edge tests (gate_up / down called directly): rigorous per-element bounds,
  see fp4_helpers: the exact dot +- (K + 8) 2^-24 sum|terms| (plus 2^-149 per scale
  product for subnormal results), then the format's bf16 roundings applied to the
  interval ends (route term; gate/up and g). A wrong scale, code or nibble order is
  off by orders of magnitude.
- The FP8 round trip (kernel prep and act_in vs an independent float64
  implementation), decoders and quantizer: exact (bit-equal).
"""
import math

import numpy as np
import pytest
from conftest import USABLE, rel_err, routes, run_forced, tier_cases
from fp4_helpers import (
    TINY,
    U,
    bits_f64,
    check_g,
    dot_bound,
    ds_flip_effect,
    kernel,
    prep,
    run_down,
    run_gate_up,
    to_bf16_bits,
)

import cpumoe_formats as cf
from cpumoe_formats import activations
from cpumoe_formats.formats.ds_fp4 import act_quant_roundtrip
from cpumoe_formats.numerics import E8M0, round_bf16

FMT = "ds_fp4"
SPEC = cf.get_format(FMT)
DSV4 = {"activation": "swiglu_clamp", "alpha": 1.0, "limit": 10.0}


def moe_tol(kern, banks, x, w, ids, ref, deq, mode, **kw):
    """2^-8 + 2^-7 * (largest single-route term) / max|ref| + 1e-3 (see the module docstring), plus the exact
    effect of the kernel kern's g flips (flip_effect)."""
    big = 0.0
    for k in range(ids.shape[1]):
        one = np.full_like(ids, -1)
        one[:, k] = ids[:, k]
        big = max(big, float(np.abs(cf.reference.moe(FMT, banks, x, w, one, mode=mode, dequantized=deq,
                                                          **kw)).max()))
    extra = ds_flip_effect(FMT, kern, banks, x, w, ids, deq, mode, **kw)
    return 2.0**-8 + (2.0**-7 * big + extra) / float(np.abs(ref).max()) + 1e-3


def check_moe(rng, mode, tier, E, H, I, T, K, x_scale=1.0, **kw):  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H), dtype=np.float32) * np.float32(x_scale)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, banks, x, w, ids, mode, tier, **kw)
    deq = SPEC.dequantize(banks)
    ref = cf.reference.moe(FMT, banks, x, w, ids, mode=mode, dequantized=deq, **kw)
    kern = kernel(FMT, E, H, I, mode, tier, **kw)
    assert rel_err(y, ref) < moe_tol(kern, banks, x, w, ids, ref, deq, mode, **kw)
    return ref


# ---------------------------------------------------------------- whole MoE step
@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_dsv4_flash_shape(rng, mode, tier):
    """DeepSeek-V4-Flash: H=4096, I=2048, top_k=6, swiglu_clamp(alpha=1, limit=10), batch 8 (E small)."""
    check_moe(rng, mode, tier, E=2, H=4096, I=2048, T=8, K=6, x_scale=8.0, **DSV4)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("H,I", [(384, 384), (1024, 512), (128, 256)])
def test_shapes(rng, mode, tier, T, H, I):  # noqa: E741
    """H = I = 384 (multiple of 128 only: odd 64-chunk pairs), the prequant test shape, the minimum."""
    check_moe(rng, mode, tier, E=4, H=H, I=I, T=T, K=4)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("act", ["silu", "swiglu_clamp"])
def test_activation_clamp_crossed(rng, mode, tier, act):
    """Large x so that gate/up cross the DeepSeek limit 10 (clamp active); plain silu has no clamp."""
    kw = DSV4 if act == "swiglu_clamp" else {}
    ref = check_moe(rng, mode, tier, E=3, H=512, I=256, T=3, K=4, x_scale=60.0, **kw)
    assert np.isfinite(ref).all()


def test_input_weight_rejected():
    with pytest.raises(ValueError, match="output"):
        cf.Kernel(FMT, 2, 128, 128, apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match="mode"):
        cf.Kernel(FMT, 2, 128, 128, mode="w8a8")
    with pytest.raises(ValueError, match="multiples of 128"):
        cf.Kernel(FMT, 2, 192, 128)


# ---------------------------------------------------------------- FP8 round trip
def roundtrip_f64(v):
    """Independent float64 implementation (frexp-based e4m3 rounding), per 128-block."""
    v = np.asarray(v, np.float64).reshape(-1, 128)
    out = np.empty_like(v)
    floor = float(np.float32(1e-4))
    for b in range(v.shape[0]):
        amax = max(floor, float(np.abs(v[b]).max()))
        m, e = math.frexp(amax / 448.0)  # amax/448 = m 2^e, m in [0.5, 1)
        s = 2.0 ** (e - 1 if m == 0.5 else e)  # 2^ceil(log2(amax / 448))
        for i, xv in enumerate(v[b]):
            q = min(max(xv / s, -448.0), 448.0)
            if q == 0:
                out[b, i] = 0.0 * xv
                continue
            _, qe = math.frexp(abs(q))
            step = max(2.0 ** (qe - 4), 2.0**-9)
            r = min(float(np.round(abs(q) / step)) * step, 448.0)  # np.round: half to even
            out[b, i] = math.copysign(r, q) * s
    return round_bf16(out).reshape(-1)


def roundtrip_cases(rng):
    blocks = [rng.standard_normal(128) * 10.0 ** rng.uniform(-8, 8) for _ in range(12)]
    blocks.append(np.zeros(128))  # amax floor 1e-4
    blocks.append(rng.standard_normal(128) * 1e-30)  # far below the floor: everything rounds to 0
    blocks.append(rng.standard_normal(128) * 1e-7)  # near the floor: subnormal e4m3 codes
    blocks.append(np.concatenate([[3e38, -3e38], rng.standard_normal(126) * 1e36]))  # huge
    ties = np.zeros(128)
    ties[:12] = [448, -448, 1.0625, -1.0625, 17, 19, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, 440, 432, -2.0**-6]
    ties[12:] = rng.integers(-448, 449, 116)
    blocks.append(ties)  # amax 448 -> s = 1: e4m3 ties round half to even, 448 saturates
    blocks.append(np.concatenate([[464.0], rng.standard_normal(127) * 100]))  # amax just above 448 -> s = 2
    blocks.append(np.concatenate([[448.0 * 2.0**-20], rng.standard_normal(127) * 1e-5]))  # amax/448 power of 2
    v = np.concatenate(blocks)
    return to_bf16_bits(v)


def test_roundtrip_matches_float64(rng):
    bits = roundtrip_cases(rng)
    v = bits_f64(bits)
    got = act_quant_roundtrip(v)
    exp = roundtrip_f64(v)
    assert np.array_equal(got, exp), np.flatnonzero(got != exp)[:10]
    t = got[16 * 128:17 * 128]  # the ties block (s = 1): check the values themselves
    assert list(t[:12]) == [448, -448, 1.0, -1.0, 16, 20, 0, 2.0**-8, 2.0**-8, 448, 448, -2.0**-6]
    assert np.all(got[13 * 128:14 * 128] == 0)


def _f32_pos(K, NL):
    """fp4_common.h f32_pos for every k (the prepared fp32 layout)."""
    C = 32 * NL
    main = K // C * C if NL else 0
    k = np.arange(K)
    c, r = k // max(C, 1), k % max(C, 1)
    half, j = r & 1, r >> 1
    L, q, d = j >> 4, ((j >> 2) & 2) | (j & 1), (j >> 1) & 3
    pos_main = c * C + half * (16 * NL) + q * (4 * NL) + L * 4 + d
    t = k - main
    pos_tail = main + (t >> 4) * 16 + (t & 1) * 8 + ((t & 15) >> 1)
    return np.where(k < main, pos_main, pos_tail)


def _parse_prep_w8(buf, K, tier):
    """w4a8's prepared vector -> activation values [K] (q * s_b, float64). scalar: int8 q[K], fp32 0.5 s_b per
    32-block. SIMD: per chunk of C = 32 NL elements, q even / odd halves (int8), C/8 int32 negated corrections
    -12 sum(q) per 8 elements, C/8 fp32 0.5 s_b per 8 elements (see ds_fp4.cpp)."""
    if tier == "scalar":
        q = buf[:K].view(np.int8).astype(np.float64)
        return q * np.repeat(buf[K:K + 4 * (K // 32)].view(np.float32).astype(np.float64) * 2.0, 32)
    NL = {"avx2": 2, "avx512f": 4, "avx512vnni": 4}[tier]
    C = 32 * NL
    rec = 2 * C
    recs = buf[:K // C * rec].reshape(K // C, rec)
    h = recs[:, :C].view(np.int8).reshape(-1, 2, C // 2).astype(np.int64)
    q = np.empty((K // C, C), np.int64)
    q[:, 0::2], q[:, 1::2] = h[:, 0], h[:, 1]
    ncorr = recs[:, C:C + C // 2].copy().view(np.int32).reshape(-1, C // 8)
    assert np.all(ncorr == -12 * q.reshape(-1, C // 8, 8).sum(-1))
    hs = recs[:, C + C // 2:].copy().view(np.float32).reshape(-1).astype(np.float64)
    return q.reshape(-1).astype(np.float64) * np.repeat(hs * 2.0, 8)


def _parse_prep(buf, K, tier):
    """The kernel's prepared vector -> (activation values [K] natural order as float64, corrections or None).

    scalar: fp32 values in the per-16 even/odd layout. SIMD: per chunk of C = 32 NL elements the int8
    pieces a0 a1 a2 (even / odd halves) of q' = q 2^9 = a2 2^14 + a1 2^7 + a0, C/8 int32 corrections
    12 sum(q') per 8 elements, then fp32 s_a 2^-10 per 128-block (see ds_fp4.cpp)."""
    if tier == "scalar":
        return buf[:4 * K].view(np.float32)[_f32_pos(K, 0)].astype(np.float64), None
    NL = {"avx2": 2, "avx512f": 4, "avx512vnni": 4}[tier]
    C = 32 * NL
    rec = 3 * C + C // 8 * 4
    nch = K // C
    recs = buf[:nch * rec].reshape(nch, rec)
    pieces = recs[:, :3 * C].view(np.int8).reshape(nch, 3, 2, C // 2).astype(np.int64)  # [chunk, piece, half, j]
    qp = pieces[:, 2] * 16384 + pieces[:, 1] * 128 + pieces[:, 0]  # [chunk, half, j]
    q = np.empty((nch, C), np.int64)
    q[:, 0::2], q[:, 1::2] = qp[:, 0], qp[:, 1]
    corr = recs[:, 3 * C:].copy().view(np.int32).reshape(nch, C // 8)
    off = (nch * rec + 63) // 64 * 64
    sact = buf[off:off + 4 * (K // 128)].view(np.float32).astype(np.float64)
    vals = q.reshape(-1).astype(np.float64) * np.repeat(sact, 128) * 2.0
    assert np.all(corr == 12 * q.reshape(nch, C // 8, 8).sum(-1))
    assert np.all(np.abs(pieces[:, :2]) <= 127) and np.all(pieces[:, :2] >= 0)
    return vals, corr


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_roundtrip_kernel_prep_bit_exact(rng, mode, tier):
    """prep_act (x and g) encodes exactly act_in's values, in the tier's layout."""
    bits = roundtrip_cases(rng)
    K = bits.size
    k = kernel(FMT, 1, K, 128, mode, tier)
    buf = prep(k, bits)
    got = _parse_prep(buf, K, tier)[0] if mode == "native" else _parse_prep_w8(buf, K, tier)
    exp = SPEC.act_in(bits_f64(bits), mode)
    assert np.array_equal(got, exp), np.flatnonzero(got != exp)[:10]


@pytest.mark.parametrize("tier", [p.values[1] for p in tier_cases(FMT, modes=("w4a8",)) if p.values[1] != "scalar"])
def test_w4a8_prep_nonfinite_matches_scalar(rng, tier):
    """The SIMD prep (the FP8 round trip and the Q8_0 rule in 8-lane vectors) gives the scalar tier's values for
    128-blocks holding inf, -inf and NaN (all NaN: s_b NaN, codes 0), a NaN-only 32-block, values below the e4m3
    subnormal threshold and at the 448 clamp."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 128 * 8
    v = rng.standard_normal(K) * np.exp(rng.uniform(-6, 6, K // 128).repeat(128))
    v[[3, 40, 41, 300, 310, 520]] = [np.inf, np.nan, -np.inf, np.nan, np.nan, -np.inf]
    v[384:416] = np.nan  # 128-blocks 0, 2, 3 and 4 hold non-finite values, 1, 5, 6 and 7 do not
    v[130:140] = v[129] * np.r_[1e-3, 2e-3, 5e-3, 1e-2, 1.7e-2, 3e-2, -1e-3, -5e-3, -2e-2, 0.0]  # e4m3 subnormals
    bits = to_bf16_bits(v)
    got = _parse_prep_w8(prep(kernel(FMT, 1, K, 128, "w4a8", tier), bits), K, tier)
    want = _parse_prep_w8(prep(kernel(FMT, 1, K, 128, "w4a8", "scalar"), bits), K, "scalar")
    np.testing.assert_array_equal(got, want)
    bad = np.repeat(~np.isfinite(v.reshape(-1, 128)).all(axis=1), 128)
    assert bad.sum() == 4 * 128 and np.isnan(want[bad]).all() and np.isfinite(want[~bad]).all()


# ---------------------------------------------------------------- work-item edge cases
def check_down_terms(acc, W, acts, weights, K):
    """acc[j] = bf16(weights[j] * W @ acts[j]) (one route each): inside the rounded error interval."""
    for j, a in enumerate(acts):
        wj = float(np.float32(weights[j]))
        ref = wj * (W @ a)
        bound = abs(wj) * dot_bound(W, a) + (K // 32 + 8) * TINY
        lo, hi = round_bf16(ref - bound), round_bf16(ref + bound)
        bad = np.flatnonzero((acc[j] < lo) | (acc[j] > hi) | ~np.isfinite(acc[j]))
        assert bad.size == 0, (f"route {j}: {bad.size} rows outside, e.g. {bad[0]}: kernel {acc[j][bad[0]]!r} "
                               f"allowed [{lo[bad[0]]!r}, {hi[bad[0]]!r}]")


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_all_e8m0_scales_down(rng, mode, tier):
    """Down row h uses scale code h (2^-127 subnormal .. 2^127, 255 clamped to 254) in all its blocks."""
    E, H, I = 1, 256, 128  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    banks["down_scale"][...] = np.repeat(np.arange(256, dtype=np.uint8), I // 32).view(E8M0).reshape(1, H, I // 32)
    banks["down_packed"][0, 255] = banks["down_packed"][0, 254]
    banks["down_packed"][0, :2] = rng.integers(0x11, 0x78, (2, I // 2), dtype=np.uint8) & 0x77  # positive codes
    k = kernel(FMT, E, H, I, mode, tier)
    _, dn = SPEC.dequantize(banks)
    # |g| ~ 1e-3 keeps 2^127 * sum|w g| below the fp32 range; 2^-127 rows land in fp32 subnormals
    gs = [to_bf16_bits(rng.standard_normal(I) * 1e-3), to_bf16_bits(rng.uniform(5e-4, 2e-3, I))]
    wts = [1.0, 0.5]
    acc = run_down(k, FMT, banks, 0, gs, wts)
    assert np.isfinite(acc).all()
    check_down_terms(acc, dn[0], [SPEC.act_in(bits_f64(g), mode) for g in gs], wts, I)
    assert np.array_equal(acc[:, 255], acc[:, 254])  # 255 behaves as 254
    # positive codes x positive g: the 2^-127 and 2^-126 rows survive as (bf16) subnormals, not flushed to 0
    assert acc[1, 0] > 0 and acc[1, 1] > 0
    # and no row whose exact term is clearly representable was flushed (random signs can cancel to ~0)
    exact = 0.5 * (dn[0] @ SPEC.act_in(bits_f64(gs[1]), mode))
    assert (acc[1][np.abs(exact) > 2.0**-120] != 0).all()


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_all_e8m0_scales_gate_up(rng, mode, tier):
    """Every scale code in the gate rows (up rows moderate) and then in the up rows; g stays finite."""
    E, H, I = 2, 256, 128  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    sc = banks["gate_up_scale"].view(np.uint8)
    nb = H // 32
    codes = rng.permutation(np.arange(I * nb) % 256).astype(np.uint8).reshape(I, nb)
    sc[0, :I], sc[0, I:] = codes, 127  # expert 0: all codes on gate
    sc[1, :I], sc[1, I:] = 127, codes  # expert 1: all codes on up
    k = kernel(FMT, E, H, I, mode, tier, **DSV4)
    gu, _ = SPEC.dequantize(banks)
    act = activations.resolve(**DSV4)
    # |x| ~ 1e-8 .. 1e-6: nonzero after the round trip; gate/up up to 2^127 * 6 * 256 * 1e-6 stay finite
    xs = [to_bf16_bits(rng.standard_normal(H) * 1e-8), to_bf16_bits(rng.standard_normal(H) * 1e-6)]
    for e in range(E):
        g = run_gate_up(k, FMT, banks, e, xs)
        assert np.isfinite(g).all()
        for j, xb in enumerate(xs):
            a = SPEC.act_in(bits_f64(xb), mode)
            gate_up, bnd = gu[e] @ a, dot_bound(gu[e], a) + (H // 32 + 8) * TINY
            check_g(g[j], gate_up[:I], gate_up[I:], bnd[:I], bnd[I:], act, round_gate_up=True)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_all_e2m1_codes_and_nibble_order(rng, mode, tier):
    """All 256 byte values (16 x 16 code pairs incl. -0) and the low-nibble-first order."""
    E, H, I = 1, 128, 512  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    dp = banks["down_packed"]
    for h in range(H):
        dp[0, h] = rng.permutation(256).astype(np.uint8)
    dp[0, 0] = rng.integers(1, 16, 256, dtype=np.uint8)  # low nibbles only
    dp[0, 1] = rng.integers(1, 16, 256, dtype=np.uint8) << 4  # high nibbles only
    dp[0, 2] = 0x80 | rng.integers(1, 8, 256, dtype=np.uint8)  # -0 in the high nibble
    dp[0, 3] = 0x08 | (rng.integers(1, 8, 256, dtype=np.uint8) << 4)  # -0 in the low nibble
    k = kernel(FMT, E, H, I, mode, tier)
    _, dn = SPEC.dequantize(banks)
    even = np.zeros(I)
    even[0::2] = 1 + rng.random(I // 2)
    odd = np.zeros(I)
    odd[1::2] = 1 + rng.random(I // 2)
    gs = [to_bf16_bits(even), to_bf16_bits(odd), to_bf16_bits(rng.standard_normal(I))]
    acc = run_down(k, FMT, banks, 0, gs, [1.0, 1.0, 1.0])
    check_down_terms(acc, dn[0], [SPEC.act_in(bits_f64(g), mode) for g in gs], [1.0, 1.0, 1.0], I)
    assert acc[0, 0] != 0 and acc[1, 0] == 0 and acc[0, 1] == 0 and acc[1, 1] != 0
    assert acc[1, 2] == 0 and acc[0, 3] == 0 and acc[0, 2] != 0 and acc[1, 3] != 0


# ---------------------------------------------------------------- decode, quantize, schema
def test_dequantize_exact(rng):
    E, H, I = 2, 128, 128  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    banks["down_scale"][...] = rng.integers(0, 256, banks["down_scale"].shape, dtype=np.uint8).view(E8M0)
    gu, dn = cf.reference.dequantize(FMT, banks)
    for got, pk, sc in ((gu, banks["gate_up_packed"], banks["gate_up_scale"]),
                        (dn, banks["down_packed"], banks["down_scale"])):
        p, s = pk.view(np.uint8), sc.view(np.uint8)
        for e, r in [(0, 0), (1, 5), (1, got.shape[1] - 1)]:
            for kk in range(got.shape[2]):
                byte = int(p[e, r, kk // 2])
                c = byte & 15 if kk % 2 == 0 else byte >> 4
                ce, cm = (c >> 1) & 3, c & 1
                wv = (cm * 0.5 if ce == 0 else (1 + cm / 2) * 2.0 ** (ce - 1)) * (-1) ** (c >> 3)
                sv = math.ldexp(1.0, min(int(s[e, r, kk // 32]), 254) - 127)
                assert got[e, r, kk] == wv * sv
    alt = {n: a.view(np.uint8) for n, a in banks.items()}  # uint8 scale banks are accepted too
    gu2, dn2 = cf.reference.dequantize(FMT, alt)
    assert np.array_equal(gu, gu2) and np.array_equal(dn, dn2)


def test_quantizer(rng):
    E, H, I = 2, 128, 256  # noqa: E741
    gu = rng.standard_normal((E, 2 * I, H)) * 10.0 ** rng.uniform(-3, 1, (E, 2 * I, 1))
    dn = rng.standard_normal((E, H, I)) * 0.02
    gu[0, 0, :32] = 0  # a zero block
    gu[0, 1, :32] = 6 * 2.0**-3  # amax exactly 6 * 2^k -> scale 2^k, codes exactly 6
    b = cf.quantize(FMT, gu.astype(np.float32), dn.astype(np.float32))
    for w, _pk, sc in ((gu.astype(np.float32), b["gate_up_packed"], b["gate_up_scale"]),
                      (dn.astype(np.float32), b["down_packed"], b["down_scale"])):
        s = sc.view(np.uint8).astype(np.int64)
        amax = np.abs(w.astype(np.float64)).reshape(w.shape[0], w.shape[1], -1, 32).max(-1)
        scale = np.ldexp(1.0, s - 127)
        nz = amax > 0
        assert np.all(amax[nz] / scale[nz] <= 6) and np.all(amax[nz] / (scale[nz] / 2) > 6)  # smallest such 2^k
    gdq, _ = cf.reference.dequantize(FMT, b)
    assert np.all(gdq[0, 0, :32] == 0) and np.all(gdq[0, 1, :32] == 6 * 2.0**-3)
    err = np.abs(gdq - gu.astype(np.float32))
    step = np.repeat(np.ldexp(1.0, b["gate_up_scale"].view(np.uint8).astype(np.int64) - 127), 32, axis=-1)
    assert np.all(err <= step * 1.0000001)  # half of the largest e2m1 gap (4 -> 6) is one scale unit
    with pytest.raises(TypeError):
        cf.quantize(FMT, gu, dn, mode="x")


def test_schema():
    assert SPEC.id == 3 and SPEC.k_multiple == 128 and not SPEC.input_weight
    assert SPEC.round_gate_up and SPEC.round_route_term
    assert SPEC.bank_names == ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale")
    assert SPEC.bytes_per_expert(4096, 2048) == 13_369_344  # spec 1.9 (DSV4-Flash)
    assert SPEC.kernel_tiers == {
        "native": ("scalar", "avx2", "avx512f"),
        "w4a8": ("scalar", "avx2", "avx512f", "avx512vnni"),
    }
    assert SPEC.modes == ("native", "w4a8") and SPEC.default_mode == "native"
    assert U == 2.0**-24
