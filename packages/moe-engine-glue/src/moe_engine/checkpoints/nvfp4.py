"""ModelOpt NVFP4 checkpoints -> nvfp4 banks.

ModelOpt keeps each expert projection as `weight` [rows, K/2] uint8 (two e2m1 codes a byte, low nibble = even
element), `weight_scale` [rows, K/16] float8_e4m3fn (one scale per 16 elements) and `weight_scale_2` (one fp32 global
per tensor), plus an `input_scale` for its W4A4 activation path, which W4A16 / W4A8 kernels do not use:

    w = e2m1(code) * e4m3(weight_scale) * weight_scale_2

Codes and block scales are copied as they are. The nvfp4 bank keeps a global per output row in fp16, so every row of
a projection gets fp16(weight_scale_2): nearest even, a relative change of at most 2^-11 for a normal fp16 value
(6.1e-5 <= |g| <= 65504), the same factor for every weight of that projection; gate and up keep their own.
`global_rounding_max_rel` in the loader's report is the largest |fp16(g) / g - 1| of the layer (docs/transformers.md).
A global outside fp16's normal range loses more precision and is reported too. Dtypes and shapes are checked before
any byte is viewed; e4m3 block scales (NaN code 0x7F / 0xFF) and globals are scanned for NaN / Inf (validation.py)."""
from __future__ import annotations

import numpy as np

import cpumoe_formats as cf

from .validation import bad_e4m3, bad_float, refuse_nonfinite

FP16_MIN_NORMAL, FP16_MAX = 2.0 ** -14, 65504.0
DTYPES = {".weight": ("U8",), ".weight_scale": ("F8_E4M3",), ".weight_scale_2": ("F32", "BF16", "F16")}


def _u8(t) -> np.ndarray:
    import torch

    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy()


def _global(t) -> tuple[np.float16, float, bool]:
    g = float(t.detach().to("cpu").float().reshape(-1)[0])
    h = np.float16(g)
    rel = abs(float(h) - g) / abs(g) if g and np.isfinite(g) else 0.0
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
        self.dev, self.out_of_range, self.bad = 0.0, 0, 0

    def put(self, store, e: int, proj: str, rows: slice, name: str, what: str, allow: bool) -> None:
        """One projection's tensors, `name` + .weight / .weight_scale / .weight_scale_2, checked, scanned, copied."""
        R = rows.stop - rows.start
        K = self.H if proj == "gate_up" else self.I
        shapes = {".weight": (R, K // 2), ".weight_scale": (R, K // 16), ".weight_scale_2": ((), (1,))}
        t = {s: store.get(name + s, DTYPES[s], shapes[s], f"{what} {s[1:]}") for s in DTYPES}
        sc = _u8(t[".weight_scale"])
        where = str(store.meta(name + ".weight_scale")[0])
        self.bad += refuse_nonfinite(bad_e4m3(sc), where, name + ".weight_scale", f"{what}, [row, block]", allow)
        self.bad += refuse_nonfinite(bad_float(t[".weight_scale_2"]), where, name + ".weight_scale_2",
                                     f"{what}, the per-tensor global", allow)
        self.b[f"{proj}_packed"][e, rows] = _u8(t[".weight"])
        self.b[f"{proj}_scale"][e, rows] = sc.view(cf.numerics.E4M3)
        g, rel, odd = _global(t[".weight_scale_2"])
        self.b[f"{proj}_global"][e, rows] = g
        self.dev = max(self.dev, rel)
        self.out_of_range += odd

    def done(self) -> tuple[dict, dict]:
        cf.get_format("nvfp4").validate(self.b)
        return self.b, {"global_rounding_max_rel": self.dev, "exact": self.dev == 0.0,
                        "globals_outside_fp16_normal": self.out_of_range, "nonfinite_scales": self.bad}


def load_layer(store, names, E: int, H: int, I: int, progress=None,  # noqa: E741
               allow_nonfinite: bool = False) -> tuple[dict, dict]:
    """One decoder layer's experts from per-expert ModelOpt tensors (gate_proj, up_proj, down_proj)."""
    if names.gate is None:
        raise KeyError(f"layer {names.layer}: ModelOpt NVFP4 experts are stored per expert "
                       "('...experts.{e}.gate_proj.weight' + weight_scale + weight_scale_2), found fused names")
    if H % 16 or I % 16:
        raise ValueError(f"NVFP4 needs H and I multiples of 16, got H={H}, I={I}")
    b = _Builder(E, H, I)
    for e in range(E):
        for proj, rows, name, p in (("gate_up", slice(0, I), names.gate[e], "gate"),
                                    ("gate_up", slice(I, 2 * I), names.up[e], "up"),
                                    ("down", slice(0, H), names.down[e], "down")):
            b.put(store, e, proj, rows, name, f"layer {names.layer} expert {e} {p}", allow_nonfinite)
        if progress is not None:
            progress(1)
    return b.done()


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_weight(weight, scale, scale_2):
    """A ModelOpt NVFP4 linear weight ([rows, K/2] uint8 codes, [rows, K/16] e4m3 scales, one fp32 global) as float32
    [rows, K]: e2m1(code) * e4m3(scale) * scale_2 (the non-expert layers of a ModelOpt checkpoint; small)."""
    import torch

    codes = weight.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    lo, hi = E2M1[codes & 0xF], E2M1[codes >> 4]
    w = np.stack([lo, hi], axis=-1).reshape(codes.shape[0], -1)  # low nibble = even element
    s = scale.detach().to("cpu").float().numpy()
    g = float(scale_2.detach().to("cpu").float().reshape(-1)[0])
    return torch.from_numpy(w * np.repeat(s, 16, axis=1)[:, :w.shape[1]] * g)
