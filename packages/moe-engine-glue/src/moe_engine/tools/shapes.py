"""MoE layer shapes: what a runner needs to know about a model's experts, and presets of real models."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MoEShape:
    """One model's routed experts: E experts of hidden size H and intermediate size I, top_k routes per token."""

    name: str
    E: int
    H: int
    I: int  # noqa: E741 - the papers' name
    top_k: int
    num_layers: int  # the model's MoE layers (a demo may build fewer)
    activation: str = "silu"
    alpha: float | None = None
    limit: float | None = None

    def with_layers(self, n: int) -> MoEShape:
        return replace(self, num_layers=int(n))


# Hidden / intermediate sizes and expert counts from the models' configs (shared/spec/reference-behaviour.md section 7).
PRESETS = {
    "qwen3-30b-a3b": MoEShape("Qwen3-30B-A3B", 128, 2048, 768, 8, 48),
    "qwen3.6-35b-a3b": MoEShape("Qwen3.6-35B-A3B", 256, 2048, 512, 8, 40),
    "gemma-4-26b-a4b": MoEShape("gemma-4-26B-A4B", 128, 2816, 704, 8, 30, "gelu_tanh"),
    "gpt-oss-20b": MoEShape("gpt-oss-20b", 32, 2880, 2880, 4, 24, "swigluoai", 1.702, 7.0),
    "gpt-oss-120b": MoEShape("gpt-oss-120b", 128, 2880, 2880, 4, 36, "swigluoai", 1.702, 7.0),
    "deepseek-v4-flash": MoEShape("DeepSeek-V4-Flash", 256, 4096, 2048, 6, 43, "swiglu_clamp", 1.0, 10.0),
    "mixtral-8x7b": MoEShape("Mixtral-8x7B", 8, 4096, 14336, 2, 32),
}


def preset(name: str) -> MoEShape:
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"preset={name!r} is not known; expected one of {sorted(PRESETS)}")
    return PRESETS[key]
