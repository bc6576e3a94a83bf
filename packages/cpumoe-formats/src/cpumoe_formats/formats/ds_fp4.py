"""ds_fp4 experts (DeepSeek-V4-Flash), format id 3.

Banks in slot order: gate_up_packed [E, 2I, H/2] uint8, gate_up_scale [E, 2I, H/32]
e8m0 (float8_e8m0fnu or uint8), down_packed [E, H, I/2] uint8, down_scale
[E, H, I/32] e8m0. No global, no bias. gate_up rows 0..I-1 gate, I..2I-1 up; two
e2m1 codes per byte, low nibble = even K element. H and I are multiples of 128.

    w[r, k] = E2M1[code] * 2^(min(s, 254) - 127)      (s = 0 gives 2^-127)

Activations: x (before gate_up) and g (before down) go through DeepSeek-V4's FP8
round trip per 128-element block (act_quant_roundtrip, reproduced bit-exactly by the
kernels' prep). gate and up are rounded to bf16 before the activation, and each
route's down term is rounded to bf16 before the fp32 sum over routes. The router
weight is always applied on the output (apply_router_weight_on_input unsupported).
DeepSeek-V4 uses activation "swiglu_clamp" with alpha=1, limit=10.

Modes:

* ``native`` (default): the kernels consume exactly the FP8-round-tripped activations (exact integer
  products through three int8 pieces per element on the SIMD tiers).
* ``w4a8``: the FP8-round-tripped activation is then quantized per 32 elements (the weight scale
  block) to int8 by the Q8_0 rule (``numerics.int8_blocks``: ``s_b = amax / 127``, ``q = rint(v / s_b)``
  clamped to +-127, half to even; q4_0 and mxfp4 use the same), so a dot is one int8 product per
  element instead of three. Lossy relative to native in the way llama.cpp's Q8_0 activations are;
  ``act_in(v, "w4a8")`` reproduces the kernels' int8 values bit for bit. Per 8 elements the kernels take
  the exact integer ``t = sum(2 E2M1 * q)`` and add ``((float)t * (0.5 s_b)) * 2^(s - 127)`` in fp32 (fused
  multiply-add on the SIMD tiers).
"""
from __future__ import annotations

import numpy as np

from ..numerics import (
    BF16,
    E2M1_TABLE,
    E4M3,
    E8M0,
    codes,
    e8m0_decode,
    e8m0_for,
    int8_blocks,
    pack_nibbles,
    to_e2m1_codes,
    unpack_nibbles,
)
from ..schema import BankSpec, FormatSpec

BLOCK = 32  # weight scale block
ACT_BLOCK = 128  # activation round-trip block


def act_quant_roundtrip(v: np.ndarray) -> np.ndarray:
    """DeepSeek-V4 act_quant then dequant, per 128-element block, in numpy float32.

    amax = max(1e-4, max|v|); s = 2^ceil(log2(amax / 448)) from the IEEE bits of the
    fp32 quotient; q = e4m3_rne(clamp(v * (1 / s), +-448)); result bf16(q * s). A block holding
    a NaN or an inf comes out NaN (s = NaN: the kernels' prep).
    v [..., K] (K % 128 == 0, bf16 values) -> float64 [..., K]."""
    v = np.asarray(v)
    x = np.asarray(v, np.float32).reshape(v.shape[:-1] + (-1, ACT_BLOCK))
    bad = ~np.isfinite(x).all(axis=-1)
    x = np.where(bad[..., None], np.float32(0), x)
    amax = np.maximum(np.float32(1e-4), np.abs(x).max(axis=-1)).astype(np.float32)
    r = (amax / np.float32(448)).astype(np.float32)
    u = r.view(np.uint32)
    ce = ((u >> 23) & 0xFF).astype(np.int64) - 127 + ((u & 0x7FFFFF) != 0)
    s = ((ce + 127).astype(np.uint32) << 23).view(np.float32)
    inv = (np.float32(1) / s).astype(np.float32)
    q = np.clip((x * inv[..., None]).astype(np.float32), np.float32(-448), np.float32(448))
    q8 = q.astype(E4M3).astype(np.float32)  # round to nearest even (ml_dtypes)
    s = np.where(bad, np.float32(np.nan), s).astype(np.float32)
    out = (q8 * s[..., None]).astype(np.float32).astype(BF16)
    return out.astype(np.float64).reshape(v.shape)


def _unpack(packed: np.ndarray) -> np.ndarray:
    lo, hi = unpack_nibbles(codes(packed))
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = lo
    out[..., 1::2] = hi
    return out


class DsFp4Format(FormatSpec):
    def dims(self, banks):
        gu, dn = banks["gate_up_packed"], banks["down_packed"]
        if gu.ndim != 3 or dn.ndim != 3:
            raise ValueError(f"ds_fp4 packed banks must be 3-D, got gate_up_packed {gu.shape}, "
                             f"down_packed {dn.shape}")
        if gu.shape[1] % 2:
            raise ValueError(f"ds_fp4 bank 'gate_up_packed': dim 1 = {gu.shape[1]} must be 2*I (even)")
        return gu.shape[0], gu.shape[2] * 2, gu.shape[1] // 2

    # ---- quantizer ---------------------------------------------------------------
    @staticmethod
    def _quant(w: np.ndarray):
        """[E, R, K] float -> (packed, e8m0 scale): per 32-block the smallest power of two
        s with amax / s <= 6, codes = e2m1 RNE of w / s."""
        w = np.asarray(w, np.float64)
        E, R, K = w.shape
        wb = w.reshape(E, R, K // BLOCK, BLOCK)
        sc = e8m0_for(np.abs(wb).max(axis=-1), 6.0)
        c = to_e2m1_codes(wb / e8m0_decode(sc)[..., None]).reshape(E, R, K)
        return pack_nibbles(c[..., 0::2], c[..., 1::2]), sc.view(E8M0)

    def quantize(self, gate_up, down, **opts):
        if opts:
            raise TypeError(f"ds_fp4 quantize takes no options, got {sorted(opts)}")
        gp, gs = self._quant(gate_up)
        dp, ds = self._quant(down)
        return {"gate_up_packed": gp, "gate_up_scale": gs, "down_packed": dp, "down_scale": ds}

    def random_banks(self, E, H, I, rng):  # noqa: E741
        def bank(R, K):
            packed = rng.integers(0, 256, size=(E, R, K // 2), dtype=np.uint8)
            scale = rng.integers(119, 122, size=(E, R, K // BLOCK), dtype=np.uint8).view(E8M0)  # 2^-8 .. 2^-6
            return packed, scale

        gp, gs = bank(2 * I, H)
        dp, ds = bank(H, I)
        return {"gate_up_packed": gp, "gate_up_scale": gs, "down_packed": dp, "down_scale": ds}

    # ---- float64 decode -------------------------------------------------------------
    @staticmethod
    def _deq(packed, scale) -> np.ndarray:
        w = E2M1_TABLE[_unpack(packed)]
        E, R, K = w.shape
        s = e8m0_decode(scale).reshape(E, R, K // BLOCK, 1)
        return (w.reshape(E, R, K // BLOCK, BLOCK) * s).reshape(E, R, K)

    def dequantize(self, banks):
        return (self._deq(banks["gate_up_packed"], banks["gate_up_scale"]),
                self._deq(banks["down_packed"], banks["down_scale"]))

    def act_in(self, v, mode):
        if mode == "native":
            return act_quant_roundtrip(v)
        if mode != "w4a8":
            raise ValueError(f"ds_fp4: unknown mode {mode!r}")
        v = act_quant_roundtrip(v)
        q, d = int8_blocks(v, BLOCK)
        return (q.astype(np.float64) * d.astype(np.float64)[:, None]).reshape(v.shape)


_U8 = np.uint8
SPEC = DsFp4Format(
    name="ds_fp4", id=3,
    banks=(BankSpec("gate_up_packed", (_U8,), lambda E, H, I: (E, 2 * I, H // 2), align=1),
           BankSpec("gate_up_scale", (E8M0, _U8), lambda E, H, I: (E, 2 * I, H // BLOCK), align=1),
           BankSpec("down_packed", (_U8,), lambda E, H, I: (E, H, I // 2), align=1),
           BankSpec("down_scale", (E8M0, _U8), lambda E, H, I: (E, H, I // BLOCK), align=1)),
    k_multiple=128,
    input_weight=False,
    modes=("native", "w4a8"),
    default_mode="native",
    round_gate_up=True,
    round_route_term=True,
    description="e2m1 weights, e8m0 scale per 32; FP8 round trip of activations per 128 (DeepSeek-V4-Flash)",
    kernel_tiers={"native": ("scalar", "avx2", "avx512f"), "w4a8": ("scalar", "avx2", "avx512f", "avx512vnni")},
    # 16 rows per vector (w4a8 only): the per-block fold once per 16 rows and token (docs/formats/ds_fp4.md
    # "ds_fp4_x16"); native runs stay ds_fp4 (the layout has no native mode)
    cpu_layout="ds_fp4_x16",
    # from avx2: ds_fp4_x16's avx2 kernel runs shared batch 8 in 10425-10568 against 15109-15159 us (2 Zen 3 cores);
    # an AVX512-F CPU without VNNI keeps ds_fp4's avx512f kernel (the layout has none)
    cpu_layout_min_tier="avx2",
)
