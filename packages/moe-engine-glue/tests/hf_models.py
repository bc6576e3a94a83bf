"""Tiny randomly initialised transformers models of each MoE architecture moe_engine maps (test_transformers*.py,
test_checkpoints.py), and helpers to compare them. H = I = 128 (one 128-block for fp8_block, four 32-blocks for
q4_0 / mxfp4), 8 experts, top-2, 2 MoE layers, vocab 256."""
from __future__ import annotations

import copy

import torch

H, I, E, K, V = 128, 128, 8, 2, 256  # noqa: E741
ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen3_next", "qwen3_5_moe")
_ATTN = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=V,
             max_position_embeddings=512, tie_word_embeddings=False)


def config(arch: str, experts: int = E, top_k: int = K):
    """The tiny config of `arch` with `experts` routed experts, `top_k` per token."""
    import transformers as tf

    E, K = experts, top_k  # noqa: N806

    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_ATTN, intermediate_size=256, moe_intermediate_size=I, num_hidden_layers=2,
                                 num_experts=E, num_experts_per_tok=K, norm_topk_prob=True)
    if arch == "mixtral":
        return tf.MixtralConfig(**_ATTN, intermediate_size=I, num_hidden_layers=2, num_local_experts=E,
                                num_experts_per_tok=K)
    if arch == "deepseek_v3":  # layer 0 dense (first_k_dense_replace), 1-2 MoE with a shared expert
        return tf.DeepseekV3Config(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, vocab_size=V,
                                   max_position_embeddings=512, tie_word_embeddings=False, intermediate_size=256,
                                   moe_intermediate_size=I, num_hidden_layers=3, first_k_dense_replace=1,
                                   n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=K,
                                   n_group=2 if E > K else 1, topk_group=1, routed_scaling_factor=2.5,
                                   q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                   v_head_dim=32, rope_interleave=True)
    if arch == "gpt_oss":
        return tf.GptOssConfig(**_ATTN, intermediate_size=I, num_hidden_layers=2, num_local_experts=E,
                               num_experts_per_tok=K, sliding_window=64, layer_types=["sliding_attention",
                                                                                        "full_attention"])
    if arch == "qwen3_next":  # one gated-delta-net layer, one full-attention layer, both MoE with a shared expert
        return tf.Qwen3NextConfig(**_ATTN, intermediate_size=256, moe_intermediate_size=I,
                                  shared_expert_intermediate_size=I, num_hidden_layers=2, num_experts=E,
                                  num_experts_per_tok=K, layer_types=["linear_attention", "full_attention"],
                                  linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
                                  linear_value_head_dim=32, linear_conv_kernel_dim=4)
    if arch == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(**_ATTN, moe_intermediate_size=I, shared_expert_intermediate_size=I,
                                    num_hidden_layers=2, num_experts=E, num_experts_per_tok=K,
                                    layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                                    linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
                                    linear_conv_kernel_dim=4)
    raise ValueError(arch)


def model_class(arch: str):
    import transformers as tf

    return {"qwen3_moe": tf.Qwen3MoeForCausalLM, "mixtral": tf.MixtralForCausalLM,
            "deepseek_v3": tf.DeepseekV3ForCausalLM, "gpt_oss": tf.GptOssForCausalLM,
            "qwen3_next": tf.Qwen3NextForCausalLM, "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM}[arch]


def build(arch: str, seed: int = 0, dtype=torch.bfloat16, scale: float = 1.0, experts: int = E, top_k: int = K):
    """A random model in eval mode. Every expert weight (and gpt-oss's biases, router bias) is drawn N(0, 0.05)
    times `scale`, so the experts move the logits well above bf16 rounding, and lm_head ~N(0, 0.5) spreads the
    logits so greedy decoding has margins."""
    torch.manual_seed(seed)
    cfg = config(arch, experts, top_k)
    m = model_class(arch)(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".experts." in name or name.endswith("router.bias"):
                p.copy_((torch.randn(p.shape, generator=g) * 0.05 * scale).to(dtype))
            elif name.startswith("lm_head"):
                p.copy_((torch.randn(p.shape, generator=g) * 0.5).to(dtype))
    return m


def clone(model):
    return copy.deepcopy(model)


def experts_modules(model):
    from moe_engine.integrations.transformers import find_experts

    return find_experts(model)


@torch.no_grad()
def layer_pairs(ref, ours, ids) -> list[tuple[str, object, object]]:
    """Each experts module's output in `ref` and in `ours` on the same inputs (the ones `ref` gave that module when
    it ran `ids`): (name, ref_y, ours_y). Routing flips downstream cannot blur this comparison."""
    seen = {}

    def keep(name):
        def hook(mod, inp, out):
            seen.setdefault(name, (inp, out))  # the first call (the prompt); returning None keeps `out`
        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in experts_modules(ref)]
    try:
        ref(ids)
    finally:
        for h in hooks:
            h.remove()
    mods = dict(experts_modules(ours))
    return [(n, y, mods[n](*inp)) for n, (inp, y) in seen.items()]


def prompt(batch: int = 1, length: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, V, (batch, length), generator=g)


@torch.no_grad()
def logits(model, ids):
    return model(ids).logits.float()


def rel(a, b) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def greedy(model, ids, steps: int = 32, **kw):
    return model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0, **kw)
