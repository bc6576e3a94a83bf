"""A model's attention at decode on the CPU through cpumoe_formats' decode attention (C ABI 1.11), registered with
transformers as the attention implementation "moe_engine" (its official extension point: AttentionInterface and
AttentionMaskInterface, the mask made as for sdpa). A few query tokens over a bf16 cache on the CPU run the native
kernel on the calling thread, reading only the positions the mask lets through; everything else (prompts, other
devices or dtypes, masks it does not take, sinks, softcapping, dropout) goes to transformers' own sdpa.
An attention module bound to a CpuMoeExecutor (`bind`; from_pretrained's gemv path binds the experts' executor)
runs the kernel on the executor's threads, its tokens x kv heads as work items; otherwise on the calling thread.

Why: torch's CPU scaled_dot_product_attention takes ~0.5 ms a layer for one token over a 34-position static cache
on the 2-core Zen 4 VM (48 layers: ~24 ms of a ~111 ms token), and grows with the cache's length, not its filled
part. The kernel: see docs/end-to-end.md for the figures.

    from moe_engine.attention import register
    register()                                   # once; idempotent
    model.set_attn_implementation("moe_engine")  # or config._attn_implementation

Numerics: fp32 dots and softmax of the bf16 inputs, output rounded once to bf16 (cpumoe_formats.reference.attention
is its float64 reference); sdpa's CPU kernel rounds differently, so logits differ from sdpa's within bf16 rounding.
Thread contract: a pure function of its inputs; any number of threads may call it."""
from __future__ import annotations

import functools

import torch

NAME = "moe_engine"
MAX_TOKENS = 16  # query tokens a call runs natively (decode steps, a speculative draft); prompts go to sdpa


@functools.lru_cache(maxsize=1)
def _native():
    """The decode attention at the default tier (CPUMOE_ISA's cap or the best), made once per process."""
    from cpumoe_formats import DecodeAttention

    return DecodeAttention()


def _sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def _mask_ok(mask: torch.Tensor | None, B: int, n: int, L: int) -> bool:
    """A mask the kernel reads: None, or bool [B, 1, n, L] on the CPU with contiguous positions."""
    return mask is None or (mask.dtype is torch.bool and mask.dim() == 4 and tuple(mask.shape) == (B, 1, n, L)
                            and mask.stride(3) == 1 and mask.device.type == "cpu")


def native_ok(module, query, key, value, attention_mask, dropout=0.0, **kwargs) -> bool:
    """Whether decode_attention runs this call natively (see the module's doc for what goes to sdpa)."""
    bf = torch.bfloat16
    if (query.dtype is not bf or key.dtype is not bf or value.dtype is not bf or query.device.type != "cpu"
            or key.device.type != "cpu" or value.device.type != "cpu" or torch.compiler.is_compiling()):
        return False
    if (dropout and module.training) or any(kwargs.get(k) is not None for k in ("s_aux", "softcap", "position_bias")):
        return False
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
        return False
    B, Hq, n, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    if not (0 < n <= MAX_TOKENS and key.shape[0] == B and key.shape[3] == D and Hkv and Hq % Hkv == 0):
        return False
    if attention_mask is None and n > 1:  # sdpa's is_causal case: prompts, which sdpa runs well
        return False
    if query.stride(3) != 1 or key.stride(3) != 1 or value.stride(3) != 1:
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    return _mask_ok(attention_mask, B, n, L)


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: query [B, Hq, n, D], key and value [B, Hkv, L, D], attention_mask bool
    [B, 1, n, L] (True: attend) or None -> (attn_output [B, n, Hq, D], None)."""
    if not native_ok(module, query, key, value, attention_mask, dropout, **kwargs):
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    B, Hq, n, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    scale = float(scaling) if scaling is not None else D ** -0.5
    out = torch.empty((B, n, Hq, D), dtype=torch.bfloat16)
    ex = getattr(module, "_moe_engine_executor", None)
    run = ex.attention_raw if ex is not None else _native().run_raw
    e = 2  # bytes of a bf16 element: data_ptr() is in bytes, strides in elements
    for b in range(B):
        mp, mt = 0, 0
        if attention_mask is not None:
            mp, mt = attention_mask.data_ptr() + b * attention_mask.stride(0), attention_mask.stride(2)
        run(n, Hq // Hkv, D, L, Hkv,
                query.data_ptr() + e * b * query.stride(0), query.stride(2), query.stride(1),
                key.data_ptr() + e * b * key.stride(0), key.stride(1), key.stride(2),
                value.data_ptr() + e * b * value.stride(0), value.stride(1), value.stride(2),
                mp, mt, scale, out.data_ptr() + e * b * out.stride(0), out.stride(1), out.stride(2))
    return out, None


def bind(model, executor) -> int:
    """Runs the attention of every module of `model` whose class name ends in "Attention" (transformers' naming) on
    `executor`'s threads (a cpumoe_executor.CpuMoeExecutor; None: the calling thread again). Returns how many."""
    n = 0
    for m in model.modules():
        if type(m).__name__.endswith("Attention"):
            m._moe_engine_executor = executor
            n += 1
    return n


@functools.lru_cache(maxsize=1)
def register() -> str:
    """Registers NAME with transformers' AttentionInterface (decode_attention) and AttentionMaskInterface (sdpa's
    masks: bool, True = attend); returns NAME. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME
