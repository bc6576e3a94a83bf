"""GGUF (llama.cpp) Q4_0 expert tensors -> q4_0 banks, bit for bit.

llama.cpp merges a layer's experts into `blk.{n}.ffn_gate_exps.weight`, `ffn_up_exps` (ggml dims [H, I, E]: numpy
[E, I, H/32 * 18] bytes) and `ffn_down_exps` ([I, H, E]: numpy [E, H, I/32 * 18]); each row is a run of 18-byte Q4_0
blocks (fp16 d, 16 bytes of nibbles), which is the q4_0 bank's layout. gate and up are stacked row-wise into
gate_up [E, 2I, H/32 * 18]. Types and dims are checked from the header before any byte is read (gguf_store.py); each
expert's d values are scanned for NaN / Inf as it is copied (validation.py)."""
from __future__ import annotations

import numpy as np

import cpumoe_formats as cf

from .naming import GGUF
from .validation import bad_q4_0_d, refuse_nonfinite

TYPES = ("Q4_0",)
DTYPES = {".weight": TYPES}
_HINT = ("; other GGUF types are not a moe_engine format: requantize the experts with llama-quantize --pure Q4_0, or "
         "load another layout")


def load_layer(store, layer: int, E: int, H: int, I: int, progress=None,  # noqa: E741
               allow_nonfinite: bool = False) -> tuple[dict, dict]:
    if H % 32 or I % 32:
        raise ValueError(f"Q4_0 needs H and I multiples of 32, got H={H}, I={I}")
    names = [n.format(n=layer) for n in GGUF]
    dims = ((H, I, E), (H, I, E), (I, H, E))  # ggml order: a row's length first
    g, u, d = (store.get_rows(n, TYPES, s, f"layer {layer} {p} experts", _HINT)
               for n, s, p in zip(names, dims, ("gate", "up", "down")))
    gu = cf.aligned_empty((E, 2 * I, H // 32 * 18), np.uint8, 64)
    dn = cf.aligned_empty((E, H, I // 32 * 18), np.uint8, 64)
    bad = 0
    for e in range(E):
        gu[e, :I], gu[e, I:], dn[e] = g[e], u[e], d[e]
        for name, rows in zip(names, (gu[e, :I], gu[e, I:], dn[e])):  # scanned while in cache
            bad += refuse_nonfinite(bad_q4_0_d(rows).reshape(rows.shape[0], -1), store.path, name,
                                    f"layer {layer} expert {e}, fp16 d of [row, block]", allow_nonfinite)
        if progress is not None:
            progress(1)
    banks = {"gate_up": gu, "down": dn}
    cf.get_format("q4_0").validate(banks)
    return banks, {"exact": True, "nonfinite_scales": bad}
