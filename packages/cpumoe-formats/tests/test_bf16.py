"""bf16 kernels vs the float64 reference, every tier forced in turn.

Tolerance: y is bf16, whose half-ulp is between 2^-9 and 2^-8 of |y| (7 stored
mantissa bits), so rounding alone reaches 3.9e-3 of max|ref|; g is rounded to
bf16 in both kernel and reference and the kernel's fp32 accumulation over
K <= 2880 adds ~sqrt(K) * 2^-24 relative, which flips the bf16 rounding of a few
g elements by one ulp (2^-7 of that element, diluted over I terms in the down
dot). rel = max|y - ref| / max|ref| <= 2^-8 + small: we allow 6e-3.
"""
import numpy as np
import pytest
from conftest import rel_err, routes, run_forced, tier_cases

import cpumoe_formats as cf
from cpumoe_formats.numerics import BF16

TOL = 6e-3


# Qwen3-30B-A3B's shape at batch 1, 3, 8; then tiny I at batch 8: at I <= 16 (avx2, avx512f) or 32 (avx512bf16)
# down rows go through Dot::rows_acc in blocks of 8/16 rows (rowmajor.h SmallK). H % 16 = 3 leaves a partial
# last block; I not a multiple of 8 takes the padded loads.
SHAPES = [(4, 2048, 768, 8, T) for T in (1, 3, 8)] + [(4, 2051, I, 4, 8) for I in (1, 5, 8, 13, 16, 17, 24, 32)]


@pytest.mark.parametrize("mode,tier", tier_cases("bf16"))
@pytest.mark.parametrize("E,H,I,K,T", SHAPES, ids=[f"H{s[1]}-I{s[2]}-T{s[4]}" for s in SHAPES])
def test_vs_reference(rng, mode, tier, E, H, I, K, T):  # noqa: E741
    banks = cf.get_format("bf16").random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    y = run_forced("bf16", banks, x, w, ids, mode, tier)
    ref = cf.reference.moe("bf16", banks, x, w, ids)
    assert rel_err(y, ref) < TOL


@pytest.mark.parametrize("mode,tier", tier_cases("bf16"))
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "swigluoai", "swiglu_clamp"])
@pytest.mark.parametrize("on_input", [False, True])
def test_ragged_activations(rng, mode, tier, act, on_input):
    E, H, I, K, T = 5, 259, 131, 4, 3  # noqa: E741 - ragged: not multiples of 8/16/32
    gu = rng.standard_normal((E, 2 * I, H)).astype(np.float32) * 0.1
    dn = rng.standard_normal((E, H, I)).astype(np.float32) * 0.1
    banks = cf.quantize("bf16", gu, dn)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, K, E)
    kw = dict(activation=act, apply_router_weight_on_input=on_input)
    if act.startswith("swiglu"):
        kw.update(alpha=1.702, limit=1.5)  # a limit the data actually crosses
    y = run_forced("bf16", banks, x, w, ids, mode, tier, **kw)
    ref = cf.reference.moe("bf16", banks, x, w, ids, **kw)
    assert rel_err(y, ref) < TOL


def test_quantizer_roundtrip(rng):
    gu = rng.standard_normal((2, 6, 10)).astype(np.float32)
    dn = rng.standard_normal((2, 10, 3)).astype(np.float32)
    b = cf.quantize("bf16", gu, dn)
    dgu, ddn = cf.reference.dequantize("bf16", b)
    assert np.abs(dgu - gu).max() <= np.abs(gu).max() * 2**-8
    assert np.abs(ddn - dn).max() <= np.abs(dn).max() * 2**-8


# ---------------------------------------------------------------- tiny I: the row-block down path


@pytest.mark.parametrize("mode,tier", tier_cases("bf16"))
@pytest.mark.parametrize("I", [5, 8, 16, 32])
def test_tiny_inter_down_rows_independent_of_split(rng, mode, tier, I):  # noqa: E741
    """A down row's bits must not depend on where its work item (and so its row block) starts: the executor
    splits H differently for every thread count. Each sub-range result must equal the same rows of the
    whole-range call bit for bit, and the whole range must match float64 (rows_acc adds y * weight into acc)."""
    E, H = 3, 203  # noqa: E741
    spec = cf.get_format("bf16")
    banks = spec.random_banks(E, H, I, rng)
    arrays, _ = spec.validate(banks)
    views = spec.bank_views(arrays)
    k = cf.Kernel("bf16", E, H, I, mode=mode, isa=tier)
    _, dn = cf.reference.dequantize("bf16", banks)
    gs = rng.standard_normal((4, I)).astype(BF16)
    acts = []
    for g in gs:  # the kernel's prepared activation of each route
        src = np.ascontiguousarray(g).view(np.uint16)
        dst = cf.aligned_empty((k._k.act_bytes(I),), np.uint8)
        k._k.prep_act(src.ctypes.data, I, dst.ctypes.data)
        acts.append(dst)
    experts, tokens = [0, 0, 1, 2], [0, 1, 0, 1]  # grouped by expert, tokens repeating
    wts = (rng.random(4) + 0.1).astype(np.float32)
    rts = [(tokens[r], experts[r], float(wts[r]), acts[r].ctypes.data) for r in range(4)]
    # acc is accumulated into: start from noise far below the terms, so that a 1-ulp change of a term shows
    base = (rng.standard_normal((2, H)) * 1e-6).astype(np.float32)

    def down(h0, h1):
        acc = base[:, h0:h1].copy()  # C-contiguous, never base itself
        k._k.down(views, h0, h1, rts, acc.ctypes.data, h1 - h0)
        return acc

    whole = down(0, H)
    for h0, h1 in ((0, 1), (1, 9), (3, 20), (7, 40), (17, 33), (100, 203), (190, 203), (202, 203)):
        np.testing.assert_array_equal(down(h0, h1).view(np.uint32), whole[:, h0:h1].view(np.uint32),
                                      err_msg=f"rows [{h0}, {h1}) differ from the whole-range call")
    ref = base.astype(np.float64)
    mag = np.abs(base).astype(np.float64)
    for r in range(4):
        g = gs[r].astype(np.float64)
        ref[tokens[r]] += float(wts[r]) * (dn[experts[r]] @ g)
        mag[tokens[r]] += float(wts[r]) * (np.abs(dn[experts[r]]) @ np.abs(g))
    # fp32: each product and sum rounds (<= I + 2 roundings of 2^-24 on |terms|); avx512bf16's vdpbf16ps
    # computes in fp32 too. 1e-5 of the magnitude is far above that and far below any wrong term.
    assert (np.abs(whole - ref) <= 1e-5 * mag).all()


@pytest.mark.parametrize("mode,tier", tier_cases("bf16"))
@pytest.mark.parametrize("I", [8, 13])
def test_tiny_inter_batch_identity(rng, mode, tier, I):  # noqa: E741
    E, H, top_k, T = 5, 515, 4, 9  # noqa: E741
    banks = cf.get_format("bf16").random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, top_k, E)
    y = run_forced("bf16", banks, x, w, ids, mode, tier).astype(np.float32)
    for t in range(T):
        y1 = run_forced("bf16", banks, x[t : t + 1], w[t : t + 1], ids[t : t + 1], mode, tier).astype(np.float32)
        np.testing.assert_array_equal(y[t].view(np.uint32), y1[0].view(np.uint32), err_msg=f"token {t}")
