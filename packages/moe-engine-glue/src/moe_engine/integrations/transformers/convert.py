"""A loaded model's expert weights -> banks: float chunks of a module (gpt-oss's interleaved layout and FP8Experts'
block scales included) quantized to a format, gpt-oss's gate_up bias folded in as one more input column where the
format has no bias banks.

Thread contract: plain functions; they only read the modules."""
from __future__ import annotations

import numpy as np

import cpumoe_formats as cf

from ...progress import bar
from .adapter import FOLD_PAD
from .experts import ExpertsSpec, decoder_layer

CHUNK_BYTES = 64 << 20  # float32 weights converted per call


def _f32(t) -> np.ndarray:
    import torch

    return t.detach().to("cpu", torch.float32).numpy()


def float_chunk(module, spec: ExpertsSpec, e0: int, e1: int):
    """Experts e0..e1 as float32 numpy: gate_up [n, 2I, H] (gate rows, up rows), down [n, H, I], biases or None."""
    import torch

    if spec.kind == "gpt_oss":
        w = module.gate_up_proj[e0:e1].detach()
        gu = torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1).transpose(1, 2)
        b = module.gate_up_proj_bias[e0:e1].detach()
        return (_f32(gu), _f32(module.down_proj[e0:e1].transpose(1, 2)),
                _f32(torch.cat([b[:, 0::2], b[:, 1::2]], dim=-1)), _f32(module.down_proj_bias[e0:e1]))
    if spec.kind == "fp8":  # requantizing FP8 experts to another format: their exact values first
        return _fp8_values(module.gate_up_proj[e0:e1], module.gate_up_proj_scale_inv[e0:e1]), _fp8_values(
            module.down_proj[e0:e1], module.down_proj_scale_inv[e0:e1]), None, None
    return _f32(module.gate_up_proj[e0:e1]), _f32(module.down_proj[e0:e1]), None, None


def _fp8_values(codes, scale) -> np.ndarray:
    """e4m3 codes [n, R, K] times their 128x128 block scales [n, nb(R), nb(K)], float32."""
    w = codes.detach().to("cpu").float()
    s = scale.detach().to("cpu").float()
    s = s.repeat_interleave(128, 1)[:, :w.shape[1]].repeat_interleave(128, 2)[:, :, :w.shape[2]]
    return (w * s).numpy()


def fold_bias(gu, dn, gub):
    """gate_up bias as input column H (x gets a 1 there), zero columns to H + FOLD_PAD; down gets zero rows."""
    n, I2, H = gu.shape
    gu2 = np.zeros((n, I2, H + FOLD_PAD), np.float32)
    gu2[:, :, :H], gu2[:, :, H] = gu, gub
    dn2 = np.zeros((n, H + FOLD_PAD, dn.shape[2]), np.float32)
    dn2[:, :H] = dn
    return gu2, dn2


def quantize_module(module, spec: ExpertsSpec, fmt: str, fold: bool, tick) -> dict:
    fspec = cf.get_format(fmt)
    per_expert = 4 * 3 * spec.H * spec.I
    chunk = max(1, min(spec.E, CHUNK_BYTES // per_expert))
    out = None
    for e0 in range(0, spec.E, chunk):
        e1 = min(spec.E, e0 + chunk)
        gu, dn, gub, dnb = float_chunk(module, spec, e0, e1)
        if gub is not None and "gate_up_bias" in fspec.bank_names:
            part = cf.quantize(fmt, gu, dn, gate_up_bias=gub, down_bias=dnb)
        else:
            if fold:
                gu, dn = fold_bias(gu, dn, gub)
            part = cf.quantize(fmt, gu, dn)
        if out is None:
            out = {k: cf.aligned_empty((spec.E,) + np.shape(v)[1:], np.asarray(v).dtype, 64) for k, v in part.items()}
        for k, v in part.items():
            out[k][e0:e1] = v
        tick(e1 - e0)
    fspec.validate(out)
    return out


def banks_from_model(found, specs, fmt: str, fold: bool, device, progress: bool, allow_nonfinite: bool):
    """Banks of every experts module (its weights only read), the per-layer reports and gpt-oss's folded down
    biases."""
    import torch

    banks, down_biases, report = [], [], {}
    with bar(total=specs[0].E * len(found), desc=f"moe_engine: experts -> {fmt}", unit="expert",
             disable=not progress) as pb:
        for (name, m), s in zip(found, specs):
            if s.kind == "fp8" and fmt == "fp8_block":
                from ...checkpoints import fp8_block

                b, rep = fp8_block.bank_from_tensors(m.gate_up_proj, m.gate_up_proj_scale_inv, m.down_proj,
                                                     m.down_proj_scale_inv, pb.update, where=name,
                                                     allow_nonfinite=allow_nonfinite)
                report[decoder_layer(name, len(banks))] = rep
            else:
                b = quantize_module(m, s, fmt, fold, pb.update)
            banks.append(b)
            if fold:
                down_biases.append(m.down_proj_bias.detach().to(device, torch.float32).clone())
    return banks, report, down_biases
