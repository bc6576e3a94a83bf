"""mxfp4 experts (gpt-oss / Triton "mxfp4_triton"): transposed split-K, N innermost.

Banks (native slot order):

| slot | bank | shape | dtype |
|---|---|---|---|
| 0 | gate_up_blocks | [E, H/2, 2I] | uint8 (two e2m1 codes) |
| 1 | gate_up_scales | [E, H/32, 2I] | uint8 or float8_e8m0fnu |
| 2 | gate_up_bias | [E, 2I] | bfloat16 (or uint16 bits) |
| 3 | down_blocks | [E, I/2, H] | uint8 |
| 4 | down_scales | [E, I/32, H] | uint8 or float8_e8m0fnu |
| 5 | down_bias | [E, H] | bfloat16 (or uint16 bits) |

Blocks row kb holds K-pair kb for every output column: low nibble = K element
2kb, high nibble = 2kb+1. Scales row kb/16 (K/32) covers 32 K per column.
gate/up are INTERLEAVED by column: column 2j is gate row j, 2j+1 is up row j
(biases likewise). w = E2M1[code] * 2^(min(s, 254) - 127); s = 0 is exactly
2^-127. The router weight is always applied on the output; the down bias is
added once per route (times the route's weight).

`dequantize`/`biases` return the LOGICAL layout the generic reference uses:
gate_up [E, 2I, H] gate rows then up rows, down [E, H, I].

Modes:

* ``native`` (default, W4A16): bf16 activations in fp32, weights decoded exactly, fp32 accumulation.
* ``w4a8``: every activation vector (x, and each g row) is quantized per 32-K block (the e8m0 scale
  block) to int8 in fp32: ``s_b = amax / 127``, ``id = 1 / s_b`` (0 where not finite: amax == 0, or
  1/s_b overflows, so the block contributes 0), ``q = clamp(rint(x * id), -127, 127)`` (half to
  even); the q4_0 Q8_0 rule. Per group and column the kernel takes the exact integer
  ``S = sum(2 * E2M1[code] * q)`` and adds ``(float)S * ((e8m0 * 0.5f) * s_b)`` in fp32 (every tier
  bit-identical: scalar, avx2, avxvnni, avx512f, avx512vnni). ``act_in`` reproduces the quantization
  bit-exactly (``w8_quantize``).
"""
from __future__ import annotations

import numpy as np

from .._arrays import aligned_copy, aligned_empty
from ..numerics import (
    BF16,
    E2M1_TABLE,
    E8M0,
    E8M0_TABLE,
    bf16_decode,
    codes,
    e8m0_for,
    int8_blocks,
    to_bf16,
    to_e2m1_codes,
)
from ..schema import BankSpec, FormatSpec

_BLOCK = 32  # K elements per scale
_QMAX = 6.0  # largest e2m1 magnitude


def _interleave(a: np.ndarray, axis: int) -> np.ndarray:
    """Logical gate-then-up along `axis` (length 2I) -> interleaved (2j gate, 2j+1 up)."""
    a = np.moveaxis(a, axis, -1)
    n = a.shape[-1] // 2
    out = np.empty_like(a)
    out[..., 0::2] = a[..., :n]
    out[..., 1::2] = a[..., n:]
    return np.moveaxis(out, -1, axis)


def _deinterleave(a: np.ndarray, axis: int) -> np.ndarray:
    """Interleaved columns -> logical gate rows then up rows along `axis`."""
    a = np.moveaxis(a, axis, -1)
    out = np.concatenate([a[..., 0::2], a[..., 1::2]], axis=-1)
    return np.moveaxis(out, -1, axis)


def _quantize_t(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [E, N, K] float (rows = output columns) -> (blocks [E, K/2, N], scales [E, K/32, N]) uint8."""
    E, N, K = w.shape
    wb = np.asarray(w, np.float64).reshape(E, N, K // _BLOCK, _BLOCK)
    s = e8m0_for(np.abs(wb).max(axis=-1), _QMAX)  # [E, N, K/32]
    q = to_e2m1_codes(wb / E8M0_TABLE[s][..., None]).reshape(E, N, K)
    blocks = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).astype(np.uint8)  # [E, N, K/2]
    return aligned_copy(blocks.transpose(0, 2, 1)), aligned_copy(s.transpose(0, 2, 1))


def _dequantize_t(blocks: np.ndarray, scales: np.ndarray, deinterleave: bool = False) -> np.ndarray:
    """(blocks [E, K/2, N], scales [E, K/32, N]) -> float64 [E, N, K], exact; one expert at a time.
    deinterleave: output rows are columns 0, 2, 4, ... then 1, 3, 5, ... (gate rows then up rows)."""
    b, s = codes(blocks), codes(scales)
    E, KP, N = b.shape
    order = np.concatenate([np.arange(0, N, 2), np.arange(1, N, 2)]) if deinterleave else np.arange(N)
    out = np.empty((E, N, 2 * KP), np.float64)
    for e in range(E):
        bt = np.ascontiguousarray(b[e].T[order])  # [N, K/2] codes, rows in output order
        w = out[e].reshape(N, KP, 2)
        w[:, :, 0] = E2M1_TABLE[bt & 0xF]  # K element 2 kb
        w[:, :, 1] = E2M1_TABLE[bt >> 4]  # K element 2 kb + 1
        out[e].reshape(N, KP // 16, 32)[...] *= E8M0_TABLE[s[e].T[order]][:, :, None]
    return out


def w8_quantize(v) -> tuple[np.ndarray, np.ndarray]:
    """The w4a8 activation quantization (numerics.int8_blocks, shared with the other 32-block mode)."""
    return int8_blocks(v, 32)


class Mxfp4Format(FormatSpec):
    def dims(self, banks):
        gu, dn = banks["gate_up_blocks"], banks["down_blocks"]
        if gu.ndim != 3 or dn.ndim != 3:
            raise ValueError(f"mxfp4 blocks must be 3-D, got gate_up_blocks {gu.shape}, down_blocks {dn.shape}")
        if gu.shape[2] % 2:
            raise ValueError(f"mxfp4 bank 'gate_up_blocks': dim 2 = {gu.shape[2]} must be 2*I (even)")
        return gu.shape[0], 2 * gu.shape[1], gu.shape[2] // 2

    def quantize(self, gate_up, down, gate_up_bias=None, down_bias=None, **opts):
        """gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I] float; optional biases
        gate_up_bias [E, 2I] (gate then up) and down_bias [E, H] (default zeros, stored bf16).

        Per 32-K block per output column: scale = smallest power of two with amax/scale <= 6,
        codes = e2m1 round-to-nearest-even of w/scale."""
        if opts:
            raise TypeError(f"mxfp4 quantize takes only gate_up_bias= and down_bias=, got {sorted(opts)}")
        gu = np.asarray(gate_up, np.float32)
        dn = np.asarray(down, np.float32)
        E, I2, H = gu.shape
        gub = np.zeros((E, I2), np.float32) if gate_up_bias is None else np.asarray(gate_up_bias, np.float32)
        dnb = np.zeros((E, H), np.float32) if down_bias is None else np.asarray(down_bias, np.float32)
        if gub.shape != (E, I2):
            raise ValueError(f"gate_up_bias: shape {gub.shape}, expected {(E, I2)}")
        if dnb.shape != (E, H):
            raise ValueError(f"down_bias: shape {dnb.shape}, expected {(E, H)}")
        gub_b, gus_b = _quantize_t(_interleave(gu, 1))
        dnb_b, dns_b = _quantize_t(dn)
        return {"gate_up_blocks": gub_b, "gate_up_scales": gus_b,
                "gate_up_bias": aligned_copy(to_bf16(_interleave(gub, 1))),
                "down_blocks": dnb_b, "down_scales": dns_b, "down_bias": aligned_copy(to_bf16(dnb))}

    def random_banks(self, E, H, I, rng):  # noqa: E741
        """Random codes (every byte value), scales 2^-8..2^-6 (weights ~0.02 rms), biases 0.01*randn, in the
        schema's shapes (so mxfp4_panel, which only reshapes the banks, inherits it)."""
        out = {}
        for b in self.banks:
            shape = b.expected(E, H, I)
            if b.name.endswith("_bias"):
                out[b.name] = aligned_copy((rng.standard_normal(shape, np.float32) * 0.01).astype(BF16))
                continue
            lo, hi = (119, 122) if b.name.endswith("_scales") else (0, 256)
            out[b.name] = aligned_empty(shape, np.uint8)
            out[b.name][...] = rng.integers(lo, hi, size=shape, dtype=np.uint8)
        return out

    def dequantize(self, banks):
        gu = _dequantize_t(banks["gate_up_blocks"], banks["gate_up_scales"], deinterleave=True)  # [E, 2I, H]
        dn = _dequantize_t(banks["down_blocks"], banks["down_scales"])  # [E, H, I]
        return gu, dn

    def act_in(self, v, mode):
        v = np.asarray(v, np.float64)
        if mode == "native":
            return v
        if mode != "w4a8":
            raise ValueError(f"mxfp4: unknown mode {mode!r}")
        q, d = w8_quantize(v)
        return (q.astype(np.float64) * d.astype(np.float64)[:, None]).reshape(v.shape)

    def biases(self, banks):
        return _deinterleave(bf16_decode(banks["gate_up_bias"]), 1), bf16_decode(banks["down_bias"])


SPEC = Mxfp4Format(
    name="mxfp4", id=2,
    banks=(BankSpec("gate_up_blocks", (np.uint8,), lambda E, H, I: (E, H // 2, 2 * I), align=1),
           BankSpec("gate_up_scales", (np.uint8, E8M0), lambda E, H, I: (E, H // 32, 2 * I), align=1),
           BankSpec("gate_up_bias", (BF16, np.uint16), lambda E, H, I: (E, 2 * I), align=2),
           BankSpec("down_blocks", (np.uint8,), lambda E, H, I: (E, I // 2, H), align=1),
           BankSpec("down_scales", (np.uint8, E8M0), lambda E, H, I: (E, I // 32, H), align=1),
           BankSpec("down_bias", (BF16, np.uint16), lambda E, H, I: (E, H), align=2)),
    k_multiple=32,
    input_weight=False,
    aliases=("mxfp4_triton",),
    hint="the Triton layout reads 64 bytes of every N-byte row per CPU work item; "
         "cpumoe_formats.repack_mxfp4_panels(banks) (or CpuMoeExecutor's default repack=None) gives format "
         "'mxfp4_panel', bit-identical; measured "
         "1.03-1.29x faster on 16 Xeon threads, 1.65-2.08x on 1-2 Zen 3 threads (docs/formats/mxfp4.md)",
    cpu_layout="mxfp4_panel",
    description="gpt-oss mxfp4 (e2m1 + e8m0 per 32 K), transposed split-K, interleaved gate/up, biases "
                "(native W4A16; w4a8 = int8 activations per 32 K)",
    modes=("native", "w4a8"),
    kernel_tiers={"native": ("scalar", "avx2", "avx512f"),
                  "w4a8": ("scalar", "avx2", "avxvnni", "avx512f", "avx512vnni")},
)
