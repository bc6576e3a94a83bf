"""q8_0 experts on the GPU (cpumoe_formats 'q8_0', GGUF Q8_0; layouts.py splits the 34-byte blocks into planes):
int8 codes [N, K], fp16 d [N, K/32] (SRS = K/32).

    w[r, k] = code * d[r, k // 32]

rows_fma forms each weight exactly in fp32 (int8 x fp16 d: 19 significant bits). rows_dot multiplies the bf16
activations by the codes (exact in bf16) on tensor cores, one 32-block per product, and scales each block's
product by its d in fp32. BK (K elements per step) is a multiple of 32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._tl import mma


@triton.jit
def rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN: tl.constexpr, BK: tl.constexpr):
    NSUB: tl.constexpr = BK // 32
    sub = tl.arange(0, NSUB)
    i = tl.arange(0, 32)
    acc = tl.zeros([BN, NSUB, 32], dtype=tl.float32)
    for k0 in range(0, K, BK):
        g = k0 // 32 + sub
        gm = g < SRS
        xo = g[:, None] * 32 + i[None, :]
        c = tl.load(w_ptr + rows[:, None, None] * K + xo[None, :, :], mask=rmask[:, None, None] & gm[None, :, None],
                    other=0)
        d = tl.load(s_ptr + rows[:, None] * SRS + g[None, :], mask=rmask[:, None] & gm[None, :],
                    other=0.0).to(tl.float32)
        x = tl.load(x_ptr + xo, mask=gm[:, None], other=0.0).to(tl.float32)
        acc += (c.to(tl.float32) * d[:, :, None]) * x[None, :, :]
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS,
             BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, INTERP: tl.constexpr):
    i = tl.arange(0, 32)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    xrow = x_ptr + xoff[:, None]
    wrow = w_ptr + rows[:, None] * K
    for k0 in range(0, K, BK):
        for j in tl.static_range(BK // 32):
            g = k0 // 32 + j
            gm = (g + i * 0) < SRS  # as a vector: a scalar & tensor mask trips the interpreter
            c = tl.load(wrow + g * 32 + i[None, :], mask=rmask[:, None] & gm[None, :], other=0)
            x = tl.load(xrow + g * 32 + i[None, :], mask=xmask[:, None] & gm[None, :], other=0.0)
            p = mma(x, tl.trans(c.to(tl.float32).to(tl.bfloat16)), tl.zeros([BM, BN], dtype=tl.float32), INTERP)
            d = tl.load(s_ptr + rows * SRS + g, mask=rmask & ((g + rows * 0) < SRS), other=0.0).to(tl.float32)
            acc += p * d[None, :]
    return acc
