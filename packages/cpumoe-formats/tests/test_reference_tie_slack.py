"""reference.moe(tie_slack=): the output's room where an intermediate sits near a bf16 rounding tie, checked
against its float64 definition with the other rounding candidate found from the bf16 bits (numerics.gap_bf16 is
checked against the same bits): at 0.5 gaps every intermediate counts, at 0.2 those within 0.2 gaps of the midpoint
between g and that candidate, at 0 only exact ties; the output is the same as without it."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cpumoe_formats as cf
from cpumoe_formats.numerics import gap_bf16, round_bf16

BF16 = ml_dtypes.bfloat16


def _neighbour(g, toward):
    """The bf16 value next to g (bf16 values, float64) on toward's side, from the bits: magnitude code +-1."""
    g = np.asarray(g, np.float64)
    code = g.astype(BF16).view(np.uint16).astype(np.int64)
    mag, sign = code & 0x7FFF, code & 0x8000
    away = np.abs(toward) > np.abs(g)
    nb_mag = np.where(away, mag + 1, np.maximum(mag - 1, 0))
    nb = np.where(mag == 0, np.where(toward < 0, 0x8001, 0x0001), sign | nb_mag)
    return nb.astype(np.uint16).view(BF16).astype(np.float64)


def test_gap_against_the_bits(rng):
    g = round_bf16(rng.standard_normal(4000) * 10.0 ** rng.integers(-30, 30, 4000))
    p2 = np.ldexp(1.0, rng.integers(-125, 120, 200)) * rng.choice([-1, 1], 200)  # powers of two: finer below
    g = np.concatenate([g, p2, [2.0 ** -126, -(2.0 ** -126), 1.0, 0.0]])
    for side in (1.0 + 1e-6, 1.0 - 1e-6):
        toward = g * side + (side - 1.0) * 1e-45
        np.testing.assert_array_equal(gap_bf16(g, toward), np.abs(_neighbour(g, toward) - g))
    assert gap_bf16(2.0, 1.9) == 2.0 ** -7 and gap_bf16(2.0, 2.1) == 2.0 ** -6


def _banks_and_routes(rng, E=4, H=64, I=32, T=3, K=2):  # noqa: E741
    gu = rng.standard_normal((E, 2 * I, H)) * 0.1
    dn = rng.standard_normal((E, H, I)) * 0.1
    banks = cf.quantize("bf16", gu, dn)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = (rng.random((T, K)) + 0.1).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    return banks, x, w, ids, I


def _want(banks, x, w, ids, I, ulps):  # noqa: E741
    gq, dq = cf.reference.dequantize("bf16", banks)
    act = cf.activations.resolve("silu", None, None)
    want = np.zeros((x.shape[0], dq.shape[1]))
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            gate_up = gq[e] @ round_bf16(x[t].astype(np.float64))
            a = act(gate_up[:I], gate_up[I:])
            g = round_bf16(a)
            other = _neighbour(g, a)
            near = np.abs(a - 0.5 * (g + other)) <= ulps * np.abs(other - g)
            want[t] += np.abs(dq[e][:, near]) @ np.abs(other - g)[near] * float(w[t, k])
    return want


@pytest.mark.parametrize("ulps", [0.5, 0.2])
def test_tie_slack_against_its_definition(rng, ulps):
    banks, x, w, ids, I = _banks_and_routes(rng)  # noqa: E741
    y0 = cf.reference.moe("bf16", banks, x, w, ids)
    y, slack = cf.reference.moe("bf16", banks, x, w, ids, tie_slack=ulps)
    assert np.array_equal(y, y0)
    want = _want(banks, x, w, ids, I, ulps)
    np.testing.assert_allclose(slack, want, rtol=1e-12, atol=0)
    assert slack.any()
    _, none = cf.reference.moe("bf16", banks, x, w, ids, tie_slack=0.0)
    assert not none.any()  # random float64 intermediates sit on no tie
