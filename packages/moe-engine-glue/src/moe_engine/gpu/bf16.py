"""bf16 experts on the GPU: row-major [N, K] bf16 tiles, fp32 accumulation (cpumoe_formats 'bf16').

Each function computes BN output rows (`rows`, any row indices of the slot's matrix) over the whole K for one token
(`rows_fma`, fp32 FMAs, the decode path) or for a tile of BM tokens (`rows_dot`, tensor-core products).
s_ptr / v_ptr / SRS are unused (the other formats' scales).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._tl import mma


@triton.jit
def rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN: tl.constexpr, BK: tl.constexpr):
    ks = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    wrow = w_ptr + rows[:, None] * K
    for k0 in range(0, K, BK):
        kk = k0 + ks
        km = kk < K
        x = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
        w = tl.load(wrow + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS,
             BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, INTERP: tl.constexpr):
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    wrow = w_ptr + rows[:, None] * K
    xrow = x_ptr + xoff[:, None]
    for k0 in range(0, K, BK):
        kk = k0 + ks
        km = kk < K
        x = tl.load(xrow + kk[None, :], mask=xmask[:, None] & km[None, :], other=0.0)
        w = tl.load(wrow + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        acc = mma(x, tl.trans(w), acc, INTERP)
    return acc
