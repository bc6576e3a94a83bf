"""q4_0_x16: GGUF Q4_0 experts with 16 rows interleaved per 32-block, for CPUs (mode w4a8).

The same 18 bytes per row and block as ``q4_0`` (fp16 d, 16 qs bytes), moved so that a CPU kernel holds 16
rows in the 16 lanes of one vector: per group of 16 rows and per block, the 16 d (row r at bytes 2r), then 4 x
64 bytes where int32 lane r of vector j is row r's qs bytes 4j..4j+3. The per-block fold (integer sum to fp32,
times the scales, add) is then paid once per 16 rows and token, not once per (row, token); a batch whose tokens
share experts costs ~3x less compute per expert than with q4_0's row-major kernels (docs/formats/q4_0.md).

Banks (slot order; a bank row is a group of 16 weight rows):

| slot | bank | shape | dtype |
|---|---|---|---|
| 0 | gate_up | [E, 2I/16, (H/32) * 288] | uint8 (gate rows 0..I-1, up rows I..2I-1, as q4_0) |
| 1 | down | [E, H/16, (I/32) * 288] | uint8 |

``repack(banks)`` turns q4_0 banks into these, ``unpack(banks)`` back. Math: q4_0's w4a8 (the Q8_0 activation
rule, exact integer block sums times fp32(fp16(d) * d_a)), summed per (row, token) block by block in K order
with a fused multiply-add, the same in every tier. So results equal q4_0's up to fp32 rounding (q4_0's kernels
group the sums otherwise), not bit for bit.
"""
from __future__ import annotations

import numpy as np

from .._arrays import aligned_empty
from . import q4_0
from ._layout import GROUP, BlockGroups, group_banks, regroup

GB = GROUP * q4_0.BLOCK_BYTES  # bytes per group and block: 16 d + 16 x 16 qs = 288


def to_groups(a: np.ndarray) -> np.ndarray:
    """q4_0 rows [E, R, nb*18] (R % 16 == 0) -> groups [E, R/16, nb*288], 64-byte aligned."""
    a = np.asarray(a)
    E, R, W = a.shape
    nb = W // q4_0.BLOCK_BYTES
    b = a.reshape(E, R // GROUP, GROUP, nb, q4_0.BLOCK_BYTES)
    out = aligned_empty((E, R // GROUP, nb * GB), np.uint8)
    v = out.reshape(E, R // GROUP, nb, GB)
    v[..., :32] = b[..., :2].transpose(0, 1, 3, 2, 4).reshape(E, R // GROUP, nb, 32)
    qs = b[..., 2:].reshape(E, R // GROUP, GROUP, nb, 4, 4)  # [.., row, block, j, byte]
    v[..., 32:] = qs.transpose(0, 1, 3, 4, 2, 5).reshape(E, R // GROUP, nb, 256)  # [.., block, j, row, byte]
    return out


def from_groups(a: np.ndarray) -> np.ndarray:
    """groups [E, R/16, nb*288] -> q4_0 rows [E, R, nb*18] (the inverse of to_groups)."""
    a = np.asarray(a)
    E, G, W = a.shape
    nb = W // GB
    v = a.reshape(E, G, nb, GB)
    out = np.empty((E, G, GROUP, nb, q4_0.BLOCK_BYTES), np.uint8)
    out[..., :2] = v[..., :32].reshape(E, G, nb, GROUP, 2).transpose(0, 1, 3, 2, 4)
    out[..., 2:] = v[..., 32:].reshape(E, G, nb, 4, GROUP, 4).transpose(0, 1, 4, 2, 3, 5).reshape(E, G, GROUP, nb, 16)
    return out.reshape(E, G * GROUP, nb * q4_0.BLOCK_BYTES)


def repack(banks) -> dict:
    """q4_0 banks (validated) -> q4_0_x16 banks (new arrays). Threads: any (reads the banks, returns new arrays)."""
    return regroup(q4_0.SPEC, to_groups, banks)


def unpack(banks) -> dict:
    """q4_0_x16 banks (validated) -> q4_0 banks. Threads: any (reads the banks, returns new arrays)."""
    return regroup(SPEC, from_groups, banks)


class Q40X16Format(BlockGroups, q4_0.Q40Format):
    source = q4_0.SPEC
    group_bytes = GB


SPEC = Q40X16Format(
    name="q4_0_x16", id=7,
    banks=group_banks(q4_0.QK, GB),
    k_multiple=q4_0.QK,
    input_weight=True,
    aliases=("q4_0_cpu",),
    modes=("w4a8",),
    default_mode="w4a8",
    description="GGUF Q4_0 with 16 rows interleaved per 32-block for CPU lanes (q4_0's bytes, moved); "
                "w4a8 = Q4_0 x Q8_0",
    kernel_tiers={"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni")},
)
