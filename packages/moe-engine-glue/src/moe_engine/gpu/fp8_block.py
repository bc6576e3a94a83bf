"""fp8_block experts on the GPU (cpumoe_formats 'fp8_block'): e4m3 codes [N, K] uint8 with fp32 block scales
[nb(N), nb(K)] (SRS = nb(K) columns; 128 x 128 blocks), w = e4m3(code) * scale[row // 128, k // 128].

BK must divide 128, so each K step of a tile meets one scale column. rows_fma folds the scale into the weight
(e4m3 x bf16-valued scale is exact in fp32); rows_dot multiplies each step's exact e4m3 product by the rows'
scales. e4m3 0x7F / 0xFF are +-480 (_tl.e4m3): v_ptr points at the slot's flag (int32, layouts.py), nonzero when
the matrix holds such a code; a matrix without one (quantizers saturate at 448) skips the fix-up per element.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._tl import e4m3, mma


@triton.jit
def _dec(c, OUT: tl.constexpr, FIX: tl.constexpr):
    if FIX:
        r = e4m3(c, OUT)
    else:
        r = c.to(tl.float8e4nv, bitcast=True).to(OUT)
    return r


@triton.jit
def _fma(x_ptr, w_ptr, s_ptr, rows, rmask, K, SRS, BN: tl.constexpr, BK: tl.constexpr, FIX: tl.constexpr):
    ks = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    wrow = w_ptr + rows[:, None] * K
    srow = s_ptr + (rows // 128) * SRS
    for k0 in range(0, K, BK):
        kk = k0 + ks
        km = kk < K
        x = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
        c = tl.load(wrow + kk[None, :], mask=rmask[:, None] & km[None, :], other=0)
        s = tl.load(srow + k0 // 128, mask=rmask, other=0.0)
        acc += (_dec(c, tl.float32, FIX) * s[:, None]) * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN: tl.constexpr, BK: tl.constexpr):
    if tl.load(v_ptr) != 0:
        r = _fma(x_ptr, w_ptr, s_ptr, rows, rmask, K, SRS, BN, BK, True)
    else:
        r = _fma(x_ptr, w_ptr, s_ptr, rows, rmask, K, SRS, BN, BK, False)
    return r


@triton.jit
def _dot(x_ptr, xoff, xmask, w_ptr, s_ptr, rows, rmask, K, SRS,
         BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, INTERP: tl.constexpr, FIX: tl.constexpr):
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    wrow = w_ptr + rows[:, None] * K
    srow = s_ptr + (rows // 128) * SRS
    xrow = x_ptr + xoff[:, None]
    for k0 in range(0, K, BK):
        kk = k0 + ks
        km = kk < K
        x = tl.load(xrow + kk[None, :], mask=xmask[:, None] & km[None, :], other=0.0)
        c = tl.load(wrow + kk[None, :], mask=rmask[:, None] & km[None, :], other=0)
        s = tl.load(srow + k0 // 128, mask=rmask, other=0.0)
        p = mma(x, tl.trans(_dec(c, tl.bfloat16, FIX)), tl.zeros([BM, BN], dtype=tl.float32), INTERP)
        acc += p * s[None, :]
    return acc


@triton.jit
def rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS,
             BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, INTERP: tl.constexpr):
    if tl.load(v_ptr) != 0:
        r = _dot(x_ptr, xoff, xmask, w_ptr, s_ptr, rows, rmask, K, SRS, BN, BK, BM, INTERP, True)
    else:
        r = _dot(x_ptr, xoff, xmask, w_ptr, s_ptr, rows, rmask, K, SRS, BN, BK, BM, INTERP, False)
    return r
