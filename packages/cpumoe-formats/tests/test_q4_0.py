"""q4_0 (GGUF Q4_0) kernels vs the float64 reference, every (mode, tier) forced in turn, plus the format's
edge cases, the quantizer (llama.cpp quantize_row_q4_0_ref) and the exact decoders.

Tolerances
----------
* Whole MoE step, ``TOL = 5e-3`` (rel = max|y - ref| / max|ref|): y is bf16, an 8-bit significand, so rounding
  the output alone errs by up to 2^-8 = 3.9e-3 of an element that sits just above a power of two (2^-9 is only
  the bottom of that range; measured max over seeds at the gemma shape: 3.3e-3). The reference applies every
  other defined rounding (bf16 x, bf16 g, and in w4a8 the Q8_0 activation quantization, which ``act_in``
  reproduces bit-exactly, see ``test_prep_act_bit_exact``: it is *not* a tolerance excuse). What is left is fp32
  accumulation (fp32 block scale fp16(d)*d_a, fp32 sums over <= 88 blocks: ~1e-6 relative) and the g elements
  whose fp32 value straddles a bf16 rounding boundary (one bf16 ulp in a few of T*top_k*I elements; in w4a8 that
  moves one q by 1 or, for a block's amax, d_a by 2^-8 relative: ~1e-4 of max|y|). 2^-8 + 1e-3 < 5e-3.
* One work item (the down pass called directly, fp32 output, no bf16 rounding): ``|y - ref| <= 1e-5 * sum|w*a|``.
  The kernels sum in fp32 lanes of 8 elements and per-block scales: for the K <= 736 of these tests the
  worst-case rounding bound is ~(K/8 + 3) * 2^-24 = 5.7e-6 of sum|w*a| (typically ~1e-7). The edge-case
  constructions (ties, nibble order) move y by >= 1e-2 of sum|w*a|, so the bound separates right from wrong by
  three orders of magnitude.
"""
import os
import struct

import numpy as np
import pytest
from conftest import USABLE, int8_blocks_slow, rel_err, routes, run_forced, tier_cases

import cpumoe_formats as cf
from cpumoe_formats.formats import q4_0 as q4
from cpumoe_formats.numerics import BF16

FMT = "q4_0"
SPEC = cf.get_format(FMT)
TOL = 5e-3
DOT_TOL = 1e-5
GROUP = {"scalar": 1, "avx2": 2, "avxvnni": 2, "avx512vnni": 4, "amx": 1}  # prep_act's block grouping per w4a8 tier


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def make_block(d: float | int, nibbles) -> np.ndarray:
    """One 18-byte block from fp16 d (a float, or raw fp16 bits as int) and 32 nibbles in element order."""
    n = np.asarray(nibbles, np.uint8)
    assert n.shape == (32,) and n.max() < 16
    bits = d if isinstance(d, (int, np.integer)) else int(np.float16(d).view(np.uint16))
    out = np.empty(18, np.uint8)
    out[0:2] = np.array([bits], "<u2").view(np.uint8)
    out[2:] = n[:16] | (n[16:] << 4)
    return out


def decode_independent(bank: np.ndarray) -> np.ndarray:
    """Per-element Q4_0 decode written from the GGUF definition, one block at a time (struct for fp16)."""
    E, R, nbytes = bank.shape
    nb = nbytes // 18
    out = np.empty((E, R, nb * 32))
    for e in range(E):
        for r in range(R):
            for b in range(nb):
                blk = bytes(bank[e, r, b * 18:(b + 1) * 18])
                (d,) = struct.unpack("<e", blk[:2])
                for t in range(32):
                    byte = blk[2 + (t % 16)]
                    nib = (byte & 0xF) if t < 16 else (byte >> 4)
                    out[e, r, b * 32 + t] = (nib - 8) * d
    return out


def decode_even_odd(bank: np.ndarray) -> np.ndarray:
    """The WRONG interleaved reading (byte j = elements 2j, 2j+1), to show tests tell the two apart."""
    b = bank.reshape(bank.shape[:-1] + (-1, 18))
    d = np.ascontiguousarray(b[..., :2]).view("<f2")[..., 0].astype(np.float64)
    qs = b[..., 2:]
    nib = np.stack([qs & 0xF, qs >> 4], axis=-1).reshape(qs.shape[:-1] + (32,)).astype(np.float64)
    return ((nib - 8) * d[..., None]).reshape(bank.shape[:-1] + (-1,))


q8_0_slow = int8_blocks_slow  # shared with the other 32-block w4a8 mode (conftest)


def bf16(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(BF16)


def prep(kernel, v_bf16: np.ndarray) -> np.ndarray:
    """The kernel's prepared activation of a bf16 vector (raw bytes)."""
    K = v_bf16.shape[0]
    src = np.ascontiguousarray(v_bf16)
    dst = cf.aligned_empty((kernel._k.act_bytes(K) + 64,), np.uint8)
    kernel._k.prep_act(src.ctypes.data, K, dst.ctypes.data)
    return dst


def down_rows(kernel, banks, e: int, h0: int, h1: int, g_bf16: np.ndarray) -> np.ndarray:
    """One down work item for a single route of weight 1: fp32 dot(down[e, h], g) for h in [h0, h1)."""
    arrays, _ = SPEC.validate(banks)
    act = prep(kernel, g_bf16)
    acc = np.zeros((1, h1 - h0), np.float32)
    kernel._k.down(SPEC.bank_views(arrays), h0, h1, [(0, e, 1.0, act.ctypes.data)], acc.ctypes.data, h1 - h0)
    return acc[0].astype(np.float64)


def dot_ref(banks, e, h0, h1, g_bf16, mode, decode=None):
    """float64 reference of down_rows: (y, sum |w*a| per row)."""
    dn = (decode or q4.decode_blocks)(banks["down"])[e, h0:h1]
    a = SPEC.act_in(g_bf16.astype(np.float64), mode)
    return dn @ a, np.abs(dn) @ np.abs(a)


def kernel_for(E, H, I, mode, tier, **kw):  # noqa: E741
    k = cf.Kernel(FMT, E, H, I, mode=mode, isa=tier, **kw)
    assert k.name == tier + ("+w4a8" if mode == "w4a8" else "")
    return k


# ---------------------------------------------------------------------------------------------------------------
# whole MoE step vs the reference
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_banks():
    """Fresh random gemma-4-26B-A4B-shaped banks, shared by the module's real-shape tests (decoding them to
    float64 once keeps the module fast); the seed is printed for reproduction."""
    seed = int(os.environ.get("CPUMOE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"gemma_banks CPUMOE_TEST_SEED={seed}")
    E, H, I = 4, 2816, 704  # noqa: E741
    banks = SPEC.random_banks(E, H, I, np.random.default_rng(seed))
    return banks, SPEC.dequantize(banks)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("T", [1, 3, 8])
def test_gemma4_shape(rng, gemma_banks, mode, tier, T):
    banks, deq = gemma_banks  # E=4, H=2816, I=704: gemma-4-26B-A4B experts; top_k 8, gelu_tanh
    E, H, K = 4, 2816, 8
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, banks, x, w, ids, mode, tier, activation="gelu_tanh")
    ref = cf.reference.moe(FMT, banks, x, w, ids, activation="gelu_tanh", mode=mode, dequantized=deq)
    assert rel_err(y, ref) < TOL


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "swigluoai", "swiglu_clamp"])
@pytest.mark.parametrize("on_input", [False, True])
def test_ragged_activations(rng, mode, tier, act, on_input):
    E, H, I, K, T = 5, 96, 160, 4, 3  # noqa: E741 - multiples of 32, not of 64 (odd block counts 3 and 5)
    gu = rng.standard_normal((E, 2 * I, H)).astype(np.float32) * 0.1
    dn = rng.standard_normal((E, H, I)).astype(np.float32) * 0.1
    banks = cf.quantize(FMT, gu, dn)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    kw = dict(activation=act, apply_router_weight_on_input=on_input)
    if act.startswith("swiglu"):
        kw.update(alpha=1.702, limit=1.5)  # a limit the data actually crosses
    y = run_forced(FMT, banks, x, w, ids, mode, tier, **kw)
    ref = cf.reference.moe(FMT, banks, x, w, ids, mode=mode, **kw)
    assert rel_err(y, ref) < TOL


# Block counts nb = K/32 that take every loop of every tier: 8-block steps, a 4-block step, a pair, a lone block
# (avx2), 4-block groups and 1..3 lone blocks (avx512vnni).
@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("H,I", [(32, 32), (64, 96), (160, 224), (480, 736), (256, 704), (2816, 32)])
def test_block_count_paths(rng, mode, tier, H, I):  # noqa: E741
    E, K, T = 3, 3, 3
    banks = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, banks, x, w, ids, mode=mode)
    assert rel_err(y, ref) < TOL


# ---------------------------------------------------------------------------------------------------------------
# one work item at a time: fp32 dots against float64, tight
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
# even and odd row counts (row pairs + a lone row); 29 rows = one full 16-row tile set and one of 13 (amx)
@pytest.mark.parametrize("h0,h1", [(0, 32), (3, 10), (5, 6), (1, 30)])
def test_down_work_item(rng, mode, tier, h0, h1):
    E, H, I = 2, 32, 736  # noqa: E741 - 23 blocks per down row: every loop of every tier
    banks = SPEC.random_banks(E, H, I, rng)
    k = kernel_for(E, H, I, mode, tier)
    g = bf16(rng.standard_normal(I))
    y = down_rows(k, banks, 1, h0, h1, g)
    ref, mag = dot_ref(banks, 1, h0, h1, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_gate_up_split_and_token_groups(rng, mode, tier):
    """gate_up work items over odd row ranges give the rows of one whole-range item bit for bit (a row does not
    depend on the split: amx's 16-row tile sets with a partial last set), and 17 tokens in one item (amx: a
    group of 16 and a lone token) give each token's single-token g bit for bit."""
    E, H, I, n = 2, 96, 64, 17  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    k = kernel_for(E, H, I, mode, tier)
    bufs = [prep(k, bf16(rng.standard_normal(H))) for _ in range(n)]
    v = SPEC.bank_views(SPEC.validate(banks)[0])

    def item(i0, i1, toks):
        g = cf.aligned_empty((len(toks), I), np.uint16)
        g[...] = 0x7FC1  # poison: rows outside [i0, i1) stay poisoned
        k._k.gate_up(v, 1, i0, i1, [bufs[t].ctypes.data for t in toks], [1.0] * len(toks),
                     [g[j].ctypes.data for j in range(len(toks))])
        return g

    whole = item(0, I, range(n))
    assert not (whole == 0x7FC1).any()
    for i0, i1 in [(0, 16), (3, 40), (17, 64), (5, 6)]:
        part = item(i0, i1, range(n))
        np.testing.assert_array_equal(part[:, i0:i1], whole[:, i0:i1], err_msg=f"rows [{i0}, {i1})")
        assert (part[:, :i0] == 0x7FC1).all() and (part[:, i1:] == 0x7FC1).all(), "wrote outside its rows"
    for t in (0, 15, 16):
        np.testing.assert_array_equal(item(0, I, [t])[0], whole[t], err_msg=f"token {t} alone")


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_natural_half_nibble_order(rng, mode, tier):
    """Row h: low nibbles = 8 + (h % 7 + 1) (elements 0..15), high nibbles random; the activation is large on
    elements 0..15 and 0 on 16..31 of every block. Even/odd reading would mix the high nibbles in."""
    E, H, I = 1, 32, 96  # noqa: E741
    nb = I // 32
    bank = np.empty((E, H, nb * 18), np.uint8)
    for h in range(H):
        for b in range(nb):
            nib = np.concatenate([np.full(16, 8 + h % 7 + 1), rng.integers(0, 4, 16)])  # high half far from 8
            bank[0, h, b * 18:(b + 1) * 18] = make_block(0.25, nib)
    banks = {"gate_up": SPEC.random_banks(E, H, I, rng)["gate_up"], "down": bank}
    g = bf16(np.tile(np.r_[rng.uniform(1, 2, 16), np.zeros(16)], nb))
    k = kernel_for(E, H, I, mode, tier)
    y = down_rows(k, banks, 0, 0, H, g)
    ref, mag = dot_ref(banks, 0, 0, H, g, mode)
    wrong, _ = dot_ref(banks, 0, 0, H, g, mode, decode=decode_even_odd)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag)
    assert np.all(np.abs(wrong - ref) > 0.1 * mag)  # the construction separates the two readings


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_extreme_nibbles_and_activations(rng, mode, tier):
    """Nibbles only 0 and 15 (w = -8d, +7d), activations of one magnitude per block so every q is +-127:
    the largest products the int8 paths see (|15*127*2| per vpmaddubsw pair)."""
    E, H, I = 1, 32, 288  # noqa: E741
    nb = I // 32
    bank = np.empty((E, H, nb * 18), np.uint8)
    for h in range(H):
        for b in range(nb):
            nib = rng.choice(np.array([0, 15]), 32) if h else np.full(32, 15)  # row 0: all 15
            bank[0, h, b * 18:(b + 1) * 18] = make_block(float(rng.choice([-1, 1]) * rng.uniform(0.5, 2)), nib)
    banks = {"gate_up": SPEC.random_banks(E, H, I, rng)["gate_up"], "down": bank}
    g = bf16(np.repeat(rng.uniform(0.5, 2, nb), 32) * rng.choice([-1.0, 1.0], I))
    g[:32] = bf16(np.full(32, 1.5))  # block 0 all positive: row 0 block 0 sums 32 * 7 * 127
    q, _ = q4.q8_0_quantize(g.astype(np.float64))
    assert np.all(np.abs(q) == 127)
    k = kernel_for(E, H, I, mode, tier)
    y = down_rows(k, banks, 0, 0, H, g)
    ref, mag = dot_ref(banks, 0, 0, H, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag)


def _d_bits(rng, kind: str, n: int) -> np.ndarray:
    sub = rng.integers(1, 0x400, n)  # fp16 subnormal magnitudes (exponent 0)
    if kind == "subnormal":
        return (sub | (rng.integers(0, 2, n) << 15)).astype(np.uint16)
    normal = np.abs(rng.uniform(0.5, 1.5, n) * 0.01).astype(np.float16).view(np.uint16)
    pick = rng.integers(0, 5, n)  # normal+, normal-, subnormal+-, +0, -0
    bits = np.where(pick == 0, normal, np.where(pick == 1, normal | 0x8000,
                    np.where(pick == 2, sub | (rng.integers(0, 2, n) << 15), np.where(pick == 3, 0, 0x8000))))
    return bits.astype(np.uint16)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("kind", ["subnormal", "mixed"])
def test_fp16_scales_subnormal_negative_zero(rng, mode, tier, kind):
    E, H, I = 2, 32, 256  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    dn = banks["down"].reshape(E, H, -1, 18)
    dn[..., 0:2] = _d_bits(rng, kind, E * H * (I // 32)).reshape(E, H, -1, 1).view(np.uint8).reshape(E, H, -1, 2)
    k = kernel_for(E, H, I, mode, tier)
    g = bf16(rng.standard_normal(I))
    y = down_rows(k, banks, 1, 0, H, g)
    ref, mag = dot_ref(banks, 1, 0, H, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag + 1e-45)
    if kind == "subnormal":
        # |w| <= 8 * 1023 * 2^-24: small but nonzero results, no flush to zero anywhere
        assert np.all(y != 0) and np.abs(ref).max() < 8 * 1023 * 2.0 ** -24 * np.abs(g.astype(np.float64)).sum()
    # the whole MoE step on such banks (gate_up with the same kind of scales)
    gu = banks["gate_up"].reshape(E, 2 * I, -1, 18)
    gu[..., 0:2] = _d_bits(rng, kind, gu.shape[0] * gu.shape[1] * gu.shape[2]).reshape(gu.shape[:3] + (1,)) \
        .view(np.uint8).reshape(gu.shape[:3] + (2,))
    x = rng.standard_normal((3, H), dtype=np.float32)
    w, ids = routes(rng, 3, 2, E)
    yf = run_forced(FMT, banks, x, w, ids, mode, tier)
    reff = cf.reference.moe(FMT, banks, x, w, ids, mode=mode)
    assert rel_err(yf, reff) < TOL


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_zero_activation_blocks(rng, mode, tier):
    """x blocks that are all zero and gate/up rows with d = 0 (g blocks all zero): amax 0 -> q = 0, block
    contributes exactly 0."""
    E, H, I, T = 2, 128, 96, 2  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    gu = banks["gate_up"].reshape(E, 2 * I, -1, 18)
    gu[:, :32, :, 0:2] = 0  # gate rows 0..31: d = 0 -> gate = 0 -> g[0:32] = act(0, up) = 0
    x = rng.standard_normal((T, H), dtype=np.float32)
    x[:, 32:64] = 0
    x[1, 96:128] = -0.0
    q, d = q4.q8_0_quantize(bf16(x[1]).astype(np.float64))
    assert np.all(q[1] == 0) and np.all(q[3] == 0) and d[1] == 0
    assert np.all(SPEC.act_in(np.zeros(64), "w4a8") == 0)
    ids = np.array([[0, 1], [1, 1]], np.int32)
    w = np.array([[0.5, 0.25], [1.0, 0.75]], np.float32)
    for act in ("silu", "gelu_tanh"):
        y = run_forced(FMT, banks, x, w, ids, mode, tier, activation=act)
        ref = cf.reference.moe(FMT, banks, x, w, ids, mode=mode, activation=act)
        assert rel_err(y, ref) < TOL
    k = kernel_for(E, H, I, mode, tier)
    g = bf16(np.r_[np.zeros(32), rng.standard_normal(I - 32)])
    y = down_rows(k, banks, 0, 0, H, g)
    ref, mag = dot_ref(banks, 0, 0, H, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag)


def _tie_vector(rng, nb: int) -> np.ndarray:
    """Blocks whose amax is 127 * 2^k (d_a = 2^k, 1/d_a exact) and whose other elements are (n + 1/2) 2^k:
    x * (1/d_a) lands exactly on .5. Positive ties n + 1/2 with n even round down under half-even."""
    out = []
    for _ in range(nb):
        s = 2.0 ** int(rng.integers(-6, 3))
        n = rng.integers(0, 63, 31) * 2  # even n: half-even rounds to n, half-away to n + 1
        blk = np.r_[127.0, n + 0.5] * s
        out.append(blk)
    return np.concatenate(out)


def test_act_in_ties_round_half_even():
    v = bf16(np.r_[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -125.5, np.zeros(23)]).astype(np.float64)
    q, d = q4.q8_0_quantize(v)
    assert d[0] == 1.0
    assert list(q[0, :9]) == [127, 0, 2, 2, 0, -2, -2, 126, -126]
    np.testing.assert_array_equal(SPEC.act_in(v, "w4a8"), q[0].astype(np.float64))


@pytest.mark.parametrize("mode,tier", tier_cases(FMT, modes=("w4a8",)))
def test_ties_in_kernel(rng, mode, tier):
    """The kernel rounds ties like act_in (half to even): with all weights positive, round-half-away would add
    one activation step per tie element, >= 1e-2 of sum|w*a|."""
    E, H, I = 1, 32, 160  # noqa: E741
    nb = I // 32
    bank = np.stack([np.concatenate([make_block(0.01 * (h + 1), rng.integers(9, 16, 32)) for _ in range(nb)])
                     for h in range(H)])[None]
    banks = {"gate_up": SPEC.random_banks(E, H, I, rng)["gate_up"], "down": bank}
    v = _tie_vector(rng, nb)
    g = bf16(v)
    assert np.array_equal(g.astype(np.float64), v)  # the ties survive the bf16 input exactly
    k = kernel_for(E, H, I, mode, tier)
    y = down_rows(k, banks, 0, 0, H, g)
    ref, mag = dot_ref(banks, 0, 0, H, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag)
    # the same with half-away-from-zero rounding differs clearly
    x = g.astype(np.float32).reshape(-1, 32)
    da = (np.abs(x).max(1) / np.float32(127)).astype(np.float32)
    away = np.clip(np.trunc(x * (np.float32(1) / da)[:, None] + np.float32(0.5)), -127, 127) * da[:, None]
    alt = q4.decode_blocks(banks["down"])[0] @ away.reshape(-1).astype(np.float64)
    assert np.all(np.abs(alt - ref) > 1e-2 * mag)


def parse_q8(raw, K, G):
    """A prepared Q8_0 vector (q4_0_q8act.h, block grouping G) -> (q int8 [K/32, 32], d_a fp32, corr [K/32, 4])."""
    nb = K // 32
    qraw = raw[:K].view(np.int8)
    q = np.empty((nb, 32), np.int8)
    for b in range(nb):
        gi = b // G
        if (gi + 1) * G <= nb:
            lo = gi * G * 32 + (b % G) * 16
            hi = lo + G * 16
        else:
            lo, hi = b * 32, b * 32 + 16
        q[b, :16], q[b, 16:] = qraw[lo:lo + 16], qraw[hi:hi + 16]
    return q, raw[K:K + 4 * nb].view(np.float32), raw[K + 4 * nb:K + 20 * nb].view(np.int32).reshape(nb, 4)


@pytest.mark.parametrize("tier", [t for t in GROUP if t != "scalar"])
def test_prep_act_nonfinite_matches_scalar(rng, tier):
    """The SIMD tiers' Q8_0 prep (common.h q8_block32) gives the scalar tier's q, d_a and corrections for blocks
    holding inf, -inf and NaN: such a block's d_a is NaN and its codes 0 (its products are NaN, as the reference's),
    the finite blocks' are as ever."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 32 * 13
    v = rng.standard_normal(K)
    v[[3, 40, 41, 100, 170, 300]] = [np.inf, np.nan, -np.inf, np.nan, np.nan, -np.inf]
    v[64:96] = np.nan  # a block of NaN only
    g = bf16(v)
    got = parse_q8(prep(kernel_for(2, 32, K, "w4a8", tier), g), K, GROUP[tier])
    want = parse_q8(prep(kernel_for(2, 32, K, "w4a8", "scalar"), g), K, 1)
    for a, b, name in zip(got, want, ("q", "d_a", "corr")):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
    bad = ~np.isfinite(np.asarray(g, np.float64).reshape(-1, 32)).all(axis=1)
    assert bad.sum() == 6 and np.isnan(want[1][bad]).all() and np.isfinite(want[1][~bad]).all()
    assert np.all(want[0][bad] == 0) and np.all(want[2][bad] == 0)


@pytest.mark.parametrize("tier", [p.values[1] for p in tier_cases(FMT, modes=("w4a8",))])
def test_prep_act_bit_exact(rng, tier):
    """The kernel's Q8_0 prep equals act_in's quantization bit for bit (q, d_a and the lane corrections), on
    random data, .5 ties, zero blocks, tiny blocks where 1/d_a overflows, and bf16 subnormals."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 32 * 23
    v = rng.standard_normal(K) * np.exp(rng.uniform(-8, 8, K // 32).repeat(32))
    v[32:160] = _tie_vector(rng, 4)
    v[160:192] = 0.0
    v[192:224] = rng.standard_normal(32) * 1e-38  # amax/127 subnormal: 1/d_a overflows -> q = 0
    r = rng.standard_normal(32)  # amax 6e-37 exactly (a random amax below ~4.3e-37 overflowed 1/d_a: 1 seed in 3000)
    v[224:256] = r / np.abs(r).max() * 6e-37  # amax/127 ~ 4.7e-39, near 2^-128: the edge of the overflow
    v[256:288] = rng.integers(-3, 4, 32) * 2.0 ** -133  # bf16 subnormals
    v[288:320] = 1e30 * rng.standard_normal(32)
    g = bf16(v)
    k = kernel_for(2, 32, K, "w4a8", tier)
    q, da, corr = parse_q8(prep(k, g), K, GROUP[tier])
    nb = K // 32
    q_ref, d_ref = q8_0_slow(g.astype(np.float64))
    q_vec, d_vec = q4.q8_0_quantize(g.astype(np.float64))
    np.testing.assert_array_equal(q_vec, q_ref)
    np.testing.assert_array_equal(d_vec.view(np.uint32), d_ref.view(np.uint32))
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(da.view(np.uint32), d_ref.view(np.uint32))
    want_corr = -8 * (q_ref[:, :16] + q_ref[:, 16:].astype(np.int32)).reshape(nb, 4, 4).sum(-1)
    np.testing.assert_array_equal(corr, want_corr)
    assert np.all(q_ref[6] == 0) and np.all(q_ref[5] == 0)
    assert np.all(q_ref[8] == 0)  # amax 3 * 2^-133: 1/d_a overflows, the block quantizes to 0 (defined rule)
    assert np.any(q_ref[7] != 0)  # amax 6e-37: 1/d_a still finite


def _corr8_slot(b: int, nb: int) -> int:
    """Slot of block b in the prepared corr8 array (q4_0_q8act.h): lanes 0 2 4 6 1 3 5 7 of each full group of 8
    blocks, then 0 2 1 3 for a following group of 4, natural after that."""
    g, i = b & ~7, b & 7
    if g + 8 <= nb:
        return g + (i & 1) * 4 + i // 2
    if g + 4 <= nb and i < 4:
        return g + (i & 1) * 2 + i // 2
    return b


@pytest.mark.parametrize("tier", ["scalar", "avx2", "avxvnni", "avx512vnni"])
@pytest.mark.parametrize("nb", [1, 2, 4, 5, 8, 12, 14, 15, 22, 23, 88])
def test_prep_act_block_corrections(rng, tier, nb):
    """The whole-block corrections -8 * sum(q_b) the avx2 / avxvnni 8- and 4-block steps add after their integer
    reduction, at the slots of their lane order, for every group shape (full 8-groups, a 4-group, a natural
    tail)."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 32 * nb
    g = bf16(rng.standard_normal(K) * np.exp(rng.uniform(-4, 4, nb).repeat(32)))
    k = kernel_for(2, 32, K, "w4a8", tier)
    raw = prep(k, g)
    assert k._k.act_bytes(K) == K + 24 * nb
    corr8 = raw[K + 20 * nb:K + 24 * nb].view(np.int32)
    q_ref, _ = q8_0_slow(g.astype(np.float64))
    want = np.empty(nb, np.int32)
    for b in range(nb):
        want[_corr8_slot(b, nb)] = -8 * int(q_ref[b].astype(np.int32).sum())
    np.testing.assert_array_equal(corr8, want)


# ---------------------------------------------------------------------------------------------------------------
# quantizer and decoders
# ---------------------------------------------------------------------------------------------------------------
def test_quantizer_hand_checked_blocks():
    # max |x| is -2 (negative): d = -2/-8 = 0.25, id = 4, q = min(15, trunc(x*4 + 8.5))
    x = np.zeros(32, np.float32)
    x[:6] = [1.0, -2.0, 0.5, 0.3, -0.13, 1.9]
    x[16], x[31] = 0.74, -1.99
    blk = q4.quantize_rows(x)
    assert blk.shape == (18,)
    assert blk[:2].view("<f2")[0] == np.float16(0.25)
    nib = np.r_[blk[2:] & 0xF, blk[2:] >> 4]
    #  1*4+8.5 = 12.5 -> 12; -8+8.5 -> 0; 2+8.5 -> 10; 1.2+8.5 -> 9; -0.52+8.5 -> 7; 7.6+8.5 = 16.1 -> 15 (clamp);
    #  0 -> 8; 2.96+8.5 -> 11; -7.96+8.5 -> 0
    assert list(nib[:6]) == [12, 0, 10, 9, 7, 15] and nib[16] == 11 and nib[31] == 0
    assert np.all(nib[6:16] == 8) and np.all(nib[17:31] == 8)
    # max |x| positive: d = -0.5, id = -2; +4 -> 0 (w = -8 * -0.5 = 4 exactly); -4 -> 16.5 -> 15 (w = -3.5)
    y = np.zeros(32, np.float32)
    y[3], y[7], y[20] = 4.0, -4.0, 1.0
    blk = q4.quantize_rows(y)
    assert blk[:2].view("<f2")[0] == np.float16(-0.5)
    nib = np.r_[blk[2:] & 0xF, blk[2:] >> 4]
    assert nib[3] == 0 and nib[7] == 15 and nib[20] == 6 and nib[0] == 8
    np.testing.assert_array_equal(q4.decode_blocks(blk)[[3, 7, 20]], [4.0, -3.5, 1.0])
    # ties in |x|: the first one wins, its sign kept (llama's strict <)
    z = np.zeros(32, np.float32)
    z[2], z[9] = -3.0, 3.0
    assert q4.quantize_rows(z)[:2].view("<f2")[0] == np.float16(3.0 / 8)
    # all zero: max stays +0.0, d = 0.0 / -8 = -0.0 (fp16 0x8000), id = 0, every q = trunc(8.5) = 8
    for zeros in (np.zeros(32, np.float32), -np.zeros(32, np.float32)):
        blk = q4.quantize_rows(zeros)
        assert blk[:2].view("<u2")[0] == 0x8000 and np.all(blk[2:] == 0x88)


def _llama_quantize_row_q4_0_ref(x: np.ndarray) -> bytes:
    """A line-by-line transliteration of llama.cpp's C reference with float32 scalars."""
    out = b""
    f32 = np.float32
    for i in range(len(x) // 32):
        amax, mx = f32(0), f32(0)
        for j in range(32):
            v = f32(x[i * 32 + j])
            if amax < abs(v):
                amax, mx = abs(v), v
        d = f32(mx / f32(-8))
        idv = f32(f32(1) / d) if d != 0 else f32(0)
        qs = bytearray(16)
        for j in range(16):
            x0 = f32(f32(x[i * 32 + j]) * idv)
            x1 = f32(f32(x[i * 32 + 16 + j]) * idv)
            xi0 = min(15, int(f32(x0 + f32(8.5))))  # (int8_t) truncates toward zero
            xi1 = min(15, int(f32(x1 + f32(8.5))))
            qs[j] = xi0 | (xi1 << 4)
        out += np.float16(d).tobytes() + bytes(qs)
    return out


def test_quantizer_matches_llama_reference(rng):
    x = (rng.standard_normal((3, 128)) * np.exp(rng.uniform(-4, 4, (3, 1)))).astype(np.float32)
    x[1, 40:64] = 0
    x[2, 0:32] = np.round(x[2, 0:32] * 4) / 4  # many exact multiples of d: boundary cases of x*id + 8.5
    got = q4.quantize_rows(x)
    for r in range(3):
        assert got[r].tobytes() == _llama_quantize_row_q4_0_ref(x[r])


def test_quantizer_roundtrip(rng):
    E, H, I = 2, 64, 96  # noqa: E741
    gu = rng.standard_normal((E, 2 * I, H)).astype(np.float32)
    dn = (rng.standard_normal((E, H, I)) * 0.01).astype(np.float32)
    banks = cf.quantize(FMT, gu, dn)
    assert banks["gate_up"].shape == (E, 2 * I, H // 32 * 18) and banks["down"].shape == (E, H, I // 32 * 18)
    for w, bank in ((gu, banks["gate_up"]), (dn, banks["down"])):
        deq = SPEC.dequantize({"gate_up": banks["gate_up"], "down": banks["down"]})[0 if w is gu else 1]
        d = np.abs(bank.reshape(bank.shape[:-1] + (-1, 18))[..., :2].copy().view("<f2")[..., 0].astype(np.float64))
        err = np.abs(deq - w).reshape(w.shape[:-1] + (-1, 32))
        # |err| <= |d|/2 except the clamp at +8 (|d|), plus d's fp16 rounding (8 * 2^-11 |d|)
        assert np.all(err <= d[..., None] * (1 + 16 * 2.0 ** -11))
        assert np.mean(err <= d[..., None] * (0.5 + 16 * 2.0 ** -11)) > 0.99
    with pytest.raises(TypeError, match="no options"):
        SPEC.quantize(gu, dn, bits=4)


def test_dequantize_exact(rng):
    E, H, I = 2, 64, 32  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    gu = banks["gate_up"].reshape(E, 2 * I, -1, 18)
    gu[0, 0, 0, 0:2] = np.array([0x0001], "<u2").view(np.uint8)  # smallest fp16 subnormal
    gu[0, 0, 0, 2] = (gu[0, 0, 0, 2] & 0xF0) | 0x0F  # element 0: nibble 15 (a random 8 would decode to 0)
    gu[0, 0, 1, 0:2] = np.array([0x8000], "<u2").view(np.uint8)  # -0
    gu[0, 1, 0, 0:2] = np.array([0xFBFF], "<u2").view(np.uint8)  # -65504
    gu[0, 1, 0, 2:] = 0x0F  # elements 0..15: nibble 15, 16..31: nibble 0
    dgu, ddn = cf.reference.dequantize(FMT, banks)
    np.testing.assert_array_equal(dgu, decode_independent(banks["gate_up"]))
    np.testing.assert_array_equal(ddn, decode_independent(banks["down"]))
    np.testing.assert_array_equal(dgu[0, 1, :32], np.r_[np.full(16, -7 * 65504.0), np.full(16, 8 * 65504.0)])
    assert dgu[0, 0, 0] != 0 and abs(dgu[0, 0, 0]) <= 8 * 2.0 ** -24
    # natural halves, spelled out: byte 0 = 0x3C -> element 0 has nibble 0xC, element 16 nibble 0x3
    blk = make_block(1.0, np.r_[12, np.full(15, 8), 3, np.full(15, 8)])
    assert blk[2] == 0x3C
    dec = q4.decode_blocks(blk)
    assert dec[0] == 4.0 and dec[16] == -5.0 and dec[1] == 0.0
    assert not np.array_equal(dec, decode_even_odd(blk[None, None])[0, 0])


def test_random_banks_are_well_formed(rng):
    banks = SPEC.random_banks(3, 96, 64, rng)
    assert cf.validate_banks(FMT, banks) == (3, 96, 64)
    d = banks["down"].reshape(3, 96, -1, 18)[..., :2].copy().view("<f2").astype(np.float64)
    assert np.all((np.abs(d) >= 0.0012) & (np.abs(d) <= 0.004))  # normal fp16, ~0.0025 scale
    assert (d < 0).any() and (d > 0).any()
    w = SPEC.dequantize(banks)[0]
    assert 0.005 < w.std() < 0.02


def test_spec_contract():
    assert SPEC.id == 4 and SPEC.k_multiple == 32 and SPEC.input_weight
    assert SPEC.modes == ("w4a8", "native") and SPEC.default_mode == "w4a8"
    assert [b.name for b in SPEC.banks] == ["gate_up", "down"] and all(b.align == 1 for b in SPEC.banks)
    assert SPEC.bytes_per_expert(2816, 704) == 3_345_408  # gemma-4-26B q4_0, spec section 1.9
    assert cf.selected_tier(FMT).endswith("+w4a8")
    with pytest.raises(ValueError, match="multiples of 32"):
        cf.Kernel(FMT, 2, 48, 32)
