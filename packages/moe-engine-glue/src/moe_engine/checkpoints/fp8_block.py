"""FP8 block checkpoints (DeepSeek-V3, Qwen3 / Qwen3.5 FP8): float8_e4m3fn weights [rows, K] with `weight_scale_inv`
[ceil(rows/128), ceil(K/128)] per 128x128 block, fp32 (or bf16, or ue8m0 powers of two), multiplying -> fp8_block
banks.

The e4m3 codes are copied as they are. The bank's block scales are bf16: an fp32 scale is rounded to the nearest bf16
(relative change at most 2^-8, the same for every weight of its block); ue8m0 scales are powers of two and exact.
`deviation` in the loader's report is the largest |bf16(s) / s - 1| over the layer's scales (docs/transformers.md).
Gate and up are fused row-wise (gate rows, then up rows), so I must be a multiple of 128 for their blocks to stay
whole blocks of the fused bank. Dtypes and shapes are checked before any byte is viewed, and every scale is scanned
for NaN / Inf (validation.py)."""
from __future__ import annotations

import numpy as np

import cpumoe_formats as cf
from cpumoe_formats.formats.fp8_block import BLOCK, fp8_block_scale_pad, nb

from .validation import CheckpointError, bad_float, check_tensor, refuse_nonfinite

SUFFIX, SCALE = ".weight", ".weight_scale_inv"
WEIGHT_DTYPES = ("F8_E4M3",)  # e5m2 or int8 codes are other numbers: refused, never read as e4m3
SCALE_DTYPES = ("F32", "BF16", "F8_E8M0")
DTYPES = {SUFFIX: WEIGHT_DTYPES, SCALE: SCALE_DTYPES}


def _codes(t) -> np.ndarray:
    """e4m3 codes of a tensor whose dtype was checked, as uint8."""
    import torch

    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy()


def _to_bf16(s) -> tuple[np.ndarray, float]:
    """Checked scales of one expert (fp32, bf16 or e8m0) -> bf16 (nearest even) and the largest relative change."""
    import torch

    s = s.detach().to("cpu").float()
    b = s.to(torch.bfloat16)
    nz = (s != 0) & torch.isfinite(s)
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
        self.dev, self.bad = 0.0, 0

    def put(self, e: int, gu_codes, gu_scale, dn_codes, dn_scale) -> None:
        """One expert's checked tensors: gate_up codes [2I, H] (uint8 or e4m3), scales [nb(2I), nb(H)], down [H, I],
        [nb(H), nb(I)]."""
        H, I = self.H, self.I  # noqa: E741
        self.gu[e] = _codes(gu_codes)
        self.dn[e] = _codes(dn_codes)
        s, d1 = _to_bf16(gu_scale)
        self.gus[e, :, :nb(H)] = s
        s, d2 = _to_bf16(dn_scale)
        self.dns[e, :, :nb(I)] = s
        self.dev = max(self.dev, d1, d2)

    def done(self) -> tuple[dict, dict]:
        banks = {"gate_up": self.gu, "gate_up_scale": self.gus, "down": self.dn, "down_scale": self.dns}
        cf.get_format("fp8_block").validate(banks)
        return banks, {"scale_rounding_max_rel": self.dev, "exact": self.dev == 0.0, "nonfinite_scales": self.bad}


def _fused_shapes(E: int, H: int, I: int) -> dict:  # noqa: E741
    return {"gate_up": (E, 2 * I, H), "gate_up_scale": (E, nb(2 * I), nb(H)), "down": (E, H, I),
            "down_scale": (E, nb(H), nb(I))}


def _check_fused_scale_rows(shape, where: str, name: str, I: int) -> None:  # noqa: E741
    """transformers keeps gate's and up's blocks apart (2 * nb(I) rows); one fused bank holds nb(2I)."""
    if len(shape) == 3 and shape[1] == 2 * nb(I) != nb(2 * I):
        raise CheckpointError(f"{where}: tensor {name!r}: {shape[1]} block rows for 2I={2 * I} rows, expected "
                              f"{nb(2 * I)}; gate and up blocks stay whole blocks of the fused bank only when "
                              f"I % {BLOCK} == 0 (I={I})")


def _from_fused(t: dict, where: dict, names: dict, layer: str, progress, allow: bool) -> tuple[dict, dict]:
    """Banks from checked fused tensors {gate_up, gate_up_scale, down, down_scale}; scales scanned first."""
    E, I2, H = t["gate_up"].shape
    b = _Builder(E, H, I2 // 2)
    for k in ("gate_up_scale", "down_scale"):
        b.bad += refuse_nonfinite(bad_float(t[k]), where[k], names[k], f"{layer} {k}, [expert, block row, block "
                                  "column]", allow)
    for e in range(E):
        b.put(e, t["gate_up"][e], t["gate_up_scale"][e], t["down"][e], t["down_scale"][e])
        if progress is not None:
            progress(1)
    return b.done()


def bank_from_tensors(gate_up, gate_up_scale, down, down_scale, progress=None, *, where: str = "FP8Experts",
                      allow_nonfinite: bool = False) -> tuple[dict, dict]:
    """fp8_block banks from stacked tensors as transformers' FP8Experts holds them (any device): gate_up [E, 2I, H]
    e4m3 with gate_up_scale [E, nb(2I), nb(H)], down [E, H, I] with down_scale [E, nb(H), nb(I)]. where: the module's
    name, for errors."""
    t = {"gate_up": gate_up, "gate_up_scale": gate_up_scale, "down": down, "down_scale": down_scale}
    names = {k: k.replace("_scale", "_proj_scale_inv") if "scale" in k else k + "_proj" for k in t}
    if len(gate_up.shape) != 3:
        raise CheckpointError(f"{where}: gate_up_proj: shape {tuple(gate_up.shape)}, expected [E, 2I, H]")
    E, I2, H = gate_up.shape
    _check_fused_scale_rows(tuple(gate_up_scale.shape), where, names["gate_up_scale"], I2 // 2)
    for k, want in _fused_shapes(E, H, I2 // 2).items():
        check_tensor(t[k], where, names[k], "FP8 experts", SCALE_DTYPES if "scale" in k else WEIGHT_DTYPES, want)
    return _from_fused(t, {k: where for k in t}, names, "FP8 experts", progress, allow_nonfinite)


def load_layer(store, names, E: int, H: int, I: int, progress=None,  # noqa: E741
               allow_nonfinite: bool = False) -> tuple[dict, dict]:
    """One decoder layer's experts from a checkpoint (per-expert gate/up/down or fused gate_up/down names)."""
    import torch

    layer = f"layer {names.layer}"
    if names.gate_up is not None:
        # transformers' FP8Experts parameters: gate_up_proj, gate_up_proj_scale_inv, down_proj, down_proj_scale_inv
        tn = {"gate_up": names.gate_up, "gate_up_scale": names.gate_up + "_scale_inv", "down": names.down_fused,
              "down_scale": names.down_fused + "_scale_inv"}
        _check_fused_scale_rows(store.meta(tn["gate_up_scale"])[2], str(store.meta(tn["gate_up_scale"])[0]),
                                tn["gate_up_scale"], I)
        t = {k: store.get(tn[k], SCALE_DTYPES if "scale" in k else WEIGHT_DTYPES, want, f"{layer} {k}")
             for k, want in _fused_shapes(E, H, I).items()}
        return _from_fused(t, {k: str(store.meta(n)[0]) for k, n in tn.items()}, tn, layer, progress,
                           allow_nonfinite)
    if I % BLOCK:
        raise ValueError(f"layer {names.layer}: I={I} is not a multiple of {BLOCK}: the gate and up projections' "
                         f"{BLOCK}-row scale blocks would not stay whole blocks of the fused gate_up bank")
    b = _Builder(E, H, I)
    for e in range(E):
        what = f"{layer} expert {e}"
        w, s = {}, {}
        for p, name, rows, cols in (("gate", names.gate[e], I, H), ("up", names.up[e], I, H),
                                    ("down", names.down[e], H, I)):
            w[p] = store.get(name + SUFFIX, WEIGHT_DTYPES, (rows, cols), f"{what} {p} weight")
            s[p] = store.get(name + SCALE, SCALE_DTYPES, (nb(rows), nb(cols)), f"{what} {p} scale")
            b.bad += refuse_nonfinite(bad_float(s[p]), str(store.meta(name + SCALE)[0]), name + SCALE,
                                      f"{what}, [block row, block column]", allow_nonfinite)
        b.put(e, torch.cat([w["gate"].view(torch.uint8), w["up"].view(torch.uint8)]),
              torch.cat([s["gate"].float(), s["up"].float()]), w["down"], s["down"])
        if progress is not None:
            progress(1)
    return b.done()
