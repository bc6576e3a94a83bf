"""The K-quant kernels (q4_k, q5_k, q6_k: GGUF Q4_K, Q5_K, Q6_K) against the float64 reference, one module
parametrized over the formats, every (mode, tier) forced in turn: the reference against gguf's own dequantizer on
random bytes with finite scales, whole MoE steps, work items of ragged sizes, edge codes, fp16 scales of every kind,
NaN / inf in d and dmin propagating as the reference's, the w4a8 activation prep bit for bit and the tiers
documented as bit-identical. The quantizers and each format's packing are checked in test_q4_k.py, test_q5_k.py and
test_q6_k.py.

Tolerances
----------
* Whole MoE step, ``TOL = 5e-3`` (rel = max|y - ref| / max|ref|): the bf16 output alone errs by up to 2^-8; the
  reference applies every other defined rounding (bf16 x and g, the w4a8 activation codes bit for bit, the weights'
  fp32 rounding as gguf dequantizes them). Left: fp32 accumulation (~1e-6), the w4a8 kernels' exact integer weights
  against the reference's fp32-rounded ones (2^-24 of a weight), g elements on a bf16 rounding boundary (~1e-4).
* One work item (fp32 output): ``|y - ref| <= 1e-5 * mag``.
  q4_k / q5_k: mag = sum (|d sc q| + |dmin m|) |a|, the size of the two terms a weight is the difference of (w4a8
  folds them separately: S (d d_a) - M (dmin d_a)). w4a8: every int32 lane is exact (< 8 * 63 * 4 * 31 * 127 <
  2^24, converted exactly), then one rounding for d d_a, one per FMA over 3 blocks x 2 terms x 8 lanes: ~12 2^-24 =
  7e-7 of mag. native: the weight's one rounding plus K/8 sequential FMAs per lane (K <= 768: ~100 2^-24 = 6e-6).
  q6_k: mag = sum |w a| (its weights are exact in fp32). w4a8: exact int32 lanes below 2^24, one rounding for d d_a
  and the FMAs over 3 blocks x 8 lanes (~5 2^-24 of mag). native: per sub-block 16 / 8 lanes x K/16 FMA roundings
  (K <= 768: ~50 2^-24 = 3e-6 of mag).
"""
import os

import numpy as np
import pytest
from conftest import USABLE, rel_err, routes, run_forced, tier_cases
from gguf_helpers import (
    bf16,
    down_routes,
    down_rows,
    finite_random_blocks,
    fp16_bits,
    gate_up_item,
    gguf_dequantize,
    kernel_for,
    kquant_mag_terms,
    prep,
    put_fp16,
)

import cpumoe_formats as cf
from cpumoe_formats.formats import q4_k as q4
from cpumoe_formats.formats import q5_k as q5
from cpumoe_formats.formats import q6_k as q6

FORMATS = ["q4_k", "q5_k", "q6_k"]
MOD = {"q4_k": q4, "q5_k": q5, "q6_k": q6}
# byte offsets of each block's fp16 scales: d and dmin (q4_k, q5_k), d (q6_k)
FP16 = {"q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}
TOL = 5e-3
DOT_TOL = 1e-5


def spec(fmt):
    return cf.get_format(fmt)


def block_bytes(fmt):
    return MOD[fmt].BLOCK_BYTES


def cases(modes=None):
    """pytest params (fmt, mode, tier) for every kernel of every K-quant (conftest.tier_cases per format)."""
    return [pytest.param(f, *p.values, id=f"{f}-{p.id}", marks=p.marks) for f in FORMATS for p in tier_cases(f, modes)]


def dot_ref(fmt, banks, e, h0, h1, g, mode):
    """float64 reference of down_rows and the magnitude its tolerance scales with (module docstring)."""
    dn = spec(fmt).dequantize(banks)[1][e, h0:h1]
    a = spec(fmt).act_in(g.astype(np.float64), mode)
    mag = np.abs(dn) if fmt == "q6_k" else kquant_mag_terms(fmt, banks["down"][e, h0:h1])
    return dn @ a, mag @ np.abs(a)


def zero_scales(fmt, blk):
    """Set the fp16 scale fields of blocks [..., block bytes] to +0 (every weight 0)."""
    for off in FP16[fmt]:
        blk[..., off:off + 2] = 0


# ---- the format against gguf ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_equals_gguf(rng, fmt):
    """Random bytes with finite fp16 scales of every kind (normal of any exponent, subnormal, +-0): our float64
    weights equal gguf.quants.dequantize's fp32 ones element for element (one fp32 rounding in both; q6_k's are
    exact) and are fp32 values."""
    QB = block_bytes(fmt)
    blocks = finite_random_blocks(rng, 2048, QB, FP16[fmt])
    rows = blocks.reshape(64, 32 * QB)
    got, want = MOD[fmt].decode_blocks(rows), gguf_dequantize(fmt, rows)
    np.testing.assert_array_equal(got, want)
    assert np.count_nonzero(got != got.astype(np.float32).astype(np.float64)) == 0


# ---- whole MoE steps --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_banks():
    """Random Qwen3-30B-A3B-shaped banks (H=2048, I=768) per format, made and decoded once; seed printed."""
    seed = int(os.environ.get("CPUMOE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"qwen_banks CPUMOE_TEST_SEED={seed}")
    made = {}

    def get(fmt):
        if fmt not in made:
            banks = spec(fmt).random_banks(4, 2048, 768, np.random.default_rng(seed))
            made[fmt] = banks, spec(fmt).dequantize(banks)
        return made[fmt]

    return get


@pytest.mark.parametrize("fmt,mode,tier", cases())
@pytest.mark.parametrize("T", [1, 3, 8])
def test_qwen3_shape(rng, qwen_banks, fmt, mode, tier, T):
    banks, deq = qwen_banks(fmt)
    x = rng.standard_normal((T, 2048), dtype=np.float32)
    w, ids = routes(rng, T, 8, 4)
    y = run_forced(fmt, banks, x, w, ids, mode, tier)
    ref = cf.reference.moe(fmt, banks, x, w, ids, mode=mode, dequantized=deq)
    assert rel_err(y, ref) < TOL


@pytest.fixture(scope="module")
def quantized_banks():
    """Banks from cf.quantize of normal weights per format (E=4, H=256, I=768: one and three blocks a row), quantized
    once (the scale search takes seconds); seed printed."""
    seed = int(os.environ.get("CPUMOE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"quantized_banks CPUMOE_TEST_SEED={seed}")
    made = {}

    def get(fmt):
        if fmt not in made:
            r = np.random.default_rng(seed)
            E, H, I = 4, 256, 768  # noqa: E741
            gu = r.standard_normal((E, 2 * I, H)).astype(np.float32) * 0.1
            dn = r.standard_normal((E, H, I)).astype(np.float32) * 0.1
            made[fmt] = cf.quantize(fmt, gu, dn)
        return made[fmt]

    return get


@pytest.mark.parametrize("fmt,mode,tier", cases())
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "swigluoai"])
@pytest.mark.parametrize("on_input", [False, True])
def test_quantized_activations(rng, quantized_banks, fmt, mode, tier, act, on_input):
    banks = quantized_banks(fmt)
    E, H, K, T = 4, 256, 4, 3
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    kw = dict(activation=act, apply_router_weight_on_input=on_input)
    if act.startswith("swiglu"):
        kw.update(alpha=1.702, limit=1.5)
    y = run_forced(fmt, banks, x, w, ids, mode, tier, **kw)
    assert rel_err(y, cf.reference.moe(fmt, banks, x, w, ids, mode=mode, **kw)) < TOL


# ---- work items -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,mode,tier", cases())
@pytest.mark.parametrize("h0,h1", [(0, 32), (3, 10), (5, 6), (1, 30)])
def test_down_work_item(rng, fmt, mode, tier, h0, h1):
    E, H, I = 2, 256, 768  # noqa: E741
    banks = spec(fmt).random_banks(E, H, I, rng)
    k = kernel_for(fmt, E, H, I, mode, tier)
    g = bf16(rng.standard_normal(I))
    y = down_rows(k, banks, 1, h0, h1, g)
    ref, mag = dot_ref(fmt, banks, 1, h0, h1, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag)


@pytest.mark.parametrize("fmt,mode,tier", cases())
def test_down_several_routes(rng, fmt, mode, tier):
    """9 routes of one expert (token blocks and a partial one) against the reference, and each route's row equal
    bit for bit to its lone-route item."""
    E, H, I = 2, 256, 512  # noqa: E741
    banks = spec(fmt).random_banks(E, H, I, rng)
    k = kernel_for(fmt, E, H, I, mode, tier)
    gs = [bf16(rng.standard_normal(I) * s) for s in rng.uniform(0.01, 10, 9)]
    acc = down_routes(k, banks, 1, gs)
    for j, g in enumerate(gs):
        ref, mag = dot_ref(fmt, banks, 1, 0, H, g, mode)
        assert np.all(np.abs(acc[j] - ref) <= DOT_TOL * mag)
        np.testing.assert_array_equal(acc[j], down_routes(k, banks, 1, [g])[0])


@pytest.mark.parametrize("fmt,mode,tier", cases())
def test_gate_up_split_and_token_groups(rng, fmt, mode, tier):
    E, H, I, n = 2, 512, 256, 17  # noqa: E741
    banks = spec(fmt).random_banks(E, H, I, rng)
    k = kernel_for(fmt, E, H, I, mode, tier)
    xs = [bf16(rng.standard_normal(H)) for _ in range(n)]
    whole = gate_up_item(k, banks, 1, 0, I, xs)
    assert not (whole == 0x7FC1).any()
    for i0, i1 in [(0, 16), (3, 40), (17, 256), (5, 6)]:
        part = gate_up_item(k, banks, 1, i0, i1, xs)
        np.testing.assert_array_equal(part[:, i0:i1], whole[:, i0:i1], err_msg=f"rows [{i0}, {i1})")
        assert (part[:, :i0] == 0x7FC1).all() and (part[:, i1:] == 0x7FC1).all(), "wrote outside its rows"
    for t in (0, 15, 16):
        np.testing.assert_array_equal(gate_up_item(k, banks, 1, 0, I, [xs[t]])[0], whole[t], err_msg=f"token {t}")


# ---- edge codes -------------------------------------------------------------------------------------------------
def _edge_mins(fmt, blk, case, rng):
    """q4_k / q5_k. max: every code 15 / 31, scale and min 63 (the largest integers against codes +127: a pair
    2 * 31 * 127, S per lane 8 * 63 * 4 * 31 * 127); codes0: every code 0 (w = -dmin m only); fifth (q5_k): random
    nibbles with every fifth bit set (codes 16..31: a kernel that drops the fifth bit is off by 16 d sc); sc0 / m0:
    scales or mins all 0."""
    sc = rng.integers(0, 64, blk.shape[:-1] + (8,)).astype(np.uint8)
    m = rng.integers(0, 64, blk.shape[:-1] + (8,)).astype(np.uint8)
    if case == "max":
        sc[...] = m[...] = 63
        blk[..., 16:] = 0xFF
    elif case == "codes0":
        blk[..., 16:] = 0
    elif case == "fifth":
        blk[..., 16:48] = 0xFF
    elif case == "sc0":
        sc[...] = 0
    else:
        m[...] = 0
    blk[..., 4:16] = q4.pack_scales_mins(sc, m)
    if fmt == "q5_k" and case == "max":
        assert np.all(q5.codes(blk) == 31)


def _edge_q6(fmt, blk, case, rng):
    """q6_k. max: every code 63 with scales -128 against activations coded +127 (a pair 2 * 63 * 127, the largest
    products and sums); min: every code 0 (w = -32 d sc) with scales 127; mid: every code 32 (w = 0 exactly); sc0:
    scales all 0 (w = 0 whatever the codes)."""
    L = {"max": 63, "min": 0, "mid": 32, "sc0": None}[case]
    if L is not None:
        blk[..., 0:128], blk[..., 128:192] = q6.pack_codes(np.full(blk.shape[:-1] + (256,), L, np.uint8))
    blk[..., 192:208] = {"max": 0x80, "min": 127, "mid": 5, "sc0": 0}[case]


EDGE = [("q4_k", c) for c in ["max", "codes0", "sc0", "m0"]] + \
       [("q5_k", c) for c in ["max", "codes0", "fifth", "sc0", "m0"]] + \
       [("q6_k", c) for c in ["max", "min", "mid", "sc0"]]
ZERO_EDGES = {("q6_k", "mid"), ("q6_k", "sc0")}  # every weight exactly 0


@pytest.mark.parametrize("fmt,mode,tier,case", [
    pytest.param(f, *p.values, c, id=f"{f}-{p.id}-{c}", marks=p.marks) for f, c in EDGE for p in tier_cases(f)])
def test_edge_codes(rng, fmt, mode, tier, case):
    """The formats' extreme codes and scales (_edge_mins, _edge_q6) against the reference: within tolerance, and
    exactly 0 where every weight is."""
    E, H, I = 1, 256, 512  # noqa: E741
    banks = spec(fmt).random_banks(E, H, I, rng)
    blk = banks["down"].reshape(E, H, -1, block_bytes(fmt))
    (_edge_q6 if fmt == "q6_k" else _edge_mins)(fmt, blk, case, rng)
    g = bf16(np.repeat(rng.uniform(0.5, 2, I // 32), 32) * (1.0 if case == "max" else rng.choice([-1.0, 1.0], I)))
    if case == "max":
        g[:256] = bf16(np.full(256, 1.5))
        q, _ = cf.numerics.int8_blocks(g.astype(np.float64), 256)
        assert np.all(q[0] == 127)
    k = kernel_for(fmt, E, H, I, mode, tier)
    y = down_rows(k, banks, 0, 0, H, g)
    ref, mag = dot_ref(fmt, banks, 0, 0, H, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag)
    if (fmt, case) in ZERO_EDGES:
        assert np.all(ref == 0) and np.all(y == 0)
    elif fmt == "q6_k":
        assert np.all(np.abs(ref) > 0)
    else:
        assert np.abs(ref).max() > 0


@pytest.mark.parametrize("fmt,mode,tier", cases())
@pytest.mark.parametrize("kind", ["subnormal", "mixed"])
def test_fp16_scales_subnormal_negative_zero(rng, fmt, mode, tier, kind):
    """d (and dmin) subnormal (not flushed), negative, +0 and -0, in both banks: work items and the whole step."""
    E, H, I = 2, 256, 256  # noqa: E741
    banks = spec(fmt).random_banks(E, H, I, rng)
    for name in ("down", "gate_up"):
        blk = banks[name].reshape(E, banks[name].shape[1], -1, block_bytes(fmt))
        for off in FP16[fmt]:
            put_fp16(blk, off, fp16_bits(rng, kind, blk[..., 0].size, 1e-4))
    k = kernel_for(fmt, E, H, I, mode, tier)
    g = bf16(rng.standard_normal(I))
    y = down_rows(k, banks, 1, 0, H, g)
    ref, mag = dot_ref(fmt, banks, 1, 0, H, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag + 1e-45)
    if kind == "subnormal":
        assert np.count_nonzero(y) > H // 2  # tiny, not flushed
    x = rng.standard_normal((3, H), dtype=np.float32)
    w, ids = routes(rng, 3, 2, E)
    yf = run_forced(fmt, banks, x, w, ids, mode, tier)
    assert rel_err(yf, cf.reference.moe(fmt, banks, x, w, ids, mode=mode)) < TOL


@pytest.mark.parametrize("fmt,mode,tier", cases())
def test_zero_blocks(rng, fmt, mode, tier):
    """Scales 0 in 32 gate rows (gate = 0, g zero), all-zero and -0 activation blocks: exactly 0 contributions."""
    E, H, I, T = 2, 512, 256, 2  # noqa: E741
    banks = spec(fmt).random_banks(E, H, I, rng)
    gu = banks["gate_up"].reshape(E, 2 * I, -1, block_bytes(fmt))
    zero_scales(fmt, gu[:, :32])
    x = rng.standard_normal((T, H), dtype=np.float32)
    x[:, 256:] = 0
    x[1, :256] = -0.0
    ids = np.array([[0, 1], [1, 1]], np.int32)
    w = np.array([[0.5, 0.25], [1.0, 0.75]], np.float32)
    y = run_forced(fmt, banks, x, w, ids, mode, tier)
    assert rel_err(y, cf.reference.moe(fmt, banks, x, w, ids, mode=mode)) < TOL


# ---- non-finite scales ------------------------------------------------------------------------------------------
NONFINITE = [("q4_k", "d"), ("q4_k", "dmin"), ("q5_k", "d"), ("q5_k", "dmin"), ("q6_k", "d")]


@pytest.mark.parametrize("fmt,mode,tier,field", [
    pytest.param(f, *p.values, fld, id=f"{f}-{p.id}-{fld}", marks=p.marks) for f, fld in NONFINITE
    for p in tier_cases(f)])
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_nonfinite_d_dmin(rng, fmt, mode, tier, field, kind):
    """A NaN or an inf in one block's d (that block's scales all 0) or dmin (its mins all 0): a kernel that skipped
    a zero term would lose it, as inf * 0 is NaN. The output rows of the tokens routed to that expert are
    non-finite where the reference's are (NaN exactly where its are, for NaN); every other row equals the clean run
    bit for bit."""
    E, H, I = 3, 256, 256  # noqa: E741
    QB = block_bytes(fmt)
    banks = spec(fmt).random_banks(E, H, I, rng)
    x = rng.standard_normal((4, H)).astype(np.float32)
    ids = np.array([[0, 1], [2, 0], [1, 1], [2, -1]], np.int32)
    w = rng.random((4, 2), dtype=np.float32) + np.float32(0.25)
    clean = run_forced(fmt, banks, x, w, ids, mode, tier)
    bad = {k: np.array(v) for k, v in banks.items()}
    blk = bad["gate_up"][1, 5, :QB]  # gate row 5's first block
    if fmt == "q6_k":
        blk[192:208] = 0
        off = 208
    else:
        sc, m = q4.scales_mins(blk[4:16])
        zero = np.zeros(8, np.uint8)
        blk[4:16] = q4.pack_scales_mins(zero, m) if field == "d" else q4.pack_scales_mins(sc, zero)
        off = 0 if field == "d" else 2
    blk[off:off + 2] = np.array([np.nan if kind == "nan" else np.inf], "<f2").view(np.uint8)
    k = kernel_for(fmt, E, H, I, mode, tier)
    y = k.forward(bad, x, w, ids).astype(np.float64)
    with np.errstate(all="ignore"):
        ref = cf.numerics.round_bf16(cf.reference.moe(fmt, bad, x, w, ids, mode=mode))
    hit = [0, 2]  # the tokens routed to expert 1
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(ref))
    if kind == "nan":
        np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    assert not np.isfinite(y[hit]).all()
    np.testing.assert_array_equal(y[[1, 3]], clean[[1, 3]])


# ---- the w4a8 activation prep -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,tier", [pytest.param(f, p.values[1], id=f"{f}-{p.values[1]}", marks=p.marks)
                                      for f in FORMATS for p in tier_cases(f, ["w4a8"])])
def test_prep_act_bit_exact(rng, fmt, tier):
    """int8 codes, fp32 d per 256-block and int16 sums of each 16 codes equal numerics.int8_blocks(v, 256) bit for
    bit: an ordinary block, an all-zero one, one with .5 ties (amax 127 * 2^-3), one of bf16 subnormals (1/d
    overflows: codes 0), one holding a NaN and one an inf (d = NaN, codes 0); nothing written past the vector."""
    K = 6 * 256
    v = rng.standard_normal(K).astype(np.float32)
    v[256:512] = 0.0
    s = np.float32(2.0 ** -3)
    v[512:768] = (np.arange(256) % 64 - 32 + 0.5).astype(np.float32) * s
    v[512] = 127 * s
    v[768:1024] = rng.choice([-1.0, 1.0], 256) * rng.uniform(1, 2, 256) * np.float32(2.0 ** -133)
    v[1100] = np.nan
    v[1400] = -np.inf
    vb = bf16(v)
    k = kernel_for(fmt, 1, K, K, "w4a8", tier)
    assert k._k.act_bytes(K) == K + 4 * K // 256 + 2 * K // 16
    buf = prep(k, vb)
    q = buf[:K].view(np.int8)
    d = buf[K:K + 4 * K // 256].view(np.float32)
    bs = buf[K + 4 * K // 256:K + 4 * K // 256 + 2 * K // 16].view(np.int16)
    qn, dn = cf.numerics.int8_blocks(vb.astype(np.float64), 256)
    np.testing.assert_array_equal(q, qn.reshape(-1))
    np.testing.assert_array_equal(d.view(np.uint32), dn.view(np.uint32))
    np.testing.assert_array_equal(bs, qn.reshape(-1, 16).astype(np.int32).sum(axis=1))
    assert np.isnan(d[4]) and np.isnan(d[5]) and not np.isnan(d[:4]).any() and (q[1024:] == 0).all()
    assert (buf[K + 4 * K // 256 + 2 * K // 16:] == 0xAB).all()


# ---- tiers documented as bit-identical --------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tier", ["avxvnni", "avx512vnni"])
@pytest.mark.parametrize("n", [1, 3, 9])
def test_vnni_tiers_equal_avx2_bit_for_bit(rng, fmt, tier, n):
    """w4a8: vpdpwssd and vpmaddwd + vpaddd form the same exact int32 lanes, folded in the same order: the VNNI
    tiers' down accumulators and g equal avx2's bit for bit (1, 3 and 9 routes)."""
    if tier not in USABLE or "avx2" not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    E, H, I = 2, 768, 512  # noqa: E741
    banks = spec(fmt).random_banks(E, H, I, rng)
    ka, kb = kernel_for(fmt, E, H, I, "w4a8", tier), kernel_for(fmt, E, H, I, "w4a8", "avx2")
    gs = [bf16(rng.standard_normal(I) * s) for s in rng.uniform(0.01, 10, n)]
    acc_a, acc_b = down_routes(ka, banks, 1, gs), down_routes(kb, banks, 1, gs)
    assert np.count_nonzero(acc_a) > acc_a.size // 2
    np.testing.assert_array_equal(acc_a.view(np.uint32), acc_b.view(np.uint32))
    xs = [bf16(rng.standard_normal(H)) for _ in range(n)]
    np.testing.assert_array_equal(gate_up_item(ka, banks, 0, 0, I, xs), gate_up_item(kb, banks, 0, 0, I, xs))


# ---- schema -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_schema_errors(rng, fmt):
    QB = block_bytes(fmt)
    banks = spec(fmt).random_banks(2, 256, 512, rng)
    with pytest.raises(ValueError, match=rf"{fmt} bank 'down'.*expected shape \(2, 256, {2 * QB}\)"):
        cf.validate_banks(fmt, {"gate_up": banks["gate_up"], "down": banks["down"][:, :, :-1]})
    with pytest.raises(ValueError, match=r"multiples of 256.*Qwen3-30B-A3B.*H=128, I=256"):
        cf.Kernel(fmt, 2, 128, 256)
    with pytest.raises(ValueError, match=r"multiples of 256.*H=256, I=96"):
        cf.quantize(fmt, np.zeros((1, 192, 256), np.float32), np.zeros((1, 256, 96), np.float32))
    with pytest.raises(ValueError, match="finite"):
        MOD[fmt].quantize_rows(np.full((1, 256), np.nan, np.float32))
    assert spec(fmt).bytes_per_expert(2048, 768) == 3 * 2048 * 768 // 256 * QB
