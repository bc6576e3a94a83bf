"""The three expert kernels every format shares, and the route-sum.

gate_up    program (p, n-block): group p (routing.py; or route p alone, GROUPED=0) times rows n-block of gate and
           of up (one tile of 2*BN interleaved rows), for each token of the group in turn (DOT=0, fp32 FMAs: each
           weight read from memory once, later tokens of the group hit the cache) or in tiles of BM tokens
           (DOT=1, tensor cores); router weight on the input if asked; activation in fp32; h[route] = bf16(g).
down_group program (p, n-block): group p times rows n-block of down; o[route] = (h @ down^T (+ bias)) * weight,
           fp32, into a [R, H] workspace; `route_sum` then adds each token's routes in route order.
down_token program (t, n-block): token t's routes in route order, y[t] = bf16(sum) directly (no workspace, no
           second kernel; the experts of one token are distinct, so nothing is read twice: the batch-1 path).
Deterministic: no atomics, every sum in a fixed order.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import bf16, fp8_block, mxfp4, nvfp4, q4_0, q4_k, q6_k, q8_0
from ._tl import activate, round_bf16

# FMT of each kernel is its matrix's format: gate_up and down may differ (a (gate_up, down) pair)
FMT_IDS = {"bf16": 0, "fp8_block": 1, "mxfp4": 2, "nvfp4": 3, "q4_0": 4, "q8_0": 5, "q4_k": 6, "q6_k": 7}


@triton.jit
def _rows_fma(FMT: tl.constexpr, x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN: tl.constexpr,
              BK: tl.constexpr):
    if FMT == 0:
        r = bf16.rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK)
    elif FMT == 1:
        r = fp8_block.rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK)
    elif FMT == 2:
        r = mxfp4.rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK)
    elif FMT == 3:
        r = nvfp4.rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK)
    elif FMT == 4:
        r = q4_0.rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK)
    elif FMT == 5:
        r = q8_0.rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK)
    elif FMT == 6:
        r = q4_k.rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK)
    else:
        r = q6_k.rows_fma(x_ptr, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK)
    return r


@triton.jit
def _rows_dot(FMT: tl.constexpr, x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS,
              BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, INTERP: tl.constexpr):
    if FMT == 0:
        r = bf16.rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK, BM, INTERP)
    elif FMT == 1:
        r = fp8_block.rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK, BM, INTERP)
    elif FMT == 2:
        r = mxfp4.rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK, BM, INTERP)
    elif FMT == 3:
        r = nvfp4.rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK, BM, INTERP)
    elif FMT == 4:
        r = q4_0.rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK, BM, INTERP)
    elif FMT == 5:
        r = q8_0.rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK, BM, INTERP)
    elif FMT == 6:
        r = q4_k.rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK, BM, INTERP)
    else:
        r = q6_k.rows_dot(x_ptr, xoff, xmask, w_ptr, s_ptr, v_ptr, rows, rmask, K, SRS, BN, BK, BM, INTERP)
    return r


@triton.jit
def _group(p, slots_ptr, order_ptr, count_ptr, capacity, GROUPED: tl.constexpr):
    """(first route, size) of the group at position p; size 0: nothing to do."""
    if GROUPED:
        first = tl.load(order_ptr + p)
        cnt = tl.load(count_ptr + p)
    else:
        first = p
        s = tl.load(slots_ptr + p)
        cnt = ((s >= 0) & (s < capacity)).to(tl.int32)
    return first, cnt


@triton.jit
def gate_up_kernel(x_ptr, x_stride, slots_ptr, tw_ptr, order_ptr, count_ptr, capacity,
                   w_ptr, s_ptr, v_ptr, w_slot, s_slot, v_slot, SRS,
                   h_ptr, I, H, alpha, limit,
                   FMT: tl.constexpr, ACT: tl.constexpr, TOP_K: tl.constexpr, GROUPED: tl.constexpr,
                   DOT: tl.constexpr, WEIGHT_IN: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   BM: tl.constexpr, INTERP: tl.constexpr):
    p = tl.program_id(0)
    nb = tl.program_id(1)
    first, cnt = _group(p, slots_ptr, order_ptr, count_ptr, capacity, GROUPED)
    if cnt == 0:
        return
    slot = tl.load(slots_ptr + first).to(tl.int64)
    wb = w_ptr + slot * w_slot
    sb = s_ptr + slot * s_slot
    vb = v_ptr + slot * v_slot
    # 2*BN rows: even = gate row n, odd = up row I + n
    i2 = tl.arange(0, 2 * BN)
    n2 = nb * BN + i2 // 2
    rows = n2 + (i2 % 2) * I
    rmask = n2 < I
    n = nb * BN + tl.arange(0, BN)
    nmask = n < I
    if DOT:
        for m0 in range(0, cnt, BM):
            mi = m0 + tl.arange(0, BM)
            mm = mi < cnt
            if GROUPED:
                routes = tl.load(order_ptr + p + mi, mask=mm, other=0)
            else:
                routes = first + mi * 0
            xoff = (routes // TOP_K).to(tl.int64) * x_stride
            acc = _rows_dot(FMT, x_ptr, xoff, mm, wb, sb, vb, rows, rmask, H, SRS, 2 * BN, BK, BM, INTERP)
            gate, up = tl.split(tl.reshape(acc, [BM, BN, 2]))
            if WEIGHT_IN:
                wt = tl.load(tw_ptr + routes, mask=mm, other=0.0)
                gate = gate * wt[:, None]
                up = up * wt[:, None]
            g = activate(gate, up, ACT, alpha, limit)
            tl.store(h_ptr + routes.to(tl.int64)[:, None] * I + n[None, :], round_bf16(g, INTERP),
                     mask=mm[:, None] & nmask[None, :])
    else:
        for m in range(0, cnt):
            if GROUPED:
                route = tl.load(order_ptr + p + m)
            else:
                route = first
            xr = x_ptr + (route // TOP_K).to(tl.int64) * x_stride
            acc = _rows_fma(FMT, xr, wb, sb, vb, rows, rmask, H, SRS, 2 * BN, BK)
            gate, up = tl.split(tl.reshape(acc, [BN, 2]))
            if WEIGHT_IN:
                wt = tl.load(tw_ptr + route)
                gate = gate * wt
                up = up * wt
            g = activate(gate, up, ACT, alpha, limit)
            tl.store(h_ptr + route.to(tl.int64) * I + n, round_bf16(g, INTERP), mask=nmask)


@triton.jit
def down_group_kernel(h_ptr, slots_ptr, tw_ptr, order_ptr, count_ptr, capacity,
                      w_ptr, s_ptr, v_ptr, w_slot, s_slot, v_slot, SRS,
                      o_ptr, H, I,
                      FMT: tl.constexpr, GROUPED: tl.constexpr, DOT: tl.constexpr, WEIGHT_OUT: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, INTERP: tl.constexpr):
    p = tl.program_id(0)
    nb = tl.program_id(1)
    first, cnt = _group(p, slots_ptr, order_ptr, count_ptr, capacity, GROUPED)
    if cnt == 0:
        return
    slot = tl.load(slots_ptr + first).to(tl.int64)
    wb = w_ptr + slot * w_slot
    sb = s_ptr + slot * s_slot
    vb = v_ptr + slot * v_slot
    n = nb * BN + tl.arange(0, BN)
    nmask = n < H
    if DOT:
        for m0 in range(0, cnt, BM):
            mi = m0 + tl.arange(0, BM)
            mm = mi < cnt
            if GROUPED:
                routes = tl.load(order_ptr + p + mi, mask=mm, other=0)
            else:
                routes = first + mi * 0
            r64 = routes.to(tl.int64)
            acc = _rows_dot(FMT, h_ptr, r64 * I, mm, wb, sb, vb, n, nmask, I, SRS, BN, BK, BM, INTERP)
            if WEIGHT_OUT:
                acc = acc * tl.load(tw_ptr + routes, mask=mm, other=0.0)[:, None]
            tl.store(o_ptr + r64[:, None] * H + n[None, :], acc, mask=mm[:, None] & nmask[None, :])
    else:
        for m in range(0, cnt):
            if GROUPED:
                route = tl.load(order_ptr + p + m)
            else:
                route = first
            r64 = route.to(tl.int64)
            acc = _rows_fma(FMT, h_ptr + r64 * I, wb, sb, vb, n, nmask, I, SRS, BN, BK)
            if WEIGHT_OUT:
                acc = acc * tl.load(tw_ptr + route)
            tl.store(o_ptr + r64 * H + n, acc, mask=nmask)


@triton.jit
def down_token_kernel(h_ptr, slots_ptr, tw_ptr, capacity,
                      w_ptr, s_ptr, v_ptr, w_slot, s_slot, v_slot, SRS,
                      y_ptr, y_stride, H, I,
                      FMT: tl.constexpr, TOP_K: tl.constexpr, WEIGHT_OUT: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    n = nb * BN + tl.arange(0, BN)
    nmask = n < H
    y = tl.zeros([BN], dtype=tl.float32)
    for k in range(0, TOP_K):
        route = t * TOP_K + k
        s = tl.load(slots_ptr + route)
        if (s >= 0) & (s < capacity):
            slot = s.to(tl.int64)
            acc = _rows_fma(FMT, h_ptr + route.to(tl.int64) * I, w_ptr + slot * w_slot, s_ptr + slot * s_slot,
                            v_ptr + slot * v_slot, n, nmask, I, SRS, BN, BK)
            if WEIGHT_OUT:
                acc = acc * tl.load(tw_ptr + route)
            y += acc
    tl.store(y_ptr + t.to(tl.int64) * y_stride + n, round_bf16(y, INTERP), mask=nmask)


@triton.jit
def route_sum_kernel(o_ptr, slots_ptr, capacity, y_ptr, y_stride, H, TOP_K: tl.constexpr, BN: tl.constexpr,
                     INTERP: tl.constexpr):
    """y[t] = bf16(sum of o[t * TOP_K + k] over the resident routes k, in route order, fp32)."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < H
    y = tl.zeros([BN], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        route = t * TOP_K + k
        s = tl.load(slots_ptr + route + n * 0)  # one value, as a vector (a scalar & vector mask trips the interpreter)
        ok = nmask & (s >= 0) & (s < capacity)
        y += tl.load(o_ptr + route.to(tl.int64) * H + n, mask=ok, other=0.0)
    tl.store(y_ptr + t.to(tl.int64) * y_stride + n, round_bf16(y, INTERP), mask=nmask)
