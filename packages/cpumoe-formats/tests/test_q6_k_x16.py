"""q6_k_x16 (q6_k with 16 rows interleaved per 256-block), both modes: the layout, the float64 reference, bit
identity of the tiers (every tier does the same integer and fp32 operations in the same order: w4a8 exact integers
and one fma a block, native fmas in element order and one a sub-block), work items over ragged row ranges with
everything outside them poisoned, the w4a8 prepared record, edge codes and scales, non-finite d and the schema.

Ragged sizes: H and I are multiples of 256 (a Q6_K block), so whole banks always hold whole groups of 16 rows; the
ragged cases are work items whose row ranges cut groups, and 1, 2 and 3 blocks per row.

Tolerance (whole steps, rel = max|y - ref| / max|ref|): q6_k's 5e-3, which bf16 output rounding (up to 2^-8)
dominates; the w4a8 activation codes are modelled exactly by the reference's act_in. Work items (fp32, before any
bf16 rounding): |y - ref| <= 1e-5 * sum |w a| (q6_k's bound; its weights are exact in fp32). w4a8: per block one exact
integer, one rounding of it to fp32, one of d d_a and one fma, over K/256 <= 3 blocks; native: 16 fmas a sub-block
and one per sub-block, K/16 + 16 <= 64 roundings at K = 768 (~4e-6).
"""
import numpy as np
import pytest
from conftest import rel_err, routes, run_forced, tier_cases
from gguf_helpers import bf16, dot_ref, down_rows, kernel_for
from x16_helpers import (
    check_kquant_x16_schema,
    check_moved,
    check_ragged_work_items,
    check_tiers_bit_identical,
    kquant_records,
)

import cpumoe_formats as cf
from cpumoe_formats.formats import q6_k, q6_k_x16

FMT = "q6_k_x16"
SPEC = cf.get_format(FMT)
SIMD = [(m, t) for m, ts in SPEC.kernel_tiers.items() for t in ts if t != "scalar"]
TOL, DOT_TOL = 5e-3, 1e-5


@pytest.mark.parametrize("H,I", [(256, 256), (768, 512)])  # noqa: E741
def test_repack_round_trip_and_layout(rng, H, I):  # noqa: E741
    b = q6_k.SPEC.random_banks(3, H, I, rng)
    r = check_moved(FMT, q6_k.SPEC, b, H, I)  # validated, the same bytes moved, and back
    assert q6_k.SPEC.cpu_layout == FMT
    # byte by byte: expert 1, row 16 g + rr, block bb
    src, dst = b["down"], r["down"]
    for g, rr, bb in [(0, 0, 0), (1, 15, I // 256 - 1), (H // 16 - 1, 7, 0)]:
        blk = src[1, 16 * g + rr, 210 * bb:210 * bb + 210]
        grp = dst[1, g, 3360 * bb:3360 * bb + 3360]
        np.testing.assert_array_equal(grp[2 * rr:2 * rr + 2], blk[208:210])
        np.testing.assert_array_equal(grp[32 + rr:288:16], blk[192:208])
        for h in range(2):
            for v in range(8):
                at = 288 + 1536 * h + 192 * v + 4 * rr
                np.testing.assert_array_equal(grp[at:at + 4], blk[64 * h + 4 * v:64 * h + 4 * v + 4])  # A
                np.testing.assert_array_equal(grp[at + 64:at + 68], blk[64 * h + 32 + 4 * v:64 * h + 36 + 4 * v])
                np.testing.assert_array_equal(grp[at + 128:at + 132], blk[128 + 32 * h + 4 * v:132 + 32 * h + 4 * v])


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
    # q6_k on the same bytes: the same integers (w4a8) or products (native), only the fp32 grouping differs
    yq = cf.moe_forward("q6_k", cf.unpack_q6_k_x16(b), x, w, ids, mode=mode)
    assert rel_err(y, yq.astype(np.float64)) < 1e-2


@pytest.mark.parametrize("mode,tier", SIMD)
@pytest.mark.parametrize("T", [1, 3, 9])
def test_tiers_bit_identical(rng, mode, tier, T):
    check_tiers_bit_identical(FMT, rng, tier, T, mode)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("n", [1, 2, 9])
def test_ragged_work_items(rng, mode, tier, n):
    """Row ranges that cut groups: each item writes exactly its rows, with the bits of a whole-range call, and the
    down terms are within q6_k's work-item bound of float64."""
    E, H, I = 3, 256, 256  # noqa: E741 - 16 groups each
    b = SPEC.random_banks(E, H, I, rng)
    wf = q6_k.decode_blocks(cf.unpack_q6_k_x16(b)["down"][1])

    def check(full, gs, wts):
        for j in range(n):
            a = SPEC.act_in(gs[j].view(cf.numerics.BF16).astype(np.float32), mode)
            assert (np.abs(full[j] - wts[j] * (wf @ a)) <= wts[j] * DOT_TOL * (np.abs(wf) @ np.abs(a)) + 1e-30).all()

    check_ragged_work_items(cf.Kernel(FMT, E, H, I, mode=mode, isa=tier), FMT, b, n, rng,
                            [(5, 37), (16, 32), (0, 1), (255, 256), (17, 18)], [(3, 29), (16, 48), (255, 256), (0, 17)],
                            check)


def _edge(blk, case, rng):
    """q6_k blocks [..., 210] set to an edge case. max: every code 63 with scales -128 (the largest products and
    partial sums, against activations coded +127); min: every code 0 (w = -32 d sc) with scales 127; mixed: codes
    0 and 63 and scales -128 and 127 at random; mid: every code 32 (w = 0 exactly); sc0: scales all 0."""
    shape = blk.shape[:-1]
    L = {"max": np.full(shape + (256,), 63), "min": np.zeros(shape + (256,)), "mid": np.full(shape + (256,), 32),
         "mixed": rng.choice(np.array([0, 63]), shape + (256,)), "sc0": None}[case]
    if L is not None:
        blk[..., 0:128], blk[..., 128:192] = q6_k.pack_codes(L.astype(np.uint8))
    sc = {"max": 0x80, "min": 127, "mid": 5, "sc0": 0, "mixed": rng.choice(np.array([0x80, 127]), shape + (16,))}[case]
    blk[..., 192:208] = sc


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("case", ["max", "min", "mixed", "mid", "sc0"])
def test_edge_codes(rng, mode, tier, case):
    """The extreme codes and scales (_edge) in a work item against float64 (exactly 0 where every weight is) and
    in a whole step."""
    E, H, I = 2, 256, 512  # noqa: E741
    b = q6_k.SPEC.random_banks(E, H, I, rng)
    for name in b:
        _edge(b[name].reshape(b[name].shape[:-1] + (-1, 210)), case, rng)
    xb = cf.repack_q6_k_x16(b)
    g = bf16(np.repeat(rng.uniform(0.5, 2, I // 32), 32) * (1.0 if case == "max" else rng.choice([-1.0, 1.0], I)))
    if case == "max":
        g[:256] = bf16(np.full(256, 1.5))
        assert np.all(cf.numerics.int8_blocks(g.astype(np.float64), 256)[0][0] == 127)
    k = kernel_for(FMT, E, H, I, mode, tier)
    y = down_rows(k, xb, 1, 0, H, g)
    ref, mag = dot_ref(SPEC, xb, 1, 0, H, g, mode)
    assert np.all(np.abs(y - ref) <= DOT_TOL * mag)
    if case in ("mid", "sc0"):
        assert np.all(ref == 0) and np.all(y == 0)
    else:
        assert np.all(np.abs(ref) > 0)
    x = np.where(rng.random((3, H)) < 0.5, -1.0, 1.0).astype(np.float32) * 3.0  # q = +-127 in every block
    w, ids = routes(rng, 3, 2, E, skip=False)
    yf = run_forced(FMT, xb, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, xb, x, w, ids, mode=mode)
    if case in ("mid", "sc0"):
        assert not yf.any() and not ref.any()
    else:
        assert rel_err(yf, ref) < TOL


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_nonfinite_d(rng, mode, tier, kind):
    """A NaN or an inf in one block's d (that block's scales all 0: a kernel that skipped a zero term would lose it,
    as inf * 0 is NaN): the outputs of the tokens routed to that expert are non-finite where the reference's are
    (NaN exactly where its are, for NaN); every other row equals the clean run bit for bit."""
    E, H, I = 3, 256, 256  # noqa: E741
    b = q6_k.SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((4, H)).astype(np.float32)
    ids = np.array([[0, 1], [2, 0], [1, 1], [2, -1]], np.int32)
    w = rng.random((4, 2), dtype=np.float32) + np.float32(0.25)
    clean = run_forced(FMT, cf.repack_q6_k_x16(b), x, w, ids, mode, tier)
    blk = b["gate_up"][1, 5, :210]  # gate row 5's first block
    blk[192:208] = 0
    blk[208:210] = np.array([np.nan if kind == "nan" else np.inf], "<f2").view(np.uint8)
    bad = cf.repack_q6_k_x16(b)
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
    """Per 256-block 324 bytes: q6_k's w4a8 codes (numerics.int8_blocks) bit for bit, then c[j] = -32 * (the sum of
    each 16 codes) as int32, then d_a."""
    rec, q_ref, d_ref = kquant_records(FMT, rng, mode, tier, 324)  # an all-zero and a NaN block among its 4
    np.testing.assert_array_equal(rec[:, :256].view(np.int8), q_ref)
    np.testing.assert_array_equal(rec[:, 256:320].copy().view(np.int32),
                                  -32 * q_ref.reshape(-1, 16, 16).astype(np.int32).sum(-1))
    np.testing.assert_array_equal(rec[:, 320:324].copy().view(np.uint32).ravel(), d_ref.view(np.uint32))


def test_schema_and_errors(rng):
    check_kquant_x16_schema(q6_k_x16, q6_k, 19, rng)
