"""q4_k_x16 (q4_k with 16 rows interleaved per 256-block): the layout, the float64 reference, bit identity of the
tiers (every tier forms the same exact integers and does the same fp32 fmas in K order), work items over ragged row
ranges with everything outside them poisoned, the prepared record, edge codes and the schema.

Tolerance (whole steps, rel = max|y - ref| / max|ref|): q4_k's 5e-3, which bf16 output rounding (up to 2^-8)
dominates; the w4a8 activation codes are modelled exactly by the reference's act_in. Work items (fp32, before any
bf16 rounding): |y - ref| <= 1e-5 * sum (|d sc q| + |dmin m|) |a| (q4_k's bound: per block two exact integers, two
roundings of their scales and two fmas, over K/256 <= 3 blocks).
"""
import numpy as np
import pytest
from conftest import rel_err, routes, run_forced, tier_cases
from gguf_helpers import kquant_mag_terms
from x16_helpers import (
    check_kquant_record,
    check_moved,
    check_ragged_work_items,
    check_tiers_bit_identical,
)

import cpumoe_formats as cf
from cpumoe_formats.formats import q4_k, q4_k_x16

FMT = "q4_k_x16"
SPEC = cf.get_format(FMT)
SIMD = [t for t in SPEC.kernel_tiers["w4a8"] if t != "scalar"]


@pytest.mark.parametrize("H,I", [(256, 256), (768, 512)])  # noqa: E741
def test_repack_round_trip_and_layout(rng, H, I):  # noqa: E741
    b = q4_k.SPEC.random_banks(3, H, I, rng)
    r = check_moved(FMT, q4_k.SPEC, b, H, I)  # validated, the same bytes moved, and back
    assert q4_k.SPEC.cpu_layout == FMT
    # byte by byte: expert 1, row 16 g + rr, block bb
    src, dst = b["down"], r["down"]
    for g, rr, bb in [(0, 0, 0), (1, 15, I // 256 - 1), (H // 16 - 1, 7, 0)]:
        blk = src[1, 16 * g + rr, 144 * bb:144 * bb + 144]
        grp = dst[1, g, 2304 * bb:2304 * bb + 2304]
        np.testing.assert_array_equal(grp[2 * rr:2 * rr + 2], blk[0:2])
        np.testing.assert_array_equal(grp[32 + 2 * rr:34 + 2 * rr], blk[2:4])
        np.testing.assert_array_equal(grp[64 + rr:256:16], blk[4:16])
        for c in range(4):
            for v in range(8):
                at = 256 + 512 * c + 64 * v + 4 * rr
                np.testing.assert_array_equal(grp[at:at + 4], blk[16 + 32 * c + 4 * v:20 + 32 * c + 4 * v])


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("H,I,T", [(256, 256, 1), (768, 512, 9), (512, 256, 3), (256, 768, 8)])  # noqa: E741
def test_against_float64_reference(rng, mode, tier, H, I, T):  # noqa: E741
    E, K = 5, 4
    b = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, b, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, b, x, w, ids, mode=mode)
    assert rel_err(y, ref) < 5e-3
    # q4_k on the same bytes: the same integers, only the fp32 grouping differs
    yq = cf.moe_forward("q4_k", cf.unpack_q4_k_x16(b), x, w, ids, mode="w4a8")
    assert rel_err(y, yq.astype(np.float64)) < 1e-2


@pytest.mark.parametrize("tier", SIMD)
@pytest.mark.parametrize("T", [1, 3, 9])
def test_tiers_bit_identical(rng, tier, T):
    check_tiers_bit_identical(FMT, rng, tier, T)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("n", [1, 2, 9])
def test_ragged_work_items(rng, mode, tier, n):
    """Row ranges that cut groups: each item writes exactly its rows, with the bits of a whole-range call, and the
    down terms are within q4_k's work-item bound of float64."""
    E, H, I = 3, 256, 256  # noqa: E741 - 16 groups each
    b = SPEC.random_banks(E, H, I, rng)
    rows = cf.unpack_q4_k_x16(b)["down"][1]
    wf, mag = q4_k.decode_blocks(rows), kquant_mag_terms("q4_k", rows)

    def check(full, gs, wts):
        for j in range(n):
            a = SPEC.act_in(gs[j].view(cf.numerics.BF16).astype(np.float32), "w4a8")
            assert (np.abs(full[j] - wts[j] * (wf @ a)) <= wts[j] * 1e-5 * (mag @ np.abs(a)) + 1e-30).all()

    check_ragged_work_items(cf.Kernel(FMT, E, H, I, mode=mode, isa=tier), FMT, b, n, rng,
                            [(5, 37), (16, 32), (0, 1), (255, 256), (17, 18)], [(3, 29), (16, 48), (255, 256), (0, 17)],
                            check)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("case", ["max", "scales"])
def test_edge_codes(rng, mode, tier, case):
    """max: every code 15 with scales and mins 63 against +-127 codes everywhere (the integer extremes: S up to
    63 * 15 * 127 * 256); scales: d and dmin subnormal, negative and +-0, scales and mins 0 and 63."""
    E, H, I = 2, 256, 512  # noqa: E741
    b = q4_k.SPEC.random_banks(E, H, I, rng)
    for name in b:
        blk = b[name].reshape(b[name].shape[:-1] + (-1, 144))
        if case == "max":
            blk[..., 16:] = 0xFF
            full = np.full(blk.shape[:-1] + (8,), 63)
            blk[..., 4:16] = q4_k.pack_scales_mins(full, full)
        else:
            d = np.array([6e-8, -0.0025, 0.0, -0.0, 0.004, 2.0 ** -20], "<f2")
            for off in (0, 2):
                blk[..., off:off + 2] = d[rng.integers(0, len(d), blk.shape[:-1])][..., None].view(np.uint8)
            v = rng.choice(np.array([0, 63]), blk.shape[:-1] + (16,)).astype(np.uint8)
            blk[..., 4:16] = q4_k.pack_scales_mins(v[..., :8], v[..., 8:])
    xb = cf.repack_q4_k_x16(b)
    x = np.where(rng.random((3, H)) < 0.5, -1.0, 1.0).astype(np.float32) * 3.0  # q = +-127 in every block
    w, ids = routes(rng, 3, 2, E, skip=False)
    y = run_forced(FMT, xb, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, xb, x, w, ids, mode=mode)
    assert rel_err(y, ref) < 5e-3


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_prepared_record(rng, mode, tier):
    check_kquant_record(FMT, rng, mode, tier)


def test_schema_and_errors(rng):
    b = SPEC.random_banks(3, 2048, 768, rng)
    assert cf.validate_banks(FMT, b) == (3, 2048, 768)
    assert SPEC.id == 16 and cf.get_format("q4_k_cpu") is SPEC and SPEC.modes == ("w4a8",)
    small = SPEC.random_banks(2, 256, 512, rng)
    with pytest.raises(ValueError, match="down.*expected shape"):
        cf.validate_banks(FMT, dict(small, down=small["down"][:, :, :2304]))
    with pytest.raises(ValueError, match="2304"):
        cf.validate_banks(FMT, dict(small, down=small["down"][:, :, :100]))
    with pytest.raises(ValueError, match="gate_up"):
        cf.validate_banks(FMT, dict(small, gate_up=small["gate_up"][:, :-1]))
    with pytest.raises(ValueError):  # q4_k's row-major banks under this name
        cf.validate_banks(FMT, q4_k.SPEC.random_banks(2, 256, 512, rng))
    with pytest.raises(ValueError, match="mode"):
        cf.Kernel(FMT, 2, 256, 256, mode="native")
    with pytest.raises(ValueError, match="multiples of 256"):
        cf.Kernel(FMT, 2, 128, 256)
    g = q4_k_x16.to_groups(q4_k.SPEC.random_banks(1, 256, 256, rng)["down"])
    np.testing.assert_array_equal(q4_k_x16.to_groups(q4_k_x16.from_groups(g)), g)
