"""q8_0_x16 (q8_0 with 16 rows interleaved per 32-block): the layout, the float64 reference, bit identity of the tiers
(the same exact integers and fp32 fmas in K order), ragged work items with everything outside them poisoned, the
prepared record, edge codes and the schema.

Tolerance (whole steps, rel = max|y - ref| / max|ref|): q8_0's 5e-3 (bf16 output rounding dominates). Work items
(fp32): |y - ref| <= (K + 8) u sum|w a| (fp4_helpers.dot_bound: one exact int32, one scale rounding and one fma per
block).
"""
import numpy as np
import pytest
from conftest import USABLE, rel_err, routes, run_forced, tier_cases
from fp4_helpers import dot_bound, prep, to_bf16_bits
from x16_helpers import check_moved, check_ragged_work_items, check_tiers_bit_identical, split_record

import cpumoe_formats as cf
from cpumoe_formats.formats import q8_0, q8_0_x16

FMT = "q8_0_x16"
SPEC = cf.get_format(FMT)
SIMD = [t for t in SPEC.kernel_tiers["w4a8"] if t != "scalar"]


@pytest.mark.parametrize("H,I", [(96, 64), (32, 32), (2048, 64)])  # noqa: E741
def test_repack_round_trip_and_layout(rng, H, I):  # noqa: E741
    b = q8_0.SPEC.random_banks(3, H, I, rng)
    r = check_moved(FMT, q8_0.SPEC, b, H, I)  # validated, the same bytes moved, and back
    assert q8_0.SPEC.cpu_layout == FMT
    src, dst = b["down"], r["down"]
    for g, rr, bb in [(0, 0, 0), (1, 15, I // 32 - 1), (H // 16 - 1, 7, 0)]:
        blk = src[1, 16 * g + rr, 34 * bb:34 * bb + 34]
        grp = dst[1, g, 544 * bb:544 * bb + 544]
        np.testing.assert_array_equal(grp[2 * rr:2 * rr + 2], blk[:2])
        for v in range(8):
            np.testing.assert_array_equal(grp[32 + 64 * v + 4 * rr:36 + 64 * v + 4 * rr], blk[2 + 4 * v:6 + 4 * v])


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("H,I,T", [(96, 64, 1), (736, 416, 9), (32, 32, 3), (256, 128, 8)])  # noqa: E741
def test_against_float64_reference(rng, mode, tier, H, I, T):  # noqa: E741
    E, K = 5, 4
    b = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, b, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, b, x, w, ids, mode=mode)
    assert rel_err(y, ref) < 5e-3
    yq = cf.moe_forward("q8_0", cf.unpack_q8_0_x16(b), x, w, ids, mode="w4a8")
    assert rel_err(y, yq.astype(np.float64)) < 1e-2


@pytest.mark.parametrize("tier", SIMD)
@pytest.mark.parametrize("T", [1, 3, 9])
def test_tiers_bit_identical(rng, tier, T):
    check_tiers_bit_identical(FMT, rng, tier, T, shape=(4, 736, 416))


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("n", [1, 2, 9])
def test_ragged_work_items(rng, mode, tier, n):
    E, H, I = 3, 160, 96  # noqa: E741
    b = SPEC.random_banks(E, H, I, rng)
    wf = q8_0.decode_blocks(cf.unpack_q8_0_x16(b)["down"][1])

    def check(full, gs, wts):
        for j in range(n):
            a = SPEC.act_in(gs[j].view(cf.numerics.BF16).astype(np.float32), "w4a8")
            assert (np.abs(full[j] - wts[j] * (wf @ a)) <= wts[j] * dot_bound(wf, a) + 1e-30).all()

    check_ragged_work_items(cf.Kernel(FMT, E, H, I, mode=mode, isa=tier), FMT, b, n, rng,
                            [(5, 37), (16, 32), (0, 1), (95, 96), (17, 18)], [(3, 29), (16, 48), (159, 160), (0, 17)],
                            check)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_edge_codes(rng, mode, tier):
    """Codes -128 and +127 against +-127 activation codes everywhere (|w| 128: the sign trick's unsigned 128, the
    offset code 0 and 255), d subnormal, negative and +-0."""
    E, H, I = 2, 64, 64  # noqa: E741
    b = q8_0.SPEC.random_banks(E, H, I, rng)
    for name in b:
        blk = b[name].reshape(b[name].shape[:-1] + (-1, 34))
        blk[..., 2:] = rng.choice(np.array([0x80, 0x7F], np.uint8), blk[..., 2:].shape)
        d = np.array([6e-8, -0.0025, 0.0, -0.0, 0.004], "<f2")
        blk[..., 0:2] = d[rng.integers(0, len(d), blk.shape[:-1])][..., None].view(np.uint8)
    xb = cf.repack_q8_0_x16(b)
    x = np.where(rng.random((3, H)) < 0.5, -1.0, 1.0).astype(np.float32) * 3.0
    w, ids = routes(rng, 3, 2, E, skip=False)
    y = run_forced(FMT, xb, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, xb, x, w, ids, mode=mode)
    assert rel_err(y, ref) < 5e-3


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_prepared_record(rng, mode, tier):
    """Per 32-block: q8_0's w4a8 codes and d_a bit for bit, then corr = -128 sum(q_b)."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 2048
    k = cf.Kernel(FMT, 1, K, K, mode=mode, isa=tier)
    assert k._k.act_bytes(K) == K + 8 * (K // 32)
    v = rng.standard_normal(K) * np.repeat(10.0 ** rng.uniform(-6, 6, K // 32), 32)
    v[:32] = 0
    bits = to_bf16_bits(v)
    q, d, corr = split_record(prep(k, bits), K, 32)
    q_ref, d_ref = cf.numerics.int8_blocks((bits.astype(np.uint32) << 16).view(np.float32), 32)
    np.testing.assert_array_equal(q, q_ref.reshape(K))
    np.testing.assert_array_equal(d.view(np.uint32), d_ref.view(np.uint32))
    np.testing.assert_array_equal(corr, -128 * q.astype(np.int64).reshape(-1, 32).sum(-1))


def test_schema_and_errors(rng):
    b = SPEC.random_banks(3, 2048, 768, rng)
    assert cf.validate_banks(FMT, b) == (3, 2048, 768)
    assert SPEC.id == 17 and cf.get_format("q8_0_cpu") is SPEC and SPEC.modes == ("w4a8",)
    small = SPEC.random_banks(2, 96, 64, rng)
    with pytest.raises(ValueError, match="544"):
        cf.validate_banks(FMT, dict(small, down=small["down"][:, :, :100]))
    with pytest.raises(ValueError):
        cf.validate_banks(FMT, q8_0.SPEC.random_banks(2, 96, 64, rng))
    with pytest.raises(ValueError, match="mode"):
        cf.Kernel(FMT, 2, 96, 64, mode="native")
    with pytest.raises(ValueError, match="multiples of 32"):
        cf.Kernel(FMT, 2, 80, 64)
    g = q8_0_x16.to_groups(q8_0.SPEC.random_banks(1, 32, 32, rng)["down"])
    np.testing.assert_array_equal(q8_0_x16.to_groups(q8_0_x16.from_groups(g)), g)
