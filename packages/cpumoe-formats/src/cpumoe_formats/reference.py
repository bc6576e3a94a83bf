"""float64 reference of a whole MoE step, for every format.

It mirrors the kernels' defined roundings and nothing else: x and g are bf16
values (g = bf16(act(gate, up))), the activation is consumed as the format's
mode prepares it (FormatSpec.act_in), ds_fp4 rounds gate/up and each route's
term to bf16. Everything else is exact float64, so the kernels' only
deviation is fp32 accumulation (see docs/formats.md for the tolerances).

Threads: every function may run on any number of threads at once (pure numpy on its arguments).
"""
from __future__ import annotations

import numpy as np

from . import activations
from .formats import get_format
from .inputs import check_routing, check_x
from .layers import model_mode, validate_layer
from .numerics import gap_bf16, round_bf16


def _pair(fmt):
    """(gate_up spec, down spec) of a format name or a (gate_up, down) pair of names."""
    if isinstance(fmt, (tuple, list)):
        if len(fmt) != 2:
            raise ValueError(f"fmt={fmt!r}: expected a format name or a (gate_up_format, down_format) pair")
        return get_format(fmt[0]), get_format(fmt[1])
    spec = get_format(fmt)
    return spec, spec


def dequantize(fmt, banks) -> tuple[np.ndarray, np.ndarray]:
    """float64 (gate_up [E, 2I, H] gate rows then up rows, down [E, H, I]). fmt: a format name, or a (gate_up, down)
    pair for a layer of two formats (layers.validate_layer's banks). Threads: any."""
    gs, ds = _pair(fmt)
    if gs is ds:
        gs.validate(banks)
        return gs.dequantize(banks)
    validate_layer((gs.name, ds.name), banks)
    return gs.dequantize_role("gate_up", banks), ds.dequantize_role("down", banks)


def moe(fmt, banks, x, topk_weights, topk_ids, *, activation: str = "silu", alpha: float | None = None,
        limit: float | None = None, apply_router_weight_on_input: bool = False, mode: str | None = None,
        dequantized: tuple | None = None, tie_slack: float | None = None):
    """y [T, H] float64, before the final bf16 rounding of the output.

    tie_slack (in gaps): also return slack [T, H], what the output may move where an intermediate's bf16 rounding
    could go the other way: for each intermediate element within tie_slack gaps of a rounding tie, the gap to the
    other candidate (numerics.gap_bf16) through its down column and route weight (|down[:, j]| gap_j |w|, summed).
    A kernel summing in fp32 in another order rounds those either way (fp32 sums sit ~1e-3 bf16 ulps off float64's);
    one flip moves every output at once (q4_k/q6_k, CPUMOE_TEST_SEED=560613285: one g at 0.49998 ulps from its tie
    flipped 6.1% of the outputs' rounding, and 0 differed with it flipped here).

    fmt: a format name, or a (gate_up_format, down_format) pair: a layer of two formats, composed per role (x as
    the gate_up format's mode prepares it, g as the down format's; the gate_up format's gate/up rounding, the down
    format's route-term rounding; mode None: layers.model_mode's choice). `dequantized` may pass a cached
    `dequantize(fmt, banks)` result. Threads: any (pure numpy).
    """
    gs, ds = _pair(fmt)
    if gs is ds:
        _, (E, H, I) = gs.validate(banks)
        mode = gs.default_mode if mode is None else mode
        if mode not in gs.modes:
            raise ValueError(f"mode={mode!r} is not supported by format {gs.name!r}; expected one of {list(gs.modes)}")
    else:
        _, (E, H, I) = validate_layer((gs.name, ds.name), banks)
        mode = model_mode([(gs.name, ds.name)], mode)
    act = activations.resolve(activation, alpha, limit)
    for spec in {gs.name: gs, ds.name: ds}.values():
        if apply_router_weight_on_input and not spec.input_weight:
            raise ValueError(f"format {spec.name!r} applies the router weight on the output; "
                             "apply_router_weight_on_input=True is not supported")
    xv = round_bf16(check_x(x, H))  # the kernel sees bf16 x
    w, ids = check_routing(topk_weights, topk_ids, xv.shape[0], E)
    gu, dn = dequantized if dequantized is not None else dequantize(fmt, banks)
    if gs is ds:
        bgu, bdn = gs.biases(banks)
    else:
        bgu, bdn = gs.biases_role("gate_up", banks), ds.biases_role("down", banks)
    T, K = ids.shape
    y = np.zeros((T, H), np.float64)
    slack = None if tie_slack is None else np.zeros((T, H), np.float64)
    for t in range(T):
        xa = gs.act_in(xv[t], mode)
        for k in range(K):
            e = int(ids[t, k])
            if e < 0:
                continue
            wt = float(np.float32(w[t, k]))
            w_in, w_out = (wt, 1.0) if apply_router_weight_on_input else (1.0, wt)
            gate_up = gu[e] @ xa
            if bgu is not None:
                gate_up = gate_up + bgu[e]
            gate, up = gate_up[:I] * w_in, gate_up[I:] * w_in
            if gs.round_gate_up:
                gate, up = round_bf16(gate), round_bf16(up)
            a = act(gate, up)
            g = round_bf16(a)
            if slack is not None:
                u = gap_bf16(g, a)  # g to the other rounding candidate, on a's side (finer below a power of two)
                near = np.abs(np.abs(a - g) - 0.5 * u) <= tie_slack * u
                slack[t] += np.abs(dn[e][:, near]) @ u[near] * abs(w_out)
            o = dn[e] @ ds.act_in(g, mode)
            if bdn is not None:
                o = o + bdn[e]
            o = o * w_out
            if ds.round_route_term:
                o = round_bf16(o)
            y[t] += o
    return y if slack is None else (y, slack)


def attention(q, k, v, mask=None, scale: float | None = None) -> np.ndarray:
    """Decode attention's float64 reference (attention.DecodeAttention): o [n, Hq, D] = softmax(scale * q k^T) v per
    query head h over its kv head h // (Hq / Hkv), masked positions (mask [n, L] False) left out; q, k, v read as
    given (bf16 values), exact in float64 before the output's rounding. A token with no position let through is NaN
    (softmax over nothing); NaN and inf propagate by IEEE float64 rules (an inf score makes its row's inf - inf NaN).
    Threads: any (pure numpy)."""
    from ._arrays import as_array

    qv, kv, vv = (np.asarray(as_array(a, name), np.float64) for a, name in ((q, "q"), (k, "k"), (v, "v")))
    n, Hq, D = qv.shape
    Hkv, L, _ = kv.shape
    g = Hq // Hkv
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    keep = np.ones((n, L), bool) if mask is None else np.asarray(mask, bool)
    o = np.empty((n, Hq, D))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for t in range(n):
            j = np.flatnonzero(keep[t])
            for h in range(Hq):
                if not len(j):
                    o[t, h] = np.nan
                    continue
                s = kv[h // g, j] @ qv[t, h] * scale
                p = np.exp(s - s.max())
                o[t, h] = p @ vv[h // g, j] / p.sum()
    return o


def linear(x, weight, bias=None) -> np.ndarray:
    """The dense linear's float64 reference (linear.Linear): y [n, M] = bf16(x) @ weight.T (+ bias), exact in float64
    before the output's rounding; x is rounded to bf16 first (the kernel reads bf16), weight and bias are read as
    given (bf16 values). NaN and inf propagate by IEEE float64 rules. Threads: any (pure numpy)."""
    from ._arrays import as_array

    xv = round_bf16(np.asarray(as_array(x, "x"), np.float64))
    w = np.asarray(as_array(weight, "weight"), np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        y = xv @ w.T
        if bias is not None:
            y = y + np.asarray(as_array(bias, "bias"), np.float64)
    return y
