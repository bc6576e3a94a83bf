"""fp8_block_x16 (fp8_block with 16 rows interleaved per K pair): the layout, the float64 reference, bit identity
of the tiers (every tier does vdpbf16ps' fp32 steps in the same order), work items over ragged row ranges with
everything outside them poisoned, edge codes, the executor-facing repack and the schema.

Tolerance (whole steps, rel = max|y - ref| / max|ref|): fp8_block's 5e-3, which bf16 output rounding (up to 2^-8 =
3.9e-3 relative) dominates; the products are exact and only fp32 sums round. Work items (fp32, before any bf16
rounding): |y - ref| <= (K + 8) u sum|w x| (fp4_helpers.dot_bound).
"""
import numpy as np
import pytest
from conftest import USABLE, rel_err, routes, run_forced, tier_cases
from fp4_helpers import dot_bound, to_bf16_bits
from x16_helpers import (
    check_like_scalar,
    check_pair_layout_errors,
    check_pair_round_trip,
    check_ragged_work_items,
    down_accumulators,
    down_bits,
)

import cpumoe_formats as cf
from cpumoe_formats.formats import fp8_block, fp8_block_x16
from cpumoe_formats.numerics import BF16, e4m3_decode

FMT = "fp8_block_x16"
SPEC = cf.get_format(FMT)
SIMD = [t for t in SPEC.kernel_tiers["native"] if t not in ("scalar", "amx")]  # amx: the tile unit's own sums


def _codes(a):
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("H,I", [(96, 64), (16, 16), (2048, 144)])  # noqa: E741
def test_repack_round_trip_and_layout(rng, H, I):  # noqa: E741
    b = fp8_block.SPEC.random_banks(3, H, I, rng)
    r = check_pair_round_trip(FMT, fp8_block.SPEC, b, H, I)
    assert r["gate_up_scale"].ctypes.data != b["gate_up_scale"].ctypes.data  # copies, not views


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("H,I,T", [(96, 64, 1), (1104, 304, 9), (16, 16, 3), (256, 128, 8)])  # noqa: E741
def test_against_float64_reference(rng, mode, tier, H, I, T):  # noqa: E741
    E, K = 5, 4
    b = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, b, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, b, x, w, ids, mode=mode)
    assert rel_err(y, ref) < 5e-3
    # fp8_block on the same bytes: the same math, only the fp32 grouping differs
    y8 = cf.moe_forward("fp8_block", cf.unpack_fp8_block_x16(b), x, w, ids)
    assert rel_err(y, y8.astype(np.float64)) < 1e-2


@pytest.mark.parametrize("tier", SIMD)
@pytest.mark.parametrize("T", [1, 3, 9])
def test_tiers_bit_identical(rng, tier, T):
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    E, H, I = 4, 1104, 304  # noqa: E741
    b = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = routes(rng, T, 3, E)
    ys, yt = (run_forced(FMT, b, x, w, ids, "native", t) for t in ("scalar", tier))
    np.testing.assert_array_equal(yt.view(np.uint64), ys.view(np.uint64))
    # fp32 down accumulators of one work item (bf16 outputs would hide a reordered fp32 sum)
    gs = to_bf16_bits(rng.standard_normal((T, I)) * rng.uniform(0.01, 10.0, (T, 1)))
    a0, a1 = down_accumulators(FMT, b, ("scalar", tier), gs, H)
    np.testing.assert_array_equal(a1.view(np.uint32), a0.view(np.uint32))


def _scaled(banks, which, R, K):
    """float64 [R, K] weights of expert 1 (codes times block scales)."""
    return fp8_block.SPEC.dequantize(cf.unpack_fp8_block_x16(banks))[which][1][:R, :K]


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("n", [1, 2, 9])
def test_ragged_work_items(rng, mode, tier, n):
    """Row ranges that cut groups: each item writes exactly its rows, with the bits of a whole-range call, and the
    down terms are within the dot bound of float64."""
    E, H, I = 3, 160, 208  # noqa: E741 - 10 and 26 groups; down K = 208: a 128-block and a partial one of 80
    b = SPEC.random_banks(E, H, I, rng)
    wf = _scaled(b, 1, H, I)

    def check(full, gs, wts):
        for j in range(n):
            a = gs[j].view(BF16).astype(np.float64)
            assert (np.abs(full[j] - wts[j] * (wf @ a)) <= wts[j] * dot_bound(wf, a) + 1e-30).all()

    check_ragged_work_items(cf.Kernel(FMT, E, H, I, mode=mode, isa=tier), FMT, b, n, rng,
                            [(5, 37), (16, 32), (0, 1), (207, 208), (17, 18), (100, 200)],
                            [(3, 29), (16, 48), (159, 160), (0, 17)], check)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_edge_codes(rng, mode, tier):
    """Every code (+-480 at 0x7F / 0xFF, the subnormals m 2^-9, +-0) in every row, block scales of distinct
    powers of two over a non-square block grid (a transposed or wrong-block scale fails), through both passes."""
    E, H, I = 2, 272, 144  # noqa: E741 - 3 x 2 and 2 x 3 scale blocks, partial ones in both passes
    b = fp8_block.SPEC.random_banks(E, H, I, rng)
    for name in ("gate_up", "down"):
        c = _codes(b[name])
        c[...] = rng.permutation(np.resize(np.arange(256, dtype=np.uint8), c.size)).reshape(c.shape)
    for name in ("gate_up_scale", "down_scale"):
        s = b[name]
        s[...] = (2.0 ** rng.integers(-14, -4, s.shape)).astype(BF16)
    xb = cf.repack_fp8_block_x16(b)
    x = rng.standard_normal((3, H)).astype(np.float32)
    w, ids = routes(rng, 3, 2, E, skip=False)
    y = run_forced(FMT, xb, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, xb, x, w, ids, mode=mode)
    assert rel_err(y, ref) < 5e-3
    assert np.abs(e4m3_decode(np.array([0x7F, 0xFF, 0x01], np.uint8))).tolist() == [480.0, 480.0, 2.0 ** -9]


def _down_banks(rng, rows):
    """fp8_block_x16 banks of one expert (H 64, I 256: down K is two 128-blocks, scales 1 and 2^-30) whose down
    codes are random with rows[r] = {K: code} (zero elsewhere) replacing row r."""
    b = fp8_block.SPEC.random_banks(1, 64, 256, rng)
    c = _codes(b["down"])[0]
    for r, ks in rows.items():
        c[r] = 0
        for k, code in ks.items():
            c[r, k] = code
    b["down_scale"][0, 0, :2] = np.array([1.0, 2.0**-30]).astype(BF16)
    return cf.repack_fp8_block_x16(b)


def test_flush_to_zero_cases(rng):
    """The fp32-FMA tiers (x16_fma.h: an MXCSR FTZ pass checked by the underflow flag, then an explicit-flush pass)
    against scalar on constructed rows (row r's c0 pair at K 4r, 4r + 1, its c1 pair at 4r + 2, 4r + 3): a
    subnormal c0 + c1 and a subnormal scale product (plain operations: scalar keeps them, FTZ flushes them), a tiny
    first product (dp_step flushes it), a subnormal code, a subnormal activation; the other rows random. e4m3
    products cannot reach FLT_MIN's rounding boundary (their bits stop at 2^-142). Scalar's values are asserted."""
    t = 2.0**-120
    cases = {  # row: ({K: (code, x)}, scalar's dot)
        0: ({1: (0x0C, t), 3: (0x88, t)}, 2.0**-127),  # 1.5 2^-126 - 2^-126
        1: ({5: (0x01, t)}, 0.0),  # 2^-9 2^-120: tiny, flushed
        2: ({129: (0x38, 2.0**-100)}, 2.0**-130),  # K block 1: 2^-100 times its scale 2^-30
        3: ({13: (0x03, 1.0)}, 3 * 2.0**-9),
        4: ({17: (0x78, 2.0**-130)}, 0.0),  # a subnormal activation reads as zero (times 2^8 it would be normal)
        5: ({21: (0x8C, t), 23: (0x08, t)}, -(2.0**-127)),
    }
    assert e4m3_decode(np.array([0x0C, 0x88, 0x01, 0x38, 0x03, 0x78], np.uint8)).tolist() == [
        1.5 * 2.0**-6, -(2.0**-6), 2.0**-9, 1.0, 3 * 2.0**-9, 256.0]
    x = rng.standard_normal(256).astype(np.float32)
    for ks, _ in cases.values():
        for k, (_, xv) in ks.items():
            x[k] = xv
    banks = _down_banks(rng, {r: {k: c for k, (c, _) in ks.items()} for r, (ks, _) in cases.items()})
    check_like_scalar(FMT, banks, to_bf16_bits(x), 64, rng, {r: v for r, (_, v) in cases.items()})


def test_subnormal_codes(rng):
    """Even rows of subnormal codes only (m 2^-9; avx2's bf16-pattern decode makes them fp32 subnormals before
    its 2^120), activations of magnitude 2^10 to 2^20: every product normal, so the FTZ pass stands, with DAZ off."""
    sub = rng.integers(1, 8, (32, 256)) | rng.choice([0, 0x80], (32, 256))
    banks = _down_banks(rng, {r: dict(enumerate(sub[r // 2])) for r in range(0, 64, 2)})
    x = to_bf16_bits(2.0 ** rng.uniform(10, 20, 256) * rng.choice([-1.0, 1.0], 256))
    assert (down_bits(FMT, banks, "scalar", [x], 64).view(np.float32)[0, ::2] != 0).all()
    check_like_scalar(FMT, banks, x, 64, rng)


def test_large_activations(rng):
    """Tokens whose x * 2^120 (avx2) would overflow (|x| >= 2^8) take the decode with its multiply (x16_fma.h
    prep_act_xs), alone (1 route) and next to tokens that take x * 2^120 (3 and 9 routes); avx512f's 2^8 overflows
    from 2^120, so x reaches 2^121 (products overflow alike in every tier)."""
    x = rng.standard_normal(256) * 2.0 ** rng.integers(-20, 12, 256)
    x[[7, 100, 200]] = [300.0, -(2.0**100), 2.0**121]
    banks = _down_banks(rng, {})
    check_like_scalar(FMT, banks, to_bf16_bits(x), 64, rng)


def test_schema_and_errors(rng):
    b = SPEC.random_banks(3, 2048, 512, rng)
    assert cf.validate_banks(FMT, b) == (3, 2048, 512)
    assert SPEC.id == 8 and cf.get_format("fp8_block_cpu") is SPEC and SPEC.modes == ("native",)
    assert fp8_block.SPEC.cpu_layout == FMT and fp8_block.SPEC.cpu_layout_min_tier == "avx2"
    check_pair_layout_errors(FMT, fp8_block.SPEC, rng)
    g = fp8_block_x16.to_groups(_codes(fp8_block.SPEC.random_banks(1, 32, 32, rng)["down"]))
    np.testing.assert_array_equal(fp8_block_x16.to_groups(fp8_block_x16.from_groups(g)), g)
