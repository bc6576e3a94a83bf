"""mxfp4_x16: gpt-oss mxfp4 experts with 16 rows interleaved per 32-block, for CPUs (mode w4a8).

The same codes, e8m0 scales and biases as ``mxfp4``, moved into ds_fp4_x16's group layout: per group of 16 rows
and per 32-block, the 16 rows' scales (row r at byte r), then 4 x 64 code bytes where int32 lane r of vector j
holds row r's codes of elements 4j..4j+3 (low nibbles) and 16+4j..16+4j+3 (high). A kernel's vector lanes are
16 rows: after the nibble split and a table lookup, one ``vpdpbusd`` takes 4 weights of each of 16 rows against
a broadcast dword of 4 activation codes, and the per-block fold is paid once per 16 rows and token
(docs/formats/mxfp4.md "mxfp4_x16"). Rows are logical: gate rows 0..I-1, then up rows I..2I-1 (mxfp4
interleaves gate/up by column); the gate_up bias follows that order.

Banks (slot order; a code bank row is a group of 16 weight rows):

| slot | bank | shape | dtype |
|---|---|---|---|
| 0 | gate_up | [E, 2I/16, (H/32) * 272] | uint8 |
| 1 | gate_up_bias | [E, 2I] | bfloat16 (or uint16 bits), gate then up |
| 2 | down | [E, H/16, (I/32) * 272] | uint8 |
| 3 | down_bias | [E, H] | bfloat16 (or uint16 bits) |

``repack(banks)`` turns mxfp4 (Triton layout) banks into these, ``unpack(banks)`` back; the executor reaches it
from mxfp4 through mxfp4_panel (mxfp4_panel's cpu_layout, mode w4a8). Math: mxfp4's w4a8, bit for bit in every
tier (the same activation codes, integers and fp32 operations in the same order; tested).
"""
from __future__ import annotations

import numpy as np

from .._arrays import aligned_copy
from ..numerics import BF16, bf16_decode, codes
from ..schema import BankSpec
from . import mxfp4, mxfp4_panel
from ._layout import GROUP, CpuLayout
from .ds_fp4_x16 import GB, QK, from_groups, to_groups


def _rows(blocks, scales, deinterleave: bool):
    """mxfp4 blocks [E, K/2, N] / scales [E, K/32, N] -> rows (packed [E, N, K/2], scale [E, N, K/32]), gate rows
    then up rows where deinterleave (a byte's low nibble is element 2i in both layouts)."""
    b, s = codes(np.asarray(blocks)).transpose(0, 2, 1), codes(np.asarray(scales)).transpose(0, 2, 1)
    if deinterleave:
        b, s = mxfp4._deinterleave(b, 1), mxfp4._deinterleave(s, 1)
    return b, s


def _columns(packed, scale, interleave: bool):
    """The inverse of _rows: (blocks [E, K/2, N], scales [E, K/32, N] uint8), 64-byte aligned."""
    if interleave:
        packed, scale = mxfp4._interleave(packed, 1), mxfp4._interleave(scale, 1)
    return aligned_copy(packed.transpose(0, 2, 1)), aligned_copy(codes(scale).transpose(0, 2, 1))


def repack(banks) -> dict:
    """mxfp4 banks (validated) -> mxfp4_x16 banks (new arrays). Threads: any (reads the banks, returns new arrays)."""
    mxfp4.SPEC.validate(banks)
    return {"gate_up": to_groups(*_rows(banks["gate_up_blocks"], banks["gate_up_scales"], True)),
            "gate_up_bias": aligned_copy(mxfp4._deinterleave(np.asarray(banks["gate_up_bias"]), 1)),
            "down": to_groups(*_rows(banks["down_blocks"], banks["down_scales"], False)),
            "down_bias": aligned_copy(np.asarray(banks["down_bias"]))}


def unpack(banks) -> dict:
    """mxfp4_x16 banks (validated) -> mxfp4 banks. Threads: any (reads the banks, returns new arrays)."""
    SPEC.validate(banks)
    gb, gs = _columns(*from_groups(banks["gate_up"]), True)
    db, ds = _columns(*from_groups(banks["down"]), False)
    return {"gate_up_blocks": gb, "gate_up_scales": gs,
            "gate_up_bias": aligned_copy(mxfp4._interleave(np.asarray(banks["gate_up_bias"]), 1)),
            "down_blocks": db, "down_scales": ds, "down_bias": aligned_copy(np.asarray(banks["down_bias"]))}


class Mxfp4X16Format(CpuLayout, mxfp4.Mxfp4Format):
    source = mxfp4.SPEC

    def repack_from(self, banks):  # from mxfp4_panel, whose cpu_layout this is
        return repack(mxfp4_panel.unpack(banks))

    def dims(self, banks):
        gu, dn, gub, dnb = banks["gate_up"], banks["down"], banks["gate_up_bias"], banks["down_bias"]
        if gu.ndim != 3 or dn.ndim != 3 or gub.ndim != 2 or dnb.ndim != 2:
            raise ValueError(f"mxfp4_x16 banks must be gate_up / down 3-D and the biases 2-D, got gate_up {gu.shape}, "
                             f"down {dn.shape}, gate_up_bias {gub.shape}, down_bias {dnb.shape}")
        if gu.shape[2] % GB or dn.shape[2] % GB:
            raise ValueError(f"mxfp4_x16 bank rows hold 272-byte group blocks: gate_up row {gu.shape[2]} bytes, "
                             f"down row {dn.shape[2]} bytes must be multiples of {GB}")
        if gu.shape[1] % 2:
            raise ValueError(f"mxfp4_x16 bank 'gate_up': dim 1 = {gu.shape[1]} must be 2I/16 (even)")
        return gu.shape[0], dn.shape[1] * GROUP, gu.shape[1] * GROUP // 2

    def biases(self, banks):  # already gate then up
        return bf16_decode(banks["gate_up_bias"]), bf16_decode(banks["down_bias"])


SPEC = Mxfp4X16Format(
    name="mxfp4_x16", id=12,
    banks=(BankSpec("gate_up", (np.uint8,), lambda E, H, I: (E, 2 * I // GROUP, H // QK * GB), align=1),
           BankSpec("gate_up_bias", (BF16, np.uint16), lambda E, H, I: (E, 2 * I), align=2),
           BankSpec("down", (np.uint8,), lambda E, H, I: (E, H // GROUP, I // QK * GB), align=1),
           BankSpec("down_bias", (BF16, np.uint16), lambda E, H, I: (E, H), align=2)),
    k_multiple=32,
    input_weight=False,
    modes=("w4a8",),
    default_mode="w4a8",
    description="gpt-oss mxfp4 (e2m1 + e8m0 per 32 K, biases) with 16 rows interleaved per 32-block for CPU lanes "
                "(mxfp4's bytes, moved; gate rows then up rows); w4a8 = mxfp4's w4a8, bit for bit",
    kernel_tiers={"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni", "avx512bf16")},
)
