"""mxfp4_panel (mxfp4 repacked into 64-column panels) against mxfp4 and the float64 reference, every tier forced.

The panel format moves bytes only, and its kernels are mxfp4's with a different column walk (one tile per
64-column panel), so the strongest check is bit identity: every output of mxfp4_panel must equal, bit for bit,
the output of mxfp4 on the same weights (whole steps at batch 1 / 3 / 8 with duplicated and -1 routes, work
items on odd ranges that cross panels, ragged N whose last panel is half padding, padded row strides). A
wrong panel offset, scale row, padding read or output offset changes bits. Parity with the float64 reference
is checked as well, with mxfp4's tolerance (test_mxfp4.py: TOL = 4e-3, twice bf16's half ulp of y);
test_mxfp4.py's alternate-dtype test covers both layouts.
"""
import numpy as np
import pytest
from conftest import POISON, poisoned, rel_err, routes, run_forced, tier_cases

import cpumoe_formats as cf
from cpumoe_formats.formats import mxfp4_panel
from cpumoe_formats.numerics import BF16

FMT = "mxfp4_panel"
SPEC = cf.get_format(FMT)
MX = cf.get_format("mxfp4")
TOL = 4e-3
GPT_OSS = dict(activation="swigluoai", alpha=1.702, limit=7.0)


def _pair(rng, E, H, I):  # noqa: E741
    """Random mxfp4 banks (every byte value) and their panel repack."""
    m = MX.random_banks(E, H, I, rng)
    return m, cf.repack_mxfp4_panels(m)


def _padded_rows(banks, extra=64):
    """The same banks with every 3-D bank's rows padded to a larger stride (the kernels use the view's stride)."""
    out = {}
    for n, a in banks.items():
        if a.ndim == 3:
            big = cf.aligned_empty(a.shape[:2] + (a.shape[2] + extra,), a.dtype)
            big.view(np.uint8)[...] = 0xEE  # padding bytes a kernel must never read as weights
            big[:, :, :a.shape[2]] = a
            out[n] = big[:, :, :a.shape[2]]
        else:
            out[n] = a
    return out


# ---------------------------------------------------------------- layout

@pytest.mark.parametrize("H,I", [(96, 160), (160, 96), (2880, 64), (32, 32)])  # noqa: E741
def test_repack_round_trip_and_layout(rng, H, I):  # noqa: E741
    m, p = _pair(rng, 3, H, I)
    assert cf.validate_banks(FMT, p) == (3, H, I)
    ph, pg = -(-H // 64), 2 * I // 64
    assert p["down_blocks"].shape == (3, ph * I // 2, 64) and p["gate_up_scales"].shape == (3, pg * H // 32, 64)
    # row p * K/2 + kb holds K-pair kb of columns 64p .. 64p + 63
    for e, kb, n in ((0, 0, 0), (2, I // 2 - 1, H - 1), (1, 5 % (I // 2), min(70, H - 1))):
        assert p["down_blocks"][e, (n // 64) * (I // 2) + kb, n % 64] == m["down_blocks"][e, kb, n]
    if H % 64:  # the last panel's padding is zero
        assert not p["down_blocks"][:, (ph - 1) * (I // 2):, H % 64:].any()
    back = cf.unpack_mxfp4_panels(p)
    for n in m:
        assert np.array_equal(np.asarray(back[n]).view(np.uint8), np.asarray(m[n]).view(np.uint8)), n
    for a, b in zip(MX.dequantize(m), SPEC.dequantize(p)):
        assert np.array_equal(a, b)


# ---------------------------------------------------------------- bit identity with mxfp4

@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("H,I", [(2880, 224), (160, 96), (96, 160)])  # noqa: E741 - gpt-oss H (45 panels), ragged
@pytest.mark.parametrize("T", [1, 3, 8])
def test_steps_bit_identical_to_mxfp4(rng, mode, tier, H, I, T):  # noqa: E741
    E, K = 4, 4
    m, p = _pair(rng, E, H, I)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    ym = run_forced("mxfp4", m, x, w, ids, mode, tier, **GPT_OSS)
    yp = run_forced(FMT, p, x, w, ids, mode, tier, **GPT_OSS)
    assert np.array_equal(yp, ym)
    # padded row strides read the same weights
    assert np.array_equal(run_forced(FMT, _padded_rows(p), x, w, ids, mode, tier, **GPT_OSS), ym)


@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
def test_work_items_bit_identical_to_mxfp4(rng, mode, tier):
    """gate_up / down items on odd ranges (inside a panel, crossing one or several panels, the half-padded last
    panel) and 1..9 tokens or routes per item, against the same items of mxfp4."""
    E, H, I = 2, 224, 192  # noqa: E741 - H: 3.5 panels
    m, p = _pair(rng, E, H, I)
    views = {f: cf.get_format(f).bank_views(cf.get_format(f).validate(b)[0]) for f, b in (("mxfp4", m), (FMT, p))}
    ks = {f: cf.Kernel(f, E, H, I, mode=mode, isa=tier, **GPT_OSS) for f in views}
    assert ks[FMT]._k.block_hint == 64 and ks[FMT].name == ks["mxfp4"].name
    k = ks[FMT]._k

    def prep(v):
        src = np.ascontiguousarray(np.asarray(v, np.float32).astype(BF16)).view(np.uint16)
        dst = cf.aligned_empty((k.act_bytes(len(src)),), np.uint8)
        k.prep_act(src.ctypes.data, len(src), dst.ctypes.data)
        return dst

    for n in (1, 2, 3, 9):
        px = [prep(v) for v in rng.standard_normal((n, H))]
        for i0, i1 in ((0, I), (0, 1), (3, 20), (5, 37), (31, 33), (40, 105), (I - 7, I)):
            gs = {}
            for f, kk in ks.items():
                g = poisoned(n, I)
                kk._k.gate_up(views[f], 1, i0, i1, [q.ctypes.data for q in px], [0.75] * n,
                              [g[j].ctypes.data for j in range(n)])
                gs[f] = g.view(np.uint16)
            assert (gs[FMT][:, i0:i1] != POISON).all() and (gs[FMT][:, :i0] == POISON).all()
            assert np.array_equal(gs[FMT], gs["mxfp4"]), (n, i0, i1)
        pg = [prep(v) for v in rng.standard_normal((n, I))]
        experts = np.sort(rng.integers(0, E, n))
        for h0, h1 in ((0, H), (0, 1), (7, 70), (33, 161), (60, 68), (H - 5, H), (192, H)):
            accs = {}
            for f, kk in ks.items():
                acc = np.full((2, h1 - h0), 0.25, np.float32)
                kk._k.down(views[f], h0, h1, [(j % 2, int(experts[j]), 0.5 + j, pg[j].ctypes.data) for j in range(n)],
                           acc.ctypes.data, h1 - h0)
                accs[f] = acc.view(np.uint32)
            assert np.array_equal(accs[FMT], accs["mxfp4"]), (n, h0, h1)


# ---------------------------------------------------------------- reference, dtypes, errors

@pytest.mark.parametrize("mode,tier", tier_cases(FMT))
@pytest.mark.parametrize("H,I,T", [(96, 160, 8), (160, 96, 3), (2880, 64, 1)])  # noqa: E741
def test_against_float64_reference(rng, mode, tier, H, I, T):  # noqa: E741
    E, K = 5, 4
    gu = rng.standard_normal((E, 2 * I, H)).astype(np.float32) * 0.1
    dn = rng.standard_normal((E, H, I)).astype(np.float32) * 0.1
    dnb = rng.standard_normal((E, H)).astype(np.float32) * 0.1
    banks = cf.quantize(FMT, gu, dn, down_bias=dnb)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced(FMT, banks, x, w, ids, mode, tier, **GPT_OSS)
    ref = cf.reference.moe(FMT, banks, x, w, ids, mode=mode, **GPT_OSS)
    assert rel_err(y, ref) < TOL


def test_schema_and_errors(rng):
    b = SPEC.random_banks(3, 2880, 2880, rng)
    assert cf.validate_banks(FMT, b) == (3, 2880, 2880)
    assert SPEC.bytes_per_expert(2880, 2880) == MX.bytes_per_expert(2880, 2880)  # 2880 = 45 panels: no padding
    assert SPEC.id == 6 and cf.get_format("mxfp4_cpu") is SPEC and SPEC.kernel_tiers == MX.kernel_tiers
    small = SPEC.random_banks(2, 96, 64, rng)
    bad = dict(small, down_blocks=small["down_blocks"][:, :, :32])
    with pytest.raises(ValueError, match="down_blocks.*expected shape"):
        cf.validate_banks(FMT, bad)
    bad = dict(small, gate_up_scales=small["gate_up_scales"][:, :-1])
    with pytest.raises(ValueError, match="gate_up_scales"):
        cf.validate_banks(FMT, bad)
    with pytest.raises(ValueError, match="expected shape"):  # Triton-layout banks under the panel name
        cf.validate_banks(FMT, MX.random_banks(2, 96, 64, rng))
    with pytest.raises(ValueError, match="router weight"):
        cf.Kernel(FMT, 2, 96, 64, apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match="64 columns"):
        mxfp4_panel.from_panels(np.zeros((1, 10, 32), np.uint8), 96)
    with pytest.raises(ValueError, match="multiples of 32"):
        cf.Kernel(FMT, 2, 80, 64)


def test_sizes_with_padding():
    # H = 96: 2 panels for down (the second half padding): 96 bytes of row data per K-pair row become 128
    assert SPEC.bytes_per_expert(96, 64) - MX.bytes_per_expert(96, 64) == (32 * 32 + 32 * 2)
