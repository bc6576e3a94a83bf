"""q8_0_x16: GGUF Q8_0 experts with 16 rows interleaved per 32-block, for CPUs (mode w4a8).

The same 34 bytes per row and block as ``q8_0``, moved: per group of 16 rows and per block 544 bytes, the 16 rows'
fp16 d (row r at 2r), then 8 vectors of 64 bytes whose int32 lane r is row r's codes 4v .. 4v+3. A vector's 16
lanes are 16 rows, so the per-block fold is paid once per 16 rows and token (docs/formats/q8_0.md "q8_0_x16").

Banks (slot order; a bank row is a group of 16 weight rows): gate_up [E, 2I/16, (H/32) * 544], down [E, H/16,
(I/32) * 544], uint8. ``repack(banks)`` turns q8_0 banks into these, ``unpack(banks)`` back. Math: q8_0's w4a8 (the
exact integer sum(w q) per block times fp32(d) * d_a), folded per (row, token) block by block in K order with a
fused multiply-add, the same in every tier; not bit for bit q8_0's (its kernels fold lanes of partial sums).
"""
from __future__ import annotations

import numpy as np

from .._arrays import aligned_empty
from . import q8_0
from ._layout import GROUP, BlockGroups, group_banks, regroup

GB = GROUP * q8_0.BLOCK_BYTES  # bytes per group and block: 544


def to_groups(a: np.ndarray) -> np.ndarray:
    """q8_0 rows [E, R, nb*34] (R % 16 == 0) -> groups [E, R/16, nb*544], 64-byte aligned."""
    a = np.asarray(a)
    E, R, W = a.shape
    nb = W // q8_0.BLOCK_BYTES
    G = R // GROUP
    b = a.reshape(E, G, GROUP, nb, q8_0.BLOCK_BYTES)
    out = aligned_empty((E, G, nb * GB), np.uint8)
    v = out.reshape(E, G, nb, GB)
    v[..., :32] = b[..., :2].transpose(0, 1, 3, 2, 4).reshape(E, G, nb, 32)
    v[..., 32:] = b[..., 2:].reshape(E, G, GROUP, nb, 8, 4).transpose(0, 1, 3, 4, 2, 5).reshape(E, G, nb, 512)
    return out


def from_groups(a: np.ndarray) -> np.ndarray:
    """groups [E, R/16, nb*544] -> q8_0 rows [E, R, nb*34] (the inverse of to_groups)."""
    a = np.asarray(a)
    E, G, W = a.shape
    nb = W // GB
    v = a.reshape(E, G, nb, GB)
    out = np.empty((E, G, GROUP, nb, q8_0.BLOCK_BYTES), np.uint8)
    out[..., :2] = v[..., :32].reshape(E, G, nb, GROUP, 2).transpose(0, 1, 3, 2, 4)
    out[..., 2:] = v[..., 32:].reshape(E, G, nb, 8, GROUP, 4).transpose(0, 1, 4, 2, 3, 5).reshape(E, G, GROUP, nb, 32)
    return out.reshape(E, G * GROUP, nb * q8_0.BLOCK_BYTES)


def repack(banks) -> dict:
    """q8_0 banks (validated) -> q8_0_x16 banks (new arrays). Threads: any (reads the banks, returns new arrays)."""
    return regroup(q8_0.SPEC, to_groups, banks)


def unpack(banks) -> dict:
    """q8_0_x16 banks (validated) -> q8_0 banks. Threads: any (reads the banks, returns new arrays)."""
    return regroup(SPEC, from_groups, banks)


class Q80X16Format(BlockGroups, q8_0.Q80Format):
    source = q8_0.SPEC
    group_bytes = GB


SPEC = Q80X16Format(
    name="q8_0_x16", id=17,
    banks=group_banks(q8_0.QK, GB),
    k_multiple=q8_0.QK,
    input_weight=True,
    aliases=("q8_0_cpu",),
    modes=("w4a8",),
    default_mode="w4a8",
    description="GGUF Q8_0 with 16 rows interleaved per 32-block for CPU lanes (q8_0's bytes, moved); "
                "w4a8 = Q8_0 x Q8_0",
    kernel_tiers={"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni")},
)
