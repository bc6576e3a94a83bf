"""q8_0 (GGUF Q8_0) kernels against the float64 reference, every (mode, tier) forced in turn; the reference
against gguf's own dequantizer, the quantizer against gguf's (ggml's quantize_row_q8_0_ref), the w4a8 activation
prep bit for bit, edge codes and the tiers documented as bit-identical.

Tolerances
----------
* Whole MoE step, ``TOL = 5e-3`` (rel = max|y - ref| / max|ref|): the bf16 output alone errs by up to 2^-8 = 3.9e-3
  of an element; the reference applies every other defined rounding (bf16 x and g, and in w4a8 the Q8_0 activation
  codes, reproduced bit for bit by ``act_in``, see test_prep_act_bit_exact). What is left is fp32 accumulation
  (~1e-6) and g elements on a bf16 rounding boundary (one bf16 ulp, moving a code by 1: ~1e-4 of max|y|).
* One work item (the down pass called directly, fp32 output): ``|y - ref| <= 1e-5 * sum|w*a|``. Every int32 lane
  is an exact sum of 4 (w4a8) products; fp32 rounds the block scale product, the lane conversions (exact below
  2^24) and the sums over <= K/32 blocks x 8 lanes: for K <= 736 the worst case is ~(K/32 + 4) 2^-24 = 1.6e-6 of
  sum|w*a|. Native sums 32 fp32 products per block (<= 35 2^-24 = 2.1e-6). The edge constructions move y by far
  more than 1e-5 of sum|w*a|.
"""
import os

import numpy as np
import pytest
from conftest import USABLE, int8_blocks_slow, rel_err, routes, run_forced, tier_cases
from gguf_helpers import (
    bf16,
    dot_ref,
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
from cpumoe_formats.formats import q8_0 as q8

FMT = "q8_0"
SPEC = cf.get_format(FMT)
TOL = 5e-3
DOT_TOL = 1e-5


# ---- the format against gguf ------------------------------------------------------------------------------------
def test_dequantize_equals_gguf(rng):
    """Random bytes with finite fp16 d of every kind (normal, subnormal, +-0): our float64 weights equal
    gguf.quants.dequantize's (whose fp32 q * d is exact) element for element."""
    blocks = finite_random_blocks(rng, 4096, q8.BLOCK_BYTES, [0])
    rows = blocks.reshape(64, 64 * q8.BLOCK_BYTES)
    np.testing.assert_array_equal(q8.decode_blocks(rows), gguf_dequantize(FMT, rows))


def test_quantizer_equals_gguf(rng):
    """quantize_rows gives gguf.quants.quantize's bytes (ggml's quantize_row_q8_0_ref, bit for bit in gguf) on
    normal rows, rows with exact .5 products (roundf: half away from zero), all-zero and tiny blocks."""
    gq = pytest.importorskip("gguf.quants")
    import gguf

    x = rng.standard_normal((48, 256)).astype(np.float32) * rng.uniform(1e-3, 10, (48, 1)).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = np.float32(1e-30)  # d underflows fp16 to 0
    x[2, :32] = np.arange(32, dtype=np.float32) - 15.5  # amax 15.5 -> 127 / 15.5 * x
    x[3, 0] = 127.0  # amax 127: id = 1 and x = k + 1/2 lands on .5 exactly
    x[3, 1:32] = np.arange(31, dtype=np.float32) - 15 + 0.5
    want = gq.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(q8.quantize_rows(x), want)
    assert set(np.unique(q8.quantize_rows(x[3:4])[0, 2:34].view(np.int8))) >= {-15, 16}  # -14.5 -> -15, 15.5 -> 16


# ---- whole MoE steps --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_banks():
    """Random Qwen3-30B-A3B-shaped banks (H=2048, I=768), decoded once for the module; seed printed."""
    seed = int(os.environ.get("CPUMOE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"qwen_banks CPUMOE_TEST_SEED={seed}")
    E, H, I = 4, 2048, 768  # noqa: E741
    banks = SPEC.random_banks(E, H, I, np.random.default_rng(seed))
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


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "swigluoai"])
@pytest.mark.parametrize("on_input", [False, True])
def test_ragged_activations(rng, mode, tier, act, on_input):
    E, H, I, K, T = 5, 96, 160, 4, 3  # noqa: E741 - 3 and 5 blocks: a 4-block step and 1-3 lone blocks
    gu = rng.standard_normal((E, 2 * I, H)).astype(np.float32) * 0.1
    dn = rng.standard_normal((E, H, I)).astype(np.float32) * 0.1
    banks = cf.quantize(FMT, gu, dn)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    kw = dict(activation=act, apply_router_weight_on_input=on_input)
    if act.startswith("swiglu"):
        kw.update(alpha=1.702, limit=1.5)
    y = run_forced(FMT, banks, x, w, ids, mode, tier, **kw)
    ref = cf.reference.moe(FMT, banks, x, w, ids, mode=mode, **kw)
    assert rel_err(y, ref) < TOL


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("H,I", [(32, 32), (64, 96), (160, 224), (480, 736)])
def test_block_count_paths(rng, mode, tier, H, I):  # noqa: E741
    """1, 2, 3, 5, 7, 15, 23 blocks: every 4-block step count and lone-block tail."""
    E, K, T = 3, 3, 5
    banks = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    assert rel_err(y, cf.reference.moe(FMT, banks, x, w, ids, mode=mode)) < TOL


# ---- work items -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("h0,h1", [(0, 32), (3, 10), (5, 6), (1, 30)])
def test_down_work_item(rng, mode, tier, h0, h1):
    E, H, I = 2, 32, 736  # noqa: E741 - 23 blocks a row: 5 4-block steps and 3 lone blocks
    banks = SPEC.random_banks(E, H, I, rng)
    k = kernel_for(FMT, E, H, I, mode, tier)
    g = bf16(rng.standard_normal(I))
    y = down_rows(k, banks, 1, h0, h1, g)
    ref, mag = dot_ref(SPEC, banks, 1, h0, h1, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_down_several_routes(rng, mode, tier):
    """9 routes of one expert (token blocks of up to 4 / 8 and a partial one) against the reference, and each
    route's row equal bit for bit to its lone-route item."""
    E, H, I = 2, 96, 224  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    k = kernel_for(FMT, E, H, I, mode, tier)
    gs = [bf16(rng.standard_normal(I) * s) for s in rng.uniform(0.01, 10, 9)]
    acc = down_routes(k, banks, 1, gs)
    for j, g in enumerate(gs):
        ref, mag = dot_ref(SPEC, banks, 1, 0, H, g, mode)
        assert np.all(np.abs(acc[j] - ref) <= DOT_TOL * mag)
        np.testing.assert_array_equal(acc[j], down_routes(k, banks, 1, [g])[0])


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_gate_up_split_and_token_groups(rng, mode, tier):
    """gate_up items over odd row ranges give the whole item's rows bit for bit and write no other row; 17 tokens
    in one item give each token's lone g bit for bit."""
    E, H, I, n = 2, 96, 64, 17  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    k = kernel_for(FMT, E, H, I, mode, tier)
    xs = [bf16(rng.standard_normal(H)) for _ in range(n)]
    whole = gate_up_item(k, banks, 1, 0, I, xs)
    assert not (whole == 0x7FC1).any()
    for i0, i1 in [(0, 16), (3, 40), (17, 64), (5, 6)]:
        part = gate_up_item(k, banks, 1, i0, i1, xs)
        np.testing.assert_array_equal(part[:, i0:i1], whole[:, i0:i1], err_msg=f"rows [{i0}, {i1})")
        assert (part[:, :i0] == 0x7FC1).all() and (part[:, i1:] == 0x7FC1).all(), "wrote outside its rows"
    for t in (0, 15, 16):
        np.testing.assert_array_equal(gate_up_item(k, banks, 1, 0, I, [xs[t]])[0], whole[t], err_msg=f"token {t}")


# ---- edge codes -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_extreme_codes(rng, mode, tier):
    """Codes -128 and +127 only (|w| = 128 d: the sign trick's unsigned 128, the largest vpmaddubsw pair
    2 * 128 * 127) against activations whose codes are all +-127; row 0 all -128 against all +127."""
    E, H, I = 1, 32, 288  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    blocks = banks["down"].reshape(E, H, -1, q8.BLOCK_BYTES)
    blocks[..., 2:] = rng.choice(np.array([0x80, 0x7F], np.uint8), blocks[..., 2:].shape)
    blocks[0, 0, :, 2:] = 0x80
    g = bf16(np.repeat(rng.uniform(0.5, 2, I // 32), 32) * rng.choice([-1.0, 1.0], I))
    g[:32] = bf16(np.full(32, 1.5))
    q, _ = cf.numerics.int8_blocks(g.astype(np.float64), 32)
    assert np.all(np.abs(q) == 127)
    k = kernel_for(FMT, E, H, I, mode, tier)
    y = down_rows(k, banks, 0, 0, H, g)
    ref, mag = dot_ref(SPEC, banks, 0, 0, H, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag)
    if mode == "w4a8":  # row 0 block 0: exactly 32 * -128 * 127 times the scale
        assert ref[0] != 0


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("kind", ["subnormal", "mixed"])
def test_fp16_scales_subnormal_negative_zero(rng, mode, tier, kind):
    E, H, I = 2, 32, 256  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    for name in ("down", "gate_up"):
        blocks = banks[name].reshape(E, banks[name].shape[1], -1, q8.BLOCK_BYTES)
        put_fp16(blocks, 0, fp16_bits(rng, kind, blocks[..., 0].size, 1e-3))
    k = kernel_for(FMT, E, H, I, mode, tier)
    g = bf16(rng.standard_normal(I))
    y = down_rows(k, banks, 1, 0, H, g)
    ref, mag = dot_ref(SPEC, banks, 1, 0, H, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag + 1e-45)
    if kind == "subnormal":  # tiny but not flushed to zero anywhere
        assert np.all(y != 0)
    x = rng.standard_normal((3, H), dtype=np.float32)
    w, ids = routes(rng, 3, 2, E)
    yf = run_forced(FMT, banks, x, w, ids, mode, tier)
    assert rel_err(yf, cf.reference.moe(FMT, banks, x, w, ids, mode=mode)) < TOL


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_zero_blocks(rng, mode, tier):
    """d = 0 rows (gate = 0, g blocks all zero), all-zero and -0 activation blocks: amax 0, codes 0, exactly 0."""
    E, H, I, T = 2, 128, 96, 2  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    gu = banks["gate_up"].reshape(E, 2 * I, -1, q8.BLOCK_BYTES)
    gu[:, :32, :, 0:2] = 0
    x = rng.standard_normal((T, H), dtype=np.float32)
    x[:, 32:64] = 0
    x[1, 96:128] = -0.0
    ids = np.array([[0, 1], [1, 1]], np.int32)
    w = np.array([[0.5, 0.25], [1.0, 0.75]], np.float32)
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    assert rel_err(y, cf.reference.moe(FMT, banks, x, w, ids, mode=mode)) < TOL
    k = kernel_for(FMT, E, H, I, mode, tier)
    g = bf16(np.r_[np.zeros(32), rng.standard_normal(I - 32)])
    y1 = down_rows(k, banks, 0, 0, H, g)
    ref, mag = dot_ref(SPEC, banks, 0, 0, H, g, mode)
    assert np.all(np.abs(y1 - ref) <= DOT_TOL * mag)


# ---- the w4a8 activation prep -----------------------------------------------------------------------------------
def _tricky_vector(rng, nb: int) -> np.ndarray:
    """nb blocks: ordinary, all-zero, -0, .5 ties (amax 127 * 2^k), bf16 subnormals (1/d overflows: codes 0), a
    NaN block and an inf block."""
    v = rng.standard_normal(nb * 32).astype(np.float32)
    v[32:64] = 0.0
    v[64:96] = -0.0
    s = np.float32(2.0 ** -3)
    v[96:128] = (np.arange(32) - 16 + 0.5).astype(np.float32) * s
    v[96] = 127 * s
    v[128:160] = rng.choice([-1.0, 1.0], 32) * rng.uniform(1, 2, 32) * np.float32(2.0 ** -133)
    v[170] = np.nan
    v[200] = -np.inf
    return v


@pytest.mark.parametrize("tier", [p.values[1] for p in tier_cases(FMT, ["w4a8"])])
def test_prep_act_bit_exact(rng, tier):
    """The prepared vector (int8 codes, then fp32 d per block) equals numerics.int8_blocks and an independent
    element-by-element transliteration bit for bit, NaN blocks included (d = NaN, codes 0); bytes past it
    untouched."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 256
    v = bf16(_tricky_vector(rng, K // 32))
    k = kernel_for(FMT, 1, K, K, "w4a8", tier)
    assert k._k.act_bytes(K) == K + 4 * K // 32
    buf = prep(k, v)
    q, d = buf[:K].view(np.int8), buf[K:K + K // 32 * 4].view(np.float32)
    qs, ds = int8_blocks_slow(v.astype(np.float32))
    qn, dn = cf.numerics.int8_blocks(v.astype(np.float64), 32)
    np.testing.assert_array_equal(q, qs.reshape(-1))
    np.testing.assert_array_equal(q, qn.reshape(-1))
    np.testing.assert_array_equal(d.view(np.uint32), ds.view(np.uint32))
    np.testing.assert_array_equal(d.view(np.uint32), dn.view(np.uint32))
    assert np.isnan(d[5]) and np.isnan(d[6]) and not np.isnan(d[:5]).any()
    assert (buf[K + K // 32 * 4:] == 0xAB).all()


# ---- tiers documented as bit-identical --------------------------------------------------------------------------
@pytest.mark.parametrize("tier", ["avxvnni", "avx512vnni"])
@pytest.mark.parametrize("n", [1, 3, 9])
def test_vnni_tiers_equal_avx2_bit_for_bit(rng, tier, n):
    """w4a8: vpdpbusd and vpmaddubsw + vpmaddwd form the same exact int32 lanes, folded in the same order, so the
    VNNI tiers' down accumulators and g equal avx2's bit for bit (1, 3 and 9 routes: the multi-row, multi-token
    and partial token-block paths; 23 blocks a row)."""
    if tier not in USABLE or "avx2" not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    E, H, I = 2, 736, 416  # noqa: E741
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
    banks = SPEC.random_banks(2, 64, 96, rng)
    with pytest.raises(ValueError, match=r"q8_0 bank 'down'.*expected shape \(2, 64, 102\)"):
        cf.validate_banks(FMT, {"gate_up": banks["gate_up"], "down": banks["down"][:, :, :-1]})
    with pytest.raises(ValueError, match="multiples of 32"):
        cf.Kernel(FMT, 2, 48, 96)
    with pytest.raises(TypeError, match="no options"):
        cf.quantize(FMT, np.zeros((1, 64, 32), np.float32), np.zeros((1, 32, 32), np.float32), scale=1)
    with pytest.raises(ValueError, match="multiple of 32"):
        q8.quantize_rows(np.zeros((2, 40), np.float32))
    assert SPEC.bytes_per_expert(2048, 768) == 3 * 2048 * 768 // 32 * 34
