"""q6_k_x16 (q6_k with 16 rows interleaved per 256-block): the layout, the float64 reference, bit identity of the
tiers (the same exact integers and fp32 fmas in K order), ragged work items with everything outside them poisoned,
the prepared record, edge codes and the schema.

Tolerance (whole steps, rel = max|y - ref| / max|ref|): q6_k's 5e-3 (bf16 output rounding, 2^-8, dominates; the
activation codes are modelled exactly). Work items (fp32): |y - ref| <= 1e-5 sum |w a| (one exact int32 per block,
one rounding for d d_a and one fma per block).
"""
import numpy as np
import pytest
from conftest import USABLE, rel_err, routes, run_forced, tier_cases
from fp4_helpers import prep, to_bf16_bits
from x16_helpers import check_ragged_work_items, down_accumulators

import cpumoe_formats as cf
from cpumoe_formats.formats import q6_k, q6_k_x16

FMT = "q6_k_x16"
SPEC = cf.get_format(FMT)
SIMD = [t for t in SPEC.kernel_tiers["w4a8"] if t != "scalar"]


@pytest.mark.parametrize("H,I", [(256, 256), (768, 512)])  # noqa: E741
def test_repack_round_trip_and_layout(rng, H, I):  # noqa: E741
    b = q6_k.SPEC.random_banks(3, H, I, rng)
    r = cf.repack_q6_k_x16(b)
    assert cf.validate_banks(FMT, r) == (3, H, I)
    assert SPEC.bytes_per_expert(H, I) == q6_k.SPEC.bytes_per_expert(H, I)  # the same bytes, moved
    assert q6_k.SPEC.cpu_layout == FMT
    u = cf.unpack_q6_k_x16(r)
    for n in b:
        np.testing.assert_array_equal(u[n], b[n])
    src, dst = b["down"], r["down"]
    for g, rr, bb in [(0, 0, 0), (1, 15, I // 256 - 1), (H // 16 - 1, 7, 0)]:
        blk = src[1, 16 * g + rr, 210 * bb:210 * bb + 210]
        grp = dst[1, g, 3360 * bb:3360 * bb + 3360]
        np.testing.assert_array_equal(grp[2 * rr:2 * rr + 2], blk[208:210])
        np.testing.assert_array_equal(grp[32 + rr:288:16], blk[192:208])
        for h in range(2):
            for v in range(8):
                at = 288 + 1536 * h + 64 * v + 4 * rr
                np.testing.assert_array_equal(grp[at:at + 4], blk[64 * h + 4 * v:64 * h + 4 * v + 4])  # A: ql
                np.testing.assert_array_equal(grp[at + 512:at + 516], blk[128 + 32 * h + 4 * v:132 + 32 * h + 4 * v])
                np.testing.assert_array_equal(grp[at + 1024:at + 1028], blk[64 * h + 32 + 4 * v:64 * h + 36 + 4 * v])


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
    yq = cf.moe_forward("q6_k", cf.unpack_q6_k_x16(b), x, w, ids, mode="w4a8")
    assert rel_err(y, yq.astype(np.float64)) < 1e-2


@pytest.mark.parametrize("tier", SIMD)
@pytest.mark.parametrize("T", [1, 3, 9])
def test_tiers_bit_identical(rng, tier, T):
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    E, H, I = 4, 768, 512  # noqa: E741
    b = SPEC.random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = routes(rng, T, 3, E)
    ys, yt = (run_forced(FMT, b, x, w, ids, "w4a8", t) for t in ("scalar", tier))
    np.testing.assert_array_equal(yt.view(np.uint64), ys.view(np.uint64))
    gs = to_bf16_bits(rng.standard_normal((T, I)) * rng.uniform(0.01, 10.0, (T, 1)))
    a0, a1 = down_accumulators(FMT, b, ("scalar", tier), gs, H)
    np.testing.assert_array_equal(a1.view(np.uint32), a0.view(np.uint32))


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("n", [1, 2, 9])
def test_ragged_work_items(rng, mode, tier, n):
    E, H, I = 3, 256, 256  # noqa: E741
    b = SPEC.random_banks(E, H, I, rng)
    wf = q6_k.decode_blocks(cf.unpack_q6_k_x16(b)["down"][1])

    def check(full, gs, wts):
        for j in range(n):
            a = SPEC.act_in(gs[j].view(cf.numerics.BF16).astype(np.float32), "w4a8")
            assert (np.abs(full[j] - wts[j] * (wf @ a)) <= wts[j] * 1e-5 * (np.abs(wf) @ np.abs(a)) + 1e-30).all()

    check_ragged_work_items(cf.Kernel(FMT, E, H, I, mode=mode, isa=tier), FMT, b, n, rng,
                            [(5, 37), (16, 32), (0, 1), (255, 256), (17, 18)], [(3, 29), (16, 48), (255, 256), (0, 17)],
                            check)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("case", ["max", "mixed"])
def test_edge_codes(rng, mode, tier, case):
    """max: codes 0 and 63 with scales -128 and 127 against +-127 codes (the integer extremes); mixed: d subnormal,
    negative and +-0, every code 32 (w = 0) in some blocks."""
    E, H, I = 2, 256, 512  # noqa: E741
    b = q6_k.SPEC.random_banks(E, H, I, rng)
    for name in b:
        blk = b[name].reshape(b[name].shape[:-1] + (-1, 210))
        if case == "max":
            L = rng.choice(np.array([0, 63], np.uint8), blk.shape[:-1] + (256,))
            blk[..., 0:128], blk[..., 128:192] = q6_k.pack_codes(L)
            blk[..., 192:208] = rng.choice(np.array([0x80, 0x7F], np.uint8), blk.shape[:-1] + (16,))
        else:
            d = np.array([6e-8, -0.0025, 0.0, -0.0, 0.004, 2.0 ** -20], "<f2")
            blk[..., 208:210] = d[rng.integers(0, len(d), blk.shape[:-1])][..., None].view(np.uint8)
            mid = rng.random(blk.shape[:-1]) < 0.3
            ql, qh = q6_k.pack_codes(np.full(blk.shape[:-1] + (256,), 32, np.uint8))
            blk[..., 0:128] = np.where(mid[..., None], ql, blk[..., 0:128])
            blk[..., 128:192] = np.where(mid[..., None], qh, blk[..., 128:192])
    xb = cf.repack_q6_k_x16(b)
    x = np.where(rng.random((3, H)) < 0.5, -1.0, 1.0).astype(np.float32) * 3.0  # q = +-127 in every block
    w, ids = routes(rng, 3, 2, E, skip=False)
    y = run_forced(FMT, xb, x, w, ids, mode, tier)
    ref = cf.reference.moe(FMT, xb, x, w, ids, mode=mode)
    assert rel_err(y, ref) < 5e-3


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_prepared_record(rng, mode, tier):
    """Per 256-block 324 bytes: q6_k's w4a8 codes and d_a bit for bit, then int32 -32 * (sum of each 16 codes)."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 1024
    k = cf.Kernel(FMT, 1, K, K, mode=mode, isa=tier)
    assert k._k.act_bytes(K) == 324 * (K // 256)
    v = rng.standard_normal(K) * np.repeat(10.0 ** rng.uniform(-6, 6, K // 256), 256)
    v[256:512] = 0
    v[700] = np.inf
    bits = to_bf16_bits(v)
    rec = np.asarray(prep(k, bits)[:324 * (K // 256)]).reshape(-1, 324)
    q_ref, d_ref = cf.numerics.int8_blocks((bits.astype(np.uint32) << 16).view(np.float32), 256)
    np.testing.assert_array_equal(rec[:, :256].view(np.int8), q_ref)
    np.testing.assert_array_equal(rec[:, 256:260].copy().view(np.uint32).ravel(), d_ref.view(np.uint32))
    sums = q_ref.reshape(-1, 16, 16).astype(np.int32).sum(-1)
    np.testing.assert_array_equal(rec[:, 260:].copy().view(np.int32), -32 * sums)


def test_schema_and_errors(rng):
    b = SPEC.random_banks(3, 2048, 768, rng)
    assert cf.validate_banks(FMT, b) == (3, 2048, 768)
    assert SPEC.id == 17 and cf.get_format("q6_k_cpu") is SPEC and SPEC.modes == ("w4a8",)
    small = SPEC.random_banks(2, 256, 512, rng)
    with pytest.raises(ValueError, match="3360"):
        cf.validate_banks(FMT, dict(small, down=small["down"][:, :, :100]))
    with pytest.raises(ValueError):
        cf.validate_banks(FMT, q6_k.SPEC.random_banks(2, 256, 512, rng))
    with pytest.raises(ValueError, match="mode"):
        cf.Kernel(FMT, 2, 256, 256, mode="native")
    with pytest.raises(ValueError, match="multiples of 256"):
        cf.Kernel(FMT, 2, 128, 256)
    g = q6_k_x16.to_groups(q6_k.SPEC.random_banks(1, 256, 256, rng)["down"])
    np.testing.assert_array_equal(q6_k_x16.to_groups(q6_k_x16.from_groups(g)), g)
