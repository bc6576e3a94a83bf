"""nvfp4_x16 (nvfp4 with 16 rows interleaved per 16-block, in 4-block chunks): the layout, the float64 reference,
bit identity of the tiers (every tier does the same exact integers and fp32 fmas in K order), work items over
ragged row ranges with everything outside them poisoned, edge codes, the prepared activations and the schema.

Tolerance (whole steps, rel = max|y - ref| / max|ref|): nvfp4's 5e-3 (test_nvfp4.py: bf16 output rounding, up to
2^-8 = 3.9e-3 relative, dominates; the w4a8 activation quantization is modelled exactly by the reference's act_in).
Against nvfp4 w4a8 on the same bytes: 1e-2 (both within 5e-3 of the reference). Work items (fp32, before any bf16
rounding): |y - ref| <= (K + 8) u sum|w a| (fp4_helpers.dot_bound), and g within the bf16 roundings of the
activation over that error box (fp4_helpers.check_g).
"""
import numpy as np
import pytest
from conftest import USABLE, rel_err, routes, run_forced, tier_cases
from fp4_helpers import check_down, check_g, dot_bound, prep, run_down, run_gate_up, to_bf16_bits
from x16_helpers import check_ragged_work_items, down_accumulators, split_record

import cpumoe_formats as cf
from cpumoe_formats import activations
from cpumoe_formats.formats import nvfp4, nvfp4_x16
from cpumoe_formats.formats.nvfp4 import quantize_w4a8_act
from cpumoe_formats.numerics import BF16, E4M3

FMT = "nvfp4_x16"
SPEC = cf.get_format(FMT)
SIMD = [t for t in SPEC.kernel_tiers["w4a8"] if t != "scalar"]


def bits_f64(b):
    return np.asarray(b, np.uint16).view(BF16).astype(np.float64)


def acts(vs_bits):
    return [SPEC.act_in(bits_f64(v), "w4a8") for v in vs_bits]


def block_offsets(nb, b):
    """(scale offset, code offset) of block b in a group row of nb blocks, computed from the documented layout."""
    c, i = divmod(b, 4)
    cb = min(4, nb - 4 * c)
    return 576 * c + 16 * i, 576 * c + 16 * cb + 128 * i


@pytest.mark.parametrize("H,I", [(96, 48), (64, 16), (2048, 512), (720, 368)])  # noqa: E741
def test_repack_round_trip_and_layout(rng, H, I):  # noqa: E741
    b = nvfp4.SPEC.random_banks(3, H, I, rng)
    r = cf.repack_nvfp4_x16(b)
    assert cf.validate_banks(FMT, r) == (3, H, I)
    assert SPEC.bytes_per_expert(H, I) == nvfp4.SPEC.bytes_per_expert(H, I)  # the same bytes, moved
    assert all(a.ctypes.data % 64 == 0 for a in r.values())
    u = cf.unpack_nvfp4_x16(r)
    for n in b:
        np.testing.assert_array_equal(np.asarray(u[n]).view(np.uint8), np.asarray(b[n]).view(np.uint8))
    assert u["gate_up_scale"].dtype == E4M3 and u["down_global"].dtype == np.float16
    # byte by byte: expert 1, row 16 g + rr, block bb (the last block sits in a partial chunk when nb % 4)
    for mat, K, R in (("down", I, H), ("gate_up", H, 2 * I)):
        src_p, src_s = b[f"{mat}_packed"].view(np.uint8), b[f"{mat}_scale"].view(np.uint8)
        dst, nb = r[mat], K // 16
        for g, rr, bb in [(0, 0, 0), (1, 15, nb - 1), (R // 16 - 1, 7, nb // 2), (R // 16 - 1, 3, nb - 2)]:
            g, bb = min(g, R // 16 - 1), max(bb, 0)
            so, co = block_offsets(nb, bb)
            row = 16 * g + rr
            assert dst[1, g, so + rr] == src_s[1, row, bb]
            for j in range(2):
                np.testing.assert_array_equal(dst[1, g, co + 64 * j + 4 * rr:co + 64 * j + 4 * rr + 4],
                                              src_p[1, row, 8 * bb + 4 * j:8 * bb + 4 * j + 4])
        np.testing.assert_array_equal(r[f"{mat}_global"][1].reshape(-1).view(np.uint16),
                                      b[f"{mat}_global"][1].view(np.uint16))


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("H,I,T", [(96, 48, 1), (720, 368, 9), (208, 80, 3), (256, 128, 8)])  # noqa: E741
def test_against_float64_reference(rng, mode, tier, H, I, T):  # noqa: E741
    """Group counts 6/6, 45/46, 13/10, 16/16; K blocks 6/3, 45/23 (odd), 13/5, 16/8: full chunks, partial last
    chunks of 1, 2 and 3 blocks, and none."""
    E, K = 5, 4
    b = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, b, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, b, x, w, ids, mode=mode)
    assert rel_err(y, ref) < 5e-3
    # nvfp4 w4a8 on the same bytes: the same math, only the fp32 grouping differs
    yn = cf.moe_forward("nvfp4", cf.unpack_nvfp4_x16(b), x, w, ids, mode="w4a8")
    assert rel_err(y, yn.astype(np.float64)) < 1e-2


@pytest.mark.parametrize("tier", SIMD)
@pytest.mark.parametrize("T", [1, 3, 9])
def test_tiers_bit_identical(rng, tier, T):
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    E, H, I = 4, 720, 368  # noqa: E741 - 45 / 23 blocks: full and partial chunks
    b = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = routes(rng, T, 3, E)
    ys, yt = (run_forced(FMT, b, x, w, ids, "w4a8", t) for t in ("scalar", tier))
    np.testing.assert_array_equal(yt.view(np.uint64), ys.view(np.uint64))
    # fp32 down accumulators of one work item (bf16 outputs would hide a reordered fp32 sum), scales from 1e-3 to 1e3
    gs = to_bf16_bits(rng.standard_normal((T, I)) * np.repeat(10.0 ** rng.uniform(-3, 3, (T, I // 16)), 16, axis=1))
    a0, a1 = down_accumulators(FMT, b, ("scalar", tier), gs, H)
    np.testing.assert_array_equal(a1.view(np.uint32), a0.view(np.uint32))


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("n", [1, 2, 9])
def test_ragged_work_items(rng, mode, tier, n):
    """Row ranges that cut groups: each item writes exactly its rows, with the bits of a whole-range call, and the
    down terms are within the dot bound of float64."""
    E, H, I = 3, 208, 80  # noqa: E741 - 13 and 10 groups, 5 and 13 blocks
    b = SPEC.random_banks(E, H, I, rng)
    wf = SPEC.dequantize(b)[1][1]  # [H, I] float64
    check_ragged_work_items(cf.Kernel(FMT, E, H, I, mode=mode, isa=tier), FMT, b, n, rng,
                            [(5, 37), (16, 32), (0, 1), (79, 80), (17, 18), (33, 80)],
                            [(3, 29), (16, 48), (207, 208), (0, 17), (100, 208)],
                            lambda full, gs, wts: check_down(full, wf, acts(gs), wts))


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_edge_codes(rng, mode, tier):
    """Every e4m3 scale code (0x7F/0xFF = +-480, subnormals m 2^-9, +-0), every e2m1 code pair (all 256 bytes),
    zero weight and activation blocks, q = +-127 against codes +-6 (the integer extremes), fp16 globals subnormal
    and negative; I = 80 puts a partial chunk after the full one."""
    E, H, I = 1, 256, 80  # noqa: E741
    b = nvfp4.SPEC.random_banks(E, H, I, rng)
    # down: row h uses scale code h in all its blocks, so each output isolates one code
    b["down_scale"][...] = np.repeat(np.arange(256, dtype=np.uint8), I // 16).view(E4M3).reshape(1, H, I // 16)
    for h in range(H):
        b["down_packed"][0, h] = rng.permutation(np.arange(256, dtype=np.uint8))[:I // 2]
    b["down_packed"][0, 0xFF] = b["down_packed"][0, 0x7F]  # +480 and -480 rows, same codes and global
    b["down_global"][0, 0xFF] = b["down_global"][0, 0x7F]
    b["down_packed"][0, 0x38, 16:24] = 0  # one all-zero weight block (scale 1.0)
    b["down_packed"][0, 0x39] = np.where(rng.random(I // 2) < 0.5, 0x77, 0xFF)  # +-6 everywhere
    b["down_global"][0, 0x40:0x48] = np.array([0x0001, 0x03FF, 0x8001, 0xBC00, 0x7BFF, 0x3C00, 0x0400, 0x83FF],
                                              np.uint16).view(np.float16)
    # gate_up: every scale code 5 times in random places
    b["gate_up_scale"][...] = rng.permutation(np.arange(2 * I * H // 16) % 256).astype(np.uint8).view(E4M3) \
        .reshape(1, 2 * I, H // 16)
    xb = cf.repack_nvfp4_x16(b)
    k = cf.Kernel(FMT, E, H, I, mode=mode, isa=tier)
    gu, dn = SPEC.dequantize(xb)
    xs = [to_bf16_bits(rng.standard_normal(H) * 3) for _ in range(3)]
    xs[1][32:48] = 0  # an all-zero activation block (s = 1, q = 0)
    xs[2] = to_bf16_bits(np.where(rng.random(H) < 0.5, -2.0, 2.0))  # q = +-127 in every block
    g = run_gate_up(k, FMT, xb, 0, xs)
    act = activations.resolve("silu")
    for j, a in enumerate(acts(xs)):
        gate_up, bnd = gu[0] @ a, dot_bound(gu[0], a)
        check_g(g[j], gate_up[:I], gate_up[I:], bnd[:I], bnd[I:], act)
    gs = [to_bf16_bits(rng.standard_normal(I)), to_bf16_bits(np.where(rng.random(I) < 0.5, -1.0, 1.0))]
    gs[0][16:32] = 0
    acc = run_down(k, FMT, xb, 0, gs, [0.75, 1.5])
    assert np.isfinite(acc).all()
    assert np.all(acc[:, 0x7F] != 0) and np.array_equal(acc[:, 0xFF], -acc[:, 0x7F])  # +-480, not NaN
    assert np.all(acc[:, 0x00] == 0) and np.all(acc[:, 0x80] == 0)  # +-0 scales
    assert np.all(acc[:, 0x01] != 0)  # the smallest subnormal scale, 2^-9
    check_down(acc, dn[0], acts(gs), [0.75, 1.5])


@pytest.mark.parametrize("tier", [p.values[1] for p in tier_cases(FMT)])
def test_prepared_activation_is_nvfp4s(rng, tier):
    """The prepared record, 24 bytes per block: the even then the odd elements' int8 codes, s_a, -12 * sum(q):
    nvfp4 w4a8's quantization (act_in's float32 model) bit for bit."""
    if tier not in USABLE:
        pytest.skip(f"this CPU lacks {tier}")
    K = 400
    k = cf.Kernel(FMT, 1, K, K, mode="w4a8", isa=tier)
    assert k._k.act_bytes(K) == K + 8 * (K // 16)
    v = rng.standard_normal(K).astype(np.float32) * np.repeat(10.0 ** rng.uniform(-6, 6, K // 16), 16)
    v[0:16] = 0
    v[16:32] = np.array([127, -2.5, 2.5, 3.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5, 0, 1, -1, 64.5, 2, 4], np.float32)
    bits = to_bf16_bits(v)
    buf = prep(k, bits)
    nb = K // 16
    q, s, corr = split_record(buf, K, 16)
    q = q.reshape(nb, 2, 8).transpose(0, 2, 1).reshape(K).astype(np.float32)  # even, odd
    q_ref, s_ref = quantize_w4a8_act(bits_f64(bits))
    np.testing.assert_array_equal(s.view(np.uint32), s_ref.view(np.uint32))
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(corr, -12 * q_ref.reshape(nb, 16).sum(axis=1).astype(np.int32))


def test_schema_and_errors(rng):
    b = SPEC.random_banks(3, 2048, 512, rng)
    assert cf.validate_banks(FMT, b) == (3, 2048, 512)
    assert SPEC.id == 9 and SPEC.modes == ("w4a8",) and SPEC.default_mode == "w4a8"
    assert nvfp4.SPEC.cpu_layout == FMT and nvfp4.SPEC.cpu_layout_min_tier == "avx2"
    small = SPEC.random_banks(2, 96, 48, rng)
    with pytest.raises(ValueError, match="down.*expected shape"):
        cf.validate_banks(FMT, dict(small, down=small["down"][:, :, :144]))
    with pytest.raises(ValueError, match="144"):
        cf.validate_banks(FMT, dict(small, down=small["down"][:, :, :100]))
    with pytest.raises(ValueError, match="gate_up"):
        cf.validate_banks(FMT, dict(small, gate_up=small["gate_up"][:, :-1]))
    with pytest.raises(ValueError, match="down_global.*expected shape"):
        cf.validate_banks(FMT, dict(small, down_global=small["down_global"][:, :-1]))
    with pytest.raises(TypeError, match="gate_up_global"):
        cf.validate_banks(FMT, dict(small, gate_up_global=small["gate_up_global"].astype(np.float32)))
    with pytest.raises(ValueError, match="needs banks"):  # nvfp4's row-major banks under this name
        cf.validate_banks(FMT, nvfp4.SPEC.random_banks(2, 96, 48, rng))
    with pytest.raises(ValueError, match="mode"):
        cf.Kernel(FMT, 2, 96, 48, mode="native")
    with pytest.raises(ValueError, match="multiples of 16"):
        cf.Kernel(FMT, 2, 88, 48)
    with pytest.raises(ValueError, match="multiples of 16"):
        cf.repack_nvfp4_x16(nvfp4.SPEC.random_banks(1, 96, 40, rng))
    with pytest.raises(ValueError, match="w4a8 only"):
        SPEC.act_in(np.zeros(16), "native")
    # to_groups / from_groups invert each other; nvfp4's generic to_cpu_layout is the repack; quantize = repack
    nb = nvfp4.SPEC.random_banks(1, 80, 48, rng)
    g = nvfp4_x16.to_groups(nb["down_packed"], nb["down_scale"])
    np.testing.assert_array_equal(nvfp4_x16.to_groups(*nvfp4_x16.from_groups(g)), g)
    for n, a in nvfp4.SPEC.to_cpu_layout(nb).items():
        np.testing.assert_array_equal(a, cf.repack_nvfp4_x16(nb)[n])
    wg, wd = rng.standard_normal((2, 96, 48)) * 0.02, rng.standard_normal((2, 48, 48)) * 0.02
    q, qn = SPEC.quantize(wg, wd), nvfp4.SPEC.quantize(wg, wd)
    for n, a in cf.repack_nvfp4_x16(qn).items():
        np.testing.assert_array_equal(q[n].view(np.uint8), a.view(np.uint8))
