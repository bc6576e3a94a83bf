"""nvfp4 kernels (native W4A16 and w4a8) vs the float64 reference, every tier forced in turn.

Tolerances:
- Whole MoE step (rel = max|y - ref| / max|ref|): TOL = 5e-3. y is bf16: rounding the
  fp32 accumulator costs up to half an ulp, which is 2^-8 = 3.9e-3 of the value at the
  bottom of a binade (so up to 3.9e-3 of max|ref|). Everything else the kernel does is
  modelled exactly by the reference (bf16 x and g, and in w4a8 the int8 activation
  quantization through act_in, bit-exact), so the only other deviation is fp32
  accumulation: ~sqrt(K) 2^-24 relative on gate/up/down dots, which occasionally flips a
  bf16 rounding of g (one ulp, 2^-8 relative, in a few of I elements; each flip moves y
  by ~2^-8 / sqrt(I) of its size). Measured: <= 2.7e-3 (mostly the output rounding).
  1e-3 of headroom over 2^-8 covers the g flips.
- Work-item edge tests (gate_up / down called directly, fp32 accumulators compared
  before any output rounding): rigorous bounds, see fp4_helpers: |acc - exact| <=
  (K + 8) 2^-24 sum|terms| per row, and g must lie between the bf16 roundings of the
  activation over that error box. A wrong scale, code, nibble order or global breaks
  these by orders of magnitude.
- Decoders, act_in (w4a8) and the quantizer's codes: exact (bit-equal).
"""
import numpy as np
import pytest
from conftest import rel_err, routes, run_forced, tier_cases
from fp4_helpers import (
    check_down,
    check_g,
    dot_bound,
    kernel,
    prep,
    run_down,
    run_gate_up,
    to_bf16_bits,
)

import cpumoe_formats as cf
from cpumoe_formats import activations
from cpumoe_formats.formats.nvfp4 import quantize_w4a8_act, unpack_codes
from cpumoe_formats.numerics import BF16, E4M3

FMT = "nvfp4"
SPEC = cf.get_format(FMT)
TOL = 5e-3


def bf16_vec(rng, n, scale=1.0):
    return to_bf16_bits(rng.standard_normal(n).astype(np.float32) * scale)


def bits_f64(b):
    return np.asarray(b, np.uint16).view(BF16).astype(np.float64)


# ---------------------------------------------------------------- whole MoE step
@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("T", [1, 3, 8])
def test_qwen36_nvfp4_shape(rng, mode, tier, T):
    """Qwen3.6-35B-A3B-NVFP4: H=2048, I=512, top_k=8 (E small)."""
    E, H, I, K = 4, 2048, 512, 8  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, banks, x, w, ids, mode=mode)
    assert rel_err(y, ref) < TOL


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("act,on_input", [("silu", False), ("silu", True), ("gelu_tanh", False),
                                          ("swigluoai", True), ("swiglu_clamp", False)])
def test_ragged_quantized(rng, mode, tier, act, on_input):
    """H = 272, I = 144: multiples of 16 but not 32 (tail blocks in every SIMD tier), real quantized weights."""
    E, H, I, K, T = 5, 272, 144, 4, 3  # noqa: E741
    gu = rng.standard_normal((E, 2 * I, H)).astype(np.float32) * 0.1
    dn = rng.standard_normal((E, H, I)).astype(np.float32) * 0.1
    banks = cf.quantize(FMT, gu, dn)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    kw = {"activation": act, "apply_router_weight_on_input": on_input}
    if act.startswith("swiglu"):
        kw.update(alpha=1.702, limit=1.5)
    y = run_forced(FMT, banks, x, w, ids, mode, tier, **kw)
    ref = cf.reference.moe(FMT, banks, x, w, ids, mode=mode, **kw)
    assert rel_err(y, ref) < TOL


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("H,I", [(16, 16), (48, 80), (320, 208)])
def test_small_shapes(rng, mode, tier, H, I):  # noqa: E741
    """Shapes with no full SIMD chunk, one chunk plus tail blocks, odd chunk counts."""
    E, K, T = 3, 2, 3
    banks = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, banks, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, banks, x, w, ids, mode=mode)
    assert rel_err(y, ref) < TOL


# ---------------------------------------------------------------- work-item edge cases
def _acts(mode, vs_bits):
    return [SPEC.act_in(bits_f64(v), mode) for v in vs_bits]


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_all_scale_codes_through_kernel(rng, mode, tier):
    """Every e4m3 block-scale code (0x7F/0xFF = +-480, subnormals m 2^-9, +-0) in both passes."""
    E, H, I = 1, 256, 64  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    # gate_up: 2I x H/16 = 2048 scale slots, every code 8 times in random places
    banks["gate_up_scale"][...] = rng.permutation(np.arange(2 * I * H // 16) % 256).astype(np.uint8).view(E4M3) \
        .reshape(1, 2 * I, H // 16)
    # down: row h uses code h in all of its blocks, so each output isolates one code
    banks["down_scale"][...] = np.repeat(np.arange(256, dtype=np.uint8), I // 16).view(E4M3).reshape(1, H, I // 16)
    banks["down_packed"][0, 0xFF] = banks["down_packed"][0, 0x7F]  # +480 and -480 rows, same codes and global
    banks["down_global"][0, 0xFF] = banks["down_global"][0, 0x7F]
    k = kernel(FMT, E, H, I, mode, tier)
    gu, dn = SPEC.dequantize(banks)
    xs = [bf16_vec(rng, H) for _ in range(3)]
    g = run_gate_up(k, FMT, banks, 0, xs)
    act = activations.resolve("silu")
    for j, a in enumerate(_acts(mode, xs)):
        gate_up, bnd = gu[0] @ a, dot_bound(gu[0], a)
        check_g(g[j], gate_up[:I], gate_up[I:], bnd[:I], bnd[I:], act)
    assert np.isfinite(g).all()
    gs = [bf16_vec(rng, I) for _ in range(2)]
    acc = run_down(k, FMT, banks, 0, gs, [0.75, 1.5])
    assert np.isfinite(acc).all()
    assert np.all(acc[:, 0x7F] != 0) and np.array_equal(acc[:, 0xFF], -acc[:, 0x7F])  # +-480, not NaN
    assert np.all(acc[:, 0x00] == 0) and np.all(acc[:, 0x80] == 0)  # +-0 scales
    check_down(acc, dn[0], _acts(mode, gs), [0.75, 1.5])


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_all_e2m1_codes_and_nibble_order(rng, mode, tier):
    """All 256 byte values (16 x 16 code pairs incl. -0) and the low-nibble-first order."""
    E, H, I = 1, 32, 512  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    dp = banks["down_packed"]
    for h in range(H):
        dp[0, h] = rng.permutation(256).astype(np.uint8)
    # rows 0/1: only low / only high nibbles set; rows 2/3: a -0 (code 8) against the other nibble
    dp[0, 0] = rng.integers(1, 16, 256, dtype=np.uint8)
    dp[0, 1] = rng.integers(1, 16, 256, dtype=np.uint8) << 4
    dp[0, 2] = 0x80 | rng.integers(1, 8, 256, dtype=np.uint8)
    dp[0, 3] = 0x08 | (rng.integers(1, 8, 256, dtype=np.uint8) << 4)
    k = kernel(FMT, E, H, I, mode, tier)
    _, dn = SPEC.dequantize(banks)
    even = np.zeros(I, np.float32)
    even[0::2] = 1 + rng.random(I // 2, dtype=np.float32)
    odd = np.zeros(I, np.float32)
    odd[1::2] = 1 + rng.random(I // 2, dtype=np.float32)
    gs = [to_bf16_bits(even), to_bf16_bits(odd), bf16_vec(rng, I)]
    acc = run_down(k, FMT, banks, 0, gs, [1.0, 1.0, 1.0])
    check_down(acc, dn[0], _acts(mode, gs), [1.0, 1.0, 1.0])
    # low nibbles are the even K elements: swapping the nibble order would zero these / make those nonzero
    assert acc[0, 0] != 0 and acc[1, 0] == 0 and acc[0, 1] == 0 and acc[1, 1] != 0
    assert acc[1, 2] == 0 and acc[0, 3] == 0 and acc[0, 2] != 0 and acc[1, 3] != 0  # -0 codes add nothing


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_fp16_globals(rng, mode, tier):
    """Per-row fp16 globals: subnormal (0x0001..0x03FF), normal, negative, tiny and large."""
    E, H, I = 2, 64, 48  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    glob = np.concatenate([np.array([0x0001, 0x03FF, 0x0400, 0x8001, 0x83FF, 0x7BFF, 0xFBFF, 0x3C00], np.uint16),
                           rng.integers(1, 0x400, 24, dtype=np.uint16),  # subnormals
                           rng.integers(0x400, 0x5C00, 24, dtype=np.uint16) | (rng.integers(0, 2, 24) << 15)
                           .astype(np.uint16),
                           rng.integers(0x8001, 0x8400, 8, dtype=np.uint16)]).astype(np.uint16)
    assert glob.size == H
    banks["down_global"][...] = glob.view(np.float16)
    gglob = rng.integers(1, 0x400, 2 * I, dtype=np.uint16)  # all-subnormal gate/up globals on expert 1
    banks["gate_up_global"][1] = gglob.view(np.float16)
    k = kernel(FMT, E, H, I, mode, tier)
    gu, dn = SPEC.dequantize(banks)
    for e in range(E):
        gs = [bf16_vec(rng, I) for _ in range(2)]
        acc = run_down(k, FMT, banks, e, gs, [1.0, 0.5])
        assert np.isfinite(acc).all()
        check_down(acc, dn[e], _acts(mode, gs), [1.0, 0.5])
    xs = [bf16_vec(rng, H, 100.0)]
    g = run_gate_up(k, FMT, banks, 1, xs)
    a = _acts(mode, xs)[0]
    gate_up, bnd = gu[1] @ a, dot_bound(gu[1], a)
    check_g(g[0], gate_up[:I], gate_up[I:], bnd[:I], bnd[I:], activations.resolve("silu"))


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_input_weight_and_routes(rng, mode, tier):
    """apply_router_weight_on_input scales gate/up; several tokens share a weight row read."""
    E, H, I = 2, 96, 80  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    k = kernel(FMT, E, H, I, mode, tier, apply_router_weight_on_input=True)
    gu, _ = SPEC.dequantize(banks)
    xs = [bf16_vec(rng, H) for _ in range(4)]
    w_in = [0.25, 1.0, 3.0, 0.0]
    g = run_gate_up(k, FMT, banks, 1, xs, w_in)
    for j, a in enumerate(_acts(mode, xs)):
        wj = float(np.float32(w_in[j]))
        gate_up, bnd = gu[1] @ a * wj, dot_bound(gu[1], a) * abs(wj)
        check_g(g[j], gate_up[:I], gate_up[I:], bnd[:I], bnd[I:], activations.resolve("silu"))


# ---------------------------------------------------------------- w4a8 activation quantization
def _w4a8_parse(buf, K):
    """Kernel-prepared w4a8 vector -> (q [K] natural order, scales [K/16])."""
    codes = buf[:K].view(np.int8)
    main = K // 128 * 128
    k = np.arange(K)
    r = k & 127
    tail = k - main
    pos = np.where(k < main, (k - r) + (r & 1) * 64 + (r >> 1),
                   main + (tail - (tail & 15)) + (tail & 1) * 8 + ((tail & 15) >> 1))
    off = (K + 63) // 64 * 64
    return codes[pos].astype(np.float32), buf[off:off + 4 * (K // 16)].view(np.float32)


@pytest.mark.parametrize("tier", [p.values[1] for p in tier_cases(FMT, modes=("w4a8",))])
def test_w4a8_act_in_bit_exact(rng, tier):
    """The kernel's int8 activation quantization equals act_in's numpy float32 model bit for bit."""
    K = 400  # 3 groups of 128 + a 16-block tail
    if tier not in cf.usable_tiers():
        pytest.skip(f"this CPU lacks {tier}")
    k = kernel(FMT, 1, K, K, "w4a8", tier)
    v = rng.standard_normal(K).astype(np.float32) * np.repeat(10.0 ** rng.uniform(-6, 6, K // 16), 16)
    v = v.astype(np.float32)
    v[0:16] = 0  # amax == 0 -> s = 1
    v[16:32] = np.array([127, -2.5, 2.5, 3.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5, 0, 1, -1, 64.5, 2, 4],
                        np.float32)  # s = 1: exact .5 ties round half to even
    v[32:48] = np.float32(1e-38) * np.arange(1, 17)  # tiny (bf16 subnormal/normal boundary)
    v[48:64] = np.float32(3e38) * np.linspace(-1, 1, 16)  # huge
    bits = to_bf16_bits(v)
    q, s = _w4a8_parse(prep(k, bits), K)
    q_ref, s_ref = quantize_w4a8_act(bits_f64(bits))
    assert np.array_equal(s.view(np.uint32), s_ref.view(np.uint32))
    assert np.array_equal(q, q_ref)
    assert np.array_equal(q[16:32], [127, -2, 2, 4, -4, 0, -0, 2, 126, -126, 0, 1, -1, 64, 2, 4])
    assert np.abs(q).max() <= 127


# ---------------------------------------------------------------- decode, quantize, schema
def _decode_independent(packed, scale, glob):
    """Per-element decode from the bit definitions (no shared tables)."""
    packed = np.asarray(packed).view(np.uint8)
    sc = np.asarray(scale).view(np.uint8)
    gl = np.asarray(glob).view(np.uint16)
    E, R, Kh = packed.shape
    out = np.empty((E, R, 2 * Kh))
    for e in range(E):
        for r in range(R):
            gb = int(gl[e, r])
            gs, ge, gm = gb >> 15, (gb >> 10) & 31, gb & 1023
            gv = (gm * 2.0**-24 if ge == 0 else (1 + gm / 1024) * 2.0 ** (ge - 15)) * (-1) ** gs
            for kk in range(2 * Kh):
                byte = int(packed[e, r, kk // 2])
                c = byte & 15 if kk % 2 == 0 else byte >> 4
                ce, cm = (c >> 1) & 3, c & 1
                wv = (cm * 0.5 if ce == 0 else (1 + cm / 2) * 2.0 ** (ce - 1)) * (-1) ** (c >> 3)
                sb = int(sc[e, r, kk // 16])
                se, sm = (sb >> 3) & 15, sb & 7
                sv = (sm * 2.0**-9 if se == 0 else (1 + sm / 8) * 2.0 ** (se - 7)) * (-1) ** (sb >> 7)
                out[e, r, kk] = wv * sv * gv
    return out


def test_dequantize_exact(rng):
    E, H, I = 2, 32, 16  # noqa: E741
    banks = SPEC.random_banks(E, H, I, rng)
    banks["gate_up_scale"][...] = rng.integers(0, 256, banks["gate_up_scale"].shape, dtype=np.uint8).view(E4M3)
    banks["down_scale"][...] = rng.integers(0, 256, banks["down_scale"].shape, dtype=np.uint8).view(E4M3)
    banks["down_global"][...] = rng.integers(0, 0x7C00, banks["down_global"].shape, dtype=np.uint16).view(np.float16)
    gu, dn = cf.reference.dequantize(FMT, banks)
    ind_gu = _decode_independent(banks["gate_up_packed"], banks["gate_up_scale"], banks["gate_up_global"])
    ind_dn = _decode_independent(banks["down_packed"], banks["down_scale"], banks["down_global"])
    assert np.array_equal(gu, ind_gu) and np.array_equal(dn, ind_dn)
    # uint8 / uint16 views of the same banks are accepted and decode the same
    alt = {n: (a.view(np.uint8) if a.dtype == E4M3 else a.view(np.uint16) if a.dtype == np.float16 else a)
           for n, a in banks.items()}
    gu2, dn2 = cf.reference.dequantize(FMT, alt)
    assert np.array_equal(gu, gu2) and np.array_equal(dn, dn2)


def test_quantizer_roundtrip(rng):
    E, H, I = 2, 64, 32  # noqa: E741
    gu = rng.standard_normal((E, 2 * I, H)).astype(np.float32) * np.float32(0.05)
    dn = rng.standard_normal((E, H, I)).astype(np.float32) * np.float32(3.0)
    gu[0, 3] = 0  # an all-zero row: global guard, zero codes, no NaN
    dn[1, :, :16] *= np.float32(1e-3)  # a small block next to a large one
    b = cf.quantize(FMT, gu, dn)
    dgu, ddn = cf.reference.dequantize(FMT, b)
    assert np.all(dgu[0, 3] == 0) and np.isfinite(dgu).all() and np.isfinite(ddn).all()
    for w, d in ((gu, dgu), (dn, ddn)):
        blk = np.abs(w.astype(np.float64)).reshape(w.shape[0], w.shape[1], -1, 16).max(-1)
        # e2m1 grid: the largest gap is 2 (4 -> 6) block-scale units, block scale ~ amax/6 (e4m3: +-1/16)
        step = np.repeat(blk / 6 * (1 + 2**-3), 16, axis=-1)
        assert np.all(np.abs(d - w) <= step * 1.0001 + 1e-30)
    # codes are the e2m1 RNE of w / (scale * global)
    c = unpack_codes(b["down_packed"])
    assert c.max() <= 15
    with pytest.raises(TypeError):
        cf.quantize(FMT, gu, dn, block=32)


def test_schema():
    assert SPEC.id == 1 and SPEC.k_multiple == 16 and SPEC.input_weight
    assert SPEC.bank_names == ("gate_up_packed", "gate_up_scale", "gate_up_global", "down_packed", "down_scale",
                               "down_global")
    assert SPEC.bytes_per_expert(2048, 512) == 1_775_616  # spec 1.9 (Qwen3.6-35B nvfp4)
    assert SPEC.bytes_per_expert(5120, 1536) == 13_287_424  # GLM-4.7 nvfp4
    assert SPEC.kernel_tiers == {"native": ("scalar", "avx2", "avx512f"),
                                 "w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni")}
    with pytest.raises(ValueError, match="multiples of 16"):
        cf.Kernel(FMT, 1, 24, 32)
