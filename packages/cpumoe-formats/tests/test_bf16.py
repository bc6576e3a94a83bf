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

TOL = 6e-3


@pytest.mark.parametrize("mode,tier", tier_cases("bf16"))
@pytest.mark.parametrize("T", [1, 3, 8])
def test_qwen3_30b_shape(rng, mode, tier, T):
    E, H, I, K = 4, 2048, 768, 8  # noqa: E741
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
