"""FP8 block checkpoints (DeepSeek-V3, Qwen3 / Qwen3.5 FP8): float8_e4m3fn weights [rows, K] with `weight_scale_inv`
[ceil(rows/128), ceil(K/128)] per 128x128 block, fp32 (or ue8m0 powers of two), multiplying -> fp8_block banks.

The e4m3 codes are copied as they are. The bank's block scales are bf16: an fp32 scale is rounded to the nearest bf16
(relative change at most 2^-8, the same for every weight of its block); ue8m0 scales are powers of two and exact.
`deviation` in the loader's report is the largest |bf16(s) / s - 1| over the layer's scales (docs/transformers.md).
Gate and up are fused row-wise (gate rows, then up rows), so I must be a multiple of 128 for their blocks to stay
whole blocks of the fused bank."""
from __future__ import annotations

import numpy as np

import cpumoe_formats as cf
from cpumoe_formats.formats.fp8_block import BLOCK, fp8_block_scale_pad, nb

SUFFIX, SCALE = ".weight", ".weight_scale_inv"


def _codes(t) -> np.ndarray:
    import torch

    if t.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"fp8 weight: dtype {t.dtype}, expected torch.float8_e4m3fn (e4m3fn codes)")
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy()


def _scales(t):
    """fp32 [.., nb(R), nb(K)] scale tensor (fp32, bf16 or ue8m0 in the checkpoint) as a float32 torch tensor."""
    import torch

    t = t.detach().to("cpu")
    if t.dtype not in (torch.float32, torch.bfloat16, getattr(torch, "float8_e8m0fnu", torch.float32)):
        raise TypeError(f"fp8 weight_scale_inv: dtype {t.dtype}, expected float32, bfloat16 or float8_e8m0fnu")
    return t.float()


def _to_bf16(s, want: tuple, what: str) -> tuple[np.ndarray, float]:
    """fp32 scales of one expert -> bf16 (nearest even) and the largest relative change."""
    import torch

    if tuple(s.shape) != want:
        raise ValueError(f"{what}: weight_scale_inv shape {tuple(s.shape)}, expected {want} (one scale per "
                         f"{BLOCK}x{BLOCK} block)")
    b = s.to(torch.bfloat16)
    nz = s != 0
    dev = float(((b.float() - s).abs()[nz] / s.abs()[nz]).max()) if bool(nz.any()) else 0.0
    return b.view(torch.int16).numpy().view(cf.numerics.BF16), dev


class _Builder:
    """fp8_block banks of E experts filled one expert at a time (the checkpoint is read expert by expert)."""

    def __init__(self, E: int, H: int, I: int):  # noqa: E741
        self.H, self.I = H, I
        self.gu = cf.aligned_empty((E, 2 * I, H), np.uint8, 64)
        self.dn = cf.aligned_empty((E, H, I), np.uint8, 64)
        self.gus = cf.aligned_empty((E, nb(2 * I), fp8_block_scale_pad(nb(2 * I), nb(H))), cf.numerics.BF16, 64)
        self.dns = cf.aligned_empty((E, nb(H), fp8_block_scale_pad(nb(H), nb(I))), cf.numerics.BF16, 64)
        self.gus[...] = 0
        self.dns[...] = 0
        self.dev = 0.0

    def put(self, e: int, gu_codes, gu_scale, dn_codes, dn_scale, what: str) -> None:
        H, I = self.H, self.I  # noqa: E741
        for name, t, want in (("gate_up", gu_codes, (2 * I, H)), ("down", dn_codes, (H, I))):
            if tuple(t.shape) != want:
                raise ValueError(f"{what} {name}: shape {tuple(t.shape)}, expected {want}")
        self.gu[e] = _codes(gu_codes)
        self.dn[e] = _codes(dn_codes)
        s, d1 = _to_bf16(_scales(gu_scale), (nb(2 * I), nb(H)), f"{what} gate_up")
        self.gus[e, :, :nb(H)] = s
        s, d2 = _to_bf16(_scales(dn_scale), (nb(H), nb(I)), f"{what} down")
        self.dns[e, :, :nb(I)] = s
        self.dev = max(self.dev, d1, d2)

    def done(self) -> tuple[dict, dict]:
        banks = {"gate_up": self.gu, "gate_up_scale": self.gus, "down": self.dn, "down_scale": self.dns}
        cf.get_format("fp8_block").validate(banks)
        return banks, {"scale_rounding_max_rel": self.dev, "exact": self.dev == 0.0}


def _fused_scale(s, I: int):  # noqa: E741
    """A fused gate_up scale [E, nb(2I), nb(H)] (transformers keeps at least 2 rows: for I < 64 gate and up have a
    block each, which one fused block cannot hold)."""
    if s.shape[0] == nb(2 * I):
        return s
    raise ValueError(f"gate_up scale: {s.shape[0]} block rows for 2I={2 * I} rows, expected {nb(2 * I)}; gate and up "
                     f"blocks stay whole blocks of the fused bank only when I % {BLOCK} == 0 (I={I})")


def bank_from_tensors(gate_up, gate_up_scale, down, down_scale, progress=None) -> tuple[dict, dict]:
    """fp8_block banks from stacked tensors as transformers' FP8Experts holds them (any device): gate_up [E, 2I, H]
    e4m3 with gate_up_scale [E, nb(2I), nb(H)], down [E, H, I] with down_scale [E, nb(H), nb(I)]."""
    E, I2, H = gate_up.shape
    I = I2 // 2  # noqa: E741
    b = _Builder(E, H, I)
    for e in range(E):
        b.put(e, gate_up[e], _fused_scale(_scales(gate_up_scale[e]), I), down[e], down_scale[e], f"expert {e}")
        if progress is not None:
            progress(1)
    return b.done()


def load_layer(store, names, E: int, H: int, I: int, progress=None) -> tuple[dict, dict]:  # noqa: E741
    """One decoder layer's experts from a checkpoint (per-expert gate/up/down or fused gate_up/down names)."""
    import torch

    if names.gate_up is not None:
        # transformers' FP8Experts parameters: gate_up_proj, gate_up_proj_scale_inv, down_proj, down_proj_scale_inv
        return bank_from_tensors(store.get(names.gate_up), store.get(names.gate_up + "_scale_inv"),
                                 store.get(names.down_fused), store.get(names.down_fused + "_scale_inv"), progress)
    if I % BLOCK:
        raise ValueError(f"layer {names.layer}: I={I} is not a multiple of {BLOCK}: the gate and up projections' "
                         f"{BLOCK}-row scale blocks would not stay whole blocks of the fused gate_up bank")
    b = _Builder(E, H, I)
    for e in range(E):
        g, u = store.get(names.gate[e] + SUFFIX), store.get(names.up[e] + SUFFIX)
        if tuple(g.shape) != (I, H) or tuple(u.shape) != (I, H):
            raise ValueError(f"{names.gate[e]}{SUFFIX} / {names.up[e]}{SUFFIX}: shapes {tuple(g.shape)}, "
                             f"{tuple(u.shape)}, expected {(I, H)}")
        gs = torch.cat([_scales(store.get(names.gate[e] + SCALE)), _scales(store.get(names.up[e] + SCALE))])
        b.put(e, torch.cat([g.view(torch.uint8), u.view(torch.uint8)]), gs, store.get(names.down[e] + SUFFIX),
              store.get(names.down[e] + SCALE), f"layer {names.layer} expert {e}")
        if progress is not None:
            progress(1)
    return b.done()
