"""q5_k_x16: GGUF Q5_K experts with 16 rows interleaved per 256-block, for CPUs (modes w4a8 and native, q5_k's).

The same 176 bytes per row and block as ``q5_k``, moved so that a CPU kernel holds 16 rows in the 16 lanes of one
vector: q4_k_x16's layout with the fifth bits after the scales. Per group of 16 rows and per block, 2816 bytes:

| bytes | what |
|---|---|
| 0-31 | the 16 rows' fp16 d (row r at 2r) |
| 32-63 | their fp16 dmin |
| 64-255 | 12 planes of 16 bytes: plane k byte r = row r's packed scale byte k |
| 256-767 | 8 vectors of 64 bytes: vector v, int32 lane r = row r's qh[4v .. 4v + 3] (the fifth bits) |
| 768-2815 | 32 vectors of 64 bytes: vector 8c + v, int32 lane r = row r's qs[32c + 4v .. 32c + 4v + 3] |

The scales, the mins and the per-block fold are then paid once per 16 rows and token instead of once per (row,
token) (docs/formats/q5_k.md "q5_k_x16").

Banks (slot order; a bank row is a group of 16 weight rows): gate_up [E, 2I/16, (H/256) * 2816] (gate rows 0..I-1,
up rows I..2I-1, as q5_k), down [E, H/16, (I/256) * 2816], uint8. ``repack(banks)`` turns q5_k banks into these,
``unpack(banks)`` back. Math, the same in every tier: w4a8 q5_k's integers (S = sum_j sc[j] sum(q q_a), M = sum_j
m[j] (sum of the run's q_a)), folded per (row, token) block by block in K order as acc = fma(S, d d_a, acc),
acc = fma(M, -(dmin d_a), acc); native q5_k's scalar tier's operations (w = fma(q, d sc[j], -(dmin m[j])), gguf's
weight, then acc = fma(w, x, acc) in element order), bit for bit that tier's. The w4a8 kernels are not bit for bit
q5_k's (its kernels fold lanes of partial sums), within its tolerance.
"""
from __future__ import annotations

import numpy as np

from .._arrays import aligned_empty
from . import q4_k, q4_k_x16, q5_k
from ._layout import GROUP, BlockGroups, group_banks, regroup

GB = GROUP * q5_k.BLOCK_BYTES  # bytes per group and block: 2816
_QH = 256  # the fifth bits' offset in a group-block; q4_k_x16's codes follow them


def to_groups(a: np.ndarray) -> np.ndarray:
    """q5_k rows [E, R, nb*176] (R % 16 == 0) -> groups [E, R/16, nb*2816], 64-byte aligned."""
    a = np.asarray(a)
    E, R, W = a.shape
    nb = W // q5_k.BLOCK_BYTES
    G = R // GROUP
    b = a.reshape(E, R, nb, q5_k.BLOCK_BYTES)
    # q4_k's 144 bytes of each block (d, dmin, scales, qs) in q4_k_x16's layout, the fifth bits beside them
    g4 = q4_k_x16.to_groups(np.concatenate([b[..., :16], b[..., 48:]], axis=-1).reshape(E, R, nb * q4_k.BLOCK_BYTES))
    g4 = g4.reshape(E, G, nb, q4_k_x16.GB)
    out = aligned_empty((E, G, nb * GB), np.uint8)
    v = out.reshape(E, G, nb, GB)
    v[..., :_QH] = g4[..., :_QH]
    qh = b[..., 16:48].reshape(E, G, GROUP, nb, 8, 4)  # [.., row, block, v, byte]
    v[..., _QH:_QH + 512] = qh.transpose(0, 1, 3, 4, 2, 5).reshape(E, G, nb, 512)  # [.., block, v, row, byte]
    v[..., _QH + 512:] = g4[..., _QH:]
    return out


def from_groups(a: np.ndarray) -> np.ndarray:
    """groups [E, R/16, nb*2816] -> q5_k rows [E, R, nb*176] (the inverse of to_groups)."""
    a = np.asarray(a)
    E, G, W = a.shape
    nb = W // GB
    v = a.reshape(E, G, nb, GB)
    g4 = np.concatenate([v[..., :_QH], v[..., _QH + 512:]], axis=-1).reshape(E, G, nb * q4_k_x16.GB)
    r4 = q4_k_x16.from_groups(g4).reshape(E, G * GROUP, nb, q4_k.BLOCK_BYTES)
    out = np.empty((E, G * GROUP, nb, q5_k.BLOCK_BYTES), np.uint8)
    out[..., :16], out[..., 48:] = r4[..., :16], r4[..., 16:]
    out[..., 16:48] = v[..., _QH:_QH + 512].reshape(E, G, nb, 8, GROUP, 4).transpose(0, 1, 4, 2, 3, 5).reshape(
        E, G * GROUP, nb, 32)
    return out.reshape(E, G * GROUP, nb * q5_k.BLOCK_BYTES)


def repack(banks) -> dict:
    """q5_k banks (validated) -> q5_k_x16 banks (new arrays). Threads: any (reads the banks, returns new arrays)."""
    return regroup(q5_k.SPEC, to_groups, banks)


def unpack(banks) -> dict:
    """q5_k_x16 banks (validated) -> q5_k banks. Threads: any (reads the banks, returns new arrays)."""
    return regroup(SPEC, from_groups, banks)


class Q5KX16Format(BlockGroups, q5_k.Q5KFormat):
    source = q5_k.SPEC
    group_bytes = GB


SPEC = Q5KX16Format(
    name="q5_k_x16", id=20,
    banks=group_banks(q5_k.QK, GB),
    k_multiple=q5_k.QK,
    input_weight=True,
    aliases=("q5_k_cpu",),
    modes=("w4a8", "native"),
    default_mode="w4a8",
    description="GGUF Q5_K with 16 rows interleaved per 256-block for CPU lanes (q5_k's bytes, moved); "
                "w4a8 = Q5_K x Q8_K (W5A8), native = W5A16",
    kernel_tiers={"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni"),
                  "native": ("scalar", "avx2", "avx512f")},
)
