"""mxfp4 experts on the GPU (cpumoe_formats 'mxfp4', gpt-oss): layouts.py de-interleaves and transposes the banks
into row-major [N, K/2] bytes (low nibble = even K element; gate_up rows: gate 0..I-1, then up), e8m0 scales
[N, K/32] (SRS = K/32), fp32 biases [N] (v_ptr, added to each row).

    w[r, k] = E2M1[code] * 2^(min(s, 254) - 127)        (s = 0 is 2^-127)

Tiles are [BN rows, BK/16 groups, 16 bytes]: one e8m0 scale per (row, group). The weight is formed exactly in
fp32 as (e2m1 * 2^-14) * 2^(min(s, 240) - 113) * 2^(max(s, 240) - 240) (every factor a normal fp32, so no
subnormal or overflowing intermediate for any code; only weights below 2^-126 are fp32 subnormals themselves).
rows_dot rounds it to bf16, exactly, for weights in bf16's normal range. BK (bytes per row per step) is a
multiple of 16.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._tl import e2m1_pair, mma

G = 16  # bytes (32 K elements) per e8m0 scale


@triton.jit
def _scales(sc):
    """e8m0 codes -> (sa, sb), sa * sb = 2^(min(s, 254) - 113) (the e2m1 decode's 2^-14 folded in)."""
    e = tl.minimum(sc.to(tl.int32), 254)
    sa = ((tl.minimum(e, 240) + 14) << 23).to(tl.float32, bitcast=True)
    sb = ((tl.maximum(e, 240) - 113) << 23).to(tl.float32, bitcast=True)
    return sa, sb


@triton.jit
def _tile(w_ptr, s_ptr, rows, rmask, kb0, KB, SRS, BN: tl.constexpr, BK: tl.constexpr):
    """Weights of bytes kb0 .. kb0+BK of `rows`: (lo, hi) fp32 [BN, BK/16, 16] (even, odd K elements)."""
    NSUB: tl.constexpr = BK // 16
    sub = tl.arange(0, NSUB)
    gidx = kb0 // 16 + sub
    gm = gidx < SRS
    kb = kb0 + sub[:, None] * 16 + tl.arange(0, 16)[None, :]
    b = tl.load(w_ptr + rows[:, None, None] * KB + kb[None, :, :], mask=rmask[:, None, None] & gm[None, :, None],
                other=0)
    sc = tl.load(s_ptr + rows[:, None] * SRS + gidx[None, :], mask=rmask[:, None] & gm[None, :], other=0)
    sa, sb = _scales(sc)
    lo, hi = e2m1_pair(b)
    lo = (lo * sa[:, :, None]) * sb[:, :, None]
    hi = (hi * sa[:, :, None]) * sb[:, :, None]
    return lo, hi, kb, gm


@triton.jit
def rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN: tl.constexpr, BK: tl.constexpr):
    NSUB: tl.constexpr = BK // 16
    KB = tl.multiple_of(K // 2, 16)  # K is a multiple of 32
    acc = tl.zeros([BN, NSUB, 16], dtype=tl.float32)
    for kb0 in range(0, KB, BK):
        lo, hi, kb, gm = _tile(w_ptr, s_ptr, rows, rmask, kb0, KB, SRS, BN, BK)
        # x[2 kb] and x[2 kb + 1] from one contiguous load of the step's 2 BK elements
        xk = 2 * kb0 + tl.arange(0, 2 * BK)
        xv = tl.load(x_ptr + xk, mask=xk < K, other=0.0).to(tl.float32)
        xe, xo = tl.split(tl.reshape(xv, [NSUB, 16, 2]))
        acc += lo * xe[None, :, :] + hi * xo[None, :, :]
    bias = tl.load(v_ptr + rows, mask=rmask, other=0.0)
    return tl.sum(tl.sum(acc, axis=2), axis=1) + bias


@triton.jit
def rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS,
             BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, INTERP: tl.constexpr):
    KB = tl.multiple_of(K // 2, 16)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    xrow = x_ptr + xoff[:, None]
    for kb0 in range(0, KB, BK):
        lo, hi, kb, gm = _tile(w_ptr, s_ptr, rows, rmask, kb0, KB, SRS, BN, BK)
        xk = 2 * kb0 + tl.arange(0, 2 * BK)
        xv = tl.load(xrow + xk[None, :], mask=xmask[:, None] & (xk < K)[None, :], other=0.0)
        xe, xo = tl.split(tl.reshape(xv, [BM, BK, 2]))
        acc = mma(xe, tl.trans(tl.reshape(lo.to(tl.bfloat16), [BN, BK])), acc, INTERP)
        acc = mma(xo, tl.trans(tl.reshape(hi.to(tl.bfloat16), [BN, BK])), acc, INTERP)
    bias = tl.load(v_ptr + rows, mask=rmask, other=0.0)
    return acc + bias[None, :]
