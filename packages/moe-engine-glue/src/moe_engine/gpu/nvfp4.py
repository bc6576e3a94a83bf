"""nvfp4 experts on the GPU (cpumoe_formats 'nvfp4', ModelOpt rows): packed [N, K/2] bytes (low nibble = even K
element), e4m3 block scales [N, K/16] (SRS = K/16), fp32 per-row globals [N] (v_ptr; the banks' fp16 widened
exactly).

    w[r, k] = E2M1[code] * e4m3(scale[r, k // 16]) * global[r]        (e4m3 0x7F / 0xFF = +-480)

Tiles are [BN rows, BK/8 groups, 8 bytes]; e2m1 * e4m3 is formed exactly in fp32 (at most 6 significant bits, so
rows_dot's bf16 rounding is exact too), and each row's sum is multiplied by its global at the end. BK (bytes per
row per step) is a multiple of 8.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._tl import e2m1_pair, e4m3, mma

G = 8  # bytes (16 K elements) per e4m3 scale


@triton.jit
def _tile(w_ptr, s_ptr, rows, rmask, kb0, KB, SRS, BN: tl.constexpr, BK: tl.constexpr):
    """Bytes kb0 .. kb0+BK of `rows` without the global: (lo, hi) fp32 [BN, BK/8, 8] (even, odd K elements)."""
    NSUB: tl.constexpr = BK // 8
    sub = tl.arange(0, NSUB)
    gidx = kb0 // 8 + sub
    gm = gidx < SRS
    kb = kb0 + sub[:, None] * 8 + tl.arange(0, 8)[None, :]
    b = tl.load(w_ptr + rows[:, None, None] * KB + kb[None, :, :], mask=rmask[:, None, None] & gm[None, :, None],
                other=0)
    sc = tl.load(s_ptr + rows[:, None] * SRS + gidx[None, :], mask=rmask[:, None] & gm[None, :], other=0)
    s = e4m3(sc, tl.float32) * 16384.0  # the e2m1 decode's 2^-14 folded in
    lo, hi = e2m1_pair(b)
    return lo * s[:, :, None], hi * s[:, :, None], kb, gm


@triton.jit
def rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN: tl.constexpr, BK: tl.constexpr):
    NSUB: tl.constexpr = BK // 8
    KB = tl.multiple_of(K // 2, 8)  # K is a multiple of 16
    acc = tl.zeros([BN, NSUB, 8], dtype=tl.float32)
    for kb0 in range(0, KB, BK):
        lo, hi, kb, gm = _tile(w_ptr, s_ptr, rows, rmask, kb0, KB, SRS, BN, BK)
        # x[2 kb] and x[2 kb + 1] from one contiguous load of the step's 2 BK elements
        xk = 2 * kb0 + tl.arange(0, 2 * BK)
        xv = tl.load(x_ptr + xk, mask=xk < K, other=0.0).to(tl.float32)
        xe, xo = tl.split(tl.reshape(xv, [NSUB, 8, 2]))
        acc += lo * xe[None, :, :] + hi * xo[None, :, :]
    glob = tl.load(v_ptr + rows, mask=rmask, other=0.0)
    return tl.sum(tl.sum(acc, axis=2), axis=1) * glob


@triton.jit
def rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS,
             BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, INTERP: tl.constexpr):
    KB = tl.multiple_of(K // 2, 8)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    xrow = x_ptr + xoff[:, None]
    for kb0 in range(0, KB, BK):
        lo, hi, kb, gm = _tile(w_ptr, s_ptr, rows, rmask, kb0, KB, SRS, BN, BK)
        xk = 2 * kb0 + tl.arange(0, 2 * BK)
        xv = tl.load(xrow + xk[None, :], mask=xmask[:, None] & (xk < K)[None, :], other=0.0)
        xe, xo = tl.split(tl.reshape(xv, [BM, BK, 2]))
        acc = mma(xe, tl.trans(tl.reshape(lo.to(tl.bfloat16), [BN, BK])), acc, INTERP)
        acc = mma(xo, tl.trans(tl.reshape(hi.to(tl.bfloat16), [BN, BK])), acc, INTERP)
    glob = tl.load(v_ptr + rows, mask=rmask, other=0.0)
    return acc * glob[None, :]
