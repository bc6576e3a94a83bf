"""The kernels' activation epilogue: its fp32 fast path gives, after the bf16 rounding every caller applies, the
same bits as the double path (the reference's formulas, activations.py), for every activation, over random and
edge arguments. The double path itself is checked against float64 here too (within one bf16 rounding)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import tier_cases
from fp4_helpers import run_gate_up

import cpumoe_formats as cf
from cpumoe_formats import _native, activations
from cpumoe_formats.numerics import BF16

ACTS = [("silu", None, None), ("gelu_tanh", None, None), ("gelu", None, None), ("swigluoai", 1.702, 7.0),
        ("swigluoai", 1.702, None), ("swiglu_clamp", 1.0, 10.0), ("swiglu_clamp", 0.5, None)]
EDGES = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.1754944e-38, 3.4028235e38, -3.4028235e38,
                  -16.0, -16.000002, -15.999999, -8.0, -7.999999, 88.72283, 88.72284, -87.33654, -87.33655,
                  -103.97, 1.0, -1.0, -1.2785, 7.0, -7.0, 10.0, -10.0, 6.98e12, -6.98e12], np.float32)


def arguments(rng, n):
    """n gates and ups: normal at scales 1 .. 30, log-uniform magnitudes 2^-140 .. 2^127 of both signs, edges."""
    def one():
        k = n // 4
        normal = rng.standard_normal(k) * rng.choice([1.0, 3.0, 10.0, 30.0], k)
        mag = np.exp2(rng.uniform(-140, 127, k)) * rng.choice([-1.0, 1.0], k)
        near = rng.uniform(-20.0, 4.0, k)  # the -16 switch and the turns of the activations
        edge = rng.choice(EDGES, n - 3 * k)
        v = np.concatenate([normal, mag, near, edge])
        rng.shuffle(v)
        return v.astype(np.float32)
    return one(), one()


def both(name, alpha, limit, gate, up):
    act = activations.resolve(name, alpha, limit)
    n = gate.size
    fast, ref = np.empty(n, np.uint16), np.empty(n, np.uint16)
    _native.activate_bf16_both(act.id, act.alpha, act.limit, gate.ctypes.data, up.ctypes.data, n,
                               fast.ctypes.data, ref.ctypes.data)
    return act, fast, ref


@pytest.mark.parametrize("name,alpha,limit", ACTS)
def test_fast_path_gives_the_double_paths_bf16(rng, name, alpha, limit):
    gate, up = arguments(rng, 1_000_000)
    _, fast, ref = both(name, alpha, limit, gate, up)
    bad = np.flatnonzero(fast != ref)
    assert bad.size == 0, (f"{name}: {bad.size} of {gate.size} differ, e.g. gate={gate[bad[0]]!r} "
                           f"up={up[bad[0]]!r}: fast {fast[bad[0]]:#06x} double {ref[bad[0]]:#06x}")


@pytest.mark.parametrize("name,alpha,limit", ACTS)
def test_double_path_matches_float64_reference(rng, name, alpha, limit):
    """bf16(act) from the kernel's double path vs float64 act rounded to bf16: equal, or one bf16 step apart where
    the double -> fp32 -> bf16 double rounding or libm's last bit can decide (rare: counted). gelu_tanh only where
    1 + tanh(v) >= 2e-7 (v >= -8): below, the reference's formula cancels to noise (libm's last bit of tanh decides
    the result), in numpy as in C."""
    gate, up = arguments(rng, 200_000)
    if name == "gelu_tanh":
        g = gate.astype(np.float64)
        with np.errstate(all="ignore"):
            keep = ~(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3) < -8.0)
        gate, up = gate[keep], up[keep]
    act, _, ref = both(name, alpha, limit, gate, up)
    with np.errstate(all="ignore"):
        want = act(gate, up).astype(np.float32).astype(BF16).view(np.uint16)
    same = (ref == want) | (np.isnan(ref.view(BF16).astype(np.float32)) & np.isnan(want.view(BF16).astype(np.float32)))
    step = np.abs(ref.astype(np.int32) - want.astype(np.int32)) == 1
    assert (same | step).all()
    assert (~same).sum() <= gate.size // 10_000, f"{(~same).sum()} of {gate.size} one bf16 step apart"


def test_exp_edges_through_silu():
    """Huge negative gates give -0 or tiny values like the reference, never NaN; huge positive gates give g * up."""
    gate = np.array([-200.0, -90.0, -88.0, 90.0, 1e30], np.float32)
    up = np.ones_like(gate)
    act, fast, _ = both("silu", None, None, gate, up)
    got = fast.view(BF16).astype(np.float64)
    assert not np.isnan(got).any()
    assert got[3] == float(np.float32(90.0).astype(BF16)) and math.isclose(got[4], 1e30, rel_tol=2 ** -8)
    assert (np.abs(got[:3]) < 1e-30).all()



@pytest.mark.parametrize("mode,tier", tier_cases("bf16"))
@pytest.mark.parametrize("name,alpha,limit", ACTS)
def test_kernel_lanes_give_the_double_paths_bf16(rng, mode, tier, name, alpha, limit):
    """The gate_up epilogue of a tier's kernel (common.h ActSink: 8 / 16 SIMD lanes, the double path for the
    lanes its checks reject): a bf16 expert whose gate and up rows are unit vectors makes gate = x[i] and
    up = x[perm[i]] exactly, so every g must be bf16(activate_f64(x[i], x[perm[i]])). One token (the lone-token
    loops) and three (the multi-token ones), every activation, random and edge values (finite: 0 * inf in the
    unit-vector dot would be NaN; normal: no -0 + 0 sign loss, no subnormals that vdpbf16ps reads as 0)."""
    H = I = 512  # noqa: E741
    perm = rng.permutation(I)
    gu = np.zeros((1, 2 * I, H), np.float32)
    gu[0, np.arange(I), np.arange(I)] = 1.0
    gu[0, I + np.arange(I), perm] = 1.0
    banks = {"gate_up": gu.astype(BF16), "down": np.zeros((1, H, I), BF16)}
    act = activations.resolve(name, alpha, limit)
    k = cf.Kernel("bf16", 1, H, I, mode=mode, isa=tier, activation=name, alpha=alpha, limit=limit)
    for n in (1, 3):
        xs = []
        for _ in range(n):
            x, _ = arguments(rng, H)
            x = x.astype(BF16).astype(np.float32)  # (FLT_MAX rounds to inf in bf16)
            # normal values only: vdpbf16ps (avx512bf16, amx) reads subnormal bf16 as zero
            x = np.where(np.isfinite(x) & (np.abs(x) >= 2.0 ** -126), x, np.float32(1.5e-30)).astype(BF16)
            xs.append(x.view(np.uint16))
        g = run_gate_up(k, "bf16", banks, 0, xs)
        for j, xb in enumerate(xs):
            xf = xb.view(BF16).astype(np.float32)
            gate, up = np.ascontiguousarray(xf[:I]), np.ascontiguousarray(xf[perm])
            _, _, ref = both(name, alpha, limit, gate, up)
            got = g[j].astype(np.float32).astype(BF16).view(np.uint16)
            nan = np.isnan(g[j]) & np.isnan(ref.view(BF16).astype(np.float32))
            bad = np.flatnonzero((got != ref) & ~nan)
            assert bad.size == 0, (f"{tier} {name} n={n}: {bad.size} of {I} differ, e.g. gate={gate[bad[0]]!r} "
                                   f"up={up[bad[0]]!r}: kernel {got[bad[0]]:#06x} double {ref[bad[0]]:#06x} "
                                   f"({act.name})")
