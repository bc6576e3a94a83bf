"""reference.moe(tie_slack=): the output's room where an intermediate sits near a bf16 rounding tie, checked
against the float64 definition: at 0.5 ulps every intermediate counts (one ulp of each, through its down column and
route weight); at 0 only exact ties; the output is the same as without it."""
from __future__ import annotations

import numpy as np

import cpumoe_formats as cf
from cpumoe_formats.numerics import round_bf16, ulp_bf16


def test_tie_slack_against_its_definition(rng):
    E, H, I, T, K = 4, 64, 32, 3, 2
    gu = rng.standard_normal((E, 2 * I, H)) * 0.1
    dn = rng.standard_normal((E, H, I)) * 0.1
    banks = cf.quantize("bf16", gu, dn)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = (rng.random((T, K)) + 0.1).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    y0 = cf.reference.moe("bf16", banks, x, w, ids)
    y, all_ = cf.reference.moe("bf16", banks, x, w, ids, tie_slack=0.5)
    assert np.array_equal(y, y0)
    gq, dq = cf.reference.dequantize("bf16", banks)
    want = np.zeros((T, H))
    for t in range(T):
        for k in range(K):
            e = ids[t, k]
            gate_up = gq[e] @ round_bf16(x[t].astype(np.float64))
            g = round_bf16(cf.activations.resolve("silu", None, None)(gate_up[:I], gate_up[I:]))
            want[t] += np.abs(dq[e]) @ ulp_bf16(g) * float(w[t, k])
    np.testing.assert_allclose(all_, want, rtol=1e-12)
    _, none = cf.reference.moe("bf16", banks, x, w, ids, tie_slack=0.0)
    assert not none.any()  # random float64 intermediates sit on no tie
