"""bf16 experts: gate_up [E, 2I, H] and down [E, H, I], bf16, row-major.

gate_up rows 0..I-1 are gate, I..2I-1 up. Any H, I (ragged tails are scalar).
Activations are consumed as bf16 values; accumulation is fp32.
"""
from __future__ import annotations

import numpy as np

from ..numerics import BF16, bf16_decode, to_bf16
from ..schema import BankSpec, FormatSpec


class Bf16Format(FormatSpec):
    def dims(self, banks):
        gu, dn = banks["gate_up"], banks["down"]
        if gu.ndim != 3 or dn.ndim != 3:
            raise ValueError(f"bf16 banks must be 3-D, got gate_up {gu.shape}, down {dn.shape}")
        if gu.shape[1] % 2:
            raise ValueError(f"bf16 bank 'gate_up': dim 1 = {gu.shape[1]} must be 2*I (even)")
        return gu.shape[0], gu.shape[2], gu.shape[1] // 2

    def quantize(self, gate_up, down, **opts):
        if opts:
            raise TypeError(f"bf16 quantize takes no options, got {sorted(opts)}")
        return {"gate_up": to_bf16(gate_up), "down": to_bf16(down)}

    def random_banks(self, E, H, I, rng):  # noqa: E741
        def rand(shape):  # N(0, 0.02) truncated to bf16 bits (fast; exact bf16 values)
            f = rng.standard_normal(shape, np.float32) * np.float32(0.02)
            return (f.view(np.uint32) >> 16).astype(np.uint16).view(BF16)
        return {"gate_up": rand((E, 2 * I, H)), "down": rand((E, H, I))}

    def dequantize(self, banks):
        return bf16_decode(banks["gate_up"]), bf16_decode(banks["down"])


SPEC = Bf16Format(
    name="bf16", id=0,
    banks=(BankSpec("gate_up", (BF16, np.uint16), lambda E, H, I: (E, 2 * I, H), align=2),
           BankSpec("down", (BF16, np.uint16), lambda E, H, I: (E, H, I), align=2)),
    description="bf16 weights, fp32 accumulation (W16A16)",
    kernel_tiers={"native": ("scalar", "avx2", "avx512f", "avx512bf16", "amx")},
    cpu_layout="bf16_x16",  # 16 rows per K pair: a token sharing an expert costs one vdpbf16ps per 32 weights
    # from avx512f (Skylake-SP to Ice Lake; the H200 host capped there: shared batch 8 751-844 against 1457-1532
    # us); AVX2 keeps bf16 (Zen 3: batch 1 ~5% slower); AMX CPUs keep bf16's tile kernel (a higher tier)
    cpu_layout_min_tier="avx512f",
)
