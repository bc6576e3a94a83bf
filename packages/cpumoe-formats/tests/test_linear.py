"""The dense bf16 linear (linear.py, C ABI 1.9) against the float64 reference, every tier forced in turn (isa= and
CPUMOE_ISA), on fresh random data.

Tolerance: the kernel sums exact bf16 products in fp32 (4 chains, then the tail), so against float64 its error is
~K * 2^-24 of sum |w x| at worst: with K <= 4099 and N(0, 1) data that is < 1e-5 of max |ref| (we allow 1e-4 for the
float32 output). A bf16 output adds its rounding: |y - ref| <= 2^-8 |ref| (half a bf16 step) plus that fp32 error.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import USABLE

import cpumoe_formats as cf
from cpumoe_formats.linear import KERNEL_TIERS, expected_tier
from cpumoe_formats.numerics import BF16

TIER_PARAMS = [pytest.param(t, id=t, marks=[] if t in USABLE else [pytest.mark.skip(reason=f"no {t} here")])
               for t in cf.TIERS]
# (M, K): ragged sizes (not multiples of 4, 8, 16, 32, 128), a K below one vector, the shapes of Qwen3-30B-A3B's
# attention (q 4096x2048, o 2048x4096) and router (128x2048)
SHAPES = [(1, 1), (3, 7), (37, 259), (130, 33), (5, 4099), (128, 2048), (4096, 2048), (2048, 4096)]
BATCHES = [1, 2, 3, 4, 5, 8, 9]


def _data(rng, n, M, K, bias=True):
    x = rng.standard_normal((n, K)).astype(BF16)
    w = rng.standard_normal((M, K)).astype(BF16)
    b = rng.standard_normal(M).astype(BF16) if bias else None
    return x, w, b


def _close(y, ref, out_dtype):
    y = y.astype(np.float64)
    scale = np.abs(ref).max()
    err = np.abs(y - ref)
    if out_dtype == "float32":
        assert err.max() <= 1e-4 * scale, f"rel {err.max() / scale:.2e}"
    else:
        bound = 2.0**-8 * np.abs(ref) + 1e-5 * scale
        where = np.unravel_index((err - bound).argmax(), err.shape)
        assert (err <= bound).all(), f"worst excess {(err - bound).max():.3e} at {where}"


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_forced_tier_reports_what_runs(tier, monkeypatch):
    assert cf.Linear(isa=tier).name == expected_tier(tier)
    monkeypatch.setenv("CPUMOE_ISA", tier)
    assert cf.Linear().name == expected_tier(tier)


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("M,K", SHAPES, ids=[f"{m}x{k}" for m, k in SHAPES])
def test_vs_reference(rng, tier, M, K):
    lin = cf.Linear(isa=tier)
    for n in BATCHES if M * K < 1 << 20 else (1, 3, 8):
        for bias, out_dtype in ((True, "bfloat16"), (False, "float32")):
            x, w, b = _data(rng, n, M, K, bias)
            y = lin.forward(x, w, b, out_dtype=out_dtype)
            assert y.dtype == np.dtype(cf.linear.OUT_DTYPES[out_dtype]) and y.shape == (n, M)
            _close(y, cf.reference.linear(x, w, b), out_dtype)


@pytest.mark.parametrize("tier", [t for t in KERNEL_TIERS if t in USABLE])
def test_a_result_depends_only_on_its_row_and_token(rng, tier):
    """Bit for bit: a token alone equals the same token inside any batch, and any row range equals the same rows of
    the whole call (the executor splits rows between threads and claims them in any order)."""
    lin = cf.Linear(isa=tier)
    M, K = 301, 517
    x, w, b = _data(rng, 9, M, K)
    whole = lin.forward(x, w, b, out_dtype="float32")
    for t in range(9):
        alone = lin.forward(x[t:t + 1], w, b, out_dtype="float32")
        assert np.array_equal(alone.view(np.uint32), whole[t:t + 1].view(np.uint32)), f"token {t}"
    for n in (2, 3, 4, 5):
        part = lin.forward(x[:n], w, b, out_dtype="float32")
        assert np.array_equal(part.view(np.uint32), whole[:n].view(np.uint32)), f"batch {n}"
    for r0, r1 in ((0, 1), (5, 37), (16, 272), (299, 301), (3, 300)):
        out = np.full((9, M), np.nan, np.float32)
        lin.forward(x, w, b, out=out, out_dtype="float32", rows=(r0, r1))
        assert np.array_equal(out[:, r0:r1].view(np.uint32), whole[:, r0:r1].view(np.uint32)), (r0, r1)
        assert np.isnan(out[:, :r0]).all() and np.isnan(out[:, r1:]).all(), "wrote outside its rows"
    # the bf16 output is the float32 one rounded to nearest even
    y16 = lin.forward(x, w, b)
    assert np.array_equal(y16.view(np.uint16), whole.astype(BF16).view(np.uint16))


@pytest.mark.parametrize("tier", [t for t in KERNEL_TIERS if t in USABLE])
def test_strided_weight_rows_and_strided_out(rng, tier):
    """A weight that is a row slice of a wider matrix (nn.Linear views, fused q/k/v) and an out with a row stride."""
    lin = cf.Linear(isa=tier)
    x, wide, _ = _data(rng, 3, 40, 300, bias=False)
    w = wide[:, 13:13 + 259]  # rows of 259 values, 300 apart
    out = np.zeros((3, 64), BF16)[:, 5:45]
    lin.forward(x[:, :259], w, out=out)
    _close(out, cf.reference.linear(x[:, :259], w), "bfloat16")


@pytest.mark.parametrize("tier", [t for t in KERNEL_TIERS if t in USABLE])
@pytest.mark.parametrize("kind", ["nan", "+inf", "-inf"])
def test_nonfinite_follow_the_reference(rng, tier, kind):
    """NaN / inf in x, in a weight row or in the bias give NaN / +inf / -inf exactly where the float64 reference does
    (which is where torch's bf16 linear does); every other output is the clean run's, bit for bit."""
    v = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}[kind]
    lin = cf.Linear(isa=tier)
    M, K = 70, 131
    x, w, b = _data(rng, 3, M, K)
    x[0, 5] = 0.0  # a zero against an inf weight: the reference's 0 * inf is NaN
    clean = lin.forward(x, w, b, out_dtype="float32")
    for where in ("x", "w", "w0", "bias"):
        xb, wb, bb = x.copy(), w.copy(), b.copy()
        if where == "x":
            xb[1, 77] = v
        elif where == "w":
            wb[9, 100] = v
        elif where == "w0":
            wb[9, 5] = v  # meets x[0, 5] = 0
        else:
            bb[30] = v
        y = lin.forward(xb, wb, bb, out_dtype="float32").astype(np.float64)
        ref = cf.reference.linear(xb, wb, bb)
        bad = ~np.isfinite(ref)
        assert bad.any()
        assert np.array_equal(np.isnan(y), np.isnan(ref)), where
        assert np.array_equal(np.isposinf(y), np.isposinf(ref)) and np.array_equal(np.isneginf(y), np.isneginf(ref))
        assert np.array_equal(y[~bad].astype(np.float32).view(np.uint32), clean[~bad].view(np.uint32)), where


def test_bad_input_is_refused_with_what_was_expected(rng):
    lin = cf.Linear()
    x, w, b = _data(rng, 2, 8, 16)
    with pytest.raises(ValueError, match=r"x: shape \(2, 15\).*expected \[n, 16\]"):
        lin.forward(x[:, :15], w)
    with pytest.raises(ValueError, match="weight: shape .* float32.*bfloat16 matrix"):
        lin.forward(x, w.astype(np.float32))
    with pytest.raises(ValueError, match="weight: strides"):
        lin.forward(x, np.ascontiguousarray(w.T).T)  # columns contiguous, not rows
    with pytest.raises(ValueError, match="bias"):
        lin.forward(x, w, b[:7])
    with pytest.raises(ValueError, match="out"):
        lin.forward(x, w, out=np.zeros((2, 8), np.float32))  # float32 out but out_dtype bfloat16
    with pytest.raises(ValueError, match="out_dtype='float16'"):
        lin.forward(x, w, out_dtype="float16")
    with pytest.raises(ValueError, match=r"rows=\(4, 9\)"):
        lin.forward(x, w, rows=(4, 9))
    with pytest.raises(TypeError, match="x: dtype int32"):
        lin.forward(x.astype(np.int32), w)
    with pytest.raises(ValueError, match="isa='avx9'"):
        cf.Linear(isa="avx9")
    lin.close()
    with pytest.raises(RuntimeError, match="closed"):
        lin.forward(x, w)


def test_env_isa_that_is_no_tier_is_an_error(monkeypatch):
    monkeypatch.setenv("CPUMOE_ISA", "avx1024")
    with pytest.raises(ValueError, match="CPUMOE_ISA=avx1024 is not a tier"):
        cf.Linear()


def test_float_x_is_rounded_to_bf16_first(rng):
    lin = cf.Linear()
    x, w, _ = _data(rng, 2, 9, 33)
    xf = rng.standard_normal((2, 33))
    assert np.array_equal(lin.forward(xf, w).view(np.uint16), lin.forward(xf.astype(np.float32).astype(BF16), w)
                          .view(np.uint16))
    assert lin.forward(np.zeros((0, 33), BF16), w).shape == (0, 9)
