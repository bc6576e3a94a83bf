"""ds_fp4_x16 (ds_fp4 with 16 rows interleaved per 32-block, mode w4a8): the layout, the float64 reference, bit
identity of the tiers (every tier does the same exact integers and fp32 fmas in K order), the accumulation order
against a float32 emulation, work items over ragged row ranges with everything outside them poisoned, edge codes
and scales, and the schema.

Tolerances: whole steps use test_ds_fp4's (rel = max|y - ref| / max|ref| < 2^-8 + 2^-7 * max|route term| /
max|ref| + 1e-3 plus the exact effect of the kernel's own g flips; see test_ds_fp4's docstring); the
reference models the w4a8 activation quantization and every bf16 rounding exactly. Against ds_fp4's own w4a8
kernel on the same bytes (same math, other fp32 grouping): twice that. Work items (fp32 dots, then the format's
bf16 roundings): |dot - exact| <= (K + 8) u sum|w a| + (K/32 + 8) 2^-149 (fp4_helpers.dot_bound), the interval
ends rounded to bf16.
"""
import numpy as np
import pytest
from conftest import USABLE, rel_err, routes, run_forced, tier_cases
from fp4_helpers import (
    TINY,
    bits_f64,
    check_g,
    dot_bound,
    ds_flip_effect,
    kernel,
    prep,
    run_down,
    run_gate_up,
    to_bf16_bits,
    views,
)
from x16_helpers import check_ragged_work_items, split_record

import cpumoe_formats as cf
from cpumoe_formats import activations
from cpumoe_formats.formats import ds_fp4, ds_fp4_x16
from cpumoe_formats.numerics import E8M0, round_bf16

FMT = "ds_fp4_x16"
SPEC = cf.get_format(FMT)
DS = ds_fp4.SPEC
TIERS = [p.values[1] for p in tier_cases(FMT)]
SIMD = [t for t in TIERS if t != "scalar"]
DSV4 = {"activation": "swiglu_clamp", "alpha": 1.0, "limit": 10.0}
KW2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)  # 2 E2M1[code]


def ds_codes(packed):
    """ds_fp4 packed [.., K/2] -> codes [.., K] in element order (low nibble = even element)."""
    p = packed.view(np.uint8)
    c = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.uint8)
    c[..., 0::2], c[..., 1::2] = p & 15, p >> 4
    return c


def moe_tol(k, banks, x, w, ids, ref, deq, **kw):
    big = 0.0
    for j in range(ids.shape[1]):
        one = np.full_like(ids, -1)
        one[:, j] = ids[:, j]
        big = max(big, float(np.abs(cf.reference.moe(FMT, banks, x, w, one, mode="w4a8", dequantized=deq,
                                                          **kw)).max()))
    extra = ds_flip_effect(FMT, k, banks, x, w, ids, deq, "w4a8", **kw)
    return 2.0**-8 + (2.0**-7 * big + extra) / float(np.abs(ref).max()) + 1e-3


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


def parse_prep(buf, K):
    """The prepared record per 32-block: int8 q[32], fp32 hs (0.5 s_b), int32 corr (-12 sum q_b)."""
    q, hs, corr = split_record(buf, K, 32)
    return q.astype(np.int64), hs, corr


# ---------------------------------------------------------------- layout
@pytest.mark.parametrize("H,I", [(128, 128), (384, 256), (640, 384)])  # noqa: E741
def test_repack_round_trip_and_layout(rng, H, I):  # noqa: E741
    b = DS.random_banks(3, H, I, rng)
    b["down_scale"][...] = rng.integers(0, 256, b["down_scale"].shape, dtype=np.uint8).view(E8M0)
    r = cf.repack_ds_fp4_x16(b)
    assert cf.validate_banks(FMT, r) == (3, H, I)
    assert SPEC.bytes_per_expert(H, I) == DS.bytes_per_expert(H, I)  # the same bytes, moved
    assert sum(a[0].nbytes for a in r.values()) == DS.bytes_per_expert(H, I)
    assert all(a.ctypes.data % 64 == 0 for a in r.values())
    u = cf.unpack_ds_fp4_x16(r)
    assert u.keys() == b.keys()
    for n in b:
        assert u[n].dtype == DS.banks[DS.bank_names.index(n)].dtypes[0]
        np.testing.assert_array_equal(u[n].view(np.uint8), b[n].view(np.uint8))
    # byte by byte: expert 1, row 16 g + rr, block bb of both banks
    for pk, sc, dst in ((b["down_packed"], b["down_scale"], r["down"]),
                        (b["gate_up_packed"], b["gate_up_scale"], r["gate_up"])):
        c = ds_codes(pk)
        R, K = c.shape[1], c.shape[2]
        for g, rr, bb in [(0, 0, 0), (1, 15, K // 32 - 1), (R // 16 - 1, 7, 1), (R // 32, 3, K // 64)]:
            grp = dst[1, g, 272 * bb:272 * bb + 272]
            assert grp[rr] == sc.view(np.uint8)[1, 16 * g + rr, bb]
            cc = c[1, 16 * g + rr, 32 * bb:32 * bb + 32]
            for j in range(4):
                for i in range(4):
                    assert grp[16 + 64 * j + 4 * rr + i] == cc[4 * j + i] | cc[16 + 4 * j + i] << 4, (g, rr, bb, j, i)
    g = ds_fp4_x16.to_groups(b["down_packed"], b["down_scale"])
    np.testing.assert_array_equal(ds_fp4_x16.to_groups(*ds_fp4_x16.from_groups(g)), g)


def test_cpu_layout_of_ds_fp4(rng):
    assert DS.cpu_layout == FMT and DS.cpu_layout_min_tier == "avx2"
    b = DS.random_banks(2, 128, 256, rng)
    r = DS.to_cpu_layout(b)
    assert set(r) == {"gate_up", "down"} and cf.validate_banks(FMT, r) == (2, 128, 256)
    with pytest.raises(ValueError, match="no format's CPU layout"):
        DS.repack_from(b)
    # the same float64 model: dequantize / act_in / roundings of ds_fp4
    for a, c in zip(SPEC.dequantize(r), DS.dequantize(b)):
        np.testing.assert_array_equal(a, c)
    assert SPEC.round_gate_up and SPEC.round_route_term and not SPEC.input_weight


# ---------------------------------------------------------------- whole steps
@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("H,I,T", [(128, 128, 1), (384, 256, 9), (640, 384, 3), (256, 128, 8)])  # noqa: E741
def test_against_float64_reference(rng, mode, tier, H, I, T):  # noqa: E741
    """8 / 24 / 40 / 16 down groups, 16 / 32 / 48 / 16 gate_up groups, token blocks full and ragged."""
    E, K = 5, 4
    b = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32) * 4
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, b, x, w, ids, mode, tier)
    deq = SPEC.dequantize(b)
    ref = cf.reference.moe(FMT, b, x, w, ids, mode=mode, dequantized=deq)
    tol = moe_tol(kernel(FMT, E, H, I, mode, tier), b, x, w, ids, ref, deq)
    assert rel_err(y, ref) < tol
    # ds_fp4's w4a8 kernel on the same bytes: the same math, only the fp32 grouping differs, so either side may
    # round a gate/up to bf16 the other way near a boundary, and through the int8 requantization a whole block of
    # g may follow: ds_fp4's own flips are allowed too (CPUMOE_TEST_SEED=1994551418: 3.7% at H=384, T=9 from one
    # such flip in AVX-512's g, gone with x scaled by 1.001)
    bd = cf.unpack_ds_fp4_x16(b)
    kd = cf.Kernel("ds_fp4", E, H, I, mode="w4a8")
    yd = kd.forward(bd, x, w, ids)
    flips_d = ds_flip_effect("ds_fp4", kd, bd, x, w, ids, cf.get_format("ds_fp4").dequantize(bd), "w4a8")
    assert rel_err(y, yd.astype(np.float64)) < 2 * tol + flips_d / float(np.abs(ref).max())


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_dsv4_flash_shape(rng, mode, tier):
    """DeepSeek-V4-Flash: H=4096, I=2048, top_k=6, swiglu_clamp(alpha=1, limit=10), batch 8 on 2 experts."""
    E, H, I, T, K = 2, 4096, 2048, 8, 6  # noqa: E741
    b = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H), dtype=np.float32) * np.float32(8.0)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, b, x, w, ids, mode, tier, **DSV4)
    deq = SPEC.dequantize(b)
    ref = cf.reference.moe(FMT, b, x, w, ids, mode=mode, dequantized=deq, **DSV4)
    assert rel_err(y, ref) < moe_tol(kernel(FMT, E, H, I, mode, tier, **DSV4), b, x, w, ids, ref, deq, **DSV4)


# ---------------------------------------------------------------- tiers: the same bits
@pytest.mark.parametrize("tier", SIMD)
@pytest.mark.parametrize("T", [1, 3, 9])
def test_tiers_bit_identical(rng, tier, T):
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    E, H, I = 4, 640, 384  # noqa: E741
    b = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = routes(rng, T, 3, E)
    ys, yt = (run_forced(FMT, b, x, w, ids, "w4a8", t) for t in ("scalar", tier))
    np.testing.assert_array_equal(yt.view(np.uint64), ys.view(np.uint64))
    ks, kt = (cf.Kernel(FMT, E, H, I, isa=t) for t in ("scalar", tier))
    # the prepared records (ds_fp4's prep in SIMD against scalar), byte for byte
    xs = to_bf16_bits(rng.standard_normal((T, H)) * rng.uniform(0.01, 10.0, (T, 1)))
    for v in xs:
        np.testing.assert_array_equal(prep(kt, v)[:kt._k.act_bytes(H)], prep(ks, v)[:ks._k.act_bytes(H)])
    # g of one gate_up work item, and fp32 down accumulators of one work item with several routes per token
    np.testing.assert_array_equal(run_gate_up(kt, FMT, b, 2, xs).view(np.uint64),
                                  run_gate_up(ks, FMT, b, 2, xs).view(np.uint64))
    gs = to_bf16_bits(rng.standard_normal((T, I)) * rng.uniform(0.01, 10.0, (T, 1)))
    accs = []
    for k in (ks, kt):
        bufs = [prep(k, g) for g in gs]
        acc = cf.aligned_empty((T, H), np.float32)
        acc[...] = 0
        rts = [(j, e, 0.5 + j + e, bufs[j].ctypes.data) for e in (1, 3) for j in range(T)]
        k._k.down(views(FMT, b), 0, H, rts, acc.ctypes.data, H)
        accs.append(acc)
    assert np.count_nonzero(accs[0]) > accs[0].size // 2
    np.testing.assert_array_equal(accs[1].view(np.uint32), accs[0].view(np.uint32))


def emulate_rows(terms, order="sequential"):
    """The documented fp32 accumulation in numpy float32 of per-block terms t_b = f32(f32(S_b) * hs_b) * 2^(s-127)
    (exact products: the scales here are normal powers of two and the products stay normal, so each fma is exactly
    f32(acc + t_b)): "sequential" from acc = 0 block by block in K order; the alternatives a wrong kernel might
    take: "two" (even and odd blocks in two chains, then added), "tree" (pairs, then the pair sums), "reverse"."""
    t = terms.astype(np.float32)
    f32 = np.float32
    if order == "sequential":
        acc = np.zeros(t.shape[0], f32)
        for bb in range(t.shape[1]):
            acc = (acc + t[:, bb]).astype(f32)
        return acc
    if order == "reverse":
        return emulate_rows(t[:, ::-1])
    if order == "two":
        return (emulate_rows(t[:, 0::2]) + emulate_rows(t[:, 1::2])).astype(f32)
    assert order == "tree"
    while t.shape[1] > 1:
        t = (t[:, 0::2] + t[:, 1::2]).astype(f32)
    return t[:, 0]


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_accumulation_order_exact(rng, mode, tier):
    """The order of the fp32 operations, made visible through bf16. Per down row the 4 blocks' terms are
    [A, B, -A, C]: block 2 = block 0 negated (codes c ^ 8, the same scale; the activation's block 2 = its block 0,
    so t_2 = -t_0 exactly), B and C scaled 2^-18 against A. In K order B is added to A and so rounded to A's ulp
    (a few bits of B survive), then A cancels exactly and C adds at its own precision; two chains, a tree or the
    reverse order round other terms to A's ulp instead. The result is ~2^-18 A, where bf16 still shows those
    roundings: every tier must give the bits of the float32 emulation of the documented order, and the test
    checks that each wrong order would have been seen."""
    E, H, I = 1, 128, 128  # noqa: E741
    b = DS.random_banks(E, H, I, rng)
    c = rng.integers(0, 16, (H, I), dtype=np.uint8)
    c[:, :32] = rng.integers(1, 8, (H, 32), dtype=np.uint8)  # positive codes in block 0: a big |A|
    c[:, 64:96] = c[:, :32] ^ 8
    b["down_packed"][0] = c[:, 0::2] | (c[:, 1::2] << 4)
    sc = np.empty((H, 4), np.uint8)
    sc[:, 0] = sc[:, 2] = rng.integers(120, 135, H)
    sc[:, 1] = sc[:, 3] = sc[:, 0] - 18
    b["down_scale"][0] = sc.view(E8M0)
    xb = cf.repack_ds_fp4_x16(b)
    k = kernel(FMT, E, H, I, mode, tier)
    v = rng.uniform(0.5, 2.0, I) * np.where(rng.random(I) < 0.5, -1, 1)
    v[:32] = np.abs(v[:32])
    v[64:96] = v[:32]
    gbits = to_bf16_bits(v)
    q, hs, corr = parse_prep(prep(k, gbits), I)
    assert hs[2] == hs[0] and (q[64:96] == q[:32]).all()
    np.testing.assert_array_equal(corr, -12 * q.reshape(4, 32).sum(-1))
    S = (KW2[c] * q).reshape(H, 4, 32).sum(-1)  # exact integers
    f = S.astype(np.float32) * hs[None, :]  # float32 products, rounded once
    terms = f * np.ldexp(np.float32(1), sc.astype(np.int64) - 127).astype(np.float32)  # exact
    assert (terms[:, 2] == -terms[:, 0]).all()
    want = round_bf16(emulate_rows(terms).astype(np.float64))
    exact = round_bf16(terms.astype(np.float64).sum(-1))
    assert np.count_nonzero(want != exact) > H // 8  # the roundings left their marks in the bf16 bits
    for order in ("two", "tree", "reverse"):
        assert np.count_nonzero(round_bf16(emulate_rows(terms, order).astype(np.float64)) != want) > H // 16, order
    acc = run_down(k, FMT, xb, 0, [gbits], [1.0])[0]
    np.testing.assert_array_equal(acc, want)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_route_term_rounding_ties(rng, mode, tier):
    """ds_fp4 rounds each route's down term (dot * weight) to bf16 before the sum over routes: ties go to even,
    also in the SIMD tiers' 8-row path (x16.h round_bf16x8). Every row's dot is one exact value here (one code per
    row; a row's e8m0 scale only shifts it), so the route weights can put dot * weight exactly on a bf16 tie whose
    kept bit is odd (rounds up), on one whose kept bit is even (rounds down), and off the ties."""
    E, H, I = 1, 128, 128  # noqa: E741 - 8 groups of 16 rows: the 8-row path
    b = DS.random_banks(E, H, I, rng)
    c = np.zeros((H, I), np.uint8)
    c[:, 1] = 1  # E2M1 0.5 at element 1 of block 0, nothing else: S = 2 E2M1 * q[1] = q[1]
    b["down_packed"][0] = c[:, 0::2] | (c[:, 1::2] << 4)
    sc = np.full((H, I // 32), 127, np.uint8)
    sc[:, 0] = rng.integers(120, 135, H)
    b["down_scale"][0] = sc.view(E8M0)
    xb = cf.repack_ds_fp4_x16(b)
    k = kernel(FMT, E, H, I, mode, tier)
    v = rng.standard_normal(I)
    v[1] = 0.7
    gbits = to_bf16_bits(v)
    q, hs, _ = parse_prep(prep(k, gbits), I)
    dot = np.float32(q[1]) * hs[0]  # float32: f32(S) * hs, rounded once; row r's dot is dot * 2^(s_r - 127)
    f32 = np.float32

    def weight_for(target):  # a float32 w with f32(dot * w) == target exactly
        w = f32(target / dot)
        for _ in range(16):
            p = f32(dot * w)
            if p == target:
                return w
            w = np.nextafter(w, f32(np.inf) if p < target else f32(-np.inf), dtype=f32)
        raise AssertionError(f"no float32 weight puts {dot!r} on {target!r}")

    e = np.floor(np.log2(abs(float(dot))))
    odd_tie = f32(np.ldexp(1 + 2.0**-7 + 2.0**-8, int(e)))  # kept bits ...1, dropped 0x8000: rounds up
    even_tie = f32(np.ldexp(1 + 2.0**-6 + 2.0**-8, int(e)))  # kept bits ...0, dropped 0x8000: rounds down
    wts = [weight_for(odd_tie), weight_for(even_tie), f32(0.75)]
    acc = run_down(k, FMT, xb, 0, [gbits] * 3, wts)
    scale = np.ldexp(1.0, sc[:, 0].astype(np.int64) - 127)
    for j, w in enumerate(wts):
        want = round_bf16((f32(dot * w) * scale).astype(np.float32).astype(np.float64))
        np.testing.assert_array_equal(acc[j], want, err_msg=f"route {j} (weight {w!r})")
    assert (acc[0] > f32(dot * wts[0]) * scale).all() and (acc[1] < f32(dot * wts[1]) * scale).all()


# ---------------------------------------------------------------- work items
@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("n", [1, 2, 9])
def test_ragged_work_items(rng, mode, tier, n):
    """Row ranges that cut groups (odd group counts for the lone route's two half streams): each item writes exactly
    its rows, with the bits of a whole-range call; the down terms are within the dot bound of float64."""
    E, H, I = 3, 384, 256  # noqa: E741 - 24 down groups, 16 + 16 gate_up groups
    b = SPEC.random_banks(E, H, I, rng)
    dn = SPEC.dequantize(b)[1][1]
    check_ragged_work_items(
        cf.Kernel(FMT, E, H, I, mode=mode, isa=tier), FMT, b, n, rng,
        [(5, 37), (16, 32), (0, 1), (255, 256), (17, 18), (33, 161)],
        [(3, 29), (16, 48), (383, 384), (0, 17), (5, 91), (32, 80)],  # 2, 2, 1, 2, 6, 3 groups
        lambda full, gs, wts: check_down_terms(full, dn, [SPEC.act_in(bits_f64(g), "w4a8") for g in gs], wts, I),
        w_in=[1.0] * n)


# ---------------------------------------------------------------- edge codes and scales
@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_all_e2m1_codes_and_element_order(rng, mode, tier):
    """All 256 byte values per row (16 x 16 code pairs incl. -0) and every element's place: one-hot activations
    at positions across a 32-block (both nibbles, both halves) must read exactly that column's weight."""
    E, H, I = 1, 128, 512  # noqa: E741
    b = DS.random_banks(E, H, I, rng)
    dp = b["down_packed"]
    for h in range(H):
        dp[0, h] = rng.permutation(256).astype(np.uint8)
    xb = cf.repack_ds_fp4_x16(b)
    k = kernel(FMT, E, H, I, mode, tier)
    _, dn = SPEC.dequantize(xb)
    pos = [0, 1, 2, 3, 4, 7, 14, 15, 16, 17, 19, 28, 31, 32 + 5, 96 + 22, 256 + 30, 511]
    gs = []
    for p in pos:
        v = np.zeros(I)
        v[p] = 1.0 + rng.random()
        gs.append(to_bf16_bits(v))
    gs.append(to_bf16_bits(rng.standard_normal(I)))
    wts = [1.0] * len(gs)
    acc = run_down(k, FMT, xb, 0, gs, wts)
    acts = [SPEC.act_in(bits_f64(g), mode) for g in gs]
    check_down_terms(acc, dn[0], acts, wts, I)
    for j, p in enumerate(pos):  # exactly bf16(w[h, p] * a_p): a one-term dot
        np.testing.assert_array_equal(acc[j], round_bf16(dn[0][:, p] * acts[j][p]))


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_all_e8m0_scales(rng, mode, tier):
    """Down row h uses scale code h in all its blocks (2^-127 subnormal .. 2^127, 255 clamped to 254); gate rows
    every code, one block each."""
    E, H, I = 1, 256, 128  # noqa: E741
    b = DS.random_banks(E, H, I, rng)
    b["down_scale"][...] = np.repeat(np.arange(256, dtype=np.uint8), I // 32).view(E8M0).reshape(1, H, I // 32)
    b["down_packed"][0, 255] = b["down_packed"][0, 254]
    b["down_packed"][0, :2] = rng.integers(0x11, 0x78, (2, I // 2), dtype=np.uint8) & 0x77  # positive codes
    xb = cf.repack_ds_fp4_x16(b)
    k = kernel(FMT, E, H, I, mode, tier)
    _, dn = SPEC.dequantize(xb)
    gs = [to_bf16_bits(rng.standard_normal(I) * 1e-3), to_bf16_bits(rng.uniform(5e-4, 2e-3, I))]
    wts = [1.0, 0.5]
    acc = run_down(k, FMT, xb, 0, gs, wts)
    assert np.isfinite(acc).all()
    check_down_terms(acc, dn[0], [SPEC.act_in(bits_f64(g), mode) for g in gs], wts, I)
    assert np.array_equal(acc[:, 255], acc[:, 254])  # 255 behaves as 254
    assert acc[1, 0] > 0 and acc[1, 1] > 0  # the 2^-127 and 2^-126 rows survive as subnormals, not flushed to 0
    exact = 0.5 * (dn[0] @ SPEC.act_in(bits_f64(gs[1]), mode))
    assert (acc[1][np.abs(exact) > 2.0**-120] != 0).all()
    # gate_up: every code in the gate rows' blocks (up rows moderate); g finite and inside its interval
    H2, I2 = 256, 128  # noqa: E741
    b2 = DS.random_banks(E, H2, I2, rng)
    sc = b2["gate_up_scale"].view(np.uint8)
    sc[0, :I2] = rng.permutation(np.arange(I2 * (H2 // 32)) % 256).astype(np.uint8).reshape(I2, H2 // 32)
    sc[0, I2:] = 127
    xb2 = cf.repack_ds_fp4_x16(b2)
    k2 = kernel(FMT, E, H2, I2, mode, tier, **DSV4)
    gu, _ = SPEC.dequantize(xb2)
    act = activations.resolve(**DSV4)
    xs = [to_bf16_bits(rng.standard_normal(H2) * 1e-8), to_bf16_bits(rng.standard_normal(H2) * 1e-6)]
    g = run_gate_up(k2, FMT, xb2, 0, xs)
    assert np.isfinite(g).all()
    for j, x in enumerate(xs):
        a = SPEC.act_in(bits_f64(x), mode)
        pre, bnd = gu[0] @ a, dot_bound(gu[0], a) + (H2 // 32 + 8) * TINY
        check_g(g[j], pre[:I2], pre[I2:], bnd[:I2], bnd[I2:], act, round_gate_up=True)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_zero_blocks_and_extreme_codes(rng, mode, tier):
    """Zero activation blocks (s_b = 0, q = 0), zero weight blocks (codes 0 and 8 = -0), and the integer extremes
    (codes +-6 against q = +-127 everywhere: |S_b| = 32 * 12 * 127)."""
    E, H, I = 2, 128, 256  # noqa: E741
    b = DS.random_banks(E, H, I, rng)
    dp = b["down_packed"]
    dp[0, :, :16] = np.where(rng.random((H, 16)) < 0.5, 0x00, 0x88)  # block 0 of every row: +-0
    dp[1] = np.where(rng.random(dp[1].shape) < 0.5, 0x77, 0xFF)  # expert 1: +6 / -6 pairs
    xb = cf.repack_ds_fp4_x16(b)
    k = kernel(FMT, E, H, I, mode, tier)
    _, dn = SPEC.dequantize(xb)
    v = rng.standard_normal(I)
    v[64:96] = 0  # a zero activation block
    ext = np.where(rng.random(I) < 0.5, -1.0, 1.0) * 3.0  # q = +-127 in every block
    gs = [to_bf16_bits(v), to_bf16_bits(ext), to_bf16_bits(np.zeros(I))]
    q, hs, _ = parse_prep(prep(k, gs[1]), I)
    assert (np.abs(q) == 127).all()
    for e in range(E):
        acc = run_down(k, FMT, xb, e, gs, [1.0, 1.0, 1.0])
        check_down_terms(acc, dn[e], [SPEC.act_in(bits_f64(g), mode) for g in gs], [1.0, 1.0, 1.0], I)
        assert (acc[2] == 0).all()
    # whole steps on those banks
    x = np.where(rng.random((3, H)) < 0.5, -1.0, 1.0).astype(np.float32) * 3.0
    x[1, :32] = 0
    w, ids = routes(rng, 3, 2, E, skip=False)
    y = run_forced(FMT, xb, x, w, ids, mode, tier)
    deq = SPEC.dequantize(xb)
    ref = cf.reference.moe(FMT, xb, x, w, ids, mode=mode, dequantized=deq)
    assert rel_err(y, ref) < moe_tol(k, xb, x, w, ids, ref, deq)


# ---------------------------------------------------------------- schema and errors
def test_schema_and_errors(rng):
    b = SPEC.random_banks(3, 512, 384, rng)
    assert cf.validate_banks(FMT, b) == (3, 512, 384)
    assert SPEC.id == 10 and cf.get_format("ds_fp4_cpu") is SPEC and SPEC.modes == ("w4a8",)
    assert SPEC.default_mode == "w4a8" and SPEC.k_multiple == 128
    assert SPEC.kernel_tiers == {"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni", "avx512bf16")}
    small = SPEC.random_banks(2, 128, 128, rng)
    with pytest.raises(ValueError, match="down.*expected shape"):
        cf.validate_banks(FMT, dict(small, down=small["down"][:, :, :272]))
    with pytest.raises(ValueError, match="272"):
        cf.validate_banks(FMT, dict(small, down=small["down"][:, :, :100]))
    with pytest.raises(ValueError, match="gate_up"):
        cf.validate_banks(FMT, dict(small, gate_up=small["gate_up"][:, :-1]))
    with pytest.raises(TypeError, match="dtype"):
        cf.validate_banks(FMT, dict(small, down=small["down"].view(np.int8)))
    with pytest.raises(ValueError, match="needs banks"):  # ds_fp4's row-major banks under this name
        cf.validate_banks(FMT, DS.random_banks(2, 128, 128, rng))
    with pytest.raises(ValueError, match="needs banks"):  # and the other way round
        cf.repack_ds_fp4_x16(small)
    with pytest.raises(ValueError, match="mode"):
        cf.Kernel(FMT, 2, 128, 128, mode="native")
    with pytest.raises(ValueError, match="multiples of 128"):
        cf.Kernel(FMT, 2, 192, 128)
    with pytest.raises(ValueError, match="multiples of 128"):
        cf.validate_banks(FMT, SPEC.random_banks(1, 128, 128, rng) | {"down": cf.aligned_empty((1, 4, 272), np.uint8)})
    with pytest.raises(ValueError, match="apply_router_weight_on_input"):
        cf.Kernel(FMT, 2, 128, 128, apply_router_weight_on_input=True)
    with pytest.raises(TypeError, match="no options"):
        cf.quantize(FMT, np.zeros((1, 256, 128), np.float32), np.zeros((1, 128, 128), np.float32), x=1)
    # the quantizer is ds_fp4's, repacked
    gu = rng.standard_normal((2, 256, 128)).astype(np.float32)
    dn = rng.standard_normal((2, 128, 128)).astype(np.float32) * 0.02
    q = cf.quantize(FMT, gu, dn)
    ref = cf.repack_ds_fp4_x16(cf.quantize("ds_fp4", gu, dn))
    for n in q:
        np.testing.assert_array_equal(q[n], ref[n])
