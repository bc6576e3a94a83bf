"""Hugging Face checkpoint directories: safetensors shards + model.safetensors.index.json, config.json,
generation_config.json, tokenizer.json / tokenizer_config.json, written shard by shard with safetensors' own
writer (`safetensors.numpy.save_file`).

Layouts (tensor names and dtypes as the shipped repositories):
  qwen3moe bf16   Qwen/Qwen3-30B-A3B: every tensor bf16, experts per expert `mlp.experts.{e}.{gate,up,down}_proj`.
  qwen3moe fp8    Qwen/Qwen3-30B-A3B-FP8: the attention projections and the experts as e4m3 `weight` + float32
                  `weight_scale_inv` [ceil(R/128), ceil(C/128)]; embeddings, lm_head, norms and the router
                  (`mlp.gate`, not an nn.Linear in transformers) bf16 (transformers' finegrained_fp8 converts the
                  nn.Linear modules but lm_head); quantization_config {quant_method fp8, fmt e4m3,
                  activation_scheme dynamic, weight_block_size [128, 128]}.
  gpt-oss mxfp4   openai/gpt-oss-20b: experts fused per layer, `mlp.experts.gate_up_proj_blocks` uint8
                  [E, 2I, H/32, 16] + `_scales` uint8 [E, 2I, H/32] + `_bias` bf16 [E, 2I] (rows interleave gate
                  and up), `down_proj_*` [E, H, I/32, 16]; everything else bf16 (attention with biases, sinks,
                  router with bias); quantization_config {quant_method mxfp4, modules_to_not_convert [...]}.

A shard holds whole tensors up to `shard_bytes` (default 1 GB, where the shipped repositories use ~4-5 GB): the
writer holds one shard in memory, so its peak RSS stays near shard_bytes + one tensor."""
from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np

from . import tokenizer, weights
from ._io import Progress, drop_cache
from .shapes import Shape

BF16 = np.dtype(ml_dtypes.bfloat16)
LAYOUTS = {"qwen3moe": ("bf16", "fp8"), "gpt-oss": ("mxfp4",)}


def _bf16(seed, key, shape, **kw):
    if len(shape) == 2 and shape[0] > weights.ROW_CHUNK:
        out = np.empty(shape, BF16)
        for r0, a in weights.normal_rows(seed, key, shape):
            out[r0:r0 + a.shape[0]] = a.astype(BF16)
        return out
    return weights.normal(seed, key, shape, **kw).astype(BF16)


def _items(s: Shape, layout: str, seed: int, random_codes: bool = False):
    """[(layer or None, [(name, dtype, shape)], producer -> {name: array})] in file order."""
    def bf16(key, shape, **kw):
        return (None, [(key, BF16, shape)], lambda: {key: _bf16(seed, key, shape, **kw)})

    def linear(key, shape):  # an nn.Linear weight: fp8 + scale in the fp8 layout, else bf16
        if layout != "fp8":
            return bf16(key, shape)
        sk = key + "_scale_inv"
        sshape = (-(-shape[0] // weights.FP8_BLOCK), -(-shape[1] // weights.FP8_BLOCK))

        def make():
            c, sc = (weights.fp8_block_codes(seed, key, shape) if random_codes else
                     weights.fp8_block(weights.normal(seed, key, shape)))
            return {key: c, sk: sc}
        return (None, [(key, np.dtype(ml_dtypes.float8_e4m3fn), shape), (sk, np.dtype(np.float32), sshape)], make)

    def with_layer(n, item):
        return (n,) + item[1:]

    out = [bf16("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for n in range(s.layers):
        p = f"model.layers.{n}."
        out += [with_layer(n, bf16(p + "input_layernorm.weight", (s.hidden,), mean=1.0)),
                with_layer(n, bf16(p + "post_attention_layernorm.weight", (s.hidden,), mean=1.0))]
        for proj, shape in (("q", (s.q_dim, s.hidden)), ("k", (s.kv_dim, s.hidden)), ("v", (s.kv_dim, s.hidden)),
                            ("o", (s.hidden, s.q_dim))):
            out.append(with_layer(n, linear(p + f"self_attn.{proj}_proj.weight", shape)))
            if s.arch == "gpt-oss":
                out.append(with_layer(n, bf16(p + f"self_attn.{proj}_proj.bias", (shape[0],))))
        if s.arch == "qwen3moe":
            out += [with_layer(n, bf16(p + "self_attn.q_norm.weight", (s.head_dim,), mean=1.0)),
                    with_layer(n, bf16(p + "self_attn.k_norm.weight", (s.head_dim,), mean=1.0)),
                    with_layer(n, bf16(p + "mlp.gate.weight", (s.experts, s.hidden)))]
            for e in range(s.experts):
                for proj, shape in (("gate", (s.moe_inter, s.hidden)), ("up", (s.moe_inter, s.hidden)),
                                    ("down", (s.hidden, s.moe_inter))):
                    out.append(with_layer(n, linear(p + f"mlp.experts.{e}.{proj}_proj.weight", shape)))
        else:
            out += [with_layer(n, bf16(p + "self_attn.sinks", (s.heads,), std=0.5)),
                    with_layer(n, bf16(p + "mlp.router.weight", (s.experts, s.hidden))),
                    with_layer(n, bf16(p + "mlp.router.bias", (s.experts,)))]
            for proj, rows, cols in (("gate_up_proj", 2 * s.moe_inter, s.hidden), ("down_proj", s.hidden,
                                                                                    s.moe_inter)):
                out.append((n, *_mxfp4_item(seed, s, p + "mlp.experts." + proj, rows, cols)))
                out.append(with_layer(n, bf16(p + f"mlp.experts.{proj}_bias", (s.experts, rows))))
    out += [bf16("model.norm.weight", (s.hidden,), mean=1.0), bf16("lm_head.weight", (s.vocab, s.hidden))]
    return out


def _mxfp4_item(seed, s: Shape, key: str, rows: int, cols: int):
    def make():
        blocks = np.empty((s.experts, rows, cols // 32, 16), np.uint8)
        scales = np.empty((s.experts, rows, cols // 32), np.uint8)
        for e in range(s.experts):
            blocks[e], scales[e] = weights.mxfp4(weights.normal(seed, f"{key}.{e}", (rows, cols)))
        return {key + "_blocks": blocks, key + "_scales": scales}
    return ([(key + "_blocks", np.dtype(np.uint8), (s.experts, rows, cols // 32, 16)),
             (key + "_scales", np.dtype(np.uint8), (s.experts, rows, cols // 32))], make)


def config(s: Shape, layout: str, vocab: tokenizer.Vocab) -> dict:
    """config.json as the shipped repository's, at this shape."""
    common = {"hidden_size": s.hidden, "intermediate_size": s.dense_inter, "num_hidden_layers": s.layers,
              "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
              "vocab_size": s.vocab, "rms_norm_eps": s.rms_eps, "rope_theta": s.rope_theta,
              "max_position_embeddings": s.max_pos, "tie_word_embeddings": False, "initializer_range": 0.02,
              "bos_token_id": vocab.bos_id, "eos_token_id": vocab.eos_id, "use_cache": True, "dtype": "bfloat16",
              "torch_dtype": "bfloat16", "attention_dropout": 0.0}
    if s.arch == "qwen3moe":
        c = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
             "attention_bias": False, "decoder_sparse_step": 1, "hidden_act": "silu", "max_window_layers": s.layers,
             "mlp_only_layers": [], "moe_intermediate_size": s.moe_inter, "norm_topk_prob": True,
             "num_experts": s.experts, "num_experts_per_tok": s.top_k, "output_router_logits": False,
             "rope_scaling": None, "router_aux_loss_coef": 0.001, "sliding_window": None,
             "use_sliding_window": False}
        if layout == "fp8":
            c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [weights.FP8_BLOCK, weights.FP8_BLOCK]}
        return c
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **common, "attention_bias": True,
            "experts_per_token": s.top_k, "num_experts_per_tok": s.top_k, "num_local_experts": s.experts,
            "hidden_act": "silu", "initial_context_length": 4096, "layer_types": s.layer_types(),
            "output_router_logits": False, "pad_token_id": vocab.pad_id, "router_aux_loss_coef": 0.9,
            "sliding_window": s.sliding_window, "swiglu_limit": 7.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "original_max_position_embeddings": 4096, "truncate": False},
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}


def write(out_dir, s: Shape, layout: str, seed: int = 0, shard_bytes: int = 1 << 30, progress: bool = True,
          random_codes: bool = False) -> dict:
    """Write a checkpoint directory; returns {'path', 'bytes', 'seconds', 'tensors', 'shards'}. random_codes: the
    fp8 layout's codes drawn directly (weights.fp8_block_codes)."""
    from safetensors.numpy import save_file

    if layout not in LAYOUTS.get(s.arch, ()):
        raise ValueError(f"layout {layout!r} for shape {s.arch!r}: expected one of {LAYOUTS.get(s.arch)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    items = _items(s, layout, seed, random_codes)
    shards, cur, cur_bytes = [], [], 0
    for it in items:
        nb = sum(int(np.prod(shape)) * dt.itemsize for _, dt, shape in it[1])
        if cur and cur_bytes + nb > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(it)
        cur_bytes += nb
    shards.append(cur)
    vocab = tokenizer.byte_level_bpe(s.vocab)
    prog = Progress(len(shards), out_dir.name, progress)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for _, decl, make in shard:
            got = make()
            for name, dt, shape in decl:
                if got[name].dtype != dt or got[name].shape != tuple(shape):
                    raise AssertionError(f"{name}: produced {got[name].dtype} {got[name].shape}, "
                                         f"declared {dt} {shape}")
            tensors.update(got)
        save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
        drop_cache(out_dir / fname)
        nb = sum(a.nbytes for a in tensors.values())
        total += nb
        weight_map.update({k: fname for k in tensors})
        prog.add(nb)
        prog.step("shard")
        del tensors
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out_dir / "config.json").write_text(json.dumps(config(s, layout, vocab), indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": vocab.bos_id, "eos_token_id": vocab.eos_id, "pad_token_id": vocab.pad_id,
         "do_sample": False}, indent=2))
    (out_dir / "tokenizer.json").write_text(tokenizer.tokenizer_json(vocab))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer.tokenizer_config(vocab), indent=2))
    return {"path": os.fspath(out_dir), "bytes": sum(f.stat().st_size for f in out_dir.glob("*.safetensors")),
            "seconds": prog.seconds, "tensors": len(weight_map), "shards": len(shards)}
