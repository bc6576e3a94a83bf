"""Routed experts read from checkpoints in the layouts they ship in, into cpumoe_formats banks, never dequantized:

  fp8_block  float8_e4m3fn `weight` + fp32 `weight_scale_inv` per 128x128 block (DeepSeek-V3, Qwen FP8) -> fp8_block:
             codes copied; fp32 scales rounded to the bank's bf16 (<= 2^-8 relative; ue8m0 scales exact)
  mxfp4      gpt-oss `*_blocks` / `*_scales` / `*_bias` -> mxfp4: exact
  nvfp4      ModelOpt `weight` / `weight_scale` / `weight_scale_2` -> nvfp4: codes and block scales copied; the fp32
             per-tensor global rounded to the bank's fp16 per-row global (<= 2^-11 relative)
  gguf_q4_0  GGUF `blk.N.ffn_{gate,up,down}_exps.weight` in Q4_0 -> q4_0: exact

One small module per layout (fp8_block.py, mxfp4.py, nvfp4.py, gguf_q4_0.py); tensor names per architecture in
naming.py; the two stores (safetensors_store.py, gguf_store.py) and what a tensor must be (validation.py).
`load_experts` reads the decoder layers asked for, in that order, one bank dict each.

Before any byte is reinterpreted, every tensor's dtype and shape are checked against the layout (from the file's
header), and a truncated file is refused naming the tensor whose bytes are missing; scales holding NaN / Inf are
refused unless allow_nonfinite=True. Every such refusal is a CheckpointError (a ValueError) naming the file, the
tensor, its layer (and expert) and what was expected; a missing tensor is a KeyError naming it."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from . import fp8_block, gguf_q4_0, mxfp4, naming, nvfp4
from .gguf_store import GgufStore
from .safetensors_store import SafetensorsStore
from .validation import CheckpointError

LAYOUTS = ("fp8_block", "mxfp4", "nvfp4", "gguf_q4_0")
FORMAT_OF = {"fp8_block": "fp8_block", "mxfp4": "mxfp4", "nvfp4": "nvfp4", "gguf_q4_0": "q4_0"}
# each layout's module: load_layer(store, names or layer, E, H, I, progress, allow_nonfinite) and DTYPES, the dtypes
# it accepts per tensor-name suffix
MODULE_OF = {"fp8_block": fp8_block, "mxfp4": mxfp4, "nvfp4": nvfp4, "gguf_q4_0": gguf_q4_0}
# the suffix whose presence on a layer's first expert tensor names the safetensors layout
# (per expert, fused; None = never fused)
SUFFIX = {"mxfp4": ("_blocks", "_blocks"), "fp8_block": (".weight_scale_inv", "_scale_inv"),
          "nvfp4": (".weight_scale_2", None)}


@dataclass
class LoadedExperts:
    layout: str
    format: str
    banks: list
    report: dict = field(default_factory=dict)  # per layer: exactness and measured rounding (see each layout)

    def deviation(self) -> dict:
        """The largest measured rounding over all layers, per kind (empty when bit-exact)."""
        return max_deviation(self.report)


def max_deviation(report: dict) -> dict:
    """{kind: the largest '*_max_rel' over the per-layer reports}: the measured rounding of a conversion."""
    out: dict = {}
    for r in report.values():
        for k, v in r.items():
            if k.endswith("_max_rel"):
                out[k] = max(out.get(k, 0.0), v)
    return out


def open_store(path):
    """A GgufStore for a .gguf file (or a directory holding exactly one), else a SafetensorsStore."""
    p = Path(os.fspath(path))
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1 and not any(p.glob("*.safetensors")):
            p = ggufs[0]
    if p.suffix == ".gguf":
        return GgufStore(p)
    return SafetensorsStore(p)


def detect_layout(store, E: int, layer: int | None = None) -> str:
    if isinstance(store, GgufStore):
        return "gguf_q4_0"
    prefixes = naming.layer_prefixes(store.keys())
    if not prefixes:
        raise KeyError(f"{store.path}: no routed-expert tensors ('*layers.N.mlp.experts.*')")
    layer = layer if layer in prefixes else min(prefixes)  # a missing layer is named by the loader
    mine = [k for k in store.keys() if k.startswith(f"{prefixes[layer]}{layer}.") and ".experts." in k]
    for layout, (suffix, fused) in SUFFIX.items():  # the suffix decides; missing experts are named by the loader
        if any(k.endswith(suffix) or (fused is not None and k.endswith(fused)) for k in mine):
            return layout
    raise ValueError(f"{store.path}: layer {layer}'s experts are in none of the layouts {list(SUFFIX)} (no "
                     "'.weight_scale_inv', '.weight_scale_2' or gpt-oss '_blocks' tensors); "
                     "float checkpoints are read by transformers and quantized from the model")


def load_experts(path, layers, *, E: int, H: int, I: int, layout: str | None = None,  # noqa: E741
                 model_type: str | None = None, progress=None, allow_nonfinite: bool = False) -> LoadedExperts:
    """Banks for the decoder layers `layers` (checkpoint numbering), in that order. progress(n) is called per
    expert read. allow_nonfinite: load scales (and mxfp4 biases) that are NaN / Inf instead of refusing them; the
    per-layer report counts them ('nonfinite_scales'), and every token routed through them computes NaN / Inf.
    Thread contract: safe to call from several threads (each call opens its own store; the banks are new arrays)."""
    with open_store(path) as store:
        layout = layout or detect_layout(store, E, layers[0] if layers else None)
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}: expected one of {list(LAYOUTS)}")
        if (layout == "gguf_q4_0") != isinstance(store, GgufStore):
            kind = "GGUF" if isinstance(store, GgufStore) else "safetensors"
            raise ValueError(f"layout={layout!r}, but {store.path} is a {kind} checkpoint")
        out = LoadedExperts(layout, FORMAT_OF[layout], [])
        for n in layers:
            if layout == "gguf_q4_0":
                banks, rep = gguf_q4_0.load_layer(store, n, E, H, I, progress, allow_nonfinite)
            else:
                suffix, fused = SUFFIX[layout]
                names = naming.resolve(store.keys(), n, E, suffix, model_type, fused_suffix=fused)
                banks, rep = MODULE_OF[layout].load_layer(store, names, E, H, I, progress, allow_nonfinite)
            out.banks.append(banks)
            out.report[n] = rep
    return out


__all__ = ["CheckpointError", "FORMAT_OF", "LAYOUTS", "MODULE_OF", "SUFFIX", "LoadedExperts", "detect_layout",
           "load_experts", "open_store"]
