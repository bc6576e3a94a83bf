"""GGUF (llama.cpp) Q4_0 expert tensors -> q4_0 banks, bit for bit.

llama.cpp merges a layer's experts into `blk.{n}.ffn_gate_exps.weight`, `ffn_up_exps` (ggml shape [H, I, E]: numpy
[E, I, H/32 * 18] bytes) and `ffn_down_exps` ([I, H, E]: numpy [E, H, I/32 * 18]); each row is a run of 18-byte Q4_0
blocks (fp16 d, 16 bytes of nibbles), which is the q4_0 bank's layout. gate and up are stacked row-wise into
gate_up [E, 2I, H/32 * 18]. Read with the `gguf` package (memory-mapped)."""
from __future__ import annotations

import os

import numpy as np

import cpumoe_formats as cf

from .naming import GGUF


class GgufStore:
    def __init__(self, path):
        from gguf import GGUFReader

        self.path = os.fspath(path)
        self.reader = GGUFReader(self.path)
        self.tensors = {t.name: t for t in self.reader.tensors}

    def keys(self):
        return self.tensors.keys()

    def field(self, name: str):
        f = self.reader.fields.get(name)
        return None if f is None else f.contents()

    def moe_layers(self) -> list[int]:
        pre, post = GGUF[0].split("{n}")
        return sorted(int(k[len(pre):-len(post)]) for k in self.tensors if k.startswith(pre) and k.endswith(post))

    def close(self) -> None:
        self.reader = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _rows(store: GgufStore, name: str, shape: tuple) -> np.ndarray:
    from gguf import GGMLQuantizationType

    t = store.tensors.get(name)
    if t is None:
        raise KeyError(f"{store.path}: no tensor {name!r}")
    if t.tensor_type != GGMLQuantizationType.Q4_0:
        raise TypeError(f"{name}: GGUF type {t.tensor_type.name}, expected Q4_0 (other GGUF types are not a "
                        "moe_engine format; requantize with llama-quantize --pure Q4_0 or load another layout)")
    a = np.asarray(t.data)
    if a.shape != shape:
        raise ValueError(f"{name}: byte shape {a.shape}, expected {shape} (ggml [K, rows, E] Q4_0)")
    return a


def load_layer(store: GgufStore, layer: int, E: int, H: int, I: int, progress=None) -> tuple[dict, dict]:  # noqa: E741
    gname, uname, dname = (n.format(n=layer) for n in GGUF)
    if H % 32 or I % 32:
        raise ValueError(f"Q4_0 needs H and I multiples of 32, got H={H}, I={I}")
    g, u = _rows(store, gname, (E, I, H // 32 * 18)), _rows(store, uname, (E, I, H // 32 * 18))
    d = _rows(store, dname, (E, H, I // 32 * 18))
    gu = cf.aligned_empty((E, 2 * I, H // 32 * 18), np.uint8, 64)
    dn = cf.aligned_empty((E, H, I // 32 * 18), np.uint8, 64)
    for e in range(E):
        gu[e, :I], gu[e, I:], dn[e] = g[e], u[e], d[e]
        if progress is not None:
            progress(1)
    banks = {"gate_up": gu, "down": dn}
    cf.get_format("q4_0").validate(banks)
    return banks, {"exact": True}
