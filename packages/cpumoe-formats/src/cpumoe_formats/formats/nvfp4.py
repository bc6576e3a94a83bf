"""nvfp4 experts (ModelOpt native rows), format id 1.

Banks in slot order: gate_up_packed [E, 2I, H/2] uint8, gate_up_scale [E, 2I, H/16]
e4m3fn, gate_up_global [E, 2I] fp16, down_packed [E, H, I/2] uint8, down_scale
[E, H, I/16] e4m3fn, down_global [E, H] fp16. gate_up rows 0..I-1 gate, I..2I-1 up.
Two e2m1 codes per byte, low nibble = even K element.

    w[r, k] = E2M1[code] * e4m3(scale[r, k // 16]) * fp16(global[r])

e4m3 codes 0x7F/0xFF decode to +-480 (no NaN). Globals are per output row, not
folded into the block scales.

Modes: "native" (W4A16: activations are consumed as their exact bf16 values) and
"w4a8" (activations quantized per 16-element block to int8: s = amax / 127 in fp32,
1 if amax == 0; q = clamp(rint(v * (1 / s)), -127, 127); a block holding a NaN or an
inf gets s = NaN; act_in reproduces it bit-exactly).
"""
from __future__ import annotations

import numpy as np

from ..numerics import (
    E2M1_TABLE,
    E4M3,
    codes,
    e4m3_decode,
    fp16_decode,
    pack_nibbles,
    to_e2m1_codes,
    to_e4m3,
    unpack_nibbles,
)
from ..schema import BankSpec, FormatSpec

BLOCK = 16
_F6X448 = 6.0 * 448.0


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """[..., K/2] packed bytes -> [..., K] 4-bit codes (low nibble = even element)."""
    lo, hi = unpack_nibbles(codes(packed))
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = lo
    out[..., 1::2] = hi
    return out


def pack_codes(c: np.ndarray) -> np.ndarray:
    """[..., K] 4-bit codes -> [..., K/2] bytes (low nibble = even element)."""
    return pack_nibbles(c[..., 0::2], c[..., 1::2])


def quantize_w4a8_act(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's w4a8 activation quantization, bit-exact in numpy float32.

    v [..., K] (bf16 values) -> (q [..., K] int8 as float32, s [..., K/16] float32). A block holding a NaN or an
    inf: s = NaN and q = 0 (its products are NaN)."""
    x = np.asarray(v, np.float32).reshape(v.shape[:-1] + (-1, BLOCK))
    bad = ~np.isfinite(x).all(axis=-1)
    x = np.where(bad[..., None], np.float32(0), x)
    amax = np.abs(x).max(axis=-1)
    s = np.where(amax == 0, np.float32(1), amax / np.float32(127)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        inv = (np.float32(1) / s).astype(np.float32)
        q = np.rint((x * inv[..., None]).astype(np.float32))
    q = np.where(np.isnan(q), np.float32(0), np.clip(q, -127, 127)).astype(np.float32)
    return q.reshape(v.shape), np.where(bad, np.float32(np.nan), s).astype(np.float32)


class Nvfp4Format(FormatSpec):
    def dims(self, banks):
        gu, dn = banks["gate_up_packed"], banks["down_packed"]
        if gu.ndim != 3 or dn.ndim != 3:
            raise ValueError(f"nvfp4 packed banks must be 3-D, got gate_up_packed {gu.shape}, down_packed {dn.shape}")
        if gu.shape[1] % 2:
            raise ValueError(f"nvfp4 bank 'gate_up_packed': dim 1 = {gu.shape[1]} must be 2*I (even)")
        return gu.shape[0], gu.shape[2] * 2, gu.shape[1] // 2

    # ---- quantizer ---------------------------------------------------------------
    @staticmethod
    def _quant(w: np.ndarray):
        """[E, R, K] float -> (packed, scale e4m3, global fp16)."""
        w = np.asarray(w, np.float64)
        E, R, K = w.shape
        amax = np.abs(w).max(axis=-1)
        glob = (np.where(amax == 0, 1.0, amax) / _F6X448).astype(np.float16)
        # a row so small that its global underflows fp16 gets the smallest subnormal
        glob = np.where(glob == 0, np.float16(2.0**-24), glob).astype(np.float16)
        g = glob.astype(np.float64)[..., None, None]
        wb = w.reshape(E, R, K // BLOCK, BLOCK)
        bmax = np.abs(wb).max(axis=-1, keepdims=True)
        scale = to_e4m3(bmax / (6.0 * g))
        sv = e4m3_decode(scale) * g
        with np.errstate(divide="ignore", invalid="ignore"):
            c = to_e2m1_codes(np.where(sv > 0, wb / np.where(sv > 0, sv, 1.0), 0.0))
        return pack_codes(c.reshape(E, R, K)), scale.reshape(E, R, K // BLOCK), glob

    def quantize(self, gate_up, down, **opts):
        if opts:
            raise TypeError(f"nvfp4 quantize takes no options, got {sorted(opts)}")
        gp, gs, gg = self._quant(gate_up)
        dp, ds, dg = self._quant(down)
        return {"gate_up_packed": gp, "gate_up_scale": gs, "gate_up_global": gg,
                "down_packed": dp, "down_scale": ds, "down_global": dg}

    def random_banks(self, E, H, I, rng):  # noqa: E741
        def bank(R, K):
            packed = rng.integers(0, 256, size=(E, R, K // 2), dtype=np.uint8)
            scale = rng.integers(0x30, 0x3D, size=(E, R, K // BLOCK), dtype=np.uint8).view(E4M3)  # 0.5 .. 1.5
            glob = (rng.random((E, R), dtype=np.float32) * 0.004 + 0.008).astype(np.float16)  # weights ~0.02 rms
            return packed, scale, glob

        gp, gs, gg = bank(2 * I, H)
        dp, ds, dg = bank(H, I)
        return {"gate_up_packed": gp, "gate_up_scale": gs, "gate_up_global": gg,
                "down_packed": dp, "down_scale": ds, "down_global": dg}

    # ---- float64 decode -------------------------------------------------------------
    @staticmethod
    def _deq(packed, scale, glob) -> np.ndarray:
        w = E2M1_TABLE[unpack_codes(packed)]
        E, R, K = w.shape
        s = e4m3_decode(scale).reshape(E, R, K // BLOCK, 1)
        return (w.reshape(E, R, K // BLOCK, BLOCK) * s).reshape(E, R, K) * fp16_decode(glob)[..., None]

    def dequantize(self, banks):
        return (self._deq(banks["gate_up_packed"], banks["gate_up_scale"], banks["gate_up_global"]),
                self._deq(banks["down_packed"], banks["down_scale"], banks["down_global"]))

    def act_in(self, v, mode):
        if mode == "native":
            return np.asarray(v, np.float64)
        if mode == "w4a8":
            q, s = quantize_w4a8_act(v)
            v = np.asarray(v)
            return (q.astype(np.float64).reshape(v.shape[:-1] + (-1, BLOCK))
                    * s.astype(np.float64)[..., None]).reshape(v.shape)
        raise ValueError(f"nvfp4: unknown mode {mode!r}")


_U8 = np.uint8
SPEC = Nvfp4Format(
    name="nvfp4", id=1,
    banks=(BankSpec("gate_up_packed", (_U8,), lambda E, H, I: (E, 2 * I, H // 2), align=1),
           BankSpec("gate_up_scale", (E4M3, _U8), lambda E, H, I: (E, 2 * I, H // BLOCK), align=1),
           BankSpec("gate_up_global", (np.float16, np.uint16), lambda E, H, I: (E, 2 * I), align=2),
           BankSpec("down_packed", (_U8,), lambda E, H, I: (E, H, I // 2), align=1),
           BankSpec("down_scale", (E4M3, _U8), lambda E, H, I: (E, H, I // BLOCK), align=1),
           BankSpec("down_global", (np.float16, np.uint16), lambda E, H, I: (E, H), align=2)),
    k_multiple=16,
    input_weight=True,
    modes=("native", "w4a8"),
    default_mode="native",
    description="e2m1 weights, e4m3 scale per 16, fp16 global per row (W4A16, or W4A8 int8 activations)",
    kernel_tiers={"native": ("scalar", "avx2", "avx512f"),
                  "w4a8": ("scalar", "avx2", "avxvnni", "avx512vnni")},
    # w4a8 only (nvfp4_x16 has no native mode): 16 rows per vector, batches sharing experts ~2x cheaper
    # (docs/formats/nvfp4.md "nvfp4_x16")
    cpu_layout="nvfp4_x16",
    # from avx2: nvfp4_x16's avx2 kernel runs shared batch 8 in 2201-2213 against 3173-3256 us (2 Zen 3 cores)
    cpu_layout_min_tier="avx2",
)
