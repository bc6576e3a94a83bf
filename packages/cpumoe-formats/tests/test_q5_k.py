"""q5_k (GGUF Q5_K) kernels against the float64 reference, every (mode, tier) forced in turn; the reference against
gguf's own dequantizer, the quantizer against a scalar transliteration of ggml's quantize_row_q5_K_ref, the w4a8
activation prep (q4_k's, checked there), edge codes, non-finite d and dmin, and the tiers documented as
bit-identical.

Tolerances
----------
* Whole MoE step, ``TOL = 5e-3``: as q4_k (the bf16 output alone errs by up to 2^-8; the reference applies every
  other defined rounding). Left: fp32 accumulation (~1e-6), the w4a8 kernels' exact integer weights against the
  reference's fp32-rounded ones (2^-24 of a weight), g elements on a bf16 rounding boundary (~1e-4).
* One work item (fp32 output): ``|y - ref| <= 1e-5 * mag``, mag = sum (|d sc q| + |dmin m|) |a|, as q4_k: w4a8's
  int32 lanes are exact (< 8 * 63 * 4 * 31 * 127 < 2^24, converted exactly), then one rounding for d d_a, one per
  FMA over 3 blocks x 2 terms x 8 lanes (~12 2^-24 = 7e-7 of mag); native: the weight's one rounding plus K/8
  sequential FMAs per lane (K <= 768: ~100 2^-24 = 6e-6 of mag).
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
from cpumoe_formats.formats import q5_k as q5

FMT = "q5_k"
SPEC = cf.get_format(FMT)
TOL = 5e-3
DOT_TOL = 1e-5
QB = q5.BLOCK_BYTES


def dot_ref(banks, e, h0, h1, g, mode):
    dn = SPEC.dequantize(banks)[1][e, h0:h1]
    a = SPEC.act_in(g.astype(np.float64), mode)
    return dn @ a, kquant_mag_terms(FMT, banks["down"][e, h0:h1]) @ np.abs(a)


def code_independent(blk: np.ndarray, e: int) -> int:
    """Element e's 5-bit code, written from ggml's dequantize_row_q5_K loop (ql += 32 and u1, u2 <<= 2 per 64)."""
    n, r = divmod(e, 64)
    hi, l = divmod(r, 32)
    ql, qh = blk[48 + 32 * n + l], blk[16 + l]
    u = 1 << (2 * n + hi)
    return int((ql >> 4 if hi else ql & 0xF) + (16 if qh & u else 0))


# ---- the format against gguf and ggml ---------------------------------------------------------------------------
def test_dequantize_equals_gguf(rng):
    """Random bytes with finite fp16 d and dmin of every kind: our float64 weights equal gguf.quants.dequantize's
    fp32 ones element for element (d sc q - dmin m rounded once to fp32 in both); the codes equal an
    element-by-element reading of ggml's loop and pack back to the bytes."""
    blocks = finite_random_blocks(rng, 2048, QB, [0, 2])
    rows = blocks.reshape(64, 32 * QB)
    got, want = q5.decode_blocks(rows), gguf_dequantize(FMT, rows)
    np.testing.assert_array_equal(got, want)
    assert np.count_nonzero(got != got.astype(np.float32).astype(np.float64)) == 0
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
@pytest.mark.parametrize("case", ["max", "codes0", "fifth", "sc0", "m0"])
def test_edge_codes(rng, mode, tier, case):
    """max: every code 31, scale and min 63, activations coded +-127 (the largest integers: pair 2 * 31 * 127, S per
    lane 8 * 63 * 4 * 31 * 127); codes0: every code 0 (w = -dmin m only); fifth: random nibbles with every fifth
    bit set (codes 16..31: a kernel that drops the fifth bit is off by 16 d sc per element); sc0 / m0: scales or
    mins all 0."""
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
    elif case == "fifth":
        blk[..., 16:48] = 0xFF
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
        assert np.all(q5.codes(blk) == 31)
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
def test_prep_act_is_q4_k_s(rng, tier):
    """q5_k's w4a8 prep is q4_k's (test_q4_k.py checks it bit for bit against numerics.int8_blocks): same bytes."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 512
    v = bf16(rng.standard_normal(K))
    v[300] = np.nan
    a, b = prep(kernel_for(FMT, 1, K, K, "w4a8", tier), v), prep(kernel_for("q4_k", 1, K, K, "w4a8", tier), v)
    np.testing.assert_array_equal(a, b)


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
    with pytest.raises(ValueError, match=r"q5_k bank 'down'.*expected shape \(2, 256, 352\)"):
        cf.validate_banks(FMT, {"gate_up": banks["gate_up"], "down": banks["down"][:, :, :-1]})
    with pytest.raises(ValueError, match=r"multiples of 256.*Qwen3-30B-A3B.*H=128, I=256"):
        cf.Kernel(FMT, 2, 128, 256)
    with pytest.raises(ValueError, match=r"multiples of 256.*H=256, I=96"):
        cf.quantize(FMT, np.zeros((1, 192, 256), np.float32), np.zeros((1, 256, 96), np.float32))
    with pytest.raises(ValueError, match="q5_k rows must be a multiple of 256 long, got 96"):
        q5.quantize_rows(np.zeros((1, 96), np.float32))
    with pytest.raises(ValueError, match="q5_k quantize: the weights must be finite"):
        q5.quantize_rows(np.full((1, 256), np.nan, np.float32))
    assert SPEC.bytes_per_expert(2048, 768) == 3 * 2048 * 768 // 256 * 176


# ---- non-finite scales ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("field", ["d", "dmin"])
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_nonfinite_d_dmin(rng, mode, tier, field, kind):
    """A NaN or an inf in one block's d (that block's scales all 0) or dmin (its mins all 0): a kernel that skipped
    a zero term would lose it, as inf * 0 is NaN. The output rows of the tokens routed to that expert are
    non-finite where the reference's are (NaN exactly where its are, for NaN); every other row equals the clean run
    bit for bit."""
    E, H, I = 3, 256, 256  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((4, H)).astype(np.float32)
    ids = np.array([[0, 1], [2, 0], [1, 1], [2, -1]], np.int32)
    w = rng.random((4, 2), dtype=np.float32) + np.float32(0.25)
    clean = run_forced(FMT, banks, x, w, ids, mode, tier)
    bad = {k: np.array(v) for k, v in banks.items()}
    blk = bad["gate_up"][1, 5, :QB]  # gate row 5's first block
    sc, m = q4.scales_mins(blk[4:16])
    zero = np.zeros(8, np.uint8)
    blk[4:16] = q4.pack_scales_mins(zero, m) if field == "d" else q4.pack_scales_mins(sc, zero)
    off = 0 if field == "d" else 2
    blk[off:off + 2] = np.array([np.nan if kind == "nan" else np.inf], "<f2").view(np.uint8)
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
