"""Decode-sized route grouping on the GPU: the T * top_k routes sorted by slot with fixed-size work.

route_groups(slots [R] int32, capacity) fills
  order[R]  route indices in (slot, route) order: resident routes first, grouped by slot, each group in route
            order; routes whose slot is not in [0, capacity) last
  count[R]  at the first position of each group, the group's size; 0 everywhere else
so a kernel with one program per position p serves group order[p : p + count[p]] when count[p] > 0 and exits
otherwise. One pass, no host synchronisation: each program ranks CHUNK routes against all R
(rank = #smaller keys + #equal keys before it), O(R^2 / CHUNK) comparisons per program; R = 512 (64 tokens x
top-8) is 8 programs of 8 steps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64


@triton.jit
def _route_kernel(slots_ptr, R, capacity, order_ptr, count_ptr, CHUNK: tl.constexpr):
    r = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    rm = r < R
    s = tl.load(slots_ptr + r, mask=rm, other=-1)
    valid = (s >= 0) & (s < capacity)
    key = tl.where(valid, s, capacity)
    less = tl.zeros([CHUNK], dtype=tl.int32)
    before = tl.zeros([CHUNK], dtype=tl.int32)
    same = tl.zeros([CHUNK], dtype=tl.int32)
    for c0 in range(0, R, CHUNK):
        r2 = c0 + tl.arange(0, CHUNK)
        m2 = r2 < R
        s2 = tl.load(slots_ptr + r2, mask=m2, other=-1)
        k2 = tl.where((s2 >= 0) & (s2 < capacity), s2, capacity)
        k2 = tl.where(m2, k2, capacity + 1)  # past the end: after every key, equal to none
        eq = k2[None, :] == key[:, None]
        less += tl.sum((k2[None, :] < key[:, None]).to(tl.int32), axis=1)
        before += tl.sum((eq & (r2[None, :] < r[:, None])).to(tl.int32), axis=1)
        same += tl.sum(eq.to(tl.int32), axis=1)
    pos = less + before
    tl.store(order_ptr + pos, r, mask=rm)
    tl.store(count_ptr + pos, tl.where(valid & (before == 0), same, 0), mask=rm)


def route_groups(slots: torch.Tensor, capacity: int, order: torch.Tensor | None = None,
                 count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """slots: int32, any shape (flattened in row-major route order) -> (order, count), int32 [R]."""
    flat = slots.reshape(-1)
    R = flat.numel()
    if order is None:
        order = torch.empty(R, dtype=torch.int32, device=flat.device)
    if count is None:
        count = torch.empty(R, dtype=torch.int32, device=flat.device)
    if R:
        _route_kernel[(triton.cdiv(R, CHUNK),)](flat, R, capacity, order, count, CHUNK=CHUNK, num_warps=4)
    return order, count
