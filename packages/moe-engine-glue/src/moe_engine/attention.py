"""A model's attention at decode on the CPU through cpumoe_formats' decode attention (C ABI 1.11), registered with
transformers as the attention implementation "moe_engine" (its official extension point: AttentionInterface and
AttentionMaskInterface, the mask made as for sdpa). A few query tokens over a bf16 cache on the CPU run the native
kernel on the calling thread, reading only the positions the mask lets through; everything else (prompts, other
devices or dtypes, masks it does not take, sinks, softcapping, dropout) goes to transformers' own sdpa.
An attention module bound to a CpuMoeExecutor (`bind`; from_pretrained's gemv path binds the experts' executor)
runs the kernel on the executor's threads, its tokens x kv heads as work items; otherwise on the calling thread.

Why: torch's CPU scaled_dot_product_attention reads a static cache's whole length, filled or not. One layer of
Qwen3-30B-A3B on the 2-core Zen 4 VM: 27 against sdpa's 834 us on a 4096-position cache holding 40, 26 against 68
at 34 positions; the full-size model decodes 1.29-1.38x llama.cpp at depth 2048 (docs/attention.md).

    from moe_engine.attention import register
    register()                                   # once; idempotent
    model.set_attn_implementation("moe_engine")  # or config._attn_implementation

Under torch.compile (GraphLoop's `compile` step) a call the kernel takes is one opaque node,
torch.ops.moe_engine.attention, instead of sdpa: inductor's sdpa path expands a static cache's kv heads to the query
heads and reads every position (4 layers on the 2-core VM, a 512-position cache, under torch.profiler: 2.2-2.5 ms a
layer against 26 us).

Numerics: fp32 dots and softmax of the bf16 inputs, output rounded once to bf16 (cpumoe_formats.reference.attention
is its float64 reference); sdpa's CPU kernel rounds differently, so logits differ from sdpa's within bf16 rounding.
Thread contract: a pure function of its inputs; any number of threads may call it."""
from __future__ import annotations

import functools

import torch

# the compiled call's executor, named by an int handle (op.py's registry)
from .op import register as _handle_of
from .op import runner_of as _object_of

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


def _plan(module, query, key, value, attention_mask, dropout, kwargs):
    """The native call's sizes and element strides, or None where the call goes to sdpa (see the module's doc).
    One pass over the tensors' attributes: at decode each read costs a fraction of a microsecond, 48 layers a token."""
    bf = torch.bfloat16
    if query.dtype is not bf or key.dtype is not bf or value.dtype is not bf:
        return None
    if (dropout and module.training) or kwargs and any(kwargs.get(k) is not None for k in _NOT_TAKEN):
        return None
    if not (query.is_cpu and key.is_cpu and value.is_cpu) or query.dim() != 4 or key.dim() != 4:
        return None
    B, Hq, n, D = query.shape
    kshape = key.shape
    _, Hkv, L, _ = kshape
    if value.shape != kshape or not (0 < n <= MAX_TOKENS and kshape[0] == B and kshape[3] == D and Hq % Hkv == 0):
        return None
    qs, ks, vs = query.stride(), key.stride(), value.stride()
    if qs[3] != 1 or ks[3] != 1 or vs[3] != 1:
        return None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    ms = (0, 0, 0, 1)
    if attention_mask is None:
        if n > 1:  # sdpa's is_causal case: prompts, which sdpa runs well
            return None
    else:
        m = attention_mask
        if m.dtype is not torch.bool or not m.is_cpu or m.dim() != 4 or m.shape != (B, 1, n, L):
            return None
        ms = m.stride()
        if ms[3] != 1:
            return None
    return B, Hq, n, D, Hkv, L, qs, ks, vs, ms


_NOT_TAKEN = ("s_aux", "softcap", "position_bias")


def native_ok(module, query, key, value, attention_mask, dropout=0.0, **kwargs) -> bool:
    """Whether decode_attention runs this call natively (see the module's doc for what goes to sdpa)."""
    return _plan(module, query, key, value, attention_mask, dropout, kwargs) is not None


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: query [B, Hq, n, D], key and value [B, Hkv, L, D], attention_mask bool
    [B, 1, n, L] (True: attend) or None -> (attn_output [B, n, Hq, D], None)."""
    plan = _plan(module, query, key, value, attention_mask, dropout, kwargs)
    if plan is None:
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    ex = getattr(module, "_moe_engine_executor", None)
    if torch.compiler.is_compiling():  # one opaque node; the op plans again on the real tensors
        h = getattr(module, "_moe_engine_handle", 0) if ex is not None else 0  # bind()'s, made eagerly
        return torch.ops.moe_engine.attention(query, key, value, attention_mask, scale, h), None
    return _run(plan, query, key, value, attention_mask, scale, ex), None


def _run(plan, query, key, value, attention_mask, scale: float, ex):
    """The native call on a plan of _plan: attn_output [B, n, Hq, D] (ex: a CpuMoeExecutor, or None for the calling
    thread)."""
    B, Hq, n, D, Hkv, L, qs, ks, vs, ms = plan
    out = torch.empty((B, n, Hq, D), dtype=torch.bfloat16)
    run = ex.attention_raw if ex is not None else _native().run_raw
    qp, kp, vp, op = query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr()
    mp = 0 if attention_mask is None else attention_mask.data_ptr()
    for b in range(B):  # data_ptr() is in bytes (2 a bf16 element, 1 a bool), strides in elements
        run(n, Hq // Hkv, D, L, Hkv, qp + 2 * b * qs[0], qs[2], qs[1], kp + 2 * b * ks[0], ks[1], ks[2],
            vp + 2 * b * vs[0], vs[1], vs[2], mp + b * ms[0] if mp else 0, ms[2], scale, op + 2 * b * n * Hq * D,
            Hq * D, D)
    return out


def bind(model, executor) -> int:
    """Runs the attention of every module of `model` whose class name ends in "Attention" (transformers' naming) on
    `executor`'s threads (a cpumoe_executor.CpuMoeExecutor; None: the calling thread again). Returns how many."""
    h = 0 if executor is None else _handle_of(executor)  # the compiled step's name for it (attention_op)
    n = 0
    for m in model.modules():
        if type(m).__name__.endswith("Attention"):
            m._moe_engine_executor, m._moe_engine_handle = executor, h
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


@torch.library.custom_op("moe_engine::attention", mutates_args=())
def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                 scale: float, executor: int) -> torch.Tensor:
    """moe_engine.attention's decode kernel: query [B, Hq, n, D], key and value [B, Hkv, L, D] bf16, attention_mask
    bool [B, 1, n, L] or None -> [B, n, Hq, D]. The caller planned on the traced tensors; the strides a compiled graph
    hands in may differ, so the plan is made again (last dimensions made contiguous where they are not)."""
    ex = _object_of(executor) if executor else None
    plan = _plan(None, query, key, value, attention_mask, 0.0, {})
    if plan is None:
        query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
        if attention_mask is not None and attention_mask.stride(-1) != 1:
            attention_mask = attention_mask.contiguous()
        plan = _plan(None, query, key, value, attention_mask, 0.0, {})
        if plan is None:
            raise ValueError(f"moe_engine.attention: query {tuple(query.shape)} {query.dtype}, key "
                             f"{tuple(key.shape)}: expected the decode shapes moe_engine.attention.native_ok takes")
    return _run(plan, query, key, value, attention_mask, scale, ex)


@attention_op.register_fake
def _(query, key, value, attention_mask, scale, executor):
    B, Hq, n, D = query.shape
    return query.new_empty((B, n, Hq, D))
