"""bf16_x16 (bf16 with 16 rows interleaved per K pair): the layout, the float64 reference, bit identity of the
tiers (scalar does vdpbf16ps' fp32 steps in its order), work items over ragged row ranges with everything outside
them poisoned, edge values, the executor-facing repack and the schema.

Tolerance (whole steps, rel = max|y - ref| / max|ref|): bf16's 6e-3 (docs/formats/bf16.md): y's and g's bf16
roundings dominate; the products are exact and only fp32 sums round. Work items (fp32, before any bf16
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
from cpumoe_formats.formats import bf16, bf16_x16
from cpumoe_formats.numerics import BF16

FMT = "bf16_x16"
SPEC = cf.get_format(FMT)
SIMD = [t for t in SPEC.kernel_tiers["native"] if t != "scalar"]
FLT_MIN = 2.0**-126


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint16)


@pytest.mark.parametrize("H,I", [(96, 64), (16, 16), (2048, 144)])  # noqa: E741
def test_repack_round_trip_and_layout(rng, H, I):  # noqa: E741
    r = check_pair_round_trip(FMT, bf16.SPEC, bf16.SPEC.random_banks(3, H, I, rng), H, I)
    assert r["down"].ctypes.data % 64 == 0


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("H,I,T", [(96, 64, 1), (1104, 304, 9), (16, 16, 3), (2048, 768, 8)])  # noqa: E741
def test_against_float64_reference(rng, mode, tier, H, I, T):  # noqa: E741
    E, K = 5, 4
    b = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, b, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, b, x, w, ids, mode=mode)
    assert rel_err(y, ref) < 6e-3
    yb = cf.moe_forward("bf16", cf.unpack_bf16_x16(b), x, w, ids)  # bf16 on the same values: another fp32 order
    assert rel_err(y, yb.astype(np.float64)) < 1e-2


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


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("n", [1, 2, 9])
def test_ragged_work_items(rng, mode, tier, n):
    """Row ranges that cut groups: each item writes exactly its rows, with the bits of a whole-range call, and the
    down terms are within the dot bound of float64."""
    E, H, I = 3, 160, 208  # noqa: E741 - 10 and 13 + 13 groups
    b = SPEC.random_banks(E, H, I, rng)
    wf = SPEC.dequantize(b)[1][1]  # [H, I] float64

    def check(full, gs, wts):
        for j in range(n):
            a = gs[j].view(BF16).astype(np.float64)
            assert (np.abs(full[j] - wts[j] * (wf @ a)) <= wts[j] * dot_bound(wf, a) + 1e-30).all()

    check_ragged_work_items(cf.Kernel(FMT, E, H, I, mode=mode, isa=tier), FMT, b, n, rng,
                            [(5, 37), (16, 32), (0, 1), (207, 208), (17, 18), (100, 200)],
                            [(3, 29), (16, 48), (159, 160), (0, 17)], check)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_edge_values(rng, mode, tier):
    """Weights of every binade from 2^-52 to 2^-6 with both signs and +-0 in every row, activations over 2^-8 to
    2^8 (normal ones: vdpbf16ps reads bf16 subnormals as zero, which the reference does not model)."""
    E, H, I = 2, 272, 144  # noqa: E741
    b = bf16.SPEC.random_banks(E, H, I, rng)
    for name in ("gate_up", "down"):
        a = b[name]
        mag = 2.0 ** rng.integers(-52, -5, a.shape) * rng.uniform(1, 2, a.shape)
        v = np.where(rng.random(a.shape) < 0.05, 0.0, mag * np.where(rng.random(a.shape) < 0.5, -1, 1))
        a[...] = v.astype(np.float32).astype(BF16)
    xb = cf.repack_bf16_x16(b)
    x = (rng.standard_normal((3, H)) * 2.0 ** rng.integers(-8, 9, (3, H))).astype(np.float32)
    w, ids = routes(rng, 3, 2, E, skip=False)
    y = run_forced(FMT, xb, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, xb, x, w, ids, mode=mode)
    assert rel_err(y, ref) < 6e-3


def _down_banks(W):
    """bf16_x16 banks of one expert whose down matrix is W [H, I] (exact bf16 values), gate_up random."""
    b = bf16.SPEC.random_banks(1, *W.shape, np.random.default_rng(0))
    b["down"][0] = W.astype(BF16)
    assert (b["down"][0].astype(np.float32) == W).all()
    return cf.repack_bf16_x16(b)


def _flush_cases(rng):
    """Down banks (H 64, I 256), an activation and scalar's dot per case row: rows 0-9 each a chain's few steps
    (zero weights elsewhere; row r's c0 pair at K 4r, 4r + 1 and its c1 pair at 4r + 2, 4r + 3, the odd element
    first), rows 16-63 dense random."""
    H, I = 64, 256  # noqa: E741
    W = (rng.standard_normal((H, I)) * 0.02).astype(BF16).astype(np.float32)
    W[:16] = 0
    x = rng.standard_normal(I).astype(BF16).astype(np.float32)
    a, b = 2.0**-75, 2.0**-63
    cases = {  # row: ((K, w, x), ...), scalar's dot
        0: (((1, b, b), (0, -a, a)), FLT_MIN),  # 2^-126 - 2^-150: the subnormal grid's midpoint, even -> FLT_MIN
        1: (((5, b, b), (4, -0.75 * a, a)), FLT_MIN),  # FTZ rounds 2^-126 - 0.75 2^-150 to 2^-126 - 2^-150: tiny
        2: (((9, b, b), (8, -1.25 * a, a)), 0.0),  # under the midpoint: the largest subnormal, flushed
        3: (((13, 2.0**-70, 2.0**-62),), 0.0),  # a tiny first product, flushed
        4: (((17, -(2.0**-70), 2.0**-62),), 0.0),  # -0, then + 0 x: +0
        5: (((21, 2.0**-130, 2.0**20),), 2.0**-110),  # a subnormal weight (kept), a normal product
        6: (((25, 2.0**20, 2.0**-130),), 0.0),  # a subnormal activation reads as zero
        7: (((29, 1.5 * b, b), (31, -b, b)), 2.0**-127),  # c0 + c1 subnormal: a plain add, kept
        8: (((33, -b, b), (32, 0.75 * a, a)), -FLT_MIN),
        # both chains' last pairs (K 252-255): a tiny negative product -> -0, then 0 x (-1) keeps it: -0 + -0
        9: (((253, -(2.0**-70), 2.0**-62), (252, 0.0, -1.0), (255, -(2.0**-70), 2.0**-62), (254, 0.0, -1.0)), -0.0),
    }
    for r, (steps, _) in cases.items():
        for k, w, xv in steps:
            W[r, k], x[k] = w, xv
    return _down_banks(W), to_bf16_bits(x), {r: v for r, (_, v) in cases.items()}


def test_flush_to_zero_cases(rng):
    """The fp32-FMA tiers (x16_fma.h: an MXCSR FTZ pass checked by the underflow flag, then an explicit-flush pass)
    against scalar's dp_step on constructed rows (_flush_cases): exact results at FLT_MIN's rounding boundary,
    where x86's FTZ (tininess after rounding) flushes what dp_step's gradual underflow rounds up to FLT_MIN, tiny
    products, the sign of a flushed zero, a subnormal c0 + c1, a subnormal weight and a subnormal activation.
    Scalar's values are asserted too, so the cases hit what they are meant to."""
    banks, x, expect = _flush_cases(rng)
    check_like_scalar(FMT, banks, x, 64, rng, expect)


@pytest.mark.skipif("avx512bf16" not in USABLE, reason="this CPU/OS lacks the avx512bf16 tier")
def test_vdpbf16ps_edges(rng):
    """Where avx512bf16 (vdpbf16ps) parts from scalar's dp_step (seen on the H200 host's Xeon, 2026-12-01): it
    reads subnormal weights as zero (DAZ on both sources: row 5) and flushes the exact results FLT_MIN - 2^-150
    and FLT_MIN - 0.75 2^-150 (rows 0, 1, 8), which dp_step's gradual underflow rounds up to +-FLT_MIN (whether
    its tininess is decided before or after rounding is not pinned here). So it equals scalar except for
    subnormal weights and steps within 2^-150 of FLT_MIN; the fp32-FMA tiers equal scalar there too
    (test_flush_to_zero_cases)."""
    banks, x, _ = _flush_cases(rng)
    ref, got = (down_bits(FMT, banks, t, [x], 64)[0] for t in ("scalar", "avx512bf16"))
    assert np.nonzero(ref != got)[0].tolist() == [0, 1, 5, 8]


@pytest.mark.parametrize("tier", ["avx2", "avx512f"])
def test_mxcsr_restored(rng, tier):
    """A call runs under its own MXCSR (FTZ) and gives the caller's back, after the fast pass and after the exact
    one: this thread's fp32 arithmetic still underflows gradually (numpy's float32 multiply is an SSE mulss)."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    fast = cf.repack_bf16_x16(bf16.SPEC.random_banks(1, 64, 256, rng)), to_bf16_bits(rng.standard_normal(256))
    for banks, g in (fast, _flush_cases(rng)[:2]):  # the flush cases take the exact pass too
        down_bits(FMT, banks, tier, [g], 64)
        assert (np.float32(FLT_MIN) * np.float32(0.5)).view(np.uint32) == 0x00400000  # 2^-127, not flushed


def test_subnormal_weights(rng):
    """Even rows of bf16 subnormal weights (m 2^-133), activations of magnitude 2^10 to 2^20: every product and
    partial sum normal, so the FTZ pass stands, with DAZ off (DAZ would read these weights as zero)."""
    H, I = 64, 256  # noqa: E741
    W = (rng.standard_normal((H, I)) * 0.02).astype(BF16).astype(np.float32)
    W[::2] = rng.integers(1, 128, (H // 2, I)) * 2.0**-133 * rng.choice([-1.0, 1.0], (H // 2, I))
    x = to_bf16_bits(2.0 ** rng.uniform(10, 20, I) * rng.choice([-1.0, 1.0], I))
    banks = _down_banks(W)
    assert (down_bits(FMT, banks, "scalar", [x], H).view(np.float32)[0, ::2] != 0).all()
    check_like_scalar(FMT, banks, x, H, rng)


def test_schema_and_errors(rng):
    b = SPEC.random_banks(3, 2048, 768, rng)
    assert cf.validate_banks(FMT, b) == (3, 2048, 768)
    assert SPEC.id == 11 and cf.get_format("bf16_cpu") is SPEC and SPEC.modes == ("native",)
    assert bf16.SPEC.cpu_layout == FMT and bf16.SPEC.cpu_layout_min_tier == "avx512f"
    check_pair_layout_errors(FMT, bf16.SPEC, rng)
    g = bf16_x16.pair_groups(_bits(bf16.SPEC.random_banks(1, 32, 32, rng)["down"]))
    np.testing.assert_array_equal(bf16_x16.pair_groups(bf16_x16.from_pair_groups(g)), g)
