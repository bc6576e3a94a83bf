"""The model shapes synthetic checkpoints are written in: full size as the shipped models, and small variants that
keep each architecture's structure (qk-norm, GQA, top-k routing; gpt-oss's sinks, biases and alternating sliding
attention) at dimensions that load in seconds."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Shape:
    """One model's dimensions. Thread contract: immutable, shareable between threads."""

    arch: str  # GGUF architecture name: "qwen3moe" | "gpt-oss"
    layers: int
    hidden: int
    experts: int
    top_k: int
    moe_inter: int  # one expert's intermediate size
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float
    rope_theta: float
    dense_inter: int  # config.intermediate_size (qwen3moe: no dense layer uses it; gpt-oss: = moe_inter)
    max_pos: int
    sliding_window: int = 0  # gpt-oss: every even layer attends to the last `sliding_window` tokens

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_types(self) -> list[str]:
        """gpt-oss's attention per layer: sliding first, then full, alternating (as openai/gpt-oss-20b)."""
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.layers)]


# Qwen/Qwen3-30B-A3B (config.json) and openai/gpt-oss-20b (config.json).
# Small qwen3moe keeps moe_inter = 768: transformers 5.25's GGUF loader maps no `expert_feed_forward_length` for
# qwen3_moe, so a GGUF file whose experts are not 768 wide does not load there (Qwen3MoeConfig's default is 768).
# 256 divides every small dimension, so the K-quants' 256-value blocks and FP8's 128 x 128 blocks tile exactly.
PRESETS = {
    ("qwen3moe", False): Shape("qwen3moe", layers=48, hidden=2048, experts=128, top_k=8, moe_inter=768, heads=32,
                               kv_heads=4, head_dim=128, vocab=151936, rms_eps=1e-6, rope_theta=1e6,
                               dense_inter=6144, max_pos=40960),
    ("qwen3moe", True): Shape("qwen3moe", layers=4, hidden=256, experts=16, top_k=4, moe_inter=768, heads=4,
                              kv_heads=2, head_dim=64, vocab=2048, rms_eps=1e-6, rope_theta=1e6, dense_inter=1024,
                              max_pos=4096),
    ("gpt-oss", False): Shape("gpt-oss", layers=24, hidden=2880, experts=32, top_k=4, moe_inter=2880, heads=64,
                              kv_heads=8, head_dim=64, vocab=201088, rms_eps=1e-5, rope_theta=150000.0,
                              dense_inter=2880, max_pos=131072, sliding_window=128),
    ("gpt-oss", True): Shape("gpt-oss", layers=4, hidden=256, experts=8, top_k=2, moe_inter=256, heads=4,
                             kv_heads=2, head_dim=64, vocab=2048, rms_eps=1e-5, rope_theta=150000.0, dense_inter=256,
                             max_pos=4096, sliding_window=128),
}
ARCHS = sorted({a for a, _ in PRESETS})


def get_shape(arch: str, small: bool = False, layers: int | None = None) -> Shape:
    """The preset for `arch` ('qwen3moe' | 'gpt-oss'), small or full size, with `layers` decoder layers if given."""
    if (arch, bool(small)) not in PRESETS:
        raise ValueError(f"shape {arch!r}: expected one of {ARCHS}")
    s = PRESETS[(arch, bool(small))]
    if layers is not None:
        if not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers={layers!r}: expected a positive int")
        s = replace(s, layers=layers)
    return s
