"""q4_0_x16 (q4_0 with 16 rows interleaved per 32-block): the layout, the float64 reference, bit identity of the
tiers (every tier does the same exact integers and fp32 fmas in K order), work items over ragged row ranges with
everything outside them poisoned, edge codes and the schema.

Tolerance (whole steps, rel = max|y - ref| / max|ref|): q4_0's 5e-3, which bf16 output rounding (up to 2^-8 =
3.9e-3 relative) dominates; the w4a8 activation quantization is modelled exactly by the reference's act_in. Work
items (fp32, before any bf16 rounding): |y - ref| <= (K + 8) u sum|w a| (fp4_helpers.dot_bound).
"""
import numpy as np
import pytest
from conftest import USABLE, rel_err, routes, run_forced, tier_cases
from fp4_helpers import dot_bound, prep, to_bf16_bits
from x16_helpers import check_moved, check_ragged_work_items, check_tiers_bit_identical, split_record

import cpumoe_formats as cf
from cpumoe_formats.formats import q4_0, q4_0_x16

FMT = "q4_0_x16"
SPEC = cf.get_format(FMT)
SIMD = [t for t in SPEC.kernel_tiers["w4a8"] if t != "scalar"]


@pytest.mark.parametrize("H,I", [(96, 64), (32, 32), (2816, 64)])  # noqa: E741
def test_repack_round_trip_and_layout(rng, H, I):  # noqa: E741
    b = q4_0.SPEC.random_banks(3, H, I, rng)
    r = check_moved(FMT, q4_0.SPEC, b, H, I)  # validated, the same bytes moved, and back
    # q4_0's CPU layout, from avx2 (its one-token avx2 pass beat q4_0's row-major kernel on Zen 3)
    assert q4_0.SPEC.cpu_layout == FMT and q4_0.SPEC.cpu_layout_min_tier == "avx2"
    # byte by byte: expert 1, row 16 g + rr, block bb
    src, dst = b["down"], r["down"]
    for g, rr, bb in [(0, 0, 0), (1, 15, I // 32 - 1), (H // 16 - 1, 7, 0)]:
        blk = src[1, 16 * g + rr, 18 * bb:18 * bb + 18]
        grp = dst[1, g, 288 * bb:288 * bb + 288]
        np.testing.assert_array_equal(grp[2 * rr:2 * rr + 2], blk[:2])
        for j in range(4):
            np.testing.assert_array_equal(grp[32 + 64 * j + 4 * rr:32 + 64 * j + 4 * rr + 4], blk[2 + 4 * j:6 + 4 * j])


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
    # q4_0 on the same bytes: the same math, only the fp32 grouping differs
    yq = cf.moe_forward("q4_0", cf.unpack_q4_0_x16(b), x, w, ids, mode="w4a8")
    assert rel_err(y, yq.astype(np.float64)) < 1e-2


@pytest.mark.parametrize("tier", SIMD)
@pytest.mark.parametrize("T", [1, 3, 9])
def test_tiers_bit_identical(rng, tier, T):
    check_tiers_bit_identical(FMT, rng, tier, T, shape=(4, 736, 416))


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("n", [1, 2, 9])
def test_ragged_work_items(rng, mode, tier, n):
    """Row ranges that cut groups: each item writes exactly its rows, with the bits of a whole-range call, and the
    down terms are within the dot bound of float64."""
    E, H, I = 3, 160, 96  # noqa: E741 - 10 and 12 groups
    b = SPEC.random_banks(E, H, I, rng)
    wf = q4_0.decode_blocks(cf.unpack_q4_0_x16(b)["down"][1])  # [H, I] float64

    def check(full, gs, wts):
        for j in range(n):
            a = SPEC.act_in(gs[j].view(cf.numerics.BF16).astype(np.float32)[None], "w4a8")[0]
            assert (np.abs(full[j] - wts[j] * (wf @ a)) <= wts[j] * dot_bound(wf, a) + 1e-30).all()

    check_ragged_work_items(cf.Kernel(FMT, E, H, I, mode=mode, isa=tier), FMT, b, n, rng,
                            [(5, 37), (16, 32), (0, 1), (95, 96), (17, 18)], [(3, 29), (16, 48), (159, 160), (0, 17)],
                            check)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_edge_codes(rng, mode, tier):
    """Nibbles 0 and 15 against +-127 codes everywhere (the integer extremes), and d subnormal, negative and +-0."""
    E, H, I = 2, 64, 64  # noqa: E741
    b = q4_0.SPEC.random_banks(E, H, I, rng)
    for name in b:
        blk = b[name].reshape(b[name].shape[:-1] + (-1, 18))
        blk[..., 2:] = np.where(rng.random(blk[..., 2:].shape) < 0.5, 0x00, 0xFF).astype(np.uint8)
        d = np.array([6e-8, -0.0025, 0.0, -0.0, 0.004], "<f2")  # a subnormal, negative, +-0
        blk[..., 0:2] = d[rng.integers(0, len(d), blk.shape[:-1])][..., None].view(np.uint8)
    xb = cf.repack_q4_0_x16(b)
    x = np.where(rng.random((3, H)) < 0.5, -1.0, 1.0).astype(np.float32) * 3.0  # q = +-127 in every block
    w, ids = routes(rng, 3, 2, E, skip=False)
    y = run_forced(FMT, xb, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, xb, x, w, ids, mode=mode)
    assert rel_err(y, ref) < 5e-3


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_prepared_record(rng, mode, tier):
    """Per 32-block: the Q8_0 codes and d_a of q4_0's w4a8 (q8_0_quantize) bit for bit, then corr = -8 sum(q_b)."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 2816
    k = cf.Kernel(FMT, 1, K, K, mode=mode, isa=tier)
    assert k._k.act_bytes(K) == K + 8 * (K // 32)
    v = rng.standard_normal(K) * np.repeat(10.0 ** rng.uniform(-6, 6, K // 32), 32)
    v[:32] = 0  # an all-zero block: d = 0, codes 0
    bits = to_bf16_bits(v)
    q, d, corr = split_record(prep(k, bits), K, 32)
    q_ref, d_ref = q4_0.q8_0_quantize((bits.astype(np.uint32) << 16).view(np.float32))
    np.testing.assert_array_equal(q, np.asarray(q_ref).reshape(K))
    np.testing.assert_array_equal(d.view(np.uint32), np.asarray(d_ref, np.float32).reshape(-1).view(np.uint32))
    np.testing.assert_array_equal(corr, -8 * q.astype(np.int64).reshape(-1, 32).sum(-1))


def test_schema_and_errors(rng):
    b = SPEC.random_banks(3, 2816, 704, rng)
    assert cf.validate_banks(FMT, b) == (3, 2816, 704)
    assert SPEC.id == 7 and cf.get_format("q4_0_cpu") is SPEC and SPEC.modes == ("w4a8",)
    small = SPEC.random_banks(2, 96, 64, rng)
    with pytest.raises(ValueError, match="down.*expected shape"):
        cf.validate_banks(FMT, dict(small, down=small["down"][:, :, :288]))
    with pytest.raises(ValueError, match="288"):
        cf.validate_banks(FMT, dict(small, down=small["down"][:, :, :100]))
    with pytest.raises(ValueError, match="gate_up"):
        cf.validate_banks(FMT, dict(small, gate_up=small["gate_up"][:, :-1]))
    with pytest.raises(ValueError):  # q4_0's row-major banks under this name
        cf.validate_banks(FMT, q4_0.SPEC.random_banks(2, 96, 64, rng))
    with pytest.raises(ValueError, match="mode"):
        cf.Kernel(FMT, 2, 96, 64, mode="native")
    with pytest.raises(ValueError, match="multiples of 32"):
        cf.Kernel(FMT, 2, 80, 64)
    g = q4_0_x16.to_groups(q4_0.SPEC.random_banks(1, 32, 32, rng)["down"])
    np.testing.assert_array_equal(q4_0_x16.to_groups(q4_0_x16.from_groups(g)), g)
