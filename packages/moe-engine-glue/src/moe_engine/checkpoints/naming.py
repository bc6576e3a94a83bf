"""Where each architecture's checkpoints keep a decoder layer's routed experts, by name.

Safetensors checkpoints (Hugging Face layouts) keep them one tensor per expert and projection, or fused per layer.
A projection's name is followed by the layout's suffixes (`.weight`, `.weight_scale_inv`, `.weight_scale`,
`.weight_scale_2`; gpt-oss's `_blocks` / `_scales` / `_bias`; FP8Experts' `_scale_inv`):

  per_expert  `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`: qwen2_moe, qwen3_moe, qwen3_next,
              qwen3_5_moe(_text), deepseek_v3, ModelOpt exports
  mixtral     `block_sparse_moe.experts.{e}.w1` (gate) / `w3` (up) / `w2` (down); `mlp.` in transformers-saved ones
  fused       `mlp.experts.gate_up_proj` / `down_proj`: gpt-oss (rows interleaved gate, up), transformers' FP8Experts

The layer prefix is whatever precedes `layers.{n}.` (`model.`, `model.language_model.`, `language_model.model.`);
it is found by scanning the keys. GGUF files (llama.cpp) name merged expert tensors `blk.{n}.ffn_gate_exps.weight`,
`blk.{n}.ffn_up_exps.weight`, `blk.{n}.ffn_down_exps.weight` for every MoE architecture.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

PER_EXPERT = {
    "per_expert": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
    "mixtral": tuple(f"block_sparse_moe.experts.{{e}}.{w}" for w in ("w1", "w3", "w2")),
    "mixtral_hf": ("mlp.experts.{e}.w1", "mlp.experts.{e}.w3", "mlp.experts.{e}.w2"),
}
FUSED = {"fused": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")}
GGUF = ("blk.{n}.ffn_gate_exps.weight", "blk.{n}.ffn_up_exps.weight", "blk.{n}.ffn_down_exps.weight")

# the naming a model_type's checkpoints use first (the others are still tried)
ARCH_NAMING = {
    "qwen2_moe": "per_expert", "qwen3_moe": "per_expert", "qwen3_next": "per_expert", "qwen3_5_moe": "per_expert",
    "qwen3_5_moe_text": "per_expert", "deepseek_v3": "per_expert", "mixtral": "mixtral", "gpt_oss": "fused",
}

_LAYER = re.compile(r"^(.*?layers\.)(\d+)\.(mlp|block_sparse_moe)\.experts\.")


@dataclass(frozen=True)
class LayerNames:
    """The tensor names (without suffix) of one decoder layer's routed experts."""

    layer: int
    naming: str
    gate: tuple[str, ...] | None  # per expert (None when fused)
    up: tuple[str, ...] | None
    down: tuple[str, ...] | None
    gate_up: str | None = None  # fused
    down_fused: str | None = None


def layer_prefixes(keys) -> dict[int, str]:
    """decoder layer index -> its key prefix (e.g. 'model.layers.'), from the keys that hold routed experts."""
    out: dict[int, str] = {}
    for k in keys:
        m = _LAYER.match(k)
        if m:
            out.setdefault(int(m.group(2)), m.group(1))
    return out


def resolve(keys, layer: int, E: int, suffix: str, model_type: str | None = None,
            fused_suffix: str | None = "") -> LayerNames:
    """The names of `layer`'s experts in a checkpoint with these keys, given the suffix a per-expert name must take
    to exist (e.g. '.weight_scale_inv') and a fused one (default: the same; None: the layout is never fused).
    Raises KeyError naming what was looked for."""
    fused_suffix = suffix if fused_suffix == "" else fused_suffix
    keys = set(keys)
    prefixes = layer_prefixes(keys)
    if layer not in prefixes:
        raise KeyError(f"layer {layer}: no routed-expert tensors (no key matching '*layers.{layer}.mlp.experts.*' or "
                       f"'*layers.{layer}.block_sparse_moe.experts.*'); the checkpoint has MoE layers "
                       f"{sorted(prefixes)[:8]}{'...' if len(prefixes) > 8 else ''}")
    p = f"{prefixes[layer]}{layer}."
    first = ARCH_NAMING.get(model_type or "")
    order = sorted({**PER_EXPERT, **FUSED}, key=lambda n: n != first)
    tried = []
    for naming in order:
        if naming in FUSED:
            if fused_suffix is None:
                continue
            gu, dn = (p + n for n in FUSED[naming])
            tried.append(gu + fused_suffix)
            if gu + fused_suffix in keys and dn + fused_suffix in keys:
                return LayerNames(layer, naming, None, None, None, gu, dn)
            continue
        names = [tuple(p + t.format(e=e) for e in range(E)) for t in PER_EXPERT[naming]]
        tried.append(names[0][0] + suffix)
        if all(n + suffix in keys for group in names for n in group):
            return LayerNames(layer, naming, *names)
        if names[0][0] + suffix in keys:  # the naming matches but experts are missing
            missing = [n + suffix for group in names for n in group if n + suffix not in keys]
            raise KeyError(f"layer {layer}: {len(missing)} expert tensors missing in naming {naming!r} (E={E}), "
                           f"e.g. {missing[0]!r}")
    raise KeyError(f"layer {layer}: no routed-expert tensors with suffix {suffix!r}; tried {tried}")
