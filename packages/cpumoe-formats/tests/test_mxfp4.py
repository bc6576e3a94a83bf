"""mxfp4 (gpt-oss / Triton transposed split-K) kernels vs the float64 reference, every tier forced.

Layout under test: blocks [E, K/2, N] (row kb = K-pair kb of every column, low nibble K = 2kb),
scales [E, K/32, N] e8m0, gate/up interleaved by column (2j gate, 2j+1 up), biases bf16,
router weight always on the output, down bias added once per route (times its weight).

Tolerances (rel = max|y - ref| / max|ref|, the reference is exact float64 except the defined
bf16 roundings of x, g and y):
- TOL = 4e-3 for whole MoE steps on random data. y is bf16: half an ulp is 2^-9 = 1.95e-3 of
  |y|. g is rounded to bf16 in kernel and reference alike; an element whose fp32 gate/up lies
  within fp32 rounding of a bf16 rounding boundary differs by one bf16 ulp (2^-8 of |g_i|), which
  moves y by |down[h,i] g_i| 2^-8, a few 1e-5 of max|y| at I = 2880. fp32 accumulation over
  K <= 2880 adds ~sqrt(K) 2^-24. So rel <= 2^-9 + small; 4e-3 is 2x the half ulp.
- EXACT_REL = 2^-6 per element where a test exposes single values (one-hot down rows, so
  y[h] = g_i exactly, or a few positive terms): both sides round the same value to bf16; a
  one-ulp flip (at most 2^-7 relative) from fp32 vs float64 gate/up is the only difference.
  2^-6 leaves a factor 2 and still catches a wrong code (distinct e2m1 magnitudes differ by
  >= 25%, and g moves >= 3% in the all-codes test), a wrong scale exponent (a factor 2) or
  swapped gate/up.
- Work items called directly: g within one bf16 ulp (2^-7 relative) plus 2^-133 absolute
  (bf16 subnormal step); down accumulators (fp32, no output rounding) within 2e-5 of
  sum |terms| (fp32 accumulation over I = 192 terms: worst case ~200 * 2^-24 = 1.2e-5,
  typically sqrt(I) * 2^-24 ~ 1e-6).
"""
import numpy as np
import pytest
from conftest import USABLE, int8_blocks_slow, poisoned, rel_err, routes, run_forced, tier_cases

import cpumoe_formats as cf
from cpumoe_formats import activations
from cpumoe_formats.numerics import BF16, E8M0, round_bf16

FMT = "mxfp4"
SPEC = cf.get_format(FMT)
TOL = 4e-3
EXACT_REL = 2.0**-6
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
GPT_OSS = dict(activation="swigluoai", alpha=1.702, limit=7.0)


def _bf16(a):
    return np.asarray(a, np.float32).astype(BF16)


def _close_elementwise(y, ref, rel=EXACT_REL, atol=0.0):
    assert np.isfinite(y).all(), "non-finite output"
    bad = np.abs(y - ref) > rel * np.abs(ref) + atol
    assert not bad.any(), f"{bad.sum()} elements off, first at {np.argwhere(bad)[0]}: " \
                          f"{y[tuple(np.argwhere(bad)[0])]} vs {ref[tuple(np.argwhere(bad)[0])]}"


def _zero_banks(E, H, I):  # noqa: E741
    """Valid banks with zero codes, scale 127 (1.0) and zero biases."""
    return {"gate_up_blocks": np.zeros((E, H // 2, 2 * I), np.uint8),
            "gate_up_scales": np.full((E, H // 32, 2 * I), 127, np.uint8),
            "gate_up_bias": np.zeros((E, 2 * I), BF16),
            "down_blocks": np.zeros((E, I // 2, H), np.uint8),
            "down_scales": np.full((E, I // 32, H), 127, np.uint8),
            "down_bias": np.zeros((E, H), BF16)}


def _set_code(blocks, e, k, n, code):
    """Put a 4-bit code at K index k, column n of a [E, K/2, N] blocks bank."""
    b = blocks[e, k // 2, n]
    blocks[e, k // 2, n] = (b & 0xF0) | code if k % 2 == 0 else (b & 0x0F) | (code << 4)


# ---------------------------------------------------------------- whole steps, real shape

@pytest.fixture(scope="module")
def gpt_oss_banks():
    """gpt-oss expert geometry H = I = 2880 (E = 4 to keep the float64 reference small), random
    codes over every byte value, e8m0 scales 119..121, biases 0.01 randn; fresh every run."""
    import os
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"gpt_oss_banks seed={seed}")
    rng = np.random.default_rng(seed)
    banks = SPEC.random_banks(4, 2880, 2880, rng)
    return banks, SPEC.dequantize(banks)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("T", [1, 3, 8])
def test_gpt_oss_shape(rng, gpt_oss_banks, mode, tier, T):
    banks, deq = gpt_oss_banks
    E, H, K = 4, 2880, 4  # I = 2880 too
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, banks, x, w, ids, mode, tier, **GPT_OSS)
    ref = cf.reference.moe(FMT, banks, x, w, ids, mode=mode, dequantized=deq, **GPT_OSS)
    assert rel_err(y, ref) < TOL


# ---------------------------------------------------------------- ragged shapes, activations

@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "swigluoai", "swiglu_clamp"])
@pytest.mark.parametrize("H,I,T", [(96, 160, 8), (160, 96, 3), (32, 32, 1)])  # noqa: E741
def test_ragged_activations(rng, mode, tier, act, H, I, T):  # noqa: E741
    """H, I multiples of 32 but not of 64: half-width column tiles and partial work items."""
    E, K = 5, 4
    gu = rng.standard_normal((E, 2 * I, H)).astype(np.float32) * 0.1
    dn = rng.standard_normal((E, H, I)).astype(np.float32) * 0.1
    gub = rng.standard_normal((E, 2 * I)).astype(np.float32) * 0.1
    dnb = rng.standard_normal((E, H)).astype(np.float32) * 0.1
    banks = cf.quantize(FMT, gu, dn, gate_up_bias=gub, down_bias=dnb)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    kw = dict(activation=act)
    if act.startswith("swiglu"):
        kw.update(alpha=1.702, limit=0.75)  # a limit the data actually crosses
    y = run_forced(FMT, banks, x, w, ids, mode, tier, **kw)
    ref = cf.reference.moe(FMT, banks, x, w, ids, mode=mode, **kw)
    assert rel_err(y, ref) < TOL


# ---------------------------------------------------------------- work items called directly

@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_arbitrary_work_items(rng, mode, tier):
    """gate_up / down on odd row ranges (tails narrower than a vector, tiles crossing vector
    and 128-column boundaries) and 1..6 tokens per item (token groups and their remainders)."""
    E, H, I = 2, 224, 192  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    arrays, _ = SPEC.validate(banks)
    views = SPEC.bank_views(arrays)
    gu, dn = SPEC.dequantize(banks)
    bgu, bdn = SPEC.biases(banks)
    act = activations.resolve("swigluoai", 1.702, 1.5)
    k = cf.Kernel(FMT, E, H, I, mode=mode, isa=tier, activation="swigluoai", alpha=1.702, limit=1.5)
    assert k._k.block_hint == 64

    def prep(v):  # bf16 vector -> the kernel's prepared activation
        src = np.ascontiguousarray(_bf16(v)).view(np.uint16)
        dst = cf.aligned_empty((k._k.act_bytes(len(src)),), np.uint8)
        k._k.prep_act(src.ctypes.data, len(src), dst.ctypes.data)
        return dst

    for n in (1, 2, 3, 5, 6):
        xs = round_bf16(rng.standard_normal((n, H)))
        px = [prep(v) for v in xs]
        e = int(rng.integers(0, E))
        xa = np.stack([SPEC.act_in(v, mode) for v in xs])  # what the kernel consumes (w4a8: int8 * s_b)
        gate_up = xa @ gu[e].T + bgu[e]  # [n, 2I] gate then up
        g_ref = round_bf16(act(gate_up[:, :I], gate_up[:, I:]))
        # fp32 accumulation of <= H/32 + 1 rounded block terms errs by at most 2^-21 * sum|terms| per
        # pre-activation; swigluoai (alpha 1.702, limit 1.5) has |d/dgate| <= 2.75 and |d/dup| <= 1.4, so
        # an element near a cancellation may differ by 4 * (e_gate + e_up) beyond the bf16 rounding (rel).
        e_pre = 2.0**-21 * (np.abs(xa) @ np.abs(gu[e]).T + np.abs(bgu[e]))
        g_atol = 4.0 * (e_pre[:, :I] + e_pre[:, I:]) + 2.0**-133
        for i0, i1 in ((0, I), (0, 1), (3, 20), (5, 37), (31, 33), (40, 105), (I - 7, I)):
            g = poisoned(n, I)
            k._k.gate_up(views, e, i0, i1, [p.ctypes.data for p in px], [1.0] * n, [g[j].ctypes.data for j in range(n)])
            raw = g.view(np.uint16)
            assert (raw[:, :i0] == 0x7FC1).all() and (raw[:, i1:] == 0x7FC1).all(), "wrote outside [i0, i1)"
            got = g.astype(np.float64)[:, i0:i1]
            _close_elementwise(got, g_ref[:, i0:i1], rel=2.0**-7, atol=g_atol[:, i0:i1])
        # down: routes grouped by expert, tokens repeating, weights != 1
        gs = round_bf16(rng.standard_normal((n, I)))
        pg = [prep(v) for v in gs]
        experts = np.sort(rng.integers(0, E, n))
        wts = rng.random(n).astype(np.float32) + 0.1
        tok = rng.integers(0, 3, n)
        for h0, h1 in ((0, H), (0, 1), (7, 70), (33, 161), (H - 5, H)):
            acc = np.zeros((3, h1 - h0), np.float32)
            acc[:] = 0.25  # the kernel accumulates into acc
            rts = [(int(tok[r]), int(experts[r]), float(wts[r]), pg[r].ctypes.data) for r in range(n)]
            k._k.down(views, h0, h1, rts, acc.ctypes.data, h1 - h0)
            ref = np.full((3, h1 - h0), 0.25)
            mag = np.full((3, h1 - h0), 0.25)
            for r in range(n):
                ga = SPEC.act_in(gs[r], mode)
                term = dn[experts[r], h0:h1] @ ga + bdn[experts[r], h0:h1]
                ref[tok[r]] += float(wts[r]) * term
                mag[tok[r]] += float(wts[r]) * (np.abs(dn[experts[r], h0:h1]) @ np.abs(ga)
                                                + np.abs(bdn[experts[r], h0:h1]))
            assert (np.abs(acc - ref) <= 2e-5 * mag).all()


# ---------------------------------------------------------------- e8m0 scales 0..255

def _x_exp(s, mode="native"):
    """log2 of the activation scale used with e8m0 code s: keeps partial sums and x normal and
    finite in fp32/bf16 while 2^(s-127) * 2^X stays near 1. w4a8 stops at 2^-118 so that the
    block's s_b = amax/127 stays normal (where 1/s_b overflows the block quantizes to 0)."""
    return int(np.clip(127 - min(s, 254), -125 if mode == "native" else -118, 120))


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_every_e8m0_scale_gate_up(rng, mode, tier):
    """Every gate_up scale code 0..255 through the kernel. gate_up column c has non-zero codes
    only in scale group c (scale c, 2^-127 for c = 0, 255 acting as 254); x's group c is scaled
    by 2^X(c) so each gate/up value is O(1); down is one-hot (y[h] = g[h mod I] exactly), so
    every g_j is checked on its own."""
    I = 128  # noqa: E741 - 2I = 256 columns, one per scale code
    H = 32 * 256
    banks = _zero_banks(1, H, I)
    banks["gate_up_scales"][0] = np.arange(256, dtype=np.uint8)[:, None]  # row g = code g, all columns
    blocks = banks["gate_up_blocks"]
    for c in range(2 * I):
        for k in rng.choice(32, 4, replace=False):
            _set_code(blocks, 0, 32 * c + int(k), c, int(rng.integers(1, 8)))  # positive, non-zero
    for h in range(H):  # one-hot down: y[h] = 1.0 * g[h % I]
        _set_code(banks["down_blocks"], 0, h % I, h, 2)
    xe = np.repeat([_x_exp(s, mode) for s in range(256)], 32)
    x = (np.ldexp(1.0 + rng.integers(0, 128, H) / 128.0, xe)).astype(np.float32)[None]  # bf16-exact
    w, ids = np.ones((1, 1), np.float32), np.zeros((1, 1), np.int32)
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    if mode == "native":
        ref = round_bf16(cf.reference.moe(FMT, banks, x, w, ids, mode=mode))
        assert (ref != 0).all()
        _close_elementwise(y, ref)
    else:  # w4a8 quantizes g per 32 (g spans 2^24 here): check every g_j from the gate_up work item
        k = cf.Kernel(FMT, 1, H, I, mode=mode, isa=tier)
        src = np.ascontiguousarray(_bf16(x[0])).view(np.uint16)
        px = cf.aligned_empty((k._k.act_bytes(H),), np.uint8)
        k._k.prep_act(src.ctypes.data, H, px.ctypes.data)
        g = poisoned(1, I)
        k._k.gate_up(SPEC.bank_views(SPEC.validate(banks)[0]), 0, 0, I, [px.ctypes.data], [1.0], [g.ctypes.data])
        gu, _ = SPEC.dequantize(banks)
        gate_up = gu[0] @ SPEC.act_in(round_bf16(x[0]), mode)
        g_ref = round_bf16(activations.resolve("silu")(gate_up[:I], gate_up[I:]))
        assert (g_ref != 0).all()
        _close_elementwise(g.astype(np.float64)[0], g_ref)
    # 255 behaves as 254: bit-identical output with every 254 replaced by 255 and vice versa
    for a, b in ((255, 254), (254, 255)):
        b2 = {n: v.copy() for n, v in banks.items()}
        b2["gate_up_scales"][b2["gate_up_scales"] == a] = b
        y2 = run_forced(FMT, b2, x, w, ids, mode, tier)
        assert np.array_equal(y2, y)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_every_e8m0_scale_down(rng, mode, tier):
    """Every down scale code 0..255 through the kernel. Output column h has non-zero codes only
    in K group h (scale h). g is set through the biases (zero gate_up codes): gate = bias_g
    in [16, 32), up = bias_u = 2^X, so g = bf16(silu(gate) * up) = gate * 2^X exactly and
    y[h] = 2^(h-127) * sum(E2M1 * g) is O(1..2^9) for every h."""
    H = 256
    I = 32 * 256  # noqa: E741
    banks = _zero_banks(1, H, I)
    banks["down_scales"][0] = np.arange(256, dtype=np.uint8)[:, None]
    for h in range(H):
        for k in rng.choice(32, 4, replace=False):
            _set_code(banks["down_blocks"], 0, 32 * h + int(k), h, int(rng.integers(1, 8)))
    lo = -126 if mode == "native" else -118  # w4a8: g's s_b = amax/127 stays normal
    xe = np.repeat([int(np.clip(117 - min(s, 254), lo, 117)) for s in range(256)], 32)  # per i
    gate = 16.0 + rng.integers(0, 128, I) / 8.0
    up = np.ldexp(1.0, xe)
    bias = np.empty(2 * I)
    bias[0::2], bias[1::2] = gate, up  # interleaved bank order
    banks["gate_up_bias"][0] = _bf16(bias)
    x = rng.standard_normal((1, H), dtype=np.float32)  # irrelevant: gate_up codes are zero
    w, ids = np.ones((1, 1), np.float32), np.zeros((1, 1), np.int32)
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    ref = round_bf16(cf.reference.moe(FMT, banks, x, w, ids, mode=mode))
    assert (ref != 0).all()
    _close_elementwise(y, ref)
    for a, b in ((255, 254), (254, 255)):
        b2 = {n: v.copy() for n, v in banks.items()}
        b2["down_scales"][b2["down_scales"] == a] = b
        assert np.array_equal(run_forced(FMT, b2, x, w, ids, mode, tier), y)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_scale_255_is_254_random(rng, mode, tier):
    """Random codes with every gate_up scale 254 or 255 (tiny x keeps it finite), ragged shape:
    output bit-identical to all-254 and within TOL of the reference."""
    E, H, I, T, K = 3, 96, 160, 3, 2  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    banks["gate_up_scales"][...] = rng.choice(np.array([254, 255], np.uint8), banks["gate_up_scales"].shape)
    banks["down_scales"][...] = rng.integers(105, 109, banks["down_scales"].shape, dtype=np.uint8)
    sign = rng.choice([-1.0, 1.0], (T, H))
    x = (sign * (1 + rng.integers(0, 128, (T, H)) / 128) * 2.0**-122).astype(np.float32)  # normal, tiny
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, banks, x, w, ids, mode, tier, activation="gelu")
    ref = cf.reference.moe(FMT, banks, x, w, ids, mode=mode, activation="gelu")
    assert rel_err(y, ref) < TOL
    b2 = dict(banks, gate_up_scales=np.minimum(banks["gate_up_scales"], 254))
    assert np.array_equal(run_forced(FMT, b2, x, w, ids, mode, tier, activation="gelu"), y)


# ---------------------------------------------------------------- e2m1 codes and interleave

@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_all_e2m1_codes(rng, mode, tier):
    """Every byte value (all 16 x 16 low/high code pairs) in gate_up; token t is one-hot at K
    index t, so gate_j = W[gate j, t] + bias; down is one-hot, so y[t, h] = g_t[h % I]. 64
    tokens routed to one expert also run the multi-token tiles."""
    E, H, I = 1, 64, 32  # noqa: E741
    banks = _zero_banks(E, H, I)
    banks["gate_up_blocks"][0] = rng.permutation(np.tile(np.arange(256, dtype=np.uint8), 8)).reshape(H // 2, 2 * I)
    bias = np.empty(2 * I)
    bias[0::2], bias[1::2] = 0.375, 0.125  # gate never 0, so g depends on up too
    banks["gate_up_bias"][0] = _bf16(bias)
    for h in range(H):
        _set_code(banks["down_blocks"], 0, h % I, h, 2)
    x = np.eye(H, dtype=np.float32)
    w = np.stack([np.full(H, 0.75), np.full(H, 0.5)], 1).astype(np.float32)
    ids = np.zeros((H, 2), np.int32)  # the same expert twice per token
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    ref = round_bf16(cf.reference.moe(FMT, banks, x, w, ids, mode=mode))
    # w4a8 quantizes g per 32 before down: g_j below amax/254 of its block become 0 (in ref alike)
    assert np.count_nonzero(ref) > (0.9 if mode == "native" else 0.75) * ref.size
    _close_elementwise(y, ref, atol=2.0**-126)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_gate_up_interleave(rng, mode, tier):
    """Hand-built banks, no quantizer or dequantizer: column 2j is gate row j (code 2 = 1.0),
    column 2j+1 is up row j (code 6 = 4.0). With x = 1/64 everywhere, gate = 1 + bias_g and
    up = 4 + bias_u; swapping the roles changes silu(gate) * up by ~30%."""
    E, H, I = 1, 64, 32  # noqa: E741
    banks = _zero_banks(E, H, I)
    banks["gate_up_blocks"][0, :, 0::2] = 0x22
    banks["gate_up_blocks"][0, :, 1::2] = 0x66
    bias = np.empty(2 * I)
    bias[0::2], bias[1::2] = 0.25, -0.5
    banks["gate_up_bias"][0] = _bf16(bias)
    for h in range(H):
        _set_code(banks["down_blocks"], 0, h % I, h, 2)
    banks["down_bias"][0] = _bf16(np.full(H, 0.125))
    x = np.full((1, H), 1 / 64, np.float32)
    w, ids = np.full((1, 1), 0.5, np.float32), np.zeros((1, 1), np.int32)
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    xs = SPEC.act_in(_bf16(x[0]).astype(np.float64), mode).sum()  # 1.0 in native
    gate, up = 1.0 * xs + 0.25, 4.0 * xs - 0.5
    g = float(round_bf16(gate / (1 + np.exp(-gate)) * up))
    want = float(round_bf16(0.5 * (g + 0.125)))
    if mode == "native":
        assert np.all(y == want), (y[0, :4], want)
    else:  # fp32 rounding of the 127 * s_b products may move g by one bf16 ulp
        _close_elementwise(y, np.full_like(y, want), rel=2.0**-7)
    # the dequantizer reads the same layout: logical rows 0..I-1 gate (1.0), I..2I-1 up (4.0)
    dgu, _ = SPEC.dequantize(banks)
    assert (dgu[0, :I] == 1.0).all() and (dgu[0, I:] == 4.0).all()
    bgu, bdn = SPEC.biases(banks)
    assert (bgu[0, :I] == 0.25).all() and (bgu[0, I:] == -0.5).all() and (bdn == 0.125).all()


def test_quantizer_interleaves():
    """quantize puts logical gate row j in column 2j and up row j in column 2j+1."""
    E, H, I = 1, 32, 32  # noqa: E741
    gu = np.zeros((E, 2 * I, H), np.float32)
    gu[0, :I] = 1.0  # gate rows: amax 1 -> scale 2^-2 (s = 125), 1 / 0.25 = 4 -> code 6
    gu[0, I:] = -4.0  # up rows: amax 4 -> scale 1 (s = 127), code 6 | 8 (sign)
    gub = np.concatenate([np.full(I, 0.5), np.full(I, -2.0)])[None]
    b = cf.quantize(FMT, gu, np.zeros((E, H, I), np.float32), gate_up_bias=gub)
    blk, scl = b["gate_up_blocks"][0], b["gate_up_scales"][0]
    assert (blk[:, 0::2] == 0x66).all() and (blk[:, 1::2] == 0xEE).all()
    assert (scl[:, 0::2] == 125).all() and (scl[:, 1::2] == 127).all()
    bias = b["gate_up_bias"][0].astype(np.float64)
    assert (bias[0::2] == 0.5).all() and (bias[1::2] == -2.0).all()


# ---------------------------------------------------------------- dequantizer and quantizer

def test_dequantize_exact_per_element(rng):
    """spec.dequantize / biases against an independent element-by-element decode."""
    E, H, I = 2, 64, 32  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    banks["gate_up_scales"][...] = rng.integers(0, 256, banks["gate_up_scales"].shape, dtype=np.uint8)
    banks["down_scales"][...] = rng.integers(0, 256, banks["down_scales"].shape, dtype=np.uint8)
    gu, dn = SPEC.dequantize(banks)
    bgu, bdn = SPEC.biases(banks)

    def elem(blocks, scales, e, k, n):
        byte = int(blocks[e, k // 2, n])
        code = byte & 0xF if k % 2 == 0 else byte >> 4
        s = min(int(scales[e, k // 32, n]), 254)
        return E2M1[code] * 2.0 ** (s - 127)

    for e in range(E):
        for j in range(I):
            for k in range(H):
                assert gu[e, j, k] == elem(banks["gate_up_blocks"], banks["gate_up_scales"], e, k, 2 * j)
                assert gu[e, I + j, k] == elem(banks["gate_up_blocks"], banks["gate_up_scales"], e, k, 2 * j + 1)
            assert bgu[e, j] == float(banks["gate_up_bias"][e, 2 * j])
            assert bgu[e, I + j] == float(banks["gate_up_bias"][e, 2 * j + 1])
        for h in range(H):
            for i in range(I):
                assert dn[e, h, i] == elem(banks["down_blocks"], banks["down_scales"], e, i, h)
            assert bdn[e, h] == float(banks["down_bias"][e, h])
    assert gu[0, 0, 0] == gu[0, 0, 0] and SPEC.dequantize(banks)[0].dtype == np.float64
    s0 = dict(banks, gate_up_scales=np.zeros_like(banks["gate_up_scales"]))
    nz = np.abs(SPEC.dequantize(s0)[0])
    assert nz[nz > 0].min() == 0.5 * 2.0**-127  # s = 0 is 2^-127, not 0


@pytest.mark.parametrize("fmt", [FMT, "mxfp4_panel"])
def test_quantizer_roundtrip(rng, fmt):
    """Both layouts: the quantizer's weights within the e2m1 grid of each block's power-of-two scale."""
    spec = cf.get_format(fmt)
    E, H, I = 2, 64, 32  # noqa: E741
    gu = (rng.standard_normal((E, 2 * I, H)) * np.exp(rng.uniform(-8, 8, (E, 2 * I, 1)))).astype(np.float32)
    dn = rng.standard_normal((E, H, I)).astype(np.float32) * 0.01
    dn[0, 3, :32] = 0.0  # an all-zero block
    gub = rng.standard_normal((E, 2 * I)).astype(np.float32)
    b = cf.quantize(fmt, gu, dn, gate_up_bias=gub)
    assert set(b) == set(spec.bank_names)
    dgu, ddn = cf.reference.dequantize(fmt, b)
    for w, d, blocks in ((gu, dgu, 32), (dn, ddn, 32)):
        wb = w.reshape(*w.shape[:-1], -1, blocks).astype(np.float64)
        db = d.reshape(wb.shape)
        amax = np.abs(wb).max(-1, keepdims=True)
        # scale = smallest power of two with amax/scale <= 6: amax/scale in (3, 6] (or block all 0)
        scale = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.where(amax > 0, amax, 1) / 6)), 1)
        assert np.all(np.abs(wb - db) <= scale * 1.0)  # largest e2m1 gap is 2 (4 -> 6)
        assert np.all((amax == 0) | (amax / scale > 3) & (amax / scale <= 6))
    assert (ddn[0, 3, :32] == 0).all()
    bgu, bdn = spec.biases(b)
    assert np.array_equal(bgu, _bf16(gub).astype(np.float64)) and (bdn == 0).all()
    # exactly representable weights (each block's amax = 6 * 2^k, so its scale is 2^k) come back exactly
    codes = rng.integers(0, 16, (1, 64, 64))
    codes[..., 0::32] = 7
    exact = (np.array(E2M1)[codes] * 2.0 ** rng.integers(-20, 20, (1, 64, 1))).astype(np.float32)
    eb = cf.quantize(fmt, exact, np.zeros((1, 64, 32), np.float32))
    assert np.array_equal(cf.reference.dequantize(fmt, eb)[0], exact.astype(np.float64))
    with pytest.raises(TypeError):
        cf.quantize(fmt, gu, dn, block_size=32)


def test_random_banks_and_schema(rng):
    b = SPEC.random_banks(3, 96, 64, rng)
    assert cf.validate_banks(FMT, b) == (3, 96, 64)
    assert [n for n in SPEC.bank_names] == ["gate_up_blocks", "gate_up_scales", "gate_up_bias", "down_blocks",
                                            "down_scales", "down_bias"]
    assert SPEC.bytes_per_expert(2880, 2880) == 13_236_480
    assert cf.get_format("mxfp4_triton") is SPEC and SPEC.id == 2 and SPEC.k_multiple == 32
    gu, dn = SPEC.dequantize(b)
    assert 0.01 < gu.std() < 0.05 and 0.01 < dn.std() < 0.05
    with pytest.raises(ValueError):
        cf.Kernel(FMT, 3, 80, 64)  # H not a multiple of 32


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("fmt", [FMT, "mxfp4_panel"])
def test_alternate_dtypes(rng, mode, tier, fmt):
    """Scales as float8_e8m0fnu and biases as uint16 bits give the same output (both layouts)."""
    E, H, I, T, K = 3, 96, 64, 3, 2  # noqa: E741 - H = 96: the panel layout's padded last panel
    spec = cf.get_format(fmt)
    banks = spec.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(fmt, banks, x, w, ids, mode, tier)
    alt = dict(banks)
    for n in ("gate_up_scales", "down_scales"):
        alt[n] = banks[n].view(E8M0)
    for n in ("gate_up_bias", "down_bias"):
        alt[n] = banks[n].view(np.uint16)
    assert np.array_equal(run_forced(fmt, alt, x, w, ids, mode, tier), y)
    assert np.array_equal(spec.dequantize(alt)[1], spec.dequantize(banks)[1])


def test_router_weight_on_input_rejected(rng):
    banks = SPEC.random_banks(2, 64, 32, rng)
    x = rng.standard_normal((1, 64), dtype=np.float32)
    w, ids = routes(rng, 1, 2, 2)
    with pytest.raises(ValueError, match="router weight"):
        cf.Kernel(FMT, 2, 64, 32, apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match="router weight"):
        cf.moe_forward(FMT, banks, x, w, ids, apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match="router weight"):
        cf.reference.moe(FMT, banks, x, w, ids, apply_router_weight_on_input=True)


def test_kernel_names():
    for t in cf.TIERS:
        if t in USABLE:
            want = {"scalar": "scalar", "avx2": "avx2", "avxvnni": "avx2"}.get(t, "avx512f")
            assert cf.selected_tier(FMT, isa=t) == want
    w8 = {"scalar": "scalar", "avx2": "avx2", "avxvnni": "avxvnni", "avx512f": "avx512f", "avx512vnni": "avx512vnni",
          "avx512bf16": "avx512vnni", "amx": "avx512vnni"}
    for t in cf.TIERS:
        if t in USABLE:
            assert cf.Kernel(FMT, 1, 64, 64, mode="w4a8", isa=t).name == w8[t] + "+w4a8"
    with pytest.raises(ValueError):
        cf.Kernel(FMT, 1, 64, 64, mode="w8a8")


# ---------------------------------------------------------------- w4a8 activation quantization

_w8_slow = int8_blocks_slow  # shared with the other 32-block w4a8 mode (conftest)


def _tie_vector(rng, nb):
    """Blocks with amax 127 * 2^k (s_b = 2^k exactly) and the other elements (n + 1/2) 2^k, n even:
    x * (1/s_b) lands on .5 exactly; half-even rounds to n, half-away to n + 1."""
    out = []
    for _ in range(nb):
        s = 2.0 ** int(rng.integers(-6, 3))
        out.append(np.r_[127.0, rng.integers(0, 63, 31) * 2 + 0.5] * s)
    return np.concatenate(out)


@pytest.mark.parametrize("tier", [p.values[1] for p in tier_cases(FMT, modes=("w4a8",)) if p.values[1] != "scalar"])
def test_w4a8_prep_act_nonfinite_matches_scalar(rng, tier):
    """Every tier's prep has the same layout: the SIMD tiers' (common.h q8_block32) bytes equal the scalar tier's
    for blocks holding inf, -inf and NaN (s_b NaN, codes 0) and a NaN-only block."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 32 * 13
    v = rng.standard_normal(K)
    v[[3, 40, 41, 100, 170, 300]] = [np.inf, np.nan, -np.inf, np.nan, np.nan, -np.inf]
    v[64:96] = np.nan
    src = np.ascontiguousarray(_bf16(v)).view(np.uint16)

    def prepped(isa):
        k = cf.Kernel(FMT, 2, 32, K, mode="w4a8", isa=isa)
        raw = cf.aligned_empty((k._k.act_bytes(K),), np.uint8)
        raw[...] = 0xAB
        k._k.prep_act(src.ctypes.data, K, raw.ctypes.data)
        return raw

    got, want = prepped(tier), prepped("scalar")
    bad = ~np.isfinite(v.reshape(-1, 32)).all(axis=1)
    sb = want[K:K + 4 * (K // 32)].view(np.float32)
    assert bad.sum() == 6 and np.isnan(sb[bad]).all() and np.isfinite(sb[~bad]).all()
    assert np.all(want[:K].view(np.int8).reshape(-1, 32)[bad] == 0)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("tier", [p.values[1] for p in tier_cases(FMT, modes=("w4a8",))])
def test_w4a8_prep_act_bit_exact(rng, tier):
    """The kernel's prep_act equals act_in's quantization bit for bit: int8 q[K], then fp32 s_b per 32 K,
    then int32 12 * sum(q) per 32 K; on random data, .5 ties, zero blocks, tiny blocks where 1/s_b
    overflows, bf16 subnormals and huge values."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 32 * 23
    v = rng.standard_normal(K) * np.exp(rng.uniform(-8, 8, K // 32).repeat(32))
    v[32:160] = _tie_vector(rng, 4)
    v[160:192] = 0.0
    v[192:224] = rng.standard_normal(32) * 1e-38  # amax/127 subnormal: 1/s_b overflows -> q = 0
    v[224:256] = rng.uniform(-1, 1, 32) * 4e-37  # near the edge of the overflow: 1/s_b finite iff amax >= ~3.7e-37,
    v[224] = 4.5e-37  # pinned above it (a random block's amax fell below it for 1 seed in ~3,000: all q = 0)
    v[256:288] = rng.integers(-3, 4, 32) * 2.0**-133  # bf16 subnormals
    v[288:320] = 1e30 * rng.standard_normal(32)
    g = _bf16(v)
    k = cf.Kernel(FMT, 2, 32, K, mode="w4a8", isa=tier)
    src = np.ascontiguousarray(g).view(np.uint16)
    n = k._k.act_bytes(K)
    assert n == K + K // 32 * 8
    raw = cf.aligned_empty((n,), np.uint8)
    k._k.prep_act(src.ctypes.data, K, raw.ctypes.data)
    q_kernel = raw[:K].view(np.int8).reshape(K // 32, 32)
    sb = raw[K:K + K // 8].view(np.float32)
    c12 = raw[K + K // 8:].view(np.int32)
    q_ref, d_ref = _w8_slow(g.astype(np.float64))
    from cpumoe_formats.formats.mxfp4 import w8_quantize
    q_vec, d_vec = w8_quantize(g.astype(np.float64))
    np.testing.assert_array_equal(q_vec, q_ref)
    np.testing.assert_array_equal(d_vec.view(np.uint32), d_ref.view(np.uint32))
    np.testing.assert_array_equal(sb.view(np.uint32), d_ref.view(np.uint32))
    np.testing.assert_array_equal(q_kernel, q_ref)
    np.testing.assert_array_equal(c12, 12 * q_ref.astype(np.int64).sum(axis=1))
    assert np.all(q_ref[5] == 0) and np.all(q_ref[6] == 0) and np.all(q_ref[8] == 0)
    assert np.any(q_ref[7] != 0)
    # act_in is q * s_b in float64
    np.testing.assert_array_equal(SPEC.act_in(g.astype(np.float64), "w4a8"),
                                  (q_ref.astype(np.float64) * d_ref.astype(np.float64)[:, None]).reshape(-1))


def test_w4a8_act_in_ties_round_half_even(rng):
    v = _tie_vector(rng, 3)
    q, d = _w8_slow(v)
    np.testing.assert_array_equal(SPEC.act_in(v, "w4a8"), (q.astype(np.float64) * d[:, None]).reshape(-1))
    assert np.all(q[:, 1:] % 2 == 0)  # every tie went to the even integer
    with pytest.raises(ValueError):
        SPEC.act_in(v, "w8a8")


@pytest.mark.parametrize("tier", [p.values[1] for p in tier_cases(FMT, modes=("w4a8",))])
def test_w4a8_tiers_bit_identical(rng, tier):
    """Every w4a8 tier computes the same integers and the same fp32 operations in the same order:
    outputs equal the scalar tier's bit for bit (ragged shape, several tokens per expert)."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    E, H, I, T, K = 3, 160, 96, 5, 2  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, banks, x, w, ids, "w4a8", tier)
    assert np.array_equal(y, run_forced(FMT, banks, x, w, ids, "w4a8", "scalar"))


@pytest.mark.parametrize("mode,tier", tier_cases(FMT, modes=("w4a8",)))
def test_w4a8_zero_and_extreme_blocks(rng, mode, tier):
    """Zero activation blocks contribute exactly 0; blocks of +-amax hit q = +-127 with the largest
    weights (+-12 as int8, u = 24: the int16 bound, 4 rows * 2 * 24 * 127 = 24384, on avx2 / avx512f), through
    the batched tile and the one-token tile."""
    E, H, I = 1, 64, 32  # noqa: E741
    banks = _zero_banks(E, H, I)
    banks["gate_up_blocks"][...] = 0x77  # +6 everywhere (int8 12)
    banks["gate_up_blocks"][0, :, 1::2] = 0xFF  # -6 in the up columns
    x = np.zeros((2, H), np.float32)
    x[0, :32] = 0.125  # one full block at amax: q = 127 everywhere
    x[1, 32:] = -0.0625
    w, ids = np.ones((2, 1), np.float32), np.zeros((2, 1), np.int32)
    for h in range(H):
        _set_code(banks["down_blocks"], 0, h % I, h, 2)
    for t0, t1 in ((0, 2), (0, 1), (1, 2)):  # both tokens in one work item (batched), each alone (one-token tile)
        y = run_forced(FMT, banks, x[t0:t1], w[t0:t1], ids[t0:t1], mode, tier, activation="silu")
        ref = round_bf16(cf.reference.moe(FMT, banks, x[t0:t1], w[t0:t1], ids[t0:t1], mode=mode, activation="silu"))
        _close_elementwise(y, ref, atol=2.0**-126)


# ---------------------------------------------------------------- batching: bit-identical per token

@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("H,I", [(160, 96), (2880, 224)])  # noqa: E741 - ragged (32 not 64) and gpt-oss H
def test_batch_bit_identical_to_single_token(rng, mode, tier, H, I):  # noqa: E741
    """Several tokens per work item decode each weight chunk once and accumulate every token from it;
    each token's result must equal, bit for bit, the same work item run for that token alone: g from
    gate_up with n = 1..11 tokens (token groups, their remainders, more than one pass of 8) on whole
    and odd row ranges, down accumulators with n routes of one expert, and whole steps (T = 8, all
    tokens on the same experts, vs T = 1 per token)."""
    E = 3
    banks = SPEC.random_banks(E, H, I, rng)
    views = SPEC.bank_views(SPEC.validate(banks)[0])
    k = cf.Kernel(FMT, E, H, I, mode=mode, isa=tier, **GPT_OSS)

    def prep(v):
        src = np.ascontiguousarray(_bf16(v)).view(np.uint16)
        dst = cf.aligned_empty((k._k.act_bytes(len(src)),), np.uint8)
        k._k.prep_act(src.ctypes.data, len(src), dst.ctypes.data)
        return dst

    xs = rng.standard_normal((11, H))
    px = [prep(v) for v in xs]
    for n in (2, 3, 5, 8, 11):
        for i0, i1 in ((0, I), (5, I - 37)):
            g = poisoned(n, I)
            k._k.gate_up(views, 1, i0, i1, [p.ctypes.data for p in px[:n]], [1.0] * n,
                         [g[j].ctypes.data for j in range(n)])
            for j in range(n):
                g1 = poisoned(1, I)
                k._k.gate_up(views, 1, i0, i1, [px[j].ctypes.data], [1.0], [g1.ctypes.data])
                assert np.array_equal(g[j].view(np.uint16), g1[0].view(np.uint16)), (n, j, i0, i1)
    pg = [prep(v) for v in rng.standard_normal((11, I))]
    for n in (2, 3, 8, 11):
        for h0, h1 in ((0, H), (3, H - 29)):
            acc = np.zeros((n, h1 - h0), np.float32)
            k._k.down(views, h0, h1, [(j, 2, 0.5 + j, pg[j].ctypes.data) for j in range(n)], acc.ctypes.data, h1 - h0)
            for j in range(n):
                a1 = np.zeros((1, h1 - h0), np.float32)
                k._k.down(views, h0, h1, [(0, 2, 0.5 + j, pg[j].ctypes.data)], a1.ctypes.data, h1 - h0)
                assert np.array_equal(acc[j].view(np.uint32), a1[0].view(np.uint32)), (n, j, h0, h1)
    x = rng.standard_normal((8, H), dtype=np.float32)
    ids = np.tile(np.array([[2, 0]], np.int32), (8, 1))
    w = rng.random((8, 2)).astype(np.float32)
    y = run_forced(FMT, banks, x, w, ids, mode, tier, **GPT_OSS)
    for t in range(8):
        y1 = run_forced(FMT, banks, x[t:t + 1], w[t:t + 1], ids[t:t + 1], mode, tier, **GPT_OSS)
        assert np.array_equal(y[t].view(np.uint16), y1[0].view(np.uint16)), t
