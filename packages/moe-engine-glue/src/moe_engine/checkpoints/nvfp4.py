"""ModelOpt NVFP4 checkpoints -> nvfp4 banks.

ModelOpt keeps each expert projection as `weight` [rows, K/2] uint8 (two e2m1 codes a byte, low nibble = even
element), `weight_scale` [rows, K/16] float8_e4m3fn (one scale per 16 elements) and `weight_scale_2` (one fp32 global
per tensor), plus an `input_scale` for its W4A4 activation path, which W4A16 / W4A8 kernels do not use:

    w = e2m1(code) * e4m3(weight_scale) * weight_scale_2

Codes and block scales are copied as they are. The nvfp4 bank keeps a global per output row in fp16, so every row of
a projection gets fp16(weight_scale_2): nearest even, a relative change of at most 2^-11 for a normal fp16 value
(6.1e-5 <= |g| <= 65504), the same factor for every weight of that projection; gate and up keep their own.
`global_rounding_max_rel` in the loader's report is the largest |fp16(g) / g - 1| of the layer (docs/transformers.md).
A global outside fp16's normal range loses more precision and is reported too."""
from __future__ import annotations

import numpy as np

import cpumoe_formats as cf

FP16_MIN_NORMAL, FP16_MAX = 2.0 ** -14, 65504.0


def _u8(t, shape: tuple, what: str) -> np.ndarray:
    import torch

    if t.dtype not in (torch.uint8, torch.int8, torch.float8_e4m3fn):
        raise TypeError(f"{what}: dtype {t.dtype}, expected uint8 codes (or float8_e4m3fn scales)")
    a = t.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    if a.shape != shape:
        raise ValueError(f"{what}: shape {a.shape}, expected {shape}")
    return a


def _global(t, what: str) -> tuple[np.float16, float, bool]:
    g = float(t.detach().to("cpu").float().reshape(-1)[0])
    if t.numel() != 1:
        raise ValueError(f"{what}: {t.numel()} values, expected one per-tensor global (weight_scale_2)")
    h = np.float16(g)
    rel = abs(float(h) - g) / abs(g) if g else 0.0
    return h, rel, not (FP16_MIN_NORMAL <= abs(g) <= FP16_MAX)


class _Builder:
    def __init__(self, E: int, H: int, I: int):  # noqa: E741
        self.H, self.I = H, I
        e4m3 = cf.numerics.E4M3
        self.b = {"gate_up_packed": cf.aligned_empty((E, 2 * I, H // 2), np.uint8, 64),
                  "gate_up_scale": cf.aligned_empty((E, 2 * I, H // 16), e4m3, 64),
                  "gate_up_global": cf.aligned_empty((E, 2 * I), np.float16, 64),
                  "down_packed": cf.aligned_empty((E, H, I // 2), np.uint8, 64),
                  "down_scale": cf.aligned_empty((E, H, I // 16), e4m3, 64),
                  "down_global": cf.aligned_empty((E, H), np.float16, 64)}
        self.dev, self.out_of_range = 0.0, 0

    def put(self, e: int, proj: str, rows: slice, weight, scale, scale_2, what: str) -> None:
        R = rows.stop - rows.start
        K = self.H if proj == "gate_up" else self.I
        self.b[f"{proj}_packed"][e, rows] = _u8(weight, (R, K // 2), f"{what}.weight")
        self.b[f"{proj}_scale"][e, rows] = _u8(scale, (R, K // 16), f"{what}.weight_scale").view(cf.numerics.E4M3)
        g, rel, odd = _global(scale_2, f"{what}.weight_scale_2")
        self.b[f"{proj}_global"][e, rows] = g
        self.dev = max(self.dev, rel)
        self.out_of_range += odd

    def done(self) -> tuple[dict, dict]:
        cf.get_format("nvfp4").validate(self.b)
        return self.b, {"global_rounding_max_rel": self.dev, "exact": self.dev == 0.0,
                        "globals_outside_fp16_normal": self.out_of_range}


def load_layer(store, names, E: int, H: int, I: int, progress=None) -> tuple[dict, dict]:  # noqa: E741
    """One decoder layer's experts from per-expert ModelOpt tensors (gate_proj, up_proj, down_proj)."""
    if names.gate is None:
        raise KeyError(f"layer {names.layer}: ModelOpt NVFP4 experts are stored per expert "
                       "('...experts.{e}.gate_proj.weight' + weight_scale + weight_scale_2), found fused names")
    b = _Builder(E, H, I)
    for e in range(E):
        for proj, rows, name in (("gate_up", slice(0, I), names.gate[e]), ("gate_up", slice(I, 2 * I), names.up[e]),
                                 ("down", slice(0, H), names.down[e])):
            b.put(e, proj, rows, store.get(name + ".weight"), store.get(name + ".weight_scale"),
                  store.get(name + ".weight_scale_2"), name)
        if progress is not None:
            progress(1)
    return b.done()
