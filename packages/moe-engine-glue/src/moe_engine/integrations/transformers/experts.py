"""What one experts module holds: its kind (standard, gpt-oss, FP8Experts, gpt-oss's MXFP4 Triton module), shape
and activation, read from the module (works on the meta device: only attributes and shapes are read). Raises for
anything not mapped exactly.

Thread contract: plain functions over the modules they are given."""
from __future__ import annotations

import re
from dataclasses import dataclass

_HF_ACT = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_STANDARD = ("Qwen3MoeExperts", "MixtralExperts", "DeepseekV3Experts", "Qwen3NextExperts", "Qwen3_5MoeExperts")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class ExpertsSpec:
    """One experts module as its architecture stores it."""

    kind: str  # standard | gpt_oss | fp8 | mxfp4_triton
    E: int
    H: int
    I: int  # noqa: E741
    activation: str
    alpha: float | None = None
    limit: float | None = None
    bias: bool = False


def _hf_activation(config, module) -> str:
    name = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if name not in _HF_ACT:
        raise NotImplementedError(f"{type(module).__name__}: hidden_act={name!r} has no moe_engine activation; "
                                  f"expected one of {sorted(_HF_ACT)}")
    return _HF_ACT[name]


def inspect_experts(module) -> ExpertsSpec:
    """How `module` stores its experts and which activation they use; raises for anything not mapped exactly."""
    cls = type(module).__name__
    names = {c.__name__ for c in type(module).__mro__}
    if "Mxfp4GptOssExperts" in names:
        return ExpertsSpec("mxfp4_triton", module.num_experts, module.hidden_size, module.intermediate_size,
                           "swigluoai", float(module.alpha), float(module.limit), True)
    if "FP8Experts" in names:
        return _inspect_fp8(module)
    if not hasattr(module, "is_transposed"):
        raise NotImplementedError(f"{cls}: not an experts module transformers dispatches (@use_experts_implementation)")
    if not module.has_gate or getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError(f"{cls}: experts without a gate or with a post-expert norm have no moe_engine format")
    gu = module.gate_up_proj
    if cls == "GptOssExperts" or (module.is_transposed and not module.is_concatenated and module.has_bias
                                  and hasattr(module, "alpha") and hasattr(module, "limit")):
        E, H, I2 = gu.shape
        return ExpertsSpec("gpt_oss", E, H, I2 // 2, "swigluoai", float(module.alpha), float(module.limit), True)
    from transformers.integrations.moe import _default_apply_gate

    if module.is_transposed or not module.is_concatenated or module.has_bias:
        raise NotImplementedError(f"{cls}: is_transposed={module.is_transposed} is_concatenated="
                                  f"{module.is_concatenated} has_bias={module.has_bias} is not a mapped layout")
    if cls not in _STANDARD and getattr(type(module), "_apply_gate", None) is not _default_apply_gate:
        raise NotImplementedError(f"{cls}: a custom _apply_gate has no exact moe_engine activation")
    E, I2, H = gu.shape
    return ExpertsSpec("standard", E, H, I2 // 2, _hf_activation(module.config, module))


def _inspect_fp8(module) -> ExpertsSpec:
    cls = type(module).__name__
    if not module.has_gate or module.has_bias:
        raise NotImplementedError(f"{cls}: FP8 experts without a gate or with biases are not mapped")
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        raise NotImplementedError(f"{cls}: activation_scheme={module.activation_scheme!r} (static activation scales) "
                                  "is not an fp8_block mode (W8A16)")
    if getattr(module, "gate_softcap", None) is not None or getattr(module, "limit_after_act", False):
        raise NotImplementedError(f"{cls}: softcapped / limit-after-activation gates have no moe_engine activation")
    fp8 = module.gate_up_proj.element_size() == 1
    if fp8 and tuple(module.block_size or ()) != (128, 128):
        raise NotImplementedError(f"{cls}: block_size={module.block_size}, expected (128, 128) (fp8_block)")
    E, I2, H = module.gate_up_proj.shape
    kind = "fp8" if fp8 else "standard"
    alpha, limit = getattr(module, "swiglu_alpha", None), getattr(module, "limit", None)
    if alpha is not None:
        return ExpertsSpec(kind, E, H, I2 // 2, "swigluoai", float(alpha), float(limit))
    act = _hf_activation(module.config, module)
    if limit is not None:
        if act != "silu":
            raise NotImplementedError(f"{cls}: a clamped {act} gate has no moe_engine activation")
        return ExpertsSpec(kind, E, H, I2 // 2, "swiglu_clamp", 1.0, float(limit))
    return ExpertsSpec(kind, E, H, I2 // 2, act)


def find_experts(model) -> list[tuple[str, object]]:
    """(qualified name, module) of every experts module, in model order."""
    out = []
    for name, m in model.named_modules():
        names = {c.__name__ for c in type(m).__mro__}
        if "Mxfp4GptOssExperts" in names or "FP8Experts" in names or (
                hasattr(m, "is_transposed") and hasattr(m, "has_gate") and hasattr(m, "gate_up_proj")):
            out.append((name, m))
    return out


def decoder_layer(name: str, default: int) -> int:
    """The decoder layer index in a module's qualified name (`...layers.N....`), else `default`."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else default
