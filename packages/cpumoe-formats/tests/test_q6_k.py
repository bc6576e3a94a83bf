"""q6_k (GGUF Q6_K) kernels against the float64 reference, every (mode, tier) forced in turn; the reference against
gguf's own dequantizer, the quantizer against a scalar transliteration of ggml's quantize_row_q6_K_ref, the w4a8
activation prep (q4_k's, checked there), edge codes and the tiers documented as bit-identical.

Tolerances
----------
* Whole MoE step, ``TOL = 5e-3``: as q4_k (the bf16 output's 2^-8, the rest modelled exactly by the reference; the
  weights are exact in fp32 here).
* One work item (fp32 output): ``|y - ref| <= 1e-5 * mag``, mag = sum |w a|. w4a8: every int32 lane is exact and
  below 2^24 (converted exactly), then one rounding for d d_a and the FMAs over 3 blocks x 8 lanes (~5 2^-24 of
  mag). native: per sub-block 16 / 8 lanes x K/16 FMA roundings (K <= 768: ~50 2^-24 = 3e-6 of mag).
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
    prep,
    put_fp16,
)

import cpumoe_formats as cf
from cpumoe_formats.formats import q6_k as q6

FMT = "q6_k"
SPEC = cf.get_format(FMT)
TOL = 5e-3
DOT_TOL = 1e-5
QB = q6.BLOCK_BYTES


def dot_ref(banks, e, h0, h1, g, mode):
    dn = SPEC.dequantize(banks)[1][e, h0:h1]
    a = SPEC.act_in(g.astype(np.float64), mode)
    return dn @ a, np.abs(dn) @ np.abs(a)


def code_independent(blk: np.ndarray, e: int) -> int:
    """Element e's 6-bit code, written from ggml's dequantize_row_q6_K loop (is = l / 16; q1..q4 of each l)."""
    h, r = divmod(e, 128)
    g, l = divmod(r, 32)
    ql, qh = blk[64 * h:64 * h + 64], blk[128 + 32 * h:128 + 32 * h + 32]
    lo = [ql[l] & 0xF, ql[l + 32] & 0xF, ql[l] >> 4, ql[l + 32] >> 4][g]
    return int(lo | (((qh[l] >> (2 * g)) & 3) << 4))


# ---- the format against gguf and ggml ---------------------------------------------------------------------------
def test_dequantize_equals_gguf(rng):
    """Random bytes with finite fp16 d of every kind: our float64 weights equal gguf.quants.dequantize's element
    for element (d sc (q - 32) is exact in fp32); the codes equal an element-by-element reading of ggml's loop."""
    blocks = finite_random_blocks(rng, 2048, QB, [208])
    rows = blocks.reshape(64, 32 * QB)
    np.testing.assert_array_equal(q6.decode_blocks(rows), gguf_dequantize(FMT, rows))
    c = q6.codes(blocks[:3])
    for i in range(3):
        assert [code_independent(blocks[i], e) for e in range(256)] == list(c[i])
    ql, qh = q6.pack_codes(c)
    np.testing.assert_array_equal(ql, blocks[:3, 0:128])
    np.testing.assert_array_equal(qh, blocks[:3, 128:192])


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
@pytest.mark.parametrize("case", ["max", "min", "mid", "sc0"])
def test_edge_codes(rng, mode, tier, case):
    """max: every code 63 with scales -128 against activations coded +127 (a pair 2 * 63 * 127, the largest
    products and sums); min: every code 0 (w = -32 d sc) with scales 127; mid: every code 32 (w = 0 exactly);
    sc0: scales all 0 (w = 0 whatever the codes)."""
    E, H, I = 1, 256, 512  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    blk = banks["down"].reshape(E, H, -1, QB)
    L = {"max": 63, "min": 0, "mid": 32, "sc0": None}[case]
    if L is not None:
        blk[..., 0:128], blk[..., 128:192] = q6.pack_codes(np.full(blk.shape[:-1] + (256,), L, np.uint8))
    blk[..., 192:208] = {"max": 0x80, "min": 127, "mid": 5, "sc0": 0}[case]
    g = bf16(np.repeat(rng.uniform(0.5, 2, I // 32), 32) * (1.0 if case == "max" else rng.choice([-1.0, 1.0], I)))
    if case == "max":
        g[:256] = bf16(np.full(256, 1.5))
        q, _ = cf.numerics.int8_blocks(g.astype(np.float64), 256)
        assert np.all(q[0] == 127)
    k = kernel_for(FMT, E, H, I, mode, tier)
    y = down_rows(k, banks, 0, 0, H, g)
    ref, mag = dot_ref(banks, 0, 0, H, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag)
    if case in ("mid", "sc0"):
        assert np.all(ref == 0) and np.all(y == 0)
    else:
        assert np.all(np.abs(ref) > 0)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("kind", ["subnormal", "mixed"])
def test_fp16_scales_subnormal_negative_zero(rng, mode, tier, kind):
    """d subnormal (not flushed), negative, +0 and -0, in both banks: work items and the whole step."""
    E, H, I = 2, 256, 256  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    for name in ("down", "gate_up"):
        blk = banks[name].reshape(E, banks[name].shape[1], -1, QB)
        put_fp16(blk, 208, fp16_bits(rng, kind, blk[..., 0].size, 1e-4))
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
    """d = 0 gate rows (gate = 0, g zero), all-zero and -0 activation blocks: exactly 0 contributions."""
    E, H, I, T = 2, 512, 256, 2  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    gu = banks["gate_up"].reshape(E, 2 * I, -1, QB)
    gu[:, :32, :, 208:210] = 0
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
    """q6_k's w4a8 prep is q4_k's (test_q4_k.py checks it bit for bit against numerics.int8_blocks): same bytes."""
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
    with pytest.raises(ValueError, match=r"q6_k bank 'down'.*expected shape \(2, 256, 420\)"):
        cf.validate_banks(FMT, {"gate_up": banks["gate_up"], "down": banks["down"][:, :, :-1]})
    with pytest.raises(ValueError, match=r"multiples of 256.*Qwen3-30B-A3B.*H=128, I=256"):
        cf.Kernel(FMT, 2, 128, 256)
    with pytest.raises(ValueError, match=r"multiples of 256.*H=256, I=96"):
        cf.quantize(FMT, np.zeros((1, 192, 256), np.float32), np.zeros((1, 256, 96), np.float32))
    with pytest.raises(ValueError, match="finite"):
        q6.quantize_rows(np.full((1, 256), np.nan, np.float32))
    assert SPEC.bytes_per_expert(2048, 768) == 3 * 2048 * 768 // 256 * 210
