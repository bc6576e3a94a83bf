"""The non-expert decode path of a from_pretrained model (attention, routers, norms, the LM head, generate()'s cache):
which one runs, chosen once at load (`decode=`), with one log line naming it and why.

  eager    transformers' defaults: dynamic cache, nn.Linear on the bf16 weights (aten::mm).
  packed   every bf16 nn.Linear on the CPU (q/k/v/o projections, dense MLPs, the LM head) becomes a PackedLinear:
           its weight reordered once into oneDNN's blocked layout (the reorder inductor's freezing pass makes) and
           multiplied by oneDNN's inner product. Same bytes, same bf16 products with fp32 accumulation; on the dev
           VM's Zen 4 at batch 1 it takes 1.36x less CPU time than aten::mm on the same weight (q_proj 4096x2048:
           1.49 vs 2.03 ms; the 151936x2048 head 47 vs 62 ms, one thread), and 1.1x less at 64 tokens (prefill).
  static   packed, plus transformers' static cache (generation_config.cache_implementation = "static"): no cache
           growth per token (torch.cat of every layer's keys and values).
  compile  static cache and torch.compile of the whole forward (inductor, fullgraph, dynamic=False; the experts are
           one opaque node, torch.ops.moe_engine.experts). With the runner's CPU executor (strategy cpu on the CPU)
           the linears, routers and decode attention are gemv's, each an opaque node too (torch.ops.moe_engine.linear
           / .attention), and inductor fuses what is left (norms, rotary, the cache update, residuals, the routers'
           softmax and top-k); elsewhere the weights stay plain bf16 (aten's products). It compiles for a minute
           or more before the first token, so auto does not pick it.
           On a GPU, GraphLoop (moe-engine bench / generate) compiles its step and captures inductor's kernels: the
           full-size Q4_0 file with a quarter of the expert bytes on an H200 decoded 110.9 tok/s against eager's
           70.7 (docs/end-to-end.md). auto leaves it to be asked for: the compile adds ~45 s before the first
           token, and the first stretch of tokens after it runs slow (every compiled run's first timed repeat, on
           an H100 and an H200: strategy cpu 11.4 then 79-80 tok/s; not seen eagerly), so a short generation loses.
  gemv     static cache, and every bf16 nn.Linear on the CPU (the LM head included, tied or not) a
           moe_engine.dense.DenseLinear: products of up to 8 tokens run on the experts' executor's threads through
           cpumoe_formats' dense bf16 linear (its weight read at the DRAM read ceiling), more tokens through F.linear
           on the same weight (no copy, no repack). Needs the runner's CPU executor (strategy cpu).
  attention  on the CPU paths (packed, static, gemv) a model on transformers' sdpa attention gets moe_engine.attention's
           instead (registered as "moe_engine"): a few query tokens run cpumoe_formats' decode attention, which reads
           only the cache positions the mask lets through; prompts and everything else stay on sdpa. One layer on
           the 2-core Zen 4 VM: 26 against sdpa's 68 us at 34 positions, 27 against 834 us on a 4096-position static
           cache holding 40 (docs/attention.md). attention="sdpa" keeps transformers' own.
  auto     gemv where the runner has a CPU executor (strategy cpu on the CPU); else static on a CPU whose oneDNN runs
           bf16 (probed: one packed product checked against aten's); eager where the non-expert weights are on a
           GPU (moe-engine bench captures CUDA graphs itself) or the probe fails.

Thread contract: apply() edits a model before it is shared (the from_pretrained call); PackedLinear.forward is a
pure function of its input (any number of threads)."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("moe_engine")
DECODE_PATHS = ("auto", "eager", "packed", "static", "compile", "gemv")
ATTENTION = ("auto", "sdpa")


class PackedLinear(torch.nn.Module):
    """A bf16 nn.Linear whose weight lives in oneDNN's blocked layout (torch.ops.mkldnn._reorder_linear_weight) and
    runs through oneDNN's inner product (torch.ops.mkldnn._linear_pointwise). The packed weight is an opaque tensor:
    it is not a parameter (state_dict and parameters() leave it out) and the module is for inference only."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)  # the layout oneDNN picks for batch 1
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def forward(self, x):
        if x.shape[-1] != self.in_features:
            raise ValueError(f"PackedLinear: input's last dimension is {x.shape[-1]}, expected {self.in_features}")
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(xb.contiguous(), self.packed, self.bias, "none", [], "")
        return y if x.dtype == torch.bfloat16 else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               "weight=oneDNN packed bf16"


def _one_of(name: str, value, choices: tuple) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def check(decode) -> str:
    return _one_of("decode", decode, DECODE_PATHS)


def check_attention(attention) -> str:
    return _one_of("attention", attention, ATTENTION)


def _probe() -> str | None:
    """Why oneDNN's packed bf16 product cannot serve here, or None when it can (one small product checked against
    aten's: a build or CPU without bf16 oneDNN raises or differs)."""
    if not torch.backends.mkldnn.is_available():
        return "torch is built without oneDNN"
    try:
        g = torch.Generator().manual_seed(0)
        lin = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
        lin.weight.data = torch.randn(48, 64, generator=g).to(torch.bfloat16)
        x = torch.randn(1, 64, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            want = x.double() @ lin.weight.double().t()
            got = PackedLinear(lin)(x).double()
    except RuntimeError as e:
        return f"oneDNN's bf16 inner product failed ({str(e).splitlines()[0]})"
    err = float((got - want).abs().max() / want.abs().max())
    return None if err < 1e-2 else f"oneDNN's bf16 inner product is off by {err:.1e}"  # bf16 output rounding: 4e-3


def _executor(runner):
    """The runner's CPU executor where its linears can run there (strategy cpu, activations on the CPU), else None."""
    if runner is None or runner.strategy != "cpu" or runner.device.type != "cpu":
        return None
    return runner.executor


def resolve(decode: str, device, runner=None) -> tuple[str, str]:
    """(path, why) for decode= on the device the non-expert weights live on; runner: the model's MoERunner."""
    check(decode)
    if decode == "gemv" and _executor(runner) is None:
        raise ValueError("decode='gemv' runs the linears on the experts' CPU executor: it needs strategy='cpu' with "
                         f"the model on the CPU (this runner: strategy {getattr(runner, 'strategy', None)}, device "
                         f"{getattr(runner, 'device', None)})")
    if decode != "auto":
        return decode, "asked for"
    if device.type != "cpu":
        return "eager", f"non-expert weights on {device.type} (transformers' own path)"
    ex = _executor(runner)
    if ex is not None:
        return "gemv", f"CPU executor: its dense bf16 linear ({ex.linear_isa}) on its threads and the static cache"
    why_not = _probe()
    if why_not is not None:
        return "eager", why_not
    return "static", "CPU with oneDNN bf16: packed linears (1.36x less CPU time a product at batch 1) and the static " \
                     "cache; torch.compile measured no faster here"


def pack_linears(model) -> int:
    """Swap every bf16 nn.Linear on the CPU for a PackedLinear (a weight shared with the input embeddings is left:
    packing it would keep a second copy). Returns how many were swapped."""
    emb = model.get_input_embeddings()
    shared = {id(emb.weight)} if emb is not None else set()
    # names only: each original weight is freed as soon as its packed copy exists (holding the modules until the end
    # kept every bf16 weight twice at once, +2.4 GB of peak RSS at Qwen3-30B-A3B's shape)
    todo = [name for name, m in model.named_modules()
            if type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"
            and id(m.weight) not in shared]
    for name in todo:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, PackedLinear(getattr(owner, leaf)))
    return len(todo)


def dense_linears(model, runner) -> tuple[int, int]:
    """Swap every bf16 nn.Linear on the CPU (the LM head too, tied or not: the same Parameter is kept) for a
    DenseLinear on the runner's executor, and make the weight of every MoE router that holds its own (a module
    whose class name ends in "Router", transformers' convention, with a 2-D bf16 CPU `weight`) a DenseWeight: its
    F.linear runs there too. Returns (linears, routers)."""
    from ...dense import DenseLinear, DenseWeight

    ex = _executor(runner)
    todo = [name for name, m in model.named_modules()
            if type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"]
    for name in todo:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, DenseLinear(getattr(owner, leaf), ex, runner.handle))
    routers = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (type(m).__name__.endswith("Router") and type(w) is torch.nn.Parameter and w.dim() == 2
                and w.dtype == torch.bfloat16 and w.device.type == "cpu"):
            m.weight = DenseWeight(w.data, ex)
            routers += 1
    return len(todo), routers


# the compile path's torch.compile settings: generate()'s CompileConfig and GraphLoop's step both take them
COMPILE = dict(fullgraph=True, dynamic=False, backend="inductor")


def compile_config():
    """transformers' CompileConfig for the compile path: inductor, fullgraph, static shapes, on any device."""
    from transformers import CompileConfig

    cc = CompileConfig(**COMPILE, mode="default")
    cc._compile_all_devices = True  # generate() compiles only on GPUs unless told
    return cc


def use_decode_attention(model, runner=None) -> str:
    """Switches a model on sdpa (transformers' default) to moe_engine.attention's implementation, on the runner's
    CPU executor's threads where it has one; returns what its attention runs now, for the log line. Another
    implementation the user chose (eager, flash, flex) is kept."""
    from ...attention import MAX_TOKENS, _native, bind, register

    cur = getattr(model.config, "_attn_implementation", None)
    if cur != "sdpa":
        return f"attention {cur} (as loaded)"
    model.set_attn_implementation(register())
    ex = _executor(runner)
    bind(model, ex)
    where = f"{ex.attention_isa}, on the executor's threads" if ex is not None else f"{_native().name}"
    return f"attention on cpumoe_formats' decode attention ({where}) for up to {MAX_TOKENS} tokens, sdpa for prompts"


def apply(model, decode: str, device, runner=None, attention: str = "auto") -> tuple[str, str]:
    """Set up the decode path on a loaded model (before its first generate()); returns (path, why) as logged.
    runner: the model's MoERunner (decode gemv runs on its executor). attention: auto or sdpa (check_attention)."""
    path, why = resolve(decode, device, runner)
    gc = model.generation_config
    detail = ""
    if path in ("packed", "static"):
        n = pack_linears(model)
        detail = f"; {n} linears packed"
    on_ex = path == "gemv" or (path == "compile" and device.type == "cpu" and _executor(runner) is not None)
    if on_ex:  # compile with a CPU executor: gemv's linears and attention, each one opaque node of the graph
        n, r = dense_linears(model, runner)
        detail = f"; {n} linears and {r} routers on the executor"
    if path in ("static", "compile", "gemv"):
        gc.cache_implementation = "static"
    if (path in ("packed", "static") or on_ex) and device.type == "cpu":
        detail += "; " + (use_decode_attention(model, runner) if check_attention(attention) == "auto"
                          else "attention sdpa (asked for)")
    if path == "compile":
        gc.compile_config = compile_config()
    model._moe_engine_decode = path
    log.info("from_pretrained: decode path %s (%s%s)", path, why, detail)
    return path, why + detail
