"""q4_k (GGUF Q4_K) kernels against the float64 reference, every (mode, tier) forced in turn; the reference against
gguf's own dequantizer, the quantizer against a scalar transliteration of ggml's quantize_row_q4_K_ref, the w4a8
activation prep bit for bit, edge codes and the tiers documented as bit-identical.

Tolerances
----------
* Whole MoE step, ``TOL = 5e-3`` (rel = max|y - ref| / max|ref|): the bf16 output alone errs by up to 2^-8; the
  reference applies every other defined rounding (bf16 x and g, the w4a8 activation codes bit for bit, the weights'
  fp32 rounding as gguf dequantizes them). Left: fp32 accumulation (~1e-6), the w4a8 kernels' exact integer weights
  against the reference's fp32-rounded ones (2^-24 of a weight), g elements on a bf16 rounding boundary (~1e-4).
* One work item (fp32 output): ``|y - ref| <= 1e-5 * mag``, mag = sum (|d sc q| + |dmin m|) |a|, the size of the
  two terms a weight is the difference of (w4a8 folds them separately: S (d d_a) - M (dmin d_a)). w4a8: every int32
  lane is exact (< 2^24, so converted exactly), then one rounding for d d_a, one per FMA over 3 blocks x 2 terms x 8
  lanes: ~12 2^-24 = 7e-7 of mag. native: the weight's one rounding plus K/8 sequential FMAs per lane (K <= 768:
  ~100 2^-24 = 6e-6 of mag).
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
    kquant_block_scalar,
    kquant_mag_terms,
    prep,
    put_fp16,
)

import cpumoe_formats as cf
from cpumoe_formats.formats import q4_k as q4

FMT = "q4_k"
SPEC = cf.get_format(FMT)
TOL = 5e-3
DOT_TOL = 1e-5
QB = q4.BLOCK_BYTES


def dot_ref(banks, e, h0, h1, g, mode):
    dn = SPEC.dequantize(banks)[1][e, h0:h1]
    a = SPEC.act_in(g.astype(np.float64), mode)
    return dn @ a, kquant_mag_terms(FMT, banks["down"][e, h0:h1]) @ np.abs(a)


# ---- the format against gguf and ggml ---------------------------------------------------------------------------
def test_dequantize_equals_gguf(rng):
    """Random bytes with finite fp16 d and dmin of every kind: our float64 weights equal gguf.quants.dequantize's
    fp32 ones element for element (d sc q - dmin m rounded once to fp32 in both)."""
    blocks = finite_random_blocks(rng, 2048, QB, [0, 2])
    rows = blocks.reshape(64, 32 * QB)
    got, want = q4.decode_blocks(rows), gguf_dequantize(FMT, rows)
    np.testing.assert_array_equal(got, want)
    assert np.count_nonzero(got != got.astype(np.float32).astype(np.float64)) == 0


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


# ---- whole MoE steps --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_banks():
    """Random Qwen3-30B-A3B-shaped banks (H=2048, I=768), decoded once for the module; seed printed."""
    seed = int(os.environ.get("CPUMOE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"qwen_banks CPUMOE_TEST_SEED={seed}")
    banks = SPEC.random_banks(4, 2048, 768, np.random.default_rng(seed))
    return banks, SPEC.dequantize(banks)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("T", [1, 3, 8])
def test_qwen3_shape(rng, qwen_banks, mode, tier, T):
    banks, deq = qwen_banks
    x = rng.standard_normal((T, 2048), dtype=np.float32)
    w, ids = routes(rng, T, 8, 4)
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, banks, x, w, ids, mode=mode, dequantized=deq)
    assert rel_err(y, ref) < TOL


@pytest.fixture(scope="module")
def quantized_banks():
    """Banks from cf.quantize of normal weights (E=4, H=256, I=768: one and three blocks a row), quantized once
    (the scale search takes seconds); seed printed."""
    seed = int(os.environ.get("CPUMOE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"quantized_banks CPUMOE_TEST_SEED={seed}")
    r = np.random.default_rng(seed)
    E, H, I = 4, 256, 768  # noqa: E741
    gu = r.standard_normal((E, 2 * I, H)).astype(np.float32) * 0.1
    dn = r.standard_normal((E, H, I)).astype(np.float32) * 0.1
    return cf.quantize(FMT, gu, dn)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "swigluoai"])
@pytest.mark.parametrize("on_input", [False, True])
def test_quantized_activations(rng, quantized_banks, mode, tier, act, on_input):
    banks = quantized_banks
    E, H, K, T = 4, 256, 4, 3
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    kw = dict(activation=act, apply_router_weight_on_input=on_input)
    if act.startswith("swiglu"):
        kw.update(alpha=1.702, limit=1.5)
    y = run_forced(FMT, banks, x, w, ids, mode, tier, **kw)
    assert rel_err(y, cf.reference.moe(FMT, banks, x, w, ids, mode=mode, **kw)) < TOL


# ---- work items -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("h0,h1", [(0, 32), (3, 10), (5, 6), (1, 30)])
def test_down_work_item(rng, mode, tier, h0, h1):
    E, H, I = 2, 256, 768  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    k = kernel_for(FMT, E, H, I, mode, tier)
    g = bf16(rng.standard_normal(I))
    y = down_rows(k, banks, 1, h0, h1, g)
    ref, mag = dot_ref(banks, 1, h0, h1, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_down_several_routes(rng, mode, tier):
    """9 routes of one expert (token blocks and a partial one) against the reference, and each route's row equal
    bit for bit to its lone-route item."""
    E, H, I = 2, 256, 512  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    k = kernel_for(FMT, E, H, I, mode, tier)
    gs = [bf16(rng.standard_normal(I) * s) for s in rng.uniform(0.01, 10, 9)]
    acc = down_routes(k, banks, 1, gs)
    for j, g in enumerate(gs):
        ref, mag = dot_ref(banks, 1, 0, H, g, mode)
        assert np.all(np.abs(acc[j] - ref) <= DOT_TOL * mag)
        np.testing.assert_array_equal(acc[j], down_routes(k, banks, 1, [g])[0])


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_gate_up_split_and_token_groups(rng, mode, tier):
    E, H, I, n = 2, 512, 256, 17  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    k = kernel_for(FMT, E, H, I, mode, tier)
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
@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("case", ["max", "codes0", "sc0", "m0"])
def test_edge_codes(rng, mode, tier, case):
    """max: every code 15, scale and min 63, activations coded +-127 (the largest integers: pair 2 * 15 * 127,
    S per lane 8 * 63 * 4 * 15 * 127); codes0: every code 0 (w = -dmin m only); sc0 / m0: scales or mins all 0."""
    E, H, I = 1, 32 * 8, 512  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    blk = banks["down"].reshape(E, H, -1, QB)
    sc = rng.integers(0, 64, blk.shape[:-1] + (8,)).astype(np.uint8)
    m = rng.integers(0, 64, blk.shape[:-1] + (8,)).astype(np.uint8)
    if case == "max":
        sc[...] = m[...] = 63
        blk[..., 16:] = 0xFF
    elif case == "codes0":
        blk[..., 16:] = 0
    elif case == "sc0":
        sc[...] = 0
    else:
        m[...] = 0
    blk[..., 4:16] = q4.pack_scales_mins(sc, m)
    g = bf16(np.repeat(rng.uniform(0.5, 2, I // 32), 32) * (1.0 if case == "max" else rng.choice([-1.0, 1.0], I)))
    if case == "max":
        g[:256] = bf16(np.full(256, 1.5))
        q, _ = cf.numerics.int8_blocks(g.astype(np.float64), 256)
        assert np.all(q[0] == 127)
    k = kernel_for(FMT, E, H, I, mode, tier)
    y = down_rows(k, banks, 0, 0, H, g)
    ref, mag = dot_ref(banks, 0, 0, H, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag)
    assert np.abs(ref).max() > 0


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("kind", ["subnormal", "mixed"])
def test_fp16_scales_subnormal_negative_zero(rng, mode, tier, kind):
    """d and dmin subnormal (not flushed), negative, +0 and -0, in both banks: work items and the whole step."""
    E, H, I = 2, 256, 256  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    for name in ("down", "gate_up"):
        blk = banks[name].reshape(E, banks[name].shape[1], -1, QB)
        put_fp16(blk, 0, fp16_bits(rng, kind, blk[..., 0].size, 1e-4))
        put_fp16(blk, 2, fp16_bits(rng, kind, blk[..., 0].size, 1e-4))
    k = kernel_for(FMT, E, H, I, mode, tier)
    g = bf16(rng.standard_normal(I))
    y = down_rows(k, banks, 1, 0, H, g)
    ref, mag = dot_ref(banks, 1, 0, H, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag + 1e-45)
    if kind == "subnormal":
        assert np.count_nonzero(y) > H // 2  # tiny, not flushed
    x = rng.standard_normal((3, H), dtype=np.float32)
    w, ids = routes(rng, 3, 2, E)
    yf = run_forced(FMT, banks, x, w, ids, mode, tier)
    assert rel_err(yf, cf.reference.moe(FMT, banks, x, w, ids, mode=mode)) < TOL


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_zero_blocks(rng, mode, tier):
    """d = dmin = 0 gate rows (gate = 0, g zero), all-zero and -0 activation blocks: exactly 0 contributions."""
    E, H, I, T = 2, 512, 256, 2  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    gu = banks["gate_up"].reshape(E, 2 * I, -1, QB)
    gu[:, :32, :, 0:4] = 0
    x = rng.standard_normal((T, H), dtype=np.float32)
    x[:, 256:] = 0
    x[1, :256] = -0.0
    ids = np.array([[0, 1], [1, 1]], np.int32)
    w = np.array([[0.5, 0.25], [1.0, 0.75]], np.float32)
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    assert rel_err(y, cf.reference.moe(FMT, banks, x, w, ids, mode=mode)) < TOL


# ---- the w4a8 activation prep -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tier", [p.values[1] for p in tier_cases(FMT, ["w4a8"])])
def test_prep_act_bit_exact(rng, tier):
    """int8 codes, fp32 d per 256-block and int16 sums of each 16 codes equal numerics.int8_blocks(v, 256) bit for
    bit: an ordinary block, an all-zero one, one with .5 ties (amax 127 * 2^-3), one of bf16 subnormals (1/d
    overflows: codes 0), one holding a NaN and one an inf (d = NaN, codes 0); nothing written past the vector."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
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
    k = kernel_for(FMT, 1, K, K, "w4a8", tier)
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
@pytest.mark.parametrize("tier", ["avxvnni", "avx512vnni"])
@pytest.mark.parametrize("n", [1, 3, 9])
def test_vnni_tiers_equal_avx2_bit_for_bit(rng, tier, n):
    """w4a8: vpdpwssd and vpmaddwd + vpaddd form the same exact int32 lanes, folded in the same order: the VNNI
    tiers' down accumulators and g equal avx2's bit for bit (1, 3 and 9 routes)."""
    if tier not in USABLE or "avx2" not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    E, H, I = 2, 768, 512  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    ka, kb = kernel_for(FMT, E, H, I, "w4a8", tier), kernel_for(FMT, E, H, I, "w4a8", "avx2")
    gs = [bf16(rng.standard_normal(I) * s) for s in rng.uniform(0.01, 10, n)]
    acc_a, acc_b = down_routes(ka, banks, 1, gs), down_routes(kb, banks, 1, gs)
    assert np.count_nonzero(acc_a) > acc_a.size // 2
    np.testing.assert_array_equal(acc_a.view(np.uint32), acc_b.view(np.uint32))
    xs = [bf16(rng.standard_normal(H)) for _ in range(n)]
    np.testing.assert_array_equal(gate_up_item(ka, banks, 0, 0, I, xs), gate_up_item(kb, banks, 0, 0, I, xs))


# ---- schema -----------------------------------------------------------------------------------------------------
def test_schema_errors(rng):
    banks = SPEC.random_banks(2, 256, 512, rng)
    with pytest.raises(ValueError, match=r"q4_k bank 'down'.*expected shape \(2, 256, 288\)"):
        cf.validate_banks(FMT, {"gate_up": banks["gate_up"], "down": banks["down"][:, :, :-1]})
    with pytest.raises(ValueError, match=r"multiples of 256.*Qwen3-30B-A3B.*H=128, I=256"):
        cf.Kernel(FMT, 2, 128, 256)
    with pytest.raises(ValueError, match=r"multiples of 256.*H=256, I=96"):
        cf.quantize(FMT, np.zeros((1, 192, 256), np.float32), np.zeros((1, 256, 96), np.float32))
    with pytest.raises(ValueError, match="finite"):
        q4.quantize_rows(np.full((1, 256), np.nan, np.float32))
    assert SPEC.bytes_per_expert(2048, 768) == 3 * 2048 * 768 // 256 * 144


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_nonfinite_dmin(rng, mode, tier, kind):
    """A NaN or inf in one block's dmin (the robustness suite's site search poisons d, the first fp16 of a block), the
    block's mins all 0 (a kernel that skipped a zero mins term would lose it): the output rows of the tokens routed
    to that expert are non-finite where the reference's are (NaN exactly where its are, for NaN), every other row
    equals the clean run bit for bit."""
    E, H, I = 3, 256, 256  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((4, H)).astype(np.float32)
    ids = np.array([[0, 1], [2, 0], [1, 1], [2, -1]], np.int32)
    w = rng.random((4, 2), dtype=np.float32) + np.float32(0.25)
    clean = run_forced(FMT, banks, x, w, ids, mode, tier)
    bad = {k: np.array(v) for k, v in banks.items()}
    blk = bad["gate_up"][1, 5, :144]  # gate row 5's first block: mins all 0, so M = 0 and only NaN * 0 carries it
    sc, _ = q4.scales_mins(blk[4:16])
    blk[4:16] = q4.pack_scales_mins(sc, np.zeros(8, np.uint8))
    blk[2:4] = np.array([np.nan if kind == "nan" else np.inf], "<f2").view(np.uint8)
    k = kernel_for(FMT, E, H, I, mode, tier)
    y = k.forward(bad, x, w, ids).astype(np.float64)
    with np.errstate(all="ignore"):
        ref = cf.numerics.round_bf16(cf.reference.moe(FMT, bad, x, w, ids, mode=mode))
    hit = [0, 2]  # the tokens routed to expert 1
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(ref))
    if kind == "nan":
        np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    assert not np.isfinite(y[hit]).all()
    np.testing.assert_array_equal(y[[1, 3]], clean[[1, 3]])
