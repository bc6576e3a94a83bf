"""The miss split's per-step division on the GPU, one launch inside the captured step: of the distinct experts a
step's routes touch that are not resident, the GPU takes round(q * n) (the first in expert order) plus any in the
layer's zero-copy set; the CPU the rest. q is held in fixed point, 2^shift for 1 (placement/split.py: q_fixed and
take_count, the same rounding on the host), so round(q n) is exact.

split_routes(ids [T, K], resident [E] bool, zc_set [E] bool, q [1] int32 fixed point) fills
  skip[E]  bool: the experts the CPU skips (resident, or taken by the GPU this step)
  zc[T, K] int32: the route's expert where the GPU reads it zero-copy, else -1
One program, no host synchronisation: [E, chunk] comparisons find the touched experts (a decode step has at most a
few hundred routes) and a scan ranks the misses.

Why per step: a fixed set of zero-copy experts gives a batch-1 step a binomial share of its ~8 misses, and the step
waits for whichever side drew more (an H100, fp8_block, batch 1, 0% resident: the set's best q ran 345 us where the
two sides' mean rates balanced gave 250)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_kernel(ids_ptr, R, res_ptr, set_ptr, q_ptr, skip_ptr, zc_ptr, E, BE: tl.constexpr, CH: tl.constexpr,
                  SHIFT: tl.constexpr, HALF: tl.constexpr):
    e = tl.arange(0, BE)
    em = e < E
    touched = tl.zeros([BE], dtype=tl.int32)
    for c0 in range(0, R, CH):  # the routes in chunks: an [E, CH] comparison each
        r = c0 + tl.arange(0, CH)
        ids = tl.load(ids_ptr + r, mask=r < R, other=-1)  # in their own dtype; ids outside [0, E) touch nothing
        touched = tl.maximum(touched, tl.max((ids[None, :] == e[:, None]).to(tl.int32), axis=1))
    res = tl.load(res_ptr + e, mask=em, other=0) != 0
    fixed = tl.load(set_ptr + e, mask=em, other=0) != 0
    miss = (touched > 0) & (res == 0) & em
    rank = tl.cumsum(miss.to(tl.int32), axis=0)  # 1-based among the misses, in expert order
    n = tl.sum(miss.to(tl.int32), axis=0)
    take_n = (tl.load(q_ptr) * n + HALF) >> SHIFT  # round(q n) in integers: the model (choose.py) rounds alike
    take = miss & ((rank <= take_n) | fixed)
    tl.store(skip_ptr + e, (res | take).to(tl.int8), mask=em)
    for c0 in range(0, R, CH):
        r = c0 + tl.arange(0, CH)
        rm = r < R
        ids = tl.load(ids_ptr + r, mask=rm, other=-1)
        by_route = tl.max(((ids[None, :] == e[:, None]) & take[:, None]).to(tl.int32), axis=0) > 0
        tl.store(zc_ptr + r, tl.where(by_route, ids, -1), mask=rm)


def split_routes(ids: torch.Tensor, resident: torch.Tensor, zc_set: torch.Tensor, q: torch.Tensor, shift: int):
    """-> (skip [E] bool, zc [T, K] int32) as the module docstring says; capture-safe (one kernel)."""
    E = resident.numel()
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    R = flat.numel()
    BE = triton.next_power_of_2(E)
    skip = torch.empty(E, dtype=torch.bool, device=resident.device)
    zc = torch.empty(ids.shape, dtype=torch.int32, device=resident.device)
    _split_kernel[(1,)](flat, R, resident.view(torch.int8), zc_set.view(torch.int8), q, skip.view(torch.int8), zc, E,
                        BE=BE, CH=max(16, min(64, 4096 // BE)), SHIFT=shift, HALF=1 << (shift - 1), num_warps=4)
    return skip, zc
