"""q4_k_x16: GGUF Q4_K experts with 16 rows interleaved per 256-block, for CPUs (mode w4a8).

The same 144 bytes per row and block as ``q4_k``, moved so that a CPU kernel holds 16 rows in the 16 lanes of one
vector. Per group of 16 rows and per block, 2304 bytes:

| bytes | what |
|---|---|
| 0-31 | the 16 rows' fp16 d (row r at 2r) |
| 32-63 | their fp16 dmin |
| 64-255 | 12 planes of 16 bytes: plane k byte r = row r's packed scale byte k |
| 256-2303 | 32 vectors of 64 bytes: vector 8c + v, int32 lane r = row r's qs[32c + 4v .. 32c + 4v + 3] |

The scales, the mins and the per-block fold are then paid once per 16 rows and token instead of once per (row,
token) (docs/formats/q4_k.md "q4_k_x16").

Banks (slot order; a bank row is a group of 16 weight rows): gate_up [E, 2I/16, (H/256) * 2304] (gate rows 0..I-1,
up rows I..2I-1, as q4_k), down [E, H/16, (I/256) * 2304], uint8. ``repack(banks)`` turns q4_k banks into these,
``unpack(banks)`` back. Math: q4_k's w4a8 integers (S = sum_j sc[j] sum(q q_a), M = sum_j m[j] (sum of the run's
q_a)), folded per (row, token) block by block in K order as acc = fma(S, d d_a, acc), acc = fma(M, -(dmin d_a), acc),
the same in every tier; not bit for bit q4_k's (its kernels fold lanes of partial sums), within its tolerance.
"""
from __future__ import annotations

import numpy as np

from .._arrays import aligned_empty
from . import q4_k
from ._layout import GROUP, BlockGroups, group_banks, regroup

GB = GROUP * q4_k.BLOCK_BYTES  # bytes per group and block: 2304


def to_groups(a: np.ndarray) -> np.ndarray:
    """q4_k rows [E, R, nb*144] (R % 16 == 0) -> groups [E, R/16, nb*2304], 64-byte aligned."""
    a = np.asarray(a)
    E, R, W = a.shape
    nb = W // q4_k.BLOCK_BYTES
    G = R // GROUP
    b = a.reshape(E, G, GROUP, nb, q4_k.BLOCK_BYTES)
    out = aligned_empty((E, G, nb * GB), np.uint8)
    v = out.reshape(E, G, nb, GB)
    v[..., 0:32] = b[..., 0:2].transpose(0, 1, 3, 2, 4).reshape(E, G, nb, 32)
    v[..., 32:64] = b[..., 2:4].transpose(0, 1, 3, 2, 4).reshape(E, G, nb, 32)
    v[..., 64:256] = b[..., 4:16].transpose(0, 1, 3, 4, 2).reshape(E, G, nb, 192)  # [.., block, byte k, row]
    qs = b[..., 16:].reshape(E, G, GROUP, nb, 4, 8, 4)  # [.., row, block, c, v, byte]
    v[..., 256:] = qs.transpose(0, 1, 3, 4, 5, 2, 6).reshape(E, G, nb, 2048)  # [.., block, c, v, row, byte]
    return out


def from_groups(a: np.ndarray) -> np.ndarray:
    """groups [E, R/16, nb*2304] -> q4_k rows [E, R, nb*144] (the inverse of to_groups)."""
    a = np.asarray(a)
    E, G, W = a.shape
    nb = W // GB
    v = a.reshape(E, G, nb, GB)
    out = np.empty((E, G, GROUP, nb, q4_k.BLOCK_BYTES), np.uint8)
    out[..., 0:2] = v[..., 0:32].reshape(E, G, nb, GROUP, 2).transpose(0, 1, 3, 2, 4)
    out[..., 2:4] = v[..., 32:64].reshape(E, G, nb, GROUP, 2).transpose(0, 1, 3, 2, 4)
    out[..., 4:16] = v[..., 64:256].reshape(E, G, nb, 12, GROUP).transpose(0, 1, 4, 2, 3)
    out[..., 16:] = v[..., 256:].reshape(E, G, nb, 4, 8, GROUP, 4).transpose(0, 1, 5, 2, 3, 4, 6).reshape(
        E, G, GROUP, nb, 128)
    return out.reshape(E, G * GROUP, nb * q4_k.BLOCK_BYTES)


def repack(banks) -> dict:
    """q4_k banks (validated) -> q4_k_x16 banks (new arrays). Threads: any (reads the banks, returns new arrays)."""
    return regroup(q4_k.SPEC, to_groups, banks)


def unpack(banks) -> dict:
    """q4_k_x16 banks (validated) -> q4_k banks. Threads: any (reads the banks, returns new arrays)."""
    return regroup(SPEC, from_groups, banks)


class Q4KX16Format(BlockGroups, q4_k.Q4KFormat):
    source = q4_k.SPEC
    group_bytes = GB


SPEC = Q4KX16Format(
    name="q4_k_x16", id=16,
    banks=group_banks(q4_k.QK, GB),
    k_multiple=q4_k.QK,
    input_weight=True,
    aliases=("q4_k_cpu",),
    modes=("w4a8",),
    default_mode="w4a8",
    description="GGUF Q4_K with 16 rows interleaved per 256-block for CPU lanes (q4_k's bytes, moved); "
                "w4a8 = Q4_K x Q8_K",
    kernel_tiers={"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni")},
)
