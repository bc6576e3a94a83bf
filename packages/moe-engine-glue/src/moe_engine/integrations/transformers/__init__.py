"""moe_engine behind Hugging Face transformers' experts dispatch (transformers >= 5).

transformers 5 runs every experts module decorated with `@use_experts_implementation` through a registered function
chosen by `config._experts_implementation` (`ExpertsInterface`, `ALL_EXPERTS_FUNCTIONS`; FP8 block checkpoints swap in
`FP8Experts`, dispatched through `FP8ExpertsInterface`). Importing this module registers the name "moe_engine" in both;
`offload_experts(model, ...)` then converts every experts module's weights into banks once, builds one MoERunner for all
of the model's MoE layers (one CPU executor), frees the modules' expert weights and selects "moe_engine" with
`model.set_experts_implementation`. Routers, shared experts (DeepSeek-V3, Qwen3-Next, Qwen3.5), routed_scaling_factor
(applied by DeepSeek-V3's router to the weights it passes), attention and caches stay as transformers runs them.

gpt-oss's MXFP4 experts (`Mxfp4GptOssExperts`, loaded only where the hub's Triton kernels are) are not dispatched:
their MLP calls the kernels directly, on Triton-swizzled weights. offload_experts replaces each such MLP with
transformers' own `GptOssMLP` around the same router and a decorated `GptOssExperts` (no weights), as transformers'
quantizers replace modules, and reads the experts from the checkpoint's `*_blocks` / `*_scales` (exact). Elsewhere
transformers loads MXFP4 (and FP8, GGUF) checkpoints dequantized into the decorated modules: pass `checkpoint=` to
read the experts in their shipped layout instead of requantizing the dequantized values (moe_engine.checkpoints).

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    offload_experts(model, format="fp8_block", strategy="cpu")    # or checkpoint=path (its own layout)
    model.generate(...)

Architectures and how their experts map onto a format (banks: gate rows then up rows, router weight on the output):
  Qwen3MoeExperts, MixtralExperts, DeepseekV3Experts, Qwen3NextExperts, Qwen3_5MoeExperts: gate_up [E, 2I, H]
    (gate; up), down [E, H, I], activation config.hidden_act (silu)
  GptOssExperts: gate_up [E, H, 2I] with columns interleaved (gate 2j, up 2j+1), down [E, I, H], biases;
    swigluoai(alpha, limit)
  FP8Experts: e4m3 gate_up / down with fp32 128x128 scale_inv; the activation its _apply_gate computes
gpt-oss's biases go into mxfp4's bias banks; a format without them (bf16, fp8_block, q4_0, ...) gets the gate_up bias
as one more input column (x gains a constant 1 and zeros up to a multiple of 32: exact) and the down bias added after
the executor, weighted by each route's router weight (sum_k w_k b[e_k], as transformers adds it).
"""
from __future__ import annotations

from .adapter import NAME, Binding, Offloaded, experts_forward, register
from .experts import ExpertsSpec, decoder_layer, find_experts, inspect_experts
from .load import from_pretrained
from .offload import offload_experts

try:  # registering needs transformers; importing this package without it still gives the helpers a clear error
    register()
except ImportError:  # pragma: no cover
    pass

__all__ = ["NAME", "Binding", "ExpertsSpec", "Offloaded", "decoder_layer", "experts_forward", "find_experts",
           "from_pretrained", "inspect_experts", "offload_experts", "register"]
