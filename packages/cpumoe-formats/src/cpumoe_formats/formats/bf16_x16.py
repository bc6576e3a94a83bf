"""bf16_x16: bf16 experts with 16 rows interleaved per pair of K elements, for CPUs (vdpbf16ps or fp32 FMAs).

The same bf16 weights as ``bf16``, moved: a bank row is a group of 16 weight rows, and per K pair p (elements
2p, 2p+1) it holds 32 values, row r's two at 2r, 2r+1 (64 bytes). One load is then a vector of 16 rows' bf16
pairs, and one ``vdpbf16ps`` with the token's pair broadcast takes 32 products for 16 rows: a token sharing an
expert costs one instruction per 32 weights, where bf16's row-major kernels stream each token's activations
through every row (docs/formats/bf16.md "bf16_x16").

Banks (slot order; H and I multiples of 16):

| slot | bank | shape | dtype |
|---|---|---|---|
| 0 | gate_up | [E, 2I/16, H * 16] | bfloat16 (uint16 accepted); gate groups 0..I/16-1, up groups after |
| 1 | down | [E, H/16, I * 16] | bfloat16 (uint16 accepted) |

Math (W16A16, x as its exact bf16): per (row, token), two chains from 0, c0 over the even K pairs and c1 over
the odd ones, each pair as ``c = fma(w_odd, x_odd, c)`` then ``c = fma(w_even, x_even, c)`` (vdpbf16ps' order;
products exact, subnormal x and partial sums read as zero), then ``c0 + c1``. The scalar tier defines it
(``x16.h`` ``dp_step``); avx2 and avx512f (fp32 FMAs, ``x16_fma.h``) are bit-identical to it for every input;
avx512bf16 too except that ``vdpbf16ps`` also reads subnormal weights as zero and flushes sums just under
FLT_MIN (from FLT_MIN - 2^-150) that scalar rounds up to it (test_vdpbf16ps_edges). A token's result does not
depend on its batch; the results equal bf16's within its tolerance (its kernels group the sums otherwise).
"""
from __future__ import annotations

import numpy as np

from ..numerics import BF16
from ..schema import BankSpec
from . import bf16
from ._layout import GROUP, CpuLayout, from_pair_groups, pair_groups


def repack(banks) -> dict:
    """bf16 banks (validated) -> bf16_x16 banks (new arrays). Threads: any (reads the banks, returns new arrays)."""
    arrs, (_, H, I) = bf16.SPEC.validate(banks)  # noqa: E741
    SPEC.check_dims(H, I)
    return {n: pair_groups(a) for n, a in zip(bf16.SPEC.bank_names, arrs)}


def unpack(banks) -> dict:
    """bf16_x16 banks (validated) -> bf16 banks. Threads: any (reads the banks, returns new arrays)."""
    arrs, _ = SPEC.validate(banks)
    return {n: from_pair_groups(a) for n, a in zip(SPEC.bank_names, arrs)}


class Bf16X16Format(CpuLayout, bf16.Bf16Format):
    source = bf16.SPEC

    def dims(self, banks):
        gu, dn = banks["gate_up"], banks["down"]
        if gu.ndim != 3 or dn.ndim != 3:
            raise ValueError(f"bf16_x16 banks must be 3-D, got gate_up {gu.shape}, down {dn.shape}")
        if gu.shape[2] % GROUP or dn.shape[2] % GROUP:
            raise ValueError(f"bf16_x16 bank rows hold 16 rows' values: gate_up row {gu.shape[2]}, down row "
                             f"{dn.shape[2]} elements must be multiples of {GROUP}")
        if gu.shape[1] % 2:
            raise ValueError(f"bf16_x16 bank 'gate_up': dim 1 = {gu.shape[1]} must be 2I/16 (even)")
        return gu.shape[0], gu.shape[2] // GROUP, gu.shape[1] * GROUP // 2


SPEC = Bf16X16Format(
    name="bf16_x16", id=11,
    banks=(BankSpec("gate_up", (BF16, np.uint16), lambda E, H, I: (E, 2 * I // GROUP, H * GROUP), align=2),
           BankSpec("down", (BF16, np.uint16), lambda E, H, I: (E, H // GROUP, I * GROUP), align=2)),
    k_multiple=GROUP,
    aliases=("bf16_cpu",),
    description="bf16 weights with 16 rows interleaved per K pair for CPU lanes (bf16's values, moved); "
                "W16A16 on vdpbf16ps or fp32 FMAs",
    kernel_tiers={"native": ("scalar", "avx2", "avx512f", "avx512bf16")},
)
