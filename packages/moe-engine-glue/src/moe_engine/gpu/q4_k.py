"""q4_k experts on the GPU (cpumoe_formats 'q4_k', GGUF Q4_K; layouts.py splits the 144-byte blocks into planes):
per row and 256-element block, 128 bytes of nibbles in w [N, K/2] (byte 32p + l: element 64p + l in its low nibble,
64p + 32 + l in its high one), the 12 packed bytes of 6-bit scales and mins in s [N, nb * 12], and fp16 (d, dmin)
in v [N, nb * 2] (SRS = nb = K/256).

    w[r, k] = d * sc[j] * q - dmin * m[j]        (sub-block j = (k % 256) // 32; ggml's get_scale_min_k4)

rows_fma forms each weight in fp32 as ggml and gguf dequantize it (d * sc and d * sc * q exact, one rounding on the
subtraction: the float64 reference's values). rows_dot takes, per 32-element sub-block, sum(q * x) on tensor cores
(q exact in bf16) and sum(x) in fp32, and combines them as d * sc * sum(q x) - dmin * m * sum(x) in fp32 (the same
weights, rounded once less). Each step covers one block: BK must be 256.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._tl import mma


@triton.jit
def _scales_mins(sp, rmask):
    """sp [BN]: each row's 12 packed bytes -> (sc, m) int32 [BN, 8]."""
    j = tl.arange(0, 8)
    lo = j < 4
    p = tl.load(sp[:, None] + tl.where(lo, j, j + 4)[None, :], mask=rmask[:, None], other=0).to(tl.int32)
    q = tl.load(sp[:, None] + tl.where(lo, j + 4, j - 4)[None, :], mask=rmask[:, None], other=0).to(tl.int32)
    r = tl.load(sp[:, None] + j[None, :], mask=rmask[:, None], other=0).to(tl.int32)
    sc = tl.where(lo[None, :], p & 63, (p & 15) | ((q >> 6) << 4))
    m = tl.where(lo[None, :], q & 63, (p >> 4) | ((r >> 6) << 4))
    return sc, m


@triton.jit
def _scale_min_j(sp, J: tl.constexpr, rmask):
    """Sub-block J's (sc, m) int32 [BN] of the rows' 12 packed bytes at sp [BN]."""
    if J < 4:
        sc = tl.load(sp + J, mask=rmask, other=0).to(tl.int32) & 63
        m = tl.load(sp + J + 4, mask=rmask, other=0).to(tl.int32) & 63
    else:
        a = tl.load(sp + J + 4, mask=rmask, other=0).to(tl.int32)
        sc = (a & 15) | ((tl.load(sp + J - 4, mask=rmask, other=0).to(tl.int32) >> 6) << 4)
        m = (a >> 4) | ((tl.load(sp + J, mask=rmask, other=0).to(tl.int32) >> 6) << 4)
    return sc, m


@triton.jit
def rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN: tl.constexpr, BK: tl.constexpr):
    j = tl.arange(0, 8)
    i = tl.arange(0, 32)
    boff = (j // 2 * 32)[:, None] + i[None, :]  # [8, 32]: the byte of element 32 j + i among the block's 128
    shift = ((j % 2) * 4)[:, None]
    eoff = j[:, None] * 32 + i[None, :]
    wrow = w_ptr + rows * (K // 2)
    srow = s_ptr + rows * (SRS * 12)
    vrow = v_ptr + rows * (SRS * 2)
    acc = tl.zeros([BN, 8, 32], dtype=tl.float32)
    for blk in range(0, SRS):
        b = tl.load(wrow[:, None, None] + blk * 128 + boff[None, :, :], mask=rmask[:, None, None], other=0)
        q = ((b.to(tl.int32) >> shift[None, :, :]) & 15).to(tl.float32)
        sc, m = _scales_mins(srow + blk * 12, rmask)
        d = tl.load(vrow + blk * 2, mask=rmask, other=0.0).to(tl.float32)
        dmin = tl.load(vrow + blk * 2 + 1, mask=rmask, other=0.0).to(tl.float32)
        dsc = d[:, None] * sc.to(tl.float32)
        dm = dmin[:, None] * m.to(tl.float32)
        w = dsc[:, :, None] * q - dm[:, :, None]
        x = tl.load(x_ptr + blk * 256 + eoff).to(tl.float32)
        acc += w * x[None, :, :]
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS,
             BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, INTERP: tl.constexpr):
    i = tl.arange(0, 32)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    xrow = x_ptr + xoff[:, None]
    wrow = w_ptr + rows[:, None] * (K // 2)
    srow = s_ptr + rows * (SRS * 12)
    vrow = v_ptr + rows * (SRS * 2)
    for blk in range(0, SRS):
        d = tl.load(vrow + blk * 2, mask=rmask, other=0.0).to(tl.float32)
        dmin = tl.load(vrow + blk * 2 + 1, mask=rmask, other=0.0).to(tl.float32)
        for j in tl.static_range(8):
            b = tl.load(wrow + blk * 128 + (j // 2) * 32 + i[None, :], mask=rmask[:, None], other=0).to(tl.int32)
            q = ((b >> ((j % 2) * 4)) & 15).to(tl.float32).to(tl.bfloat16)
            x = tl.load(xrow + blk * 256 + j * 32 + i[None, :], mask=xmask[:, None], other=0.0)
            p = mma(x, tl.trans(q), tl.zeros([BM, BN], dtype=tl.float32), INTERP)
            xs = tl.sum(x.to(tl.float32), axis=1)
            sc, m = _scale_min_j(srow + blk * 12, j, rmask)
            acc += p * (d * sc.to(tl.float32))[None, :] - xs[:, None] * (dmin * m.to(tl.float32))[None, :]
    return acc
