"""q6_k experts on the GPU (cpumoe_formats 'q6_k', GGUF Q6_K; layouts.py splits the 210-byte blocks into planes):
per row and 256-element block, the block's ql (128 bytes) then qh (64) in w [N, nb * 192], its 16 int8 scales in
s [N, K/16], its fp16 d in v [N, nb] (SRS = nb = K/256).

    element 128h + 32g + l (g < 4, l < 32): q = (ql[64h + 32 (g % 2) + l] >> 4 (g // 2)) & 15
                                                | ((qh[32h + l] >> 2g) & 3) << 4
    w = d * sc[k // 16] * (q - 32)       (exact in fp32, as in the float64 reference)

Tiles are [BN rows, 16 sub-blocks, 16 elements] (sub-block j = 8h + 2g + l // 16): each code's two bytes are
gathered by index. rows_dot takes sum((q - 32) x) per sub-block on tensor cores ((q - 32) exact in bf16) and scales
it by d * sc in fp32. Each step covers one block: BK must be 256.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._tl import mma


@triton.jit
def rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN: tl.constexpr, BK: tl.constexpr):
    j = tl.arange(0, 16)
    i = tl.arange(0, 16)
    h = j // 8
    g = (j % 8) // 2
    el = (j % 2)[:, None] * 16 + i[None, :]  # l of element 16 j + i within its 32-group
    qlo = (64 * h + 32 * (g % 2))[:, None] + el
    slo = (4 * (g // 2))[:, None]
    qho = 128 + (32 * h)[:, None] + el
    sho = (2 * g)[:, None]
    eoff = j[:, None] * 16 + i[None, :]
    wrow = w_ptr + rows * (SRS * 192)
    srow = s_ptr + rows * (SRS * 16)
    vrow = v_ptr + rows * SRS
    acc = tl.zeros([BN, 16, 16], dtype=tl.float32)
    m3 = rmask[:, None, None]
    for blk in range(0, SRS):
        base = wrow[:, None, None] + blk * 192
        a = tl.load(base + qlo[None, :, :], mask=m3, other=0).to(tl.int32)
        c = tl.load(base + qho[None, :, :], mask=m3, other=0).to(tl.int32)
        code = ((a >> slo[None, :, :]) & 15) | (((c >> sho[None, :, :]) & 3) << 4)
        sc = tl.load(srow[:, None] + blk * 16 + j[None, :], mask=rmask[:, None], other=0).to(tl.float32)
        d = tl.load(vrow + blk, mask=rmask, other=0.0).to(tl.float32)
        w = (d[:, None] * sc)[:, :, None] * (code - 32).to(tl.float32)
        x = tl.load(x_ptr + blk * 256 + eoff).to(tl.float32)
        acc += w * x[None, :, :]
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS,
             BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, INTERP: tl.constexpr):
    i = tl.arange(0, 16)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    xrow = x_ptr + xoff[:, None]
    wrow = w_ptr + rows[:, None] * (SRS * 192)
    srow = s_ptr + rows * (SRS * 16)
    vrow = v_ptr + rows * SRS
    for blk in range(0, SRS):
        d = tl.load(vrow + blk, mask=rmask, other=0.0).to(tl.float32)
        for j in tl.static_range(16):
            el = (j % 2) * 16 + i[None, :]
            a = tl.load(wrow + blk * 192 + 64 * (j // 8) + 32 * ((j % 8) // 2 % 2) + el, mask=rmask[:, None],
                        other=0).to(tl.int32)
            c = tl.load(wrow + blk * 192 + 128 + 32 * (j // 8) + el, mask=rmask[:, None], other=0).to(tl.int32)
            code = ((a >> (4 * ((j % 8) // 4))) & 15) | (((c >> (2 * ((j % 8) // 2))) & 3) << 4)
            x = tl.load(xrow + blk * 256 + j * 16 + i[None, :], mask=xmask[:, None], other=0.0)
            p = mma(x, tl.trans((code - 32).to(tl.float32).to(tl.bfloat16)), tl.zeros([BM, BN], dtype=tl.float32),
                    INTERP)
            sc = tl.load(srow + blk * 16 + j, mask=rmask, other=0).to(tl.float32)
            acc += p * (d * sc)[None, :]
    return acc
