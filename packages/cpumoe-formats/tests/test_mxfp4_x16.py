"""mxfp4_x16 (gpt-oss mxfp4 with 16 rows interleaved per 32-block, mode w4a8): the layout and its round trip, the
executor's repack chain (mxfp4 -> mxfp4_panel -> mxfp4_x16), whole steps against the float64 reference and bit
for bit against mxfp4's own w4a8 kernel at the same tier, every e2m1 byte and e8m0 scale, ragged work items with
poisoned outputs, the prepared record, schema and errors.

The layout's definition is mxfp4's w4a8 with the same activation codes, integers and fp32 operations in the same
order (csrc/formats/mxfp4_x16.cpp), so its outputs must equal mxfp4's bit for bit: that is the main check here,
and it covers what test_mxfp4 checks against float64 (tolerances there: TOL = 4e-3 for whole steps; bf16 output
half ulp 2^-9 plus g flips and fp32 accumulation). A float64 comparison with that TOL stays as an independent
check at the real shape.
"""
import numpy as np
import pytest
from conftest import USABLE, rel_err, routes, run_forced, tier_cases
from fp4_helpers import kernel, prep, run_down, run_gate_up, to_bf16_bits
from x16_helpers import check_ragged_work_items, split_record

import cpumoe_formats as cf
from cpumoe_formats.formats import mxfp4_x16

FMT = "mxfp4_x16"
SPEC = cf.get_format(FMT)
MX = cf.get_format("mxfp4")
PANEL = cf.get_format("mxfp4_panel")
TOL = 4e-3  # test_mxfp4's
GPT_OSS = dict(activation="swigluoai", alpha=1.702, limit=7.0)
W8 = tier_cases(FMT)  # (w4a8, tier)


def random_mx(rng, E, H, I, all_scales=False):  # noqa: E741
    """mxfp4 banks; all_scales: every e8m0 code (0 = 2^-127 .. 255 clamped) in the scale banks."""
    b = MX.random_banks(E, H, I, rng)
    if all_scales:
        for n in ("gate_up_scales", "down_scales"):
            b[n][...] = rng.integers(0, 256, b[n].shape, dtype=np.uint8)
    return b


def same_bits(a, b):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint64), np.asarray(b).view(np.uint64))


# ---------------------------------------------------------------- layout
@pytest.mark.parametrize("H,I", [(32, 32), (96, 160), (2880, 224)])  # noqa: E741
def test_repack_round_trip_and_layout(rng, H, I):  # noqa: E741
    b = random_mx(rng, 3, H, I, all_scales=True)
    r = cf.repack_mxfp4_x16(b)
    assert cf.validate_banks(FMT, r) == (3, H, I)
    assert SPEC.bytes_per_expert(H, I) == MX.bytes_per_expert(H, I)  # the same bytes, moved
    assert all(a.ctypes.data % 64 == 0 for a in r.values())
    u = cf.unpack_mxfp4_x16(r)
    assert u.keys() == b.keys()
    for n in b:
        np.testing.assert_array_equal(np.asarray(u[n]).view(np.uint8), np.asarray(b[n]).view(np.uint8))
    # byte by byte, expert 1: logical row n of gate_up is mxfp4 column 2n (gate, n < I) or 2(n - I) + 1 (up)
    for bank, blocks, scales, bias, R, col in (
            ("gate_up", "gate_up_blocks", "gate_up_scales", "gate_up_bias", 2 * I,
             lambda n: 2 * n if n < I else 2 * (n - I) + 1),
            ("down", "down_blocks", "down_scales", "down_bias", H, lambda n: n)):
        K = b[blocks].shape[1] * 2
        for g, rr, bb in [(0, 0, 0), (R // 16 - 1, 15, K // 32 - 1), (R // 32, 7, K // 64), (R // 16 // 2 - 1, 3, 0)]:
            n, c = 16 * g + rr, col(16 * g + rr)
            codes = np.empty(32, np.uint8)
            byts = b[blocks][1, 16 * bb:16 * bb + 16, c]
            codes[0::2], codes[1::2] = byts & 15, byts >> 4  # low nibble = element 2kb (mxfp4)
            grp = r[bank][1, g, 272 * bb:272 * bb + 272]
            assert grp[rr] == b[scales][1, bb, c]
            for j in range(4):
                for i in range(4):
                    assert grp[16 + 64 * j + 4 * rr + i] == codes[4 * j + i] | codes[16 + 4 * j + i] << 4
            assert r[bias].view(np.uint16)[1, n] == b[bias].view(np.uint16)[1, c]


def test_repack_chain_and_float64_model(rng):
    """mxfp4's CPU layout is mxfp4_panel (both modes), whose CPU layout is mxfp4_x16 (w4a8, from avx2)."""
    assert MX.cpu_layout == "mxfp4_panel" and PANEL.cpu_layout == FMT and PANEL.cpu_layout_min_tier == "avx2"
    b = random_mx(rng, 2, 96, 64)
    r = cf.repack_mxfp4_x16(b)
    for n, a in PANEL.to_cpu_layout(cf.repack_mxfp4_panels(b)).items():
        np.testing.assert_array_equal(a, r[n])
    for given, banks in ((MX, b), (PANEL, cf.repack_mxfp4_panels(b))):  # the chain from either end, same bytes
        x = given.to_layout(banks, FMT)
        assert x.keys() == r.keys() and all(np.array_equal(x[n], r[n]) for n in r)
    assert MX.to_layout(b, "mxfp4_panel").keys() == cf.repack_mxfp4_panels(b).keys()
    assert MX.to_layout(b, "mxfp4") is b
    with pytest.raises(ValueError, match="not on 'mxfp4_panel'"):
        PANEL.to_layout(cf.repack_mxfp4_panels(b), "q4_0_x16")
    with pytest.raises(ValueError, match="no CPU layout"):
        SPEC.to_cpu_layout(r)
    for a, c in zip(SPEC.dequantize(r) + SPEC.biases(r), MX.dequantize(b) + MX.biases(b)):
        np.testing.assert_array_equal(a, c)
    gu = rng.standard_normal((2, 128, 96)).astype(np.float32)
    dn = rng.standard_normal((2, 96, 64)).astype(np.float32) * 0.02
    gub = rng.standard_normal((2, 128)).astype(np.float32)
    q = cf.quantize(FMT, gu, dn, gate_up_bias=gub)
    ref = cf.repack_mxfp4_x16(cf.quantize("mxfp4", gu, dn, gate_up_bias=gub))
    for n in q:
        np.testing.assert_array_equal(q[n], ref[n])


# ---------------------------------------------------------------- whole steps: mxfp4's bits
@pytest.mark.parametrize("mode,tier", W8)
@pytest.mark.parametrize("H,I,T,act", [(96, 160, 3, "swigluoai"), (32, 32, 1, "silu"), (160, 96, 8, "gelu_tanh"),
                                       (2880, 224, 9, "swigluoai")])  # noqa: E741
def test_bit_identical_to_mxfp4(rng, mode, tier, H, I, T, act):  # noqa: E741
    """Random data, every e8m0 scale, duplicated and -1 routes, full and ragged token blocks of the kernels."""
    kw = GPT_OSS if act == "swigluoai" else dict(activation=act)
    E = 5
    b = random_mx(rng, E, H, I, all_scales=H < 2880)
    x = (rng.standard_normal((T, H)) * rng.uniform(0.01, 4.0, (T, 1))).astype(np.float32)
    w, ids = routes(rng, T, 4, E)
    y = run_forced(FMT, cf.repack_mxfp4_x16(b), x, w, ids, mode, tier, **kw)
    same_bits(y, run_forced("mxfp4", b, x, w, ids, mode, mx_tier(mode, tier), **kw))


@pytest.mark.parametrize("mode,tier", W8)
def test_gpt_oss_shape(rng, mode, tier):
    """gpt-oss-120b experts (H = I = 2880, top_k 4, swigluoai), batch 8 on 3 experts: the float64 reference within
    test_mxfp4's TOL, and mxfp4's bits."""
    E, H, I, T = 3, 2880, 2880, 8  # noqa: E741
    b = MX.random_banks(E, H, I, rng)
    r = cf.repack_mxfp4_x16(b)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, 4, E)
    y = run_forced(FMT, r, x, w, ids, mode, tier, **GPT_OSS)
    ref = cf.reference.moe(FMT, r, x, w, ids, mode=mode, **GPT_OSS)
    assert rel_err(y, ref) < TOL
    same_bits(y, run_forced("mxfp4", b, x, w, ids, mode, mx_tier(mode, tier), **GPT_OSS))


# ---------------------------------------------------------------- work items: mxfp4's bits, edge codes
def mx_tier(mode, tier):
    """mxfp4's own tier to compare with mxfp4_x16 at `tier`: mxfp4 has no avx512bf16 w4a8 kernel, and its bits are
    every tier's, so avx512vnni stands in there."""
    return tier if tier in MX.kernel_tiers[mode] else "avx512vnni"


def mxfp4_at(E, H, I, mode, tier):  # noqa: N803, E741
    """mxfp4's own kernel at mx_tier(mode, tier), checked by name."""
    return kernel("mxfp4", E, H, I, mode, mx_tier(mode, tier), **GPT_OSS)


@pytest.mark.parametrize("mode,tier", W8)
def test_every_byte_and_scale_work_items(rng, mode, tier):
    """Every byte value in every down row (16 x 16 code pairs, -0 included), every e8m0 code in every row's blocks
    (2^-127 .. 2^127; 255 as 254), zero and +-127 activation blocks: the fp32 down accumulators and g equal
    mxfp4's, inf and NaN included where the scales overflow."""
    E, H, I = 1, 256, 512  # noqa: E741
    b = MX.random_banks(E, H, I, rng)
    for kb in range(I // 2):
        b["down_blocks"][0, kb] = rng.permutation(256).astype(np.uint8)
    b["down_scales"][0] = (np.arange(H)[None, :] + 7 * np.arange(I // 32)[:, None]) % 256
    b["gate_up_scales"][0] = rng.permutation(np.arange(b["gate_up_scales"][0].size) % 256).reshape(
        b["gate_up_scales"][0].shape)
    r = cf.repack_mxfp4_x16(b)
    kx, km = kernel(FMT, E, H, I, mode, tier, **GPT_OSS), mxfp4_at(E, H, I, mode, tier)
    v = rng.standard_normal(I)
    v[64:96] = 0
    gs = [to_bf16_bits(v), to_bf16_bits(np.where(rng.random(I) < 0.5, -3.0, 3.0)),
          to_bf16_bits(rng.standard_normal(I) * 1e-30), to_bf16_bits(np.zeros(I))]
    wts = [1.0, 0.5, 2.0, 1.0]
    with np.errstate(invalid="ignore", over="ignore"):
        ax, am = run_down(kx, FMT, r, 0, gs, wts), run_down(km, "mxfp4", b, 0, gs, wts)
    assert np.isfinite(ax[0, :128]).all()
    np.testing.assert_array_equal(ax[3], MX.biases(b)[1][0])  # a zero activation: the bias term alone
    same_bits(ax, am)
    xs = [to_bf16_bits(rng.standard_normal(H) * s) for s in (1e-30, 1e-6, 1.0)]
    same_bits(run_gate_up(kx, FMT, r, 0, xs), run_gate_up(km, "mxfp4", b, 0, xs))


@pytest.mark.parametrize("mode,tier", W8)
@pytest.mark.parametrize("n", [1, 2, 9])
def test_ragged_work_items(rng, mode, tier, n):
    """Row ranges that cut groups (odd group counts for a lone route's two half streams): each item writes exactly
    its rows with the bits of a whole-range call, and the whole-range down accumulators are mxfp4's."""
    E, H, I = 3, 416, 224  # noqa: E741 - 26 down groups, 14 + 14 gate_up groups
    b = MX.random_banks(E, H, I, rng)
    r = cf.repack_mxfp4_x16(b)
    km = mxfp4_at(E, H, I, mode, tier)

    def full_down(acc, gs, wts):
        same_bits(acc.astype(np.float64), run_down(km, "mxfp4", b, 1, gs, wts))

    check_ragged_work_items(
        cf.Kernel(FMT, E, H, I, mode=mode, isa=tier, **GPT_OSS), FMT, r, n, rng,
        [(5, 37), (16, 32), (0, 1), (223, 224), (17, 18), (33, 161)],
        [(3, 29), (16, 48), (415, 416), (0, 17), (5, 91), (32, 80)], full_down, w_in=[1.0] * n)


@pytest.mark.parametrize("tier", [t for _, t in (p.values for p in W8)])
def test_prepared_record(rng, tier):
    """int8 q[K] and fp32 s_b[K/32] as mxfp4's w4a8 record, corr = -12 sum(q_b) (mxfp4 keeps +12 sum), per block."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 2880
    kx, km = (cf.Kernel(f, 1, K, K, mode="w4a8", isa=tier) for f in (FMT, "mxfp4"))
    for v in (rng.standard_normal(K) * 10, rng.standard_normal(K) * 1e-37, np.zeros(K)):
        bits = to_bf16_bits(v)
        px, pm = prep(kx, bits), prep(km, bits)
        assert kx._k.act_bytes(K) == km._k.act_bytes(K) == K + K // 32 * 8
        qx, sx, cx = split_record(px, K, 32)
        np.testing.assert_array_equal(qx, pm[:K].view(np.int8))
        np.testing.assert_array_equal(sx.view(np.uint32), pm[K:K + 4 * (K // 32)].view(np.uint32))
        q = qx.astype(np.int64).reshape(-1, 32)
        np.testing.assert_array_equal(cx, -12 * q.sum(-1))
        np.testing.assert_array_equal(pm[K + 4 * (K // 32):K + 8 * (K // 32)].view(np.int32), 12 * q.sum(-1))


# ---------------------------------------------------------------- schema and errors
def test_schema_and_errors(rng):
    b = SPEC.random_banks(3, 512, 384, rng)
    assert cf.validate_banks(FMT, b) == (3, 512, 384)
    assert SPEC.id == 12 and SPEC.modes == ("w4a8",) and SPEC.default_mode == "w4a8" and SPEC.k_multiple == 32
    assert SPEC.kernel_tiers == {"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni", "avx512bf16")}
    assert not SPEC.input_weight
    small = SPEC.random_banks(2, 64, 64, rng)
    with pytest.raises(ValueError, match="down.*expected shape"):
        cf.validate_banks(FMT, dict(small, down=small["down"][:, :, :272]))
    with pytest.raises(ValueError, match="272"):
        cf.validate_banks(FMT, dict(small, down=small["down"][:, :, :100]))
    with pytest.raises(ValueError, match="gate_up"):
        cf.validate_banks(FMT, dict(small, gate_up=small["gate_up"][:, :-1]))
    with pytest.raises(ValueError, match="down_bias"):
        cf.validate_banks(FMT, dict(small, down_bias=small["down_bias"][:, :-1]))
    with pytest.raises(TypeError, match="dtype"):
        cf.validate_banks(FMT, dict(small, down=small["down"].view(np.int8)))
    with pytest.raises(ValueError, match="needs banks"):  # mxfp4's banks under this name
        cf.validate_banks(FMT, MX.random_banks(2, 64, 64, rng))
    with pytest.raises(ValueError, match="needs banks"):  # and the other way round
        cf.repack_mxfp4_x16(small)
    with pytest.raises(ValueError, match="mode"):
        cf.Kernel(FMT, 2, 64, 64, mode="native")
    with pytest.raises(ValueError, match="multiples of 32"):
        cf.Kernel(FMT, 2, 80, 64)
    with pytest.raises(ValueError, match="apply_router_weight_on_input"):
        cf.Kernel(FMT, 2, 64, 64, apply_router_weight_on_input=True)
    assert mxfp4_x16.GB == 272
