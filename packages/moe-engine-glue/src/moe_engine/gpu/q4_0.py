"""q4_0 experts on the GPU (cpumoe_formats 'q4_0', GGUF Q4_0; layouts.py splits the 18-byte blocks into planes):
nibbles [N, K/2] uint8 (16 bytes per 32-element block: byte l holds element l in its low nibble and element 16 + l
in its high one), fp16 d [N, K/32] (SRS = K/32).

    w[r, k] = (nibble - 8) * d[r, k // 32]

rows_fma forms each weight exactly in fp32 ((nibble - 8) * fp16 d: 15 significant bits). rows_dot multiplies the
bf16 activations by the codes (nibble - 8, exact in bf16) on tensor cores, one 32-block per pair of 16-wide products,
and scales each block's product by its d in fp32. BK (K elements per step) is a multiple of 32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._tl import mma


@triton.jit
def rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN: tl.constexpr, BK: tl.constexpr):
    NSUB: tl.constexpr = BK // 32
    KB = K // 2
    sub = tl.arange(0, NSUB)
    i = tl.arange(0, 16)
    acc = tl.zeros([BN, NSUB, 16], dtype=tl.float32)
    for k0 in range(0, K, BK):
        g = k0 // 32 + sub
        gm = g < SRS
        b = tl.load(w_ptr + rows[:, None, None] * KB + g[None, :, None] * 16 + i[None, None, :],
                    mask=rmask[:, None, None] & gm[None, :, None], other=0).to(tl.int32)
        d = tl.load(s_ptr + rows[:, None] * SRS + g[None, :], mask=rmask[:, None] & gm[None, :],
                    other=0.0).to(tl.float32)
        lo = ((b & 15) - 8).to(tl.float32) * d[:, :, None]
        hi = ((b >> 4) - 8).to(tl.float32) * d[:, :, None]
        xo = g[:, None] * 32 + i[None, :]
        xl = tl.load(x_ptr + xo, mask=gm[:, None], other=0.0).to(tl.float32)
        xh = tl.load(x_ptr + xo + 16, mask=gm[:, None], other=0.0).to(tl.float32)
        acc += lo * xl[None, :, :] + hi * xh[None, :, :]
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS,
             BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, INTERP: tl.constexpr):
    KB = K // 2
    i = tl.arange(0, 16)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    xrow = x_ptr + xoff[:, None]
    wrow = w_ptr + rows[:, None] * KB
    for k0 in range(0, K, BK):
        for j in tl.static_range(BK // 32):
            g = k0 // 32 + j
            gm = (g + i * 0) < SRS  # as a vector: a scalar & tensor mask trips the interpreter
            b = tl.load(wrow + g * 16 + i[None, :], mask=rmask[:, None] & gm[None, :], other=0).to(tl.int32)
            clo = ((b & 15) - 8).to(tl.float32).to(tl.bfloat16)
            chi = ((b >> 4) - 8).to(tl.float32).to(tl.bfloat16)
            xl = tl.load(xrow + g * 32 + i[None, :], mask=xmask[:, None] & gm[None, :], other=0.0)
            xh = tl.load(xrow + g * 32 + 16 + i[None, :], mask=xmask[:, None] & gm[None, :], other=0.0)
            p = mma(xl, tl.trans(clo), tl.zeros([BM, BN], dtype=tl.float32), INTERP)
            p = mma(xh, tl.trans(chi), p, INTERP)
            d = tl.load(s_ptr + rows * SRS + g, mask=rmask & ((g + rows * 0) < SRS), other=0.0).to(tl.float32)
            acc += p * d[None, :]
    return acc
