"""nvfp4_x16: nvfp4 experts with 16 rows interleaved per 16-block, for CPUs (mode w4a8).

The same 9 bytes per row and block (8 packed e2m1 bytes, one e4m3 scale) and 2 per row (fp16 global) as
``nvfp4``, moved so that a CPU kernel holds 16 rows in the 16 lanes of one vector. Per group of 16 rows the
16-blocks come in chunks of 4 (the last chunk holds nb % 4 blocks when that is not 0); a chunk of cb blocks is
cb x 16 e4m3 scales (block i's row r at byte 16 i + r), then cb x 128 code bytes: block i's two 64-byte vectors
at 16 cb + 128 i + 64 j, whose int32 lane r is row r's packed bytes 4j..4j+3. A full chunk is 576 bytes (9 cache
lines): with K % 64 == 0 every vector load is line-aligned. The globals are a bank of their own, 16 per group.
The per-block fold (integer sum to fp32, times the scales, add) is then paid once per 16 rows and token, not once
per (row, token) as in nvfp4's row-major kernels (docs/formats/nvfp4.md "nvfp4_x16").

Banks (slot order; a bank row is a group of 16 weight rows):

| slot | bank | shape | dtype |
|---|---|---|---|
| 0 | gate_up | [E, 2I/16, (H/16) * 144] | uint8 (gate rows 0..I-1, up rows I..2I-1, as nvfp4) |
| 1 | gate_up_global | [E, 2I/16, 16] | float16 |
| 2 | down | [E, H/16, (I/16) * 144] | uint8 |
| 3 | down_global | [E, H/16, 16] | float16 |

``repack(banks)`` turns nvfp4 banks into these, ``unpack(banks)`` back. Math: nvfp4's w4a8 (the same int8
activation codes and scales, exact integer block sums), summed per (row, token) block by block in K order with
a fused multiply-add, ``acc = fma(isum_b, (e4m3(scale_b) / 256) * s_a_b, acc)``, then ``acc * (128 * global)``,
the same in every tier. So results equal nvfp4 w4a8's up to fp32 rounding (nvfp4's kernels group the sums otherwise).
"""
from __future__ import annotations

import numpy as np

from .._arrays import aligned_empty
from ..numerics import E4M3
from ..schema import BankSpec
from . import nvfp4
from ._layout import GROUP, CpuLayout

BLOCK = nvfp4.BLOCK  # K elements per block (one e4m3 scale)
CHUNK = 4  # blocks per chunk
GB = GROUP * (BLOCK // 2 + 1)  # bytes per group and block: 16 scales + 16 x 8 code bytes = 144


def to_groups(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """nvfp4 rows: packed [E, R, K/2], scale [E, R, K/16] (R % 16 == 0) -> groups [E, R/16, (K/16)*144], 64-byte
    aligned."""
    p = np.asarray(packed).view(np.uint8)
    s = np.asarray(scale).view(np.uint8)
    E, R, W = p.shape
    G, nb = R // GROUP, W // 8
    # [e, g, r, b, j, byte] -> [e, g, b, j, r, byte]: block b's 128 code bytes
    codes = p.reshape(E, G, GROUP, nb, 2, 4).transpose(0, 1, 3, 4, 2, 5).reshape(E, G, nb, 128)
    scl = s.reshape(E, G, GROUP, nb).transpose(0, 1, 3, 2)  # [e, g, b, r]
    out = aligned_empty((E, G, nb * GB), np.uint8)
    nc = nb // CHUNK
    full = out[..., :nc * CHUNK * GB].reshape(E, G, nc, CHUNK * GB)
    full[..., :CHUNK * GROUP] = scl[:, :, :nc * CHUNK].reshape(E, G, nc, CHUNK * GROUP)
    full[..., CHUNK * GROUP:] = codes[:, :, :nc * CHUNK].reshape(E, G, nc, CHUNK * 128)
    rem = nb - nc * CHUNK
    if rem:
        tail = out[..., nc * CHUNK * GB:]
        tail[..., :rem * GROUP] = scl[:, :, nc * CHUNK:].reshape(E, G, rem * GROUP)
        tail[..., rem * GROUP:] = codes[:, :, nc * CHUNK:].reshape(E, G, rem * 128)
    return out


def from_groups(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """groups [E, R/16, (K/16)*144] -> nvfp4 rows (packed [E, R, K/2] uint8, scale [E, R, K/16] e4m3), the inverse
    of to_groups."""
    a = np.asarray(a)
    E, G, W = a.shape
    nb = W // GB
    nc, rem = divmod(nb, CHUNK)
    scl = np.empty((E, G, nb, GROUP), np.uint8)
    codes = np.empty((E, G, nb, 128), np.uint8)
    full = a[..., :nc * CHUNK * GB].reshape(E, G, nc, CHUNK * GB)
    scl[:, :, :nc * CHUNK] = full[..., :CHUNK * GROUP].reshape(E, G, nc * CHUNK, GROUP)
    codes[:, :, :nc * CHUNK] = full[..., CHUNK * GROUP:].reshape(E, G, nc * CHUNK, 128)
    if rem:
        tail = a[..., nc * CHUNK * GB:]
        scl[:, :, nc * CHUNK:] = tail[..., :rem * GROUP].reshape(E, G, rem, GROUP)
        codes[:, :, nc * CHUNK:] = tail[..., rem * GROUP:].reshape(E, G, rem, 128)
    packed = codes.reshape(E, G, nb, 2, GROUP, 4).transpose(0, 1, 4, 2, 3, 5).reshape(E, G * GROUP, nb * 8)
    scale = np.ascontiguousarray(scl.transpose(0, 1, 3, 2).reshape(E, G * GROUP, nb)).view(E4M3)
    return np.ascontiguousarray(packed), scale


def globals_to_groups(g: np.ndarray) -> np.ndarray:
    """nvfp4 globals [E, R] fp16 -> [E, R/16, 16] fp16, 64-byte aligned."""
    g = np.asarray(g).view(np.float16)
    out = aligned_empty((g.shape[0], g.shape[1] // GROUP, GROUP), np.float16)
    out[...] = g.reshape(out.shape)
    return out


def repack(banks) -> dict:
    """nvfp4 banks (validated) -> nvfp4_x16 banks (new arrays). Threads: any (reads the banks, returns new arrays)."""
    arrs, _ = nvfp4.SPEC.validate(banks)
    b = dict(zip(nvfp4.SPEC.bank_names, arrs))
    return {"gate_up": to_groups(b["gate_up_packed"], b["gate_up_scale"]),
            "gate_up_global": globals_to_groups(b["gate_up_global"]),
            "down": to_groups(b["down_packed"], b["down_scale"]),
            "down_global": globals_to_groups(b["down_global"])}


def unpack(banks) -> dict:
    """nvfp4_x16 banks (validated) -> nvfp4 banks. Threads: any (reads the banks, returns new arrays)."""
    arrs, _ = SPEC.validate(banks)
    b = dict(zip(SPEC.bank_names, arrs))
    gp, gs = from_groups(b["gate_up"])
    dp, ds = from_groups(b["down"])
    glob = lambda g: np.ascontiguousarray(g.view(np.float16).reshape(g.shape[0], -1))  # noqa: E731
    return {"gate_up_packed": gp, "gate_up_scale": gs, "gate_up_global": glob(b["gate_up_global"]),
            "down_packed": dp, "down_scale": ds, "down_global": glob(b["down_global"])}


class Nvfp4X16Format(CpuLayout, nvfp4.Nvfp4Format):
    source = nvfp4.SPEC

    def dims(self, banks):
        gu, dn = banks["gate_up"], banks["down"]
        if gu.ndim != 3 or dn.ndim != 3:
            raise ValueError(f"nvfp4_x16 banks 'gate_up' and 'down' must be 3-D, got gate_up {gu.shape}, "
                             f"down {dn.shape}")
        if gu.shape[2] % GB or dn.shape[2] % GB:
            raise ValueError(f"nvfp4_x16 bank rows hold {GB}-byte group blocks: gate_up row {gu.shape[2]} bytes, "
                             f"down row {dn.shape[2]} bytes must be multiples of {GB}")
        if gu.shape[1] % 2:
            raise ValueError(f"nvfp4_x16 bank 'gate_up': dim 1 = {gu.shape[1]} must be 2I/16 (even)")
        return gu.shape[0], dn.shape[1] * GROUP, gu.shape[1] * GROUP // 2


    def act_in(self, v, mode):
        if mode != "w4a8":
            raise ValueError(f"nvfp4_x16: unknown mode {mode!r} (it has w4a8 only)")
        return super().act_in(v, mode)


_U8, _F16 = np.uint8, (np.float16, np.uint16)
SPEC = Nvfp4X16Format(
    name="nvfp4_x16", id=9,
    banks=(BankSpec("gate_up", (_U8,), lambda E, H, I: (E, 2 * I // GROUP, H // BLOCK * GB), align=1),
           BankSpec("gate_up_global", _F16, lambda E, H, I: (E, 2 * I // GROUP, GROUP), align=2),
           BankSpec("down", (_U8,), lambda E, H, I: (E, H // GROUP, I // BLOCK * GB), align=1),
           BankSpec("down_global", _F16, lambda E, H, I: (E, H // GROUP, GROUP), align=2)),
    k_multiple=BLOCK,
    input_weight=True,
    modes=("w4a8",),
    default_mode="w4a8",
    description="nvfp4 with 16 rows interleaved per 16-block for CPU lanes (nvfp4's bytes, moved); "
                "w4a8 = e2m1 x int8 per 16",
    kernel_tiers={"w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni", "avx512bf16")},
)
