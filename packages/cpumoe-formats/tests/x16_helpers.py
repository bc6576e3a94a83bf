"""Checks shared by the _x16 layouts' tests (q4_0_x16, nvfp4_x16, ds_fp4_x16, fp8_block_x16): work items over
ragged row ranges with poisoned outputs and sentinels, and the fp32 down accumulators of a work item per tier."""
import numpy as np
from fp4_helpers import prep, to_bf16_bits, views

import cpumoe_formats as cf

POISON = 0x7FC1  # a bf16 NaN no kernel writes


def down_accumulators(fmt, banks, tiers, gs, H):  # noqa: N803
    """The fp32 accumulators [T, H] of one down work item over all rows, per tier (routes of expert 1, weights
    0.5 + j): bf16 outputs would hide a reordered fp32 sum. Asserts most elements are non-zero."""
    E, _, I = cf.validate_banks(fmt, banks)  # noqa: E741
    out = []
    for t in tiers:
        k = cf.Kernel(fmt, E, H, I, isa=t)
        bufs = [prep(k, g) for g in gs]
        acc = cf.aligned_empty((len(gs), H), np.float32)
        acc[...] = 0
        k._k.down(views(fmt, banks), 0, H, [(j, 1, 0.5 + j, bufs[j].ctypes.data) for j in range(len(gs))],
                  acc.ctypes.data, H)
        assert np.count_nonzero(acc) > acc.size // 2
        out.append(acc)
    return out


def check_ragged_work_items(k, fmt, banks, n, rng, gate_ranges, down_ranges, check_full_down, w_in=None):
    """gate_up over row ranges [i0, i1) (expert 2) and down over [h0, h1) (expert 1) that cut groups: each call
    writes exactly its rows (everything else keeps its poison or sentinel), with the bits of a whole-range call.
    check_full_down(acc [n, H], g bits [n, I], weights [n]) checks the whole-range down terms against float64."""
    _, H, I = cf.validate_banks(fmt, banks)  # noqa: E741
    V = views(fmt, banks)
    xs = [prep(k, x) for x in to_bf16_bits(rng.standard_normal((n, H)))]
    w_in = list(rng.uniform(0.5, 1.5, n)) if w_in is None else w_in

    def gate_up(i0, i1):
        g = cf.aligned_empty((n, I + 8), np.uint16)
        g[...] = POISON
        k._k.gate_up(V, 2, i0, i1, [a.ctypes.data for a in xs], w_in, [g[j].ctypes.data for j in range(n)])
        assert (g[:, I:] == POISON).all(), "gate_up wrote past its rows"
        return g[:, :I]

    whole = gate_up(0, I)
    assert not (whole == POISON).any()
    for i0, i1 in gate_ranges:
        g = gate_up(i0, i1)
        np.testing.assert_array_equal(g[:, i0:i1], whole[:, i0:i1])
        assert (g[:, :i0] == POISON).all() and (g[:, i1:] == POISON).all(), (i0, i1)

    gs = to_bf16_bits(rng.standard_normal((n, I)))
    acts = [prep(k, g) for g in gs]
    wts = rng.uniform(0.1, 1.0, n)
    rts = [(j, 1, float(wts[j]), acts[j].ctypes.data) for j in range(n)]

    def down(h0, h1):
        acc = cf.aligned_empty((n, h1 - h0 + 8), np.float32)
        acc[...] = 12345.0  # sentinel past each token's rows [h0, h1): a write outside them changes it
        acc[:, :h1 - h0] = 0
        k._k.down(V, h0, h1, rts, acc.ctypes.data, acc.shape[1])
        assert (acc[:, h1 - h0:] == 12345.0).all(), "down wrote outside its rows"
        return acc[:, :h1 - h0]

    full = down(0, H)
    check_full_down(full, gs, wts)
    for h0, h1 in down_ranges:
        np.testing.assert_array_equal(down(h0, h1), full[:, h0:h1])
