"""q5_k_x16 (q5_k with 16 rows interleaved per 256-block), both modes: the layout, the float64 reference, bit
identity of the tiers (every tier does the same integer and fp32 operations in the same order: w4a8 exact integers
and two fmas a block, native q5_k's scalar operations, element by element), native bit for bit q5_k's scalar tier,
work items over ragged row ranges with everything outside them poisoned, the w4a8 prepared record, edge codes and
scales, non-finite d and dmin and the schema.

Ragged sizes: H and I are multiples of 256 (a Q5_K block), so whole banks always hold whole groups of 16 rows; the
ragged cases are work items whose row ranges cut groups, and 1, 2 and 3 blocks per row.

Tolerance (whole steps, rel = max|y - ref| / max|ref|): q5_k's 5e-3, which bf16 output rounding (up to 2^-8)
dominates; the w4a8 activation codes are modelled exactly by the reference's act_in. Work items (fp32, before any
bf16 rounding): |y - ref| <= 1e-5 * sum (|d sc q| + |dmin m|) |a| (q5_k's bound, test_kquant_kernels.py: w4a8 per
block two exact integers, two roundings of their scales and two fmas over K/256 <= 3 blocks; native gguf's weights,
exact, and one fma an element).
"""
import numpy as np
import pytest
from conftest import USABLE, rel_err, routes, run_forced, tier_cases
from gguf_helpers import bf16, down_rows, kernel_for, kquant_mag_terms
from x16_helpers import (
    check_kquant_record,
    check_kquant_x16_schema,
    check_moved,
    check_ragged_work_items,
    check_tiers_bit_identical,
)

import cpumoe_formats as cf
from cpumoe_formats.formats import q4_k, q5_k, q5_k_x16

FMT = "q5_k_x16"
SPEC = cf.get_format(FMT)
SIMD = [(m, t) for m, ts in SPEC.kernel_tiers.items() for t in ts if t != "scalar"]
TOL, DOT_TOL = 5e-3, 1e-5


@pytest.mark.parametrize("H,I", [(256, 256), (768, 512)])  # noqa: E741
def test_repack_round_trip_and_layout(rng, H, I):  # noqa: E741
    b = q5_k.SPEC.random_banks(3, H, I, rng)
    r = check_moved(FMT, q5_k.SPEC, b, H, I)  # validated, the same bytes moved, and back
    assert q5_k.SPEC.cpu_layout == FMT
    # byte by byte: expert 1, row 16 g + rr, block bb
    src, dst = b["down"], r["down"]
    for g, rr, bb in [(0, 0, 0), (1, 15, I // 256 - 1), (H // 16 - 1, 7, 0)]:
        blk = src[1, 16 * g + rr, 176 * bb:176 * bb + 176]
        grp = dst[1, g, 2816 * bb:2816 * bb + 2816]
        np.testing.assert_array_equal(grp[2 * rr:2 * rr + 2], blk[0:2])
        np.testing.assert_array_equal(grp[32 + 2 * rr:34 + 2 * rr], blk[2:4])
        np.testing.assert_array_equal(grp[64 + rr:256:16], blk[4:16])
        for v in range(8):
            at = 256 + 64 * v + 4 * rr
            np.testing.assert_array_equal(grp[at:at + 4], blk[16 + 4 * v:20 + 4 * v])  # qh
        for c in range(4):
            for v in range(8):
                at = 768 + 512 * c + 64 * v + 4 * rr
                np.testing.assert_array_equal(grp[at:at + 4], blk[48 + 32 * c + 4 * v:52 + 32 * c + 4 * v])


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("H,I,T", [(256, 256, 1), (768, 512, 9), (512, 256, 3), (256, 768, 8)])  # noqa: E741
def test_against_float64_reference(rng, mode, tier, H, I, T):  # noqa: E741
    E, K = 5, 4
    b = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, b, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, b, x, w, ids, mode=mode)
    assert rel_err(y, ref) < TOL
    # q5_k on the same bytes: the same integers (w4a8) or weights (native), only the fp32 grouping differs
    yq = cf.moe_forward("q5_k", cf.unpack_q5_k_x16(b), x, w, ids, mode=mode)
    assert rel_err(y, yq.astype(np.float64)) < 1e-2


@pytest.mark.parametrize("tier", SPEC.kernel_tiers["native"])
@pytest.mark.parametrize("T", [1, 3, 9])
def test_native_is_q5_k_scalar_bit_for_bit(rng, tier, T):
    """native does q5_k's scalar tier's operations in its order: the same output bits as q5_k's scalar kernel."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    E, H, I = 4, 512, 768  # noqa: E741
    b = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = routes(rng, T, 3, E)
    y = run_forced(FMT, b, x, w, ids, "native", tier)
    yq = run_forced("q5_k", cf.unpack_q5_k_x16(b), x, w, ids, "native", "scalar")
    np.testing.assert_array_equal(y.view(np.uint64), yq.view(np.uint64))


@pytest.mark.parametrize("mode,tier", SIMD)
@pytest.mark.parametrize("T", [1, 3, 9])
def test_tiers_bit_identical(rng, mode, tier, T):
    check_tiers_bit_identical(FMT, rng, tier, T, mode)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("n", [1, 2, 9])
def test_ragged_work_items(rng, mode, tier, n):
    """Row ranges that cut groups: each item writes exactly its rows, with the bits of a whole-range call, and the
    down terms are within q5_k's work-item bound of float64."""
    E, H, I = 3, 256, 256  # noqa: E741 - 16 groups each
    b = SPEC.random_banks(E, H, I, rng)
    rows = cf.unpack_q5_k_x16(b)["down"][1]
    wf, mag = q5_k.decode_blocks(rows), kquant_mag_terms("q5_k", rows)

    def check(full, gs, wts):
        for j in range(n):
            a = SPEC.act_in(gs[j].view(cf.numerics.BF16).astype(np.float32), mode)
            assert (np.abs(full[j] - wts[j] * (wf @ a)) <= wts[j] * DOT_TOL * (mag @ np.abs(a)) + 1e-30).all()

    check_ragged_work_items(cf.Kernel(FMT, E, H, I, mode=mode, isa=tier), FMT, b, n, rng,
                            [(5, 37), (16, 32), (0, 1), (255, 256), (17, 18)], [(3, 29), (16, 48), (255, 256), (0, 17)],
                            check)


def _edge(blk, case, rng):
    """q5_k blocks [..., 176] set to an edge case. max: every code 31 with scales and mins 63 (the largest products
    and sums, against activations coded +-127); fifth: random nibbles with every fifth bit set (codes 16..31: a
    kernel that drops or misplaces a fifth bit is off by 16 d sc); lowfifth: every fifth bit set, every nibble 0
    (codes exactly 16); codes0: every code 0 (w = -dmin m only); sc0 / m0: scales or mins all 0; scales: d and dmin
    subnormal, negative and +-0, scales and mins 0 and 63."""
    sc = rng.integers(0, 64, blk.shape[:-1] + (8,)).astype(np.uint8)
    m = rng.integers(0, 64, blk.shape[:-1] + (8,)).astype(np.uint8)
    if case == "max":
        sc[...] = m[...] = 63
        blk[..., 16:] = 0xFF
    elif case == "fifth":
        blk[..., 16:48] = 0xFF
    elif case == "lowfifth":
        blk[..., 16:48], blk[..., 48:] = 0xFF, 0
    elif case == "codes0":
        blk[..., 16:] = 0
    elif case == "sc0":
        sc[...] = 0
    elif case == "m0":
        m[...] = 0
    else:
        d = np.array([6e-8, -0.0025, 0.0, -0.0, 0.004, 2.0 ** -20], "<f2")
        for off in (0, 2):
            blk[..., off:off + 2] = d[rng.integers(0, len(d), blk.shape[:-1])][..., None].view(np.uint8)
        v = rng.choice(np.array([0, 63]), blk.shape[:-1] + (16,)).astype(np.uint8)
        sc, m = v[..., :8], v[..., 8:]
    blk[..., 4:16] = q4_k.pack_scales_mins(sc, m)
    want = {"max": 31, "lowfifth": 16, "codes0": 0}.get(case)
    if want is not None:
        assert np.all(q5_k.codes(blk) == want)
    if case == "fifth":
        assert np.all(q5_k.codes(blk) >= 16)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("case", ["max", "fifth", "lowfifth", "codes0", "sc0", "m0", "scales"])
def test_edge_codes(rng, mode, tier, case):
    """The extreme codes and scales (_edge) in a work item against float64 and in a whole step."""
    E, H, I = 2, 256, 512  # noqa: E741
    b = q5_k.SPEC.random_banks(E, H, I, rng)
    for name in b:
        _edge(b[name].reshape(b[name].shape[:-1] + (-1, 176)), case, rng)
    xb = cf.repack_q5_k_x16(b)
    g = bf16(np.repeat(rng.uniform(0.5, 2, I // 32), 32) * (1.0 if case == "max" else rng.choice([-1.0, 1.0], I)))
    if case == "max":
        g[:256] = bf16(np.full(256, 1.5))
        assert np.all(cf.numerics.int8_blocks(g.astype(np.float64), 256)[0][0] == 127)
    k = kernel_for(FMT, E, H, I, mode, tier)
    y = down_rows(k, xb, 1, 0, H, g)
    wf = SPEC.dequantize(xb)[1][1]
    a = SPEC.act_in(g.astype(np.float64), mode)
    mag = kquant_mag_terms("q5_k", b["down"][1]) @ np.abs(a)
    assert np.all(np.abs(y - wf @ a) <= DOT_TOL * mag + 1e-30)
    x = np.where(rng.random((3, H)) < 0.5, -1.0, 1.0).astype(np.float32) * 3.0  # q = +-127 in every block
    w, ids = routes(rng, 3, 2, E, skip=False)
    yf = run_forced(FMT, xb, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, xb, x, w, ids, mode=mode)
    assert rel_err(yf, ref) < TOL


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("field,kind", [("d", "nan"), ("d", "inf"), ("dmin", "nan"), ("dmin", "inf")])
def test_nonfinite_d(rng, mode, tier, field, kind):
    """A NaN or an inf in one block's d or dmin (that block's scales and mins all 0: a kernel that skipped a zero
    term would lose it, as inf * 0 is NaN): the outputs of the tokens routed to that expert are non-finite where the
    reference's are (NaN exactly where its are, for NaN); every other row equals the clean run bit for bit."""
    E, H, I = 3, 256, 256  # noqa: E741
    b = q5_k.SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((4, H)).astype(np.float32)
    ids = np.array([[0, 1], [2, 0], [1, 1], [2, -1]], np.int32)
    w = rng.random((4, 2), dtype=np.float32) + np.float32(0.25)
    clean = run_forced(FMT, cf.repack_q5_k_x16(b), x, w, ids, mode, tier)
    blk = b["gate_up"][1, 5, :176]  # gate row 5's first block
    blk[4:16] = 0
    off = {"d": 0, "dmin": 2}[field]
    blk[off:off + 2] = np.array([np.nan if kind == "nan" else np.inf], "<f2").view(np.uint8)
    bad = cf.repack_q5_k_x16(b)
    y = kernel_for(FMT, E, H, I, mode, tier).forward(bad, x, w, ids).astype(np.float64)
    with np.errstate(all="ignore"):
        ref = cf.numerics.round_bf16(cf.reference.moe(FMT, bad, x, w, ids, mode=mode))
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(ref))
    if kind == "nan":
        np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    assert not np.isfinite(y[[0, 2]]).all()  # the tokens routed to expert 1
    np.testing.assert_array_equal(y[[1, 3]], clean[[1, 3]])


@pytest.mark.parametrize("mode,tier", tier_cases(FMT, ["w4a8"]))
def test_prepared_record(rng, mode, tier):
    check_kquant_record(FMT, rng, mode, tier)


def test_schema_and_errors(rng):
    check_kquant_x16_schema(q5_k_x16, q5_k, 20, rng)
