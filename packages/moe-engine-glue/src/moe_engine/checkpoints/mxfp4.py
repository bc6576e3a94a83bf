"""gpt-oss MXFP4 checkpoints -> mxfp4 banks, bit for bit.

The checkpoint keeps, per layer, `mlp.experts.gate_up_proj_blocks` [E, 2I, H/32, 16] uint8 (two e2m1 codes a byte,
low nibble = even element), `gate_up_proj_scales` [E, 2I, H/32] uint8 (e8m0 exponents), `gate_up_proj_bias` [E, 2I]
(rows interleaved: 2j = gate j, 2j+1 = up j), and `down_proj_{blocks,scales,bias}` [E, H, I/32, 16], [E, H, I/32],
[E, H]. The mxfp4 bank is the same codes transposed to [E, K/2, rows] (Triton's split-K layout, gate/up interleaved by
column, as the checkpoint's rows are), scales [E, K/32, rows], biases as they are. Biases stored as fp32 are rounded
to the bank's bf16 (gpt-oss ships bf16: exact). Dtypes and shapes are checked against the model's (E, H, I) before any
byte is viewed; the e8m0 scales (0xFF is NaN) and the biases are scanned for NaN / Inf (validation.py)."""
from __future__ import annotations

import numpy as np

import cpumoe_formats as cf

from .validation import bad_e8m0, bad_float, refuse_nonfinite

SUFFIXES = ("_blocks", "_scales", "_bias")
DTYPES = {"_blocks": ("U8",), "_scales": ("U8", "F8_E8M0"), "_bias": ("BF16", "F32", "F16")}


def _shapes(rows: int, K: int, E: int) -> dict:
    return {"_blocks": (E, rows, K // 32, 16), "_scales": (E, rows, K // 32), "_bias": (E, rows)}


def _u8(t) -> np.ndarray:
    import torch

    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy()


def _bf16(t) -> tuple[np.ndarray, bool]:
    import torch

    t = t.detach().to("cpu")
    b = t.to(torch.bfloat16)
    exact = t.dtype == torch.bfloat16 or bool((b.float() == t.float()).all())
    return b.view(torch.int16).numpy().view(cf.numerics.BF16), exact


def load_layer(store, names, E: int, H: int, I: int, progress=None,  # noqa: E741
               allow_nonfinite: bool = False) -> tuple[dict, dict]:
    if names.gate_up is None:
        raise KeyError(f"layer {names.layer}: gpt-oss MXFP4 experts are fused per layer "
                       f"('...experts.gate_up_proj_blocks'), found per-expert names ({names.naming})")
    if H % 32 or I % 32:
        raise ValueError(f"MXFP4 needs H and I multiples of 32, got H={H}, I={I}")
    t, bad = {}, 0
    for proj, base, rows, K in (("gate_up", names.gate_up, 2 * I, H), ("down", names.down_fused, H, I)):
        for s, want in _shapes(rows, K, E).items():
            t[proj + s] = x = store.get(base + s, DTYPES[s], want, f"layer {names.layer} {proj} {s[1:]}")
            if s != "_blocks":
                scan = bad_e8m0(_u8(x)) if s == "_scales" else bad_float(x)
                bad += refuse_nonfinite(scan, str(store.meta(base + s)[0]), base + s,
                                        f"layer {names.layer}, [expert, row{', block' if s == '_scales' else ''}]",
                                        allow_nonfinite, "scales" if s == "_scales" else "biases")
    out = {"gate_up_blocks": cf.aligned_empty((E, H // 2, 2 * I), np.uint8, 64),
           "gate_up_scales": cf.aligned_empty((E, H // 32, 2 * I), np.uint8, 64),
           "down_blocks": cf.aligned_empty((E, I // 2, H), np.uint8, 64),
           "down_scales": cf.aligned_empty((E, I // 32, H), np.uint8, 64)}
    for e in range(E):  # one expert at a time: [rows, K/32, 16] -> [K/2, rows]
        out["gate_up_blocks"][e] = _u8(t["gate_up_blocks"][e]).reshape(2 * I, -1).T
        out["gate_up_scales"][e] = _u8(t["gate_up_scales"][e]).T
        out["down_blocks"][e] = _u8(t["down_blocks"][e]).reshape(H, -1).T
        out["down_scales"][e] = _u8(t["down_scales"][e]).T
        if progress is not None:
            progress(1)
    gub, ex1 = _bf16(t["gate_up_bias"])
    dnb, ex2 = _bf16(t["down_bias"])
    out["gate_up_bias"], out["down_bias"] = cf.aligned_copy(gub), cf.aligned_copy(dnb)
    banks = {k: out[k] for k in cf.get_format("mxfp4").bank_names}
    cf.get_format("mxfp4").validate(banks)
    return banks, {"exact": ex1 and ex2, "bias_rounded": not (ex1 and ex2), "nonfinite_scales": bad}
