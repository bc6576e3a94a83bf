"""Helpers shared by the nvfp4 and ds_fp4 tests: direct calls of a kernel's
prep_act / gate_up / down work items, and rigorous per-element bounds.

Bounds used (u = 2^-24, the fp32 unit roundoff):
- a dot product of K terms summed in fp32 in any order, then multiplied by a few
  scale factors, is within (K + 8) u * sum|terms| of the exact value (the classic
  gamma_n bound, n = K + 8 covers the scale/global/weight products);
- g = bf16(act(gate, up)) is monotone in its rounding, so a correct kernel's g lies
  in [bf16(min act), bf16(max act)] over the box gate +- dg, up +- du, where dg, du
  are the dot bounds above. act is f(gate) h(up) with h monotone, so its extremes over
  the box lie at the up ends and at the gate ends or a stationary point of f inside the
  gate interval (silu and gelu have an interior minimum: a gate box that straddles it,
  as a cancelled dot with huge scales does, must include it). The box is usually tiny,
  so this is a tight, exact check.
"""
from __future__ import annotations

import functools

import numpy as np

import cpumoe_formats as cf
from cpumoe_formats.numerics import BF16, round_bf16

U = 2.0**-24


def kernel(fmt, E, H, I, mode, tier, **kw):  # noqa: E741
    k = cf.Kernel(fmt, E, H, I, mode=mode, isa=tier, **kw)
    assert k.name == tier + ("+w4a8" if mode == "w4a8" else "")
    return k


def to_bf16_bits(v) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(v, np.float32).astype(BF16)).view(np.uint16)


def prep(k, v_bits: np.ndarray) -> np.ndarray:
    """The kernel's prepared form of one bf16 vector (uint16 bits)."""
    v_bits = np.ascontiguousarray(v_bits, np.uint16)
    K = v_bits.shape[0]
    buf = cf.aligned_empty((k._k.act_bytes(K) + 64,), np.uint8)
    k._k.prep_act(v_bits.ctypes.data, K, buf.ctypes.data)
    return buf


def views(fmt, banks):
    spec = cf.get_format(fmt)
    arrays, _ = spec.validate(banks)
    return spec.bank_views(arrays)


def run_gate_up(k, fmt, banks, e, xs_bits, w_in=None) -> np.ndarray:
    """g [n, I] (float64 of the kernel's bf16) for tokens xs (bf16 bits [n, H])."""
    n, I = len(xs_bits), k.I  # noqa: E741
    bufs = [prep(k, x) for x in xs_bits]
    g = cf.aligned_empty((n, I), np.uint16)
    g[...] = 0x7FC1  # poison
    w_in = [1.0] * n if w_in is None else list(w_in)
    k._k.gate_up(views(fmt, banks), e, 0, I, [b.ctypes.data for b in bufs], w_in, [g[j].ctypes.data for j in range(n)])
    assert not (g == 0x7FC1).any(), "gate_up left g unwritten"
    return g.view(BF16).astype(np.float64)


def run_down(k, fmt, banks, e, gs_bits, weights) -> np.ndarray:
    """acc [n, H] fp32 -> float64: acc[j] = weights[j] * down[e] . act(g_j)."""
    n, H = len(gs_bits), k.H
    bufs = [prep(k, g) for g in gs_bits]
    acc = cf.aligned_empty((n, H), np.float32)
    acc[...] = 0
    routes = [(j, e, float(weights[j]), bufs[j].ctypes.data) for j in range(n)]
    k._k.down(views(fmt, banks), 0, H, routes, acc.ctypes.data, H)
    return acc.astype(np.float64)


def dot_bound(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """(K + 8) u * sum_k |w[r, k] a[k]| per row r."""
    return (w.shape[-1] + 8) * U * (np.abs(w) @ np.abs(a))


def check_down(acc, W, acts, weights, rel_extra=0.0):
    """acc [n, H] vs exact weights[j] * W @ acts[j] within the dot bound (+ rel_extra * |ref|)."""
    for j in range(len(acts)):
        ref = float(np.float32(weights[j])) * (W @ acts[j])
        bound = abs(float(np.float32(weights[j]))) * dot_bound(W, acts[j]) + rel_extra * np.abs(ref) + 1e-300
        err = np.abs(acc[j] - ref)
        bad = np.flatnonzero(err > bound)
        assert bad.size == 0, (f"route {j}: {bad.size} rows outside the fp32 bound, e.g. row {bad[0]}: "
                               f"kernel {acc[j][bad[0]]!r} exact {ref[bad[0]]!r} bound {bound[bad[0]]!r}")


@functools.lru_cache(maxsize=None)
def stationary_gates(act) -> tuple[float, ...]:
    """Gates where f(gate) = act(gate, up=1) has a local extremum (silu: -1.2785 / alpha; gelu: -0.7518)."""
    # [-5, 5] / alpha holds every turn of these activations; further out 1 + erf(x) cancels to noise
    x = np.linspace(-5.0, 5.0, 100_001) / max(abs(act.alpha), 1e-3)
    with np.errstate(over="ignore"):
        f = act(x, np.ones_like(x))
    d = np.sign(np.diff(f))
    out = []
    for i in np.flatnonzero(d[:-1] * d[1:] < 0) + 1:  # f turns at x[i]; refine by golden-section search
        lo, hi, want_min = x[i - 1], x[i + 1], d[i - 1] < 0
        for _ in range(80):
            m1, m2 = lo + 0.382 * (hi - lo), hi - 0.382 * (hi - lo)
            f1, f2 = act(np.array([m1, m2]), np.ones(2))
            lo, hi = (lo, m2) if (f1 < f2) == want_min else (m1, hi)
        out.append(0.5 * (lo + hi))
    return tuple(out)


def check_g(g, gate, up, dgate, dup, act, round_gate_up=False):
    """Kernel g (bf16 values) within [bf16(min act), bf16(max act)] over the error box."""
    glo, ghi = gate - dgate, gate + dgate
    if round_gate_up:  # bf16 rounding is monotone: the box maps to a box
        glo, ghi = round_bf16(glo), round_bf16(ghi)
    gates = [glo, round_bf16(gate) if round_gate_up else gate, ghi]
    gates += [np.where((glo < c) & (c < ghi), c, glo) for c in stationary_gates(act)]
    cands = []
    for ga in gates:
        for su in (-1, 0, 1):
            ua = up + su * dup
            if round_gate_up:
                ua = round_bf16(ua)
            with np.errstate(over="ignore"):  # exp(-gate) overflows for hugely negative gates: act -> -0
                cands.append(act(ga, ua))
    c = np.stack(cands)
    lo, hi = round_bf16(c.min(axis=0)), round_bf16(c.max(axis=0))
    bad = np.flatnonzero((g < lo) | (g > hi) | ~np.isfinite(g))
    assert bad.size == 0, (f"{bad.size} g elements outside their bounds, e.g. {bad[0]}: kernel {g.flat[bad[0]]!r} "
                           f"allowed [{lo.flat[bad[0]]!r}, {hi.flat[bad[0]]!r}]")


TINY = 2.0**-149  # fp32 subnormal step: absolute error of one product with a subnormal result


def bits_f64(b):
    return np.asarray(b, np.uint16).view(BF16).astype(np.float64)


def ds_flip_effect(fmt, k, banks, x, w, ids, deq, mode, **kw):
    """ds_fp4 and ds_fp4_x16 (fmt): what the kernel's own g flips do to y, exactly (per token, the largest |change|
    of an output element).

    The kernel's gate/up (fp32) may round to bf16 the other way than the float64 reference where the exact value
    sits within fp32 error of a rounding boundary ((c) of the module docstring). Its g then differs in that
    element; through the FP8 round trip (native) and the int8 requantization (w4a8) the whole 128- or 32-block
    of activations may follow when the element is a block maximum, and a duplicated expert repeats it. Rather
    than bound that, this takes the kernel's g from its gate_up work item (checked here against the rigorous
    interval of check_g, so it is a g the kernel may produce) and propagates the difference of the prepared
    activations through the exact down rows: sum over routes of w * down[e] @ (act_in(g_kernel) - act_in(g_ref)).
    It is 0 when no flip happened (the usual case), so the tolerance stays tight. Found by looping seeds: a w4a8
    step whose expert was routed three times read 1.26e-2 against 9.0e-3."""
    spec = cf.get_format(fmt)
    gu, dn = deq
    act = cf.activations.resolve(kw.get("activation", "silu"), kw.get("alpha"), kw.get("limit"))
    H, I = dn.shape[1], dn.shape[2]  # noqa: E741
    worst = 0.0
    for t in range(ids.shape[0]):
        xb = to_bf16_bits(x[t])
        xa = spec.act_in(bits_f64(xb), mode)
        delta = np.zeros(H)
        for e in {int(v) for v in ids[t] if v >= 0}:
            g_k = run_gate_up(k, fmt, banks, e, [xb])[0]
            pre = gu[e] @ xa
            bnd = dot_bound(gu[e], xa) + (H // 32 + 8) * TINY
            check_g(g_k, pre[:I], pre[I:], bnd[:I], bnd[I:], act, round_gate_up=True)
            g_r = round_bf16(act(round_bf16(pre[:I]), round_bf16(pre[I:])))
            if np.array_equal(g_k, g_r):
                continue
            wsum = sum(float(np.float32(w[t, j])) for j in range(ids.shape[1]) if ids[t, j] == e)
            delta += wsum * (dn[e] @ (spec.act_in(g_k, mode) - spec.act_in(g_r, mode)))
        worst = max(worst, float(np.abs(delta).max()))
    return worst
