"""fp8_block_x16: fp8_block experts with 16 rows interleaved per pair of K elements, for CPUs (mode native).

The same e4m3 codes and bf16 128x128 block scales as ``fp8_block``; only the code banks move. A bank row is a
group of 16 weight rows: per K pair p (elements 2p, 2p+1), 32 bytes, row r's two codes at bytes 2r, 2r+1. So a
64-byte line holds 2 K pairs of 16 rows, decoded (e4m3 -> bf16 byte tables) it is 2 vectors whose 32-bit lane r
is row r's bf16 pair, and one ``vdpbf16ps`` with the token's bf16 pair broadcast takes 32 products for 16 rows.
The row-major kernels stream each token's activations through a row (or decode and fold per row and token);
here a token costs one instruction per 32 weights, so 8 tokens that share an expert cost little more than one
(docs/formats/fp8_block.md "fp8_block_x16").

Banks (slot order; H and I multiples of 16):

| slot | bank | shape | dtype |
|---|---|---|---|
| 0 | gate_up | [E, 2I/16, H * 16] | float8_e4m3fn (uint8 accepted); gate groups 0..I/16-1, up groups after |
| 1 | gate_up_scale | [E, nb(2I), >= nb(H)] | bfloat16, as fp8_block |
| 2 | down | [E, H/16, I * 16] | float8_e4m3fn (uint8 accepted) |
| 3 | down_scale | [E, nb(H), >= nb(I)] | bfloat16, as fp8_block |

Math (W8A16, x as its exact bf16): per (row, token), from acc = 0, per 128-K block (the last one partial) two
chains c0 (even K pairs of the block) and c1 (odd ones), each pair as ``c = fma(w_odd, x_odd, c)`` then
``c = fma(w_even, x_even, c)`` (vdpbf16ps' order; products are exact), then ``acc = fma(c0 + c1, scale, acc)``.
Every tier but amx does these fp32 operations in this order (avx2 and avx512f with fp32 FMAs, ``x16_fma.h``),
bit-identical to scalar, so a token's result does not depend on its batch, and the results equal fp8_block's
within its tolerance (its kernels group the sums otherwise).
"""
from __future__ import annotations

import numpy as np

from .._arrays import aligned_empty
from ..numerics import E4M3
from ..schema import BankSpec
from . import fp8_block
from ._layout import GROUP, CpuLayout, from_pair_groups, pair_groups

to_groups, from_groups = pair_groups, from_pair_groups  # codes [E, R, K] <-> groups [E, R/16, K*16]


def _copy(a: np.ndarray) -> np.ndarray:
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


def repack(banks) -> dict:
    """fp8_block banks (validated) -> fp8_block_x16 banks (new arrays; the scale banks copied as they are).
    Threads: any (reads the banks, returns new arrays)."""
    arrs, (_, H, I) = fp8_block.SPEC.validate(banks)  # noqa: E741
    SPEC.check_dims(H, I)
    gu, gus, dn, dns = arrs
    return {"gate_up": to_groups(gu), "gate_up_scale": _copy(gus), "down": to_groups(dn), "down_scale": _copy(dns)}


def unpack(banks) -> dict:
    """fp8_block_x16 banks (validated) -> fp8_block banks. Threads: any (reads the banks, returns new arrays)."""
    gu, gus, dn, dns = SPEC.validate(banks)[0]
    return {"gate_up": from_groups(gu), "gate_up_scale": _copy(gus), "down": from_groups(dn),
            "down_scale": _copy(dns)}


class Fp8BlockX16Format(CpuLayout, fp8_block.Fp8BlockFormat):
    source = fp8_block.SPEC

    def dims(self, banks):
        gu, dn = banks["gate_up"], banks["down"]
        if gu.ndim != 3 or dn.ndim != 3:
            raise ValueError(f"fp8_block_x16 banks must be 3-D, got gate_up {gu.shape}, down {dn.shape}")
        if gu.shape[2] % GROUP or dn.shape[2] % GROUP:
            raise ValueError(f"fp8_block_x16 bank rows hold 16 rows' codes: gate_up row {gu.shape[2]} bytes, down "
                             f"row {dn.shape[2]} bytes must be multiples of {GROUP}")
        if gu.shape[1] % 2:
            raise ValueError(f"fp8_block_x16 bank 'gate_up': dim 1 = {gu.shape[1]} must be 2I/16 (even)")
        return gu.shape[0], gu.shape[2] // GROUP, gu.shape[1] * GROUP // 2



SPEC = Fp8BlockX16Format(
    name="fp8_block_x16", id=8,
    banks=(BankSpec("gate_up", (E4M3, np.uint8), lambda E, H, I: (E, 2 * I // GROUP, H * GROUP), align=1),
           fp8_block.SPEC.banks[1],
           BankSpec("down", (E4M3, np.uint8), lambda E, H, I: (E, H // GROUP, I * GROUP), align=1),
           fp8_block.SPEC.banks[3]),
    k_multiple=GROUP,
    aliases=("fp8_block_cpu",),
    description="128x128 block FP8 e4m3 with 16 rows interleaved per K pair for CPU lanes (fp8_block's bytes, "
                "moved); W8A16 on vdpbf16ps or fp32 FMAs",
    # amx: the same B layout for tdpbf16ps (a decoded line is two B rows); the tile unit sums each 32-K chunk in its
    # own order, so amx is the one tier not bit-identical to the others (each is batch-invariant)
    kernel_tiers={"native": ("scalar", "avx2", "avx512f", "avx512bf16", "amx")},
)
