"""ds_fp4_x16: ds_fp4 experts (DeepSeek-V4-Flash) with 16 rows interleaved per 32-block, for CPUs (mode w4a8).

The same 17 bytes per row and 32-block as ``ds_fp4`` (16 bytes of e2m1 codes, one e8m0 scale), moved so that a
CPU kernel holds 16 rows in the 16 lanes of one vector: per group of 16 rows and per block, the 16 rows' e8m0
scales (row r at byte r), then 4 x 64 code bytes where int32 lane r of vector j holds row r's codes of elements
4j..4j+3 in its low nibbles and 16+4j..16+4j+3 in its high ones (byte i of the lane: elements 4j+i, 16+4j+i;
ds_fp4 pairs elements 2i, 2i+1 in a byte). After the nibble split and an e2m1 -> int8 table lookup, lane r of a
vector is 4 consecutive weights of row r, against a broadcast dword of 4 consecutive activation codes. The
per-block fold (integer sum to fp32, times the scales, add) is then paid once per 16 rows and token, not once per
(row, token) as in ds_fp4's row-major kernels (docs/formats/ds_fp4.md "ds_fp4_x16").

Banks (slot order; a bank row is a group of 16 weight rows):

| slot | bank | shape | dtype |
|---|---|---|---|
| 0 | gate_up | [E, 2I/16, (H/32) * 272] | uint8 (gate rows 0..I-1, up rows I..2I-1, as ds_fp4) |
| 1 | down | [E, H/16, (I/32) * 272] | uint8 |

``repack(banks)`` turns ds_fp4 banks into these, ``unpack(banks)`` back. Math: ds_fp4's w4a8 (the FP8 round trip
per 128, then the Q8_0 int8 rule per 32; the same activation codes), with per (row, token) and block the exact
integer ``S = sum(2 E2M1 * q)`` and, from acc = 0 block by block in K order,
``acc = fma(float(S) * (0.5 s_b), 2^(s - 127), acc)``, the same in every tier. So results equal ds_fp4's w4a8 up
to fp32 rounding (ds_fp4's kernels group the sums otherwise), not bit for bit. gate/up and each route's down
term are rounded to bf16 as in ds_fp4.
"""
from __future__ import annotations

import numpy as np

from .._arrays import aligned_empty
from ..numerics import E8M0, codes, pack_nibbles
from ..schema import BankSpec
from . import ds_fp4
from ._layout import GROUP, CpuLayout

QK = ds_fp4.BLOCK  # 32 elements per scale block
GB = GROUP * (QK // 2 + 1)  # bytes per group and block: 16 scales + 16 x 16 code bytes = 272


def to_groups(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """ds_fp4 rows packed [E, R, K/2], scale [E, R, K/32] (R % 16 == 0) -> groups [E, R/16, (K/32)*272],
    64-byte aligned."""
    p = codes(np.asarray(packed))
    sc = codes(np.asarray(scale))
    E, R, K2 = p.shape
    G, nb = R // GROUP, 2 * K2 // QK
    out = aligned_empty((E, G, nb * GB), np.uint8)
    v = out.reshape(E, G, nb, GB)
    v[..., :GROUP] = sc.reshape(E, G, GROUP, nb).transpose(0, 1, 3, 2)
    # Group byte (j, i) of a row's block = element 4j + i (low nibble) | element 16 + 4j + i (high). The block's
    # packed bytes A = 0-7 and B = 8-15 hold elements 2m, 2m + 1 and 16 + 2m, 17 + 2m (m < 8), so byte m of
    # A and B gives i = 2 (m % 2) (the low nibbles) and i + 1 (the high ones) of j = m // 2: nibble moves on the
    # packed bytes, no unpacking to one code per byte.
    p = p.reshape(E, G, GROUP, nb, 2, 8)
    a, b = p[..., 0, :], p[..., 1, :]
    pair = np.stack([(a & 0x0F) | (b << 4), (a >> 4) | (b & 0xF0)], axis=-1)  # [.., row, block, m, low/high]
    v[..., GROUP:] = pair.reshape(E, G, GROUP, nb, 4, 4).transpose(0, 1, 3, 4, 2, 5).reshape(E, G, nb, GROUP * 16)
    return out


def from_groups(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """groups [E, R/16, nb*272] -> ds_fp4 rows (packed [E, R, nb*16] uint8, scale [E, R, nb] e8m0): the inverse
    of to_groups."""
    a = np.asarray(a)
    E, G, W = a.shape
    nb = W // GB
    v = a.reshape(E, G, nb, GB)
    scale = np.ascontiguousarray(v[..., :GROUP].transpose(0, 1, 3, 2)).reshape(E, G * GROUP, nb)
    b = v[..., GROUP:].reshape(E, G, nb, 4, GROUP, 4).transpose(0, 1, 4, 2, 3, 5)  # [.., row, block, j, i]
    c = np.stack([b & 15, b >> 4], axis=-3).reshape(E, G * GROUP, nb * QK)  # element order
    return pack_nibbles(c[..., 0::2], c[..., 1::2]), scale.view(E8M0)


def repack(banks) -> dict:
    """ds_fp4 banks (validated) -> ds_fp4_x16 banks (new arrays). Threads: any (reads the banks, returns new arrays)."""
    ds_fp4.SPEC.validate(banks)
    return {"gate_up": to_groups(banks["gate_up_packed"], banks["gate_up_scale"]),
            "down": to_groups(banks["down_packed"], banks["down_scale"])}


def unpack(banks) -> dict:
    """ds_fp4_x16 banks (validated) -> ds_fp4 banks. Threads: any (reads the banks, returns new arrays)."""
    SPEC.validate(banks)
    gp, gs = from_groups(banks["gate_up"])
    dp, ds = from_groups(banks["down"])
    return {"gate_up_packed": gp, "gate_up_scale": gs, "down_packed": dp, "down_scale": ds}


class DsFp4X16Format(CpuLayout, ds_fp4.DsFp4Format):
    source = ds_fp4.SPEC

    def dims(self, banks):
        gu, dn = banks["gate_up"], banks["down"]
        if gu.ndim != 3 or dn.ndim != 3:
            raise ValueError(f"ds_fp4_x16 banks must be 3-D, got gate_up {gu.shape}, down {dn.shape}")
        if gu.shape[2] % GB or dn.shape[2] % GB:
            raise ValueError(f"ds_fp4_x16 bank rows hold 272-byte group blocks: gate_up row {gu.shape[2]} bytes, "
                             f"down row {dn.shape[2]} bytes must be multiples of {GB}")
        if gu.shape[1] % 2:
            raise ValueError(f"ds_fp4_x16 bank 'gate_up': dim 1 = {gu.shape[1]} must be 2I/16 (even)")
        return gu.shape[0], dn.shape[1] * GROUP, gu.shape[1] * GROUP // 2



SPEC = DsFp4X16Format(
    name="ds_fp4_x16", id=10,
    banks=(BankSpec("gate_up", (np.uint8,), lambda E, H, I: (E, 2 * I // GROUP, H // QK * GB), align=1),
           BankSpec("down", (np.uint8,), lambda E, H, I: (E, H // GROUP, I // QK * GB), align=1)),
    k_multiple=ds_fp4.ACT_BLOCK,
    input_weight=False,
    aliases=("ds_fp4_cpu",),
    modes=("w4a8",),
    default_mode="w4a8",
    round_gate_up=True,
    round_route_term=True,
    description="ds_fp4 (DeepSeek-V4-Flash e2m1, e8m0 per 32) with 16 rows interleaved per 32-block for CPU "
                "lanes (ds_fp4's bytes, moved); w4a8 = ds_fp4's w4a8",
    kernel_tiers={"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni", "avx512bf16")},
)
