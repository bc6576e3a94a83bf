"""q6_k_x16: GGUF Q6_K experts with 16 rows interleaved per 256-block, for CPUs (modes w4a8 and native, q6_k's).

The same 210 bytes per row and block as ``q6_k``, moved so that a CPU kernel holds 16 rows in the 16 lanes of one
vector. Per group of 16 rows and per block, 3360 bytes:

| bytes | what |
|---|---|
| 0-31 | the 16 rows' fp16 d (row r at 2r) |
| 32-287 | 16 planes of 16 bytes: plane j byte r = row r's int8 scale sc[j] |
| 288-3359 | per half h and code step v (0..7), at 288 + 1536 h + 192 v: vectors A, B, C of 64 bytes |

Vector A of step v has in its int32 lane r row r's ql[64h + 4v .. +3], B ql[64h + 32 + 4v ..], C qh[32h + 4v ..]:
the four 6-bit codes runs of the step (elements 128h + 32g + 4v ..) are A's low nibbles with C's bits 0-1, B's low
with bits 2-3, A's high with bits 4-5, B's high with bits 6-7. The kernels read a block front to back.

The scales and the per-block fold are paid once per 16 rows and token instead of once per (row, token)
(docs/formats/q6_k.md "q6_k_x16").

Banks (slot order; a bank row is a group of 16 weight rows): gate_up [E, 2I/16, (H/256) * 3360] (gate rows 0..I-1,
up rows I..2I-1, as q6_k), down [E, H/16, (I/256) * 3360], uint8. ``repack(banks)`` turns q6_k banks into these,
``unpack(banks)`` back. Math, the same in every tier: w4a8 q6_k's integer S = sum_j sc[j] sum((q - 32) q_a), folded
per (row, token) block by block in K order as acc = fma(S, d d_a, acc); native per sub-block j s = sum((q - 32) x)
by fmas in element order, acc = fma(s, d sc[j], acc) in K order. Not bit for bit q6_k's (its kernels fold lanes of
partial sums), within its tolerance.
"""
from __future__ import annotations

import numpy as np

from .._arrays import aligned_empty
from . import q6_k
from ._layout import GROUP, BlockGroups, group_banks, regroup

GB = GROUP * q6_k.BLOCK_BYTES  # bytes per group and block: 3360


def to_groups(a: np.ndarray) -> np.ndarray:
    """q6_k rows [E, R, nb*210] (R % 16 == 0) -> groups [E, R/16, nb*3360], 64-byte aligned."""
    a = np.asarray(a)
    E, R, W = a.shape
    nb = W // q6_k.BLOCK_BYTES
    G = R // GROUP
    b = a.reshape(E, G, GROUP, nb, q6_k.BLOCK_BYTES)
    out = aligned_empty((E, G, nb * GB), np.uint8)
    v = out.reshape(E, G, nb, GB)
    v[..., 0:32] = b[..., 208:210].transpose(0, 1, 3, 2, 4).reshape(E, G, nb, 32)
    v[..., 32:288] = b[..., 192:208].transpose(0, 1, 3, 4, 2).reshape(E, G, nb, 256)  # [.., block, j, row]
    ql = b[..., 0:128].reshape(E, G, GROUP, nb, 2, 2, 8, 4)  # [.., row, block, h, A/B, v, byte]
    qh = b[..., 128:192].reshape(E, G, GROUP, nb, 2, 1, 8, 4)  # [.., row, block, h, C, v, byte]
    codes = np.concatenate([ql, qh], axis=5)  # [.., row, block, h, A/B/C, v, byte]
    v[..., 288:] = codes.transpose(0, 1, 3, 4, 6, 5, 2, 7).reshape(E, G, nb, 3072)  # [.., block, h, v, ABC, row, byte]
    return out


def from_groups(a: np.ndarray) -> np.ndarray:
    """groups [E, R/16, nb*3360] -> q6_k rows [E, R, nb*210] (the inverse of to_groups)."""
    a = np.asarray(a)
    E, G, W = a.shape
    nb = W // GB
    v = a.reshape(E, G, nb, GB)
    out = np.empty((E, G, GROUP, nb, q6_k.BLOCK_BYTES), np.uint8)
    out[..., 208:210] = v[..., 0:32].reshape(E, G, nb, GROUP, 2).transpose(0, 1, 3, 2, 4)
    out[..., 192:208] = v[..., 32:288].reshape(E, G, nb, 16, GROUP).transpose(0, 1, 4, 2, 3)
    # [.., block, h, v, ABC, row, byte] -> [.., row, block, h, ABC, v, byte]
    codes = v[..., 288:].reshape(E, G, nb, 2, 8, 3, GROUP, 4).transpose(0, 1, 6, 2, 3, 5, 4, 7)
    out[..., 0:128] = codes[..., 0:2, :, :].reshape(E, G, GROUP, nb, 128)
    out[..., 128:192] = codes[..., 2, :, :].reshape(E, G, GROUP, nb, 64)
    return out.reshape(E, G * GROUP, nb * q6_k.BLOCK_BYTES)


def repack(banks) -> dict:
    """q6_k banks (validated) -> q6_k_x16 banks (new arrays). Threads: any (reads the banks, returns new arrays)."""
    return regroup(q6_k.SPEC, to_groups, banks)


def unpack(banks) -> dict:
    """q6_k_x16 banks (validated) -> q6_k banks. Threads: any (reads the banks, returns new arrays)."""
    return regroup(SPEC, from_groups, banks)


class Q6KX16Format(BlockGroups, q6_k.Q6KFormat):
    source = q6_k.SPEC
    group_bytes = GB


SPEC = Q6KX16Format(
    name="q6_k_x16", id=19,
    banks=group_banks(q6_k.QK, GB),
    k_multiple=q6_k.QK,
    input_weight=True,
    aliases=("q6_k_cpu",),
    modes=("w4a8", "native"),
    default_mode="w4a8",
    description="GGUF Q6_K with 16 rows interleaved per 256-block for CPU lanes (q6_k's bytes, moved); "
                "w4a8 = Q6_K x Q8_K (W6A8), native = W6A16",
    kernel_tiers={"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni"),
                  "native": ("scalar", "avx2", "avx512f")},
)
