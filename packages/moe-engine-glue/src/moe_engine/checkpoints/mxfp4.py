"""gpt-oss MXFP4 checkpoints -> mxfp4 banks, bit for bit.

The checkpoint keeps, per layer, `mlp.experts.gate_up_proj_blocks` [E, 2I, H/32, 16] uint8 (two e2m1 codes a byte,
low nibble = even element), `gate_up_proj_scales` [E, 2I, H/32] uint8 (e8m0 exponents), `gate_up_proj_bias` [E, 2I]
(rows interleaved: 2j = gate j, 2j+1 = up j), and `down_proj_{blocks,scales,bias}` [E, H, I/32, 16], [E, H, I/32],
[E, H]. The mxfp4 bank is the same codes transposed to [E, K/2, rows] (Triton's split-K layout, gate/up interleaved by
column, as the checkpoint's rows are), scales [E, K/32, rows], biases as they are. Biases stored as fp32 are rounded
to the bank's bf16 (gpt-oss ships bf16: exact)."""
from __future__ import annotations

import numpy as np

import cpumoe_formats as cf

SUFFIXES = ("_blocks", "_scales", "_bias")


def _u8(t, shape: tuple, what: str) -> np.ndarray:
    import torch

    if t.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        raise TypeError(f"{what}: dtype {t.dtype}, expected uint8")
    a = t.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    if a.shape != shape:
        raise ValueError(f"{what}: shape {a.shape}, expected {shape}")
    return a


def _bf16(t, shape: tuple, what: str) -> tuple[np.ndarray, bool]:
    import torch

    t = t.detach().to("cpu")
    if tuple(t.shape) != shape:
        raise ValueError(f"{what}: shape {tuple(t.shape)}, expected {shape}")
    b = t.to(torch.bfloat16)
    exact = t.dtype == torch.bfloat16 or bool((b.float() == t.float()).all())
    return b.view(torch.int16).numpy().view(cf.numerics.BF16), exact


def bank_from_tensors(gu_blocks, gu_scales, gu_bias, dn_blocks, dn_scales, dn_bias, progress=None) -> tuple[dict, dict]:
    """mxfp4 banks from one layer's gpt-oss tensors (shapes in the module docstring)."""
    E, R, G, B = gu_blocks.shape
    if B != 16:
        raise ValueError(f"gate_up_proj_blocks: shape {tuple(gu_blocks.shape)}, expected [E, 2I, H/32, 16]")
    I, H = R // 2, G * 32  # noqa: E741
    out = {"gate_up_blocks": cf.aligned_empty((E, H // 2, 2 * I), np.uint8, 64),
           "gate_up_scales": cf.aligned_empty((E, H // 32, 2 * I), np.uint8, 64),
           "down_blocks": cf.aligned_empty((E, I // 2, H), np.uint8, 64),
           "down_scales": cf.aligned_empty((E, I // 32, H), np.uint8, 64)}
    for e in range(E):  # one expert at a time: [rows, K/32, 16] -> [K/2, rows]
        out["gate_up_blocks"][e] = _u8(gu_blocks[e], (2 * I, H // 32, 16), "gate_up_proj_blocks").reshape(2 * I, -1).T
        out["gate_up_scales"][e] = _u8(gu_scales[e], (2 * I, H // 32), "gate_up_proj_scales").T
        out["down_blocks"][e] = _u8(dn_blocks[e], (H, I // 32, 16), "down_proj_blocks").reshape(H, -1).T
        out["down_scales"][e] = _u8(dn_scales[e], (H, I // 32), "down_proj_scales").T
        if progress is not None:
            progress(1)
    gub, ex1 = _bf16(gu_bias, (E, 2 * I), "gate_up_proj_bias")
    dnb, ex2 = _bf16(dn_bias, (E, H), "down_proj_bias")
    out["gate_up_bias"], out["down_bias"] = cf.aligned_copy(gub), cf.aligned_copy(dnb)
    banks = {k: out[k] for k in cf.get_format("mxfp4").bank_names}
    cf.get_format("mxfp4").validate(banks)
    return banks, {"exact": ex1 and ex2, "bias_rounded": not (ex1 and ex2)}


def load_layer(store, names, E: int, H: int, I: int, progress=None) -> tuple[dict, dict]:  # noqa: E741
    if names.gate_up is None:
        raise KeyError(f"layer {names.layer}: gpt-oss MXFP4 experts are fused per layer "
                       f"('...experts.gate_up_proj_blocks'), found per-expert names ({names.naming})")
    gu, dn = names.gate_up, names.down_fused
    t = [store.get(gu + s) for s in SUFFIXES] + [store.get(dn + s) for s in SUFFIXES]
    banks, info = bank_from_tensors(*t, progress=progress)
    got = cf.get_format("mxfp4").dims(banks)
    if tuple(got) != (E, H, I):
        raise ValueError(f"layer {names.layer}: the checkpoint's experts are (E, H, I)={tuple(got)}, the model's "
                         f"{(E, H, I)}")
    return banks, info
