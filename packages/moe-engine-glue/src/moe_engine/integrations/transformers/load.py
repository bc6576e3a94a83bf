"""from_pretrained: a transformers model from a shipped checkpoint, its routed experts streamed layer by layer from
the file into banks and served by one MoERunner; the float copy of the experts is never made.

Order of work, each step before anything heavier: the path; the config; the skeleton (meta device) and its experts
modules; the experts' format in the file; the GPU budget (what goes where, one log line); the non-expert weights
onto their device; the experts, layer by layer (progress bar), into banks; the runner (qualified); the binding.

Banks and the file's bytes. GGUF experts in Q4_0, Q8_0, Q4_K, Q5_K, Q6_K (Q5_K where cpumoe_formats has q5_k) are their
format's banks block for block; each layer's (gate_up, down) formats come from its tensors' types, so a Q4_K_M or Q5_K_M
file (down Q6_K in some layers) runs as shipped. GGUF keeps a layer's gate and up experts as two tensors and the bank
fuses them per expert (gate rows, then up rows), so the bytes are copied, never mapped; where the executor runs another
CPU layout (q4_0_x16, q8_0_x16, q4_k_x16, q5_k_x16, q6_k_x16 from avx2), a CPU-only model converts each layer,
matrix by matrix, right after reading it, so the process holds one copy of the experts. With a GPU the host keeps
the banks in the file's formats (the GPU experts load from them) and the executor its own layout beside them.

Thread contract: from_pretrained is a plain function; the model it returns follows transformers' (one generate()
at a time) and its runner MoERunner's (shareable)."""
from __future__ import annotations

import gc
import logging
import time

import cpumoe_formats as cf

from ... import layer_formats
from ...loading import budget, heap
from ...progress import bar
from . import decode as decode_path
from . import skeleton
from .adapter import NAME, Binding, Offloaded, register
from .experts import decoder_layer, find_experts, inspect_experts
from .sources import open_source

log = logging.getLogger("moe_engine")


def _cpu_layout(fmt: str, H: int, I: int, mode, isa) -> str:  # noqa: E741
    from cpumoe_executor import cpu_layout

    return cpu_layout(fmt, H=H, I=I, mode=mode, isa=isa)


def _cpu_pairs(pairs, H: int, I: int, kwargs) -> list[tuple]:  # noqa: E741
    """Each layer's (gate_up, down) formats as the CPU executor runs them, for the mode / isa in kwargs."""
    return [tuple(_cpu_layout(f, H, I, kwargs.get("mode"), kwargs.get("isa")) for f in p) for p in pairs]


def from_pretrained(path, gguf_file=None, *, format=None, strategy="auto", device=None, gpu_memory=None,  # noqa: A002
                    threads=None, dtype=None, kv_length: int = 4096, kv_batch: int = 1, host_memory=None,
                    allow_nonfinite: bool = False, progress: bool = True, decode: str = "auto", attention: str = "auto",
                    **kwargs):
    """A transformers model ready for generate(), its routed experts served by moe_engine (`model.moe_engine`).

    path: a Hugging Face directory (config.json + *.safetensors: bf16, FP8 block, gpt-oss MXFP4, ModelOpt NVFP4) or
        a GGUF file (or the directory holding it, with gguf_file= its name); the config comes from the file.
    format: the banks' format where the experts are stored in floats (bf16 safetensors): quantized layer by layer
        to it (default bf16); a quantized checkpoint's own format otherwise (format may only repeat it). GGUF experts
        are served as shipped in Q4_0, Q8_0, Q4_K, Q5_K, Q6_K (Q5_K with cpumoe_formats' q5_k), a (gate_up, down) format
        per layer from the tensors' types (Q4_K_M, Q5_K_M); other types are refused before anything heavy is read.
    strategy: auto (gpu where every expert fits the budget, hybrid otherwise, cpu without a GPU), cpu, hybrid, gpu.
    device: where the non-expert weights and activations live (default cuda if torch sees a GPU, else cpu).
    gpu_memory: the GPU bytes this model may use (int or '16GiB'; default: the device's free memory): non-expert
        weights, a KV cache of kv_length tokens x kv_batch sequences, a reserve, then as many experts as fit.
    threads: the CPU executor's workers. dtype: the non-expert weights' dtype (default torch.bfloat16).
    host_memory: the host bytes the experts may take (int or '48GiB'; default: MemAvailable when the load starts).
        Beside a GPU with strategy hybrid, each layer is put in the CPU executor's layout as it is read (q4_0 ->
        q4_0_x16, fp8_block -> fp8_block_x16, ...), and the GPU loads its experts from that one copy (gpu/moved.py).
        Only where a layout is not the format's bytes moved (mxfp4's: mxfp4_panel, mxfp4_x16) would the CPU's layout
        be a second copy beside the banks the GPU loads from; host_memory decides that case: two copies where they fit,
        else the executor runs the GPU's banks as they are (loading/budget.py host_copy). One log line says which
        and why; repack= overrides it. Without a GPU, or with strategy cpu, there is one copy whatever it is.
    allow_nonfinite: load NaN / Inf scales instead of refusing them (they then propagate as the reference says).
    decode: the non-expert decode path (decode.py): auto (gemv with strategy cpu on the CPU, else static on a CPU
        with oneDNN bf16, else eager), eager, packed (oneDNN-packed bf16 linears), static (packed + transformers'
        static cache), compile (static cache + torch.compile), gemv (the linears' few-token products on the
        executor's threads + the static cache); one log line names the choice and why, model.moe_engine.decode
        keeps it.
    attention: auto (on the CPU decode paths packed, static and gemv, a model on transformers' sdpa gets
        moe_engine.attention: up to 16 query tokens through cpumoe_formats' decode attention, on the executor's
        threads under gemv) or sdpa (transformers' own everywhere). The decode path's log line says which.
    kwargs: MoERunner's other keywords (residency, graph_batch_sizes, max_tokens, mode, isa, handshake, qualify,
        prefill, pin_memory: on a GPU with experts on the CPU it defaults to True, the host banks page-locked up to
        half of MemAvailable, so a prompt's staged experts copy at link speed; False keeps them pageable).
        residency: which experts hybrid's GPU share holds: the budget's slots in every layer, "hot" (the default:
        each layer's most-routed, re-placed from routing counts) or "random" or "uniform"; or "layers" (whole
        layers, the last ones, as llama.cpp's --n-cpu-moe).
    """
    import torch

    from ...runner import MoERunner
    from ...validate import device as check_device
    from ..model_edit import ModelEdit

    t0 = time.perf_counter()
    dtype = torch.bfloat16 if dtype is None else dtype
    dev = check_device(torch, device)
    decode_path.check(decode)
    decode_path.check_attention(attention)
    limit = budget.parse_bytes(gpu_memory) if gpu_memory is not None else None
    host_limit = budget.parse_bytes(host_memory, "host_memory") if host_memory is not None else None
    for name, v in (("kv_length", kv_length), ("kv_batch", kv_batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: expected a positive int")
    src = open_source(path, gguf_file, allow_nonfinite)
    try:
        register()
        model = skeleton.build(src.config, dtype)
        found = find_experts(model)
        if not found:
            raise NotImplementedError(f"{type(model).__name__} ({src.config.model_type}): no experts module "
                                      "transformers dispatches (@use_experts_implementation); moe_engine cannot serve "
                                      "its experts")
        specs = [inspect_experts(m) for _, m in found]
        first = specs[0]
        E, H, I = first.E, first.H, first.I  # noqa: E741
        layers = [decoder_layer(n, i) for i, (n, _) in enumerate(found)]
        shipped = src.experts_format(layers)  # a name, a (gate_up, down) pair per layer (GGUF), or None
        if shipped is None:  # float experts: quantized to format= (default bf16) as each layer is read
            if first.bias:
                raise NotImplementedError(f"{src.where}: float experts with biases (gpt-oss in bf16) are not read by "
                                          "from_pretrained; load the model with transformers and use offload_experts")
            fmt = cf.get_format(format or "bf16").name
        else:
            fmt = shipped
            if format is not None and cf.get_format(format).name != shipped:
                raise ValueError(f"format={format!r}, but {src.where} ships its experts as "
                                 f"{layer_formats.describe(layer_formats.normalize(shipped, len(layers)))}; omit "
                                 "format= (the experts are served as shipped)")
        pairs = layer_formats.normalize(fmt, len(layers))
        fmt_text = layer_formats.describe(pairs)
        missing = [n for n in src.bind(model) if not n.startswith(tuple(p + "." for p, _ in found))]
        tied = getattr(src.config.get_text_config(), "tie_word_embeddings", False)
        missing = [n for n in missing if not (tied and n.endswith("lm_head.weight"))]
        if missing:
            raise ValueError(f"{src.where}: no tensor for {len(missing)} of the model's parameters, e.g. "
                             f"{missing[:3]}")
        names = skeleton.non_expert_names(model, [n for n, _ in found])
        ne_bytes = sum(model.get_parameter(n).numel() for n in names) * torch.finfo(dtype).bits // 8
        gpu_kernels = _has_gpu_experts(pairs)
        if dev.type == "cuda" and limit is None:
            limit = torch.cuda.mem_get_info(dev)[0]
        kv = budget.kv_cache_bytes(src.config, kv_length, kv_batch, torch.finfo(dtype).bits // 8)
        # the mean over layers: the plan keeps the same number of experts in every layer
        per_expert = -(-sum(layer_formats.bytes_per_expert(p, H, I) for p in pairs) // len(pairs))
        residency = kwargs.pop("residency", None)
        plan = budget.plan(strategy, dev, limit, non_expert_bytes=ne_bytes, kv_bytes=kv, expert_bytes=per_expert,
                           E=E, layers=len(found), gpu_kernels=gpu_kernels, whole_layers=residency == "layers")
        plan.formats = fmt_text
        log.info("from_pretrained: %s: %s, %d MoE layers x %d experts (%s); strategy=%s: %s", src.where,
                 type(model).__name__, len(found), E, fmt_text, plan.strategy, plan.why)
        run_pairs = pairs
        if plan.strategy == "hybrid" and "repack" not in kwargs:  # decided before anything heavy is read
            run_pairs, kwargs["repack"] = _host_copy(pairs, H, I, E, host_limit, kwargs)
        skeleton.empty_experts([m for _, m in found], dev)
        skeleton.load(model, names, src.read, dev, dtype, src.where, progress)
        skeleton.place_buffers(model, dev)
        left = skeleton.meta_left(model)
        if left:
            raise ValueError(f"{src.where}: {len(left)} tensors were never loaded, e.g. {left[:3]}")
        if plan.strategy == "cpu":  # one copy of the experts: each layer converted as it arrives
            run_pairs = _cpu_pairs(pairs, H, I, kwargs)
        banks = []
        run_fmt = layer_formats.compact(run_pairs)
        desc = f"moe_engine: experts -> {run_fmt if isinstance(run_fmt, str) else 'per-layer formats'}"
        with bar(total=len(layers), desc=desc, unit="layer", disable=not progress) as pb:
            for n, pair, run in zip(layers, pairs, run_pairs):
                b = src.expert_banks(n, E, H, I, fmt if isinstance(fmt, str) else pair)
                banks.append(layer_formats.to_layout(b, pair, run, threads))
                del b
                heap.trim()
                pb.update(1)
        gc.collect()
        act = dict(activation=first.activation, alpha=first.alpha, limit=first.limit)
        if act["activation"] not in ("swigluoai", "swiglu_clamp"):
            act.pop("alpha"), act.pop("limit")
        cfg = src.config.get_text_config()
        place = {}
        if plan.strategy == "hybrid" and plan.gpu_layers is not None:
            place = dict(residency="layers", gpu_layers=plan.gpu_layers)
        elif plan.strategy == "hybrid" and residency is not None and not isinstance(residency, str):
            place = dict(residency=residency)  # a fraction or per-layer masks, as given
        elif plan.strategy == "hybrid":  # the budget's slots per layer, placed as named or by the runner (hot)
            n = plan.experts_per_layer
            place = dict(residency=residency, capacity=n) if n else dict(residency=0.0)
        if dev.type == "cuda" and plan.strategy in ("cpu", "hybrid"):
            # page-locked host banks (up to half of MemAvailable): a prompt's staged experts copy at link speed
            # (pageable: 4-6 GB/s on the H200 host, docs/moe-engine.md), hot's re-placements too
            kwargs.setdefault("pin_memory", True)
        runner = MoERunner(run_fmt, banks, top_k=int(cfg.num_experts_per_tok), strategy=plan.strategy, device=dev,
                           threads=threads, progress=progress, **place, **act, **kwargs)
        del banks
        out = Offloaded(runner, run_fmt, [n for n, _ in found], layers, f"{src.layout} {src.where}",
                        tokenizer=src.tokenizer(), plan=plan)
        edit = ModelEdit(model)
        for i, (_, m) in enumerate(found):
            edit.bind(m, Binding(runner, i, H, E, None, bool(getattr(m, "_is_expert_parallel", False))))
        edit.commit(NAME, {"moe_engine": out})
        model.eval()
        out.decode = decode_path.apply(model, decode, dev, runner, attention)
        out.load_seconds = time.perf_counter() - t0
        log.info("from_pretrained: ready in %.1f s; %s", out.load_seconds, runner.describe())
        return model
    finally:
        src.close()


def _host_copy(pairs, H: int, I: int, E: int, host_limit, kwargs) -> tuple[list, bool | None]:  # noqa: E741
    """Hybrid's host banks: (the per-layer formats each layer is converted to as it is read, the CPU executor's
    repack=), and one log line. One copy in the executor's layout where the GPU loads from it (a layout that moves
    the format's bytes, gpu/moved.py); else the file's formats, with the executor's own layout as a second copy where
    host memory holds both (None), or the file's banks run as they are (False; budget.host_copy)."""
    from ...gpu.moved import source

    cpu_pairs = _cpu_pairs(pairs, H, I, kwargs)
    if cpu_pairs == list(pairs):
        return list(pairs), None
    if all(source(c, H, I) == g for cp, p in zip(cpu_pairs, pairs) for c, g in zip(cp, p)):
        log.info("from_pretrained: host memory: one copy of the experts, %.2f GiB in %s: the CPU executor runs it and "
                 "the GPU loads its experts from it (each load put in %s's order on the device)",
                 E * sum(layer_formats.bytes_per_expert(p, H, I) for p in cpu_pairs) / budget.GiB,
                 layer_formats.describe(cpu_pairs), layer_formats.describe(pairs))
        return cpu_pairs, None
    base = E * sum(layer_formats.bytes_per_expert(p, H, I) for p in pairs)
    repacked = E * sum(layer_formats.bytes_per_expert(p, H, I) for p, q in zip(cpu_pairs, pairs) if p != q)
    from ...placement.pinning import mem_available

    avail = host_limit if host_limit is not None else mem_available()  # nothing of the model is loaded yet
    ok, why = budget.host_copy(base_bytes=base, repacked_bytes=repacked, layer_bytes=-(-base // len(pairs)),
                               host_bytes=avail, limit_name="host_memory" if host_limit is not None else "MemAvailable",
                               base=layer_formats.describe(pairs), repacked=layer_formats.describe(cpu_pairs))
    log.info("from_pretrained: host memory: %s", why)
    return list(pairs), None if ok else False


def _has_gpu_experts(pairs) -> bool:
    try:
        from ...gpu.experts import GpuExperts
    except ImportError:
        return False
    return all(f in GpuExperts.FORMATS for p in pairs for f in p)
