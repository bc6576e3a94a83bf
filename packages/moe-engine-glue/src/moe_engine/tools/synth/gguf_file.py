"""qwen3moe GGUF files as llama.cpp's convert + llama-quantize write them, streamed tensor by tensor.

gguf's GGUFWriter: every tensor's info is declared first (`add_tensor_info`), then the header, the KV data and the
tensor infos are written, then `write_tensor_data` one tensor at a time, so only one tensor (at most the 622 MB
bf16 embedding) is in memory at once.

Tensor types: routed experts by `experts` (below); every other matrix BF16; norms and the router
(`ffn_gate_inp`) F32, as convert_hf_to_gguf.py keeps them whatever the output type.
  q4_0    gate, up, down Q4_0 (gguf.quants.quantize of the float weights)
  q8_0    gate, up, down Q8_0 (idem)
  q4_k_m  gate, up Q4_K; down Q6_K in the layers of llama.cpp's `use_more_bits` rule, Q4_K elsewhere (random
          blocks: gguf-py has no K-quant quantizer)
  q5_k_m  gate, up Q5_K; down Q6_K in the `use_more_bits` layers, Q5_K elsewhere (random blocks, as q4_k_m's)
  q4_k    gate, up, down Q4_K; q5_k, q6_k likewise (random blocks; one type per file, as a test needs)
Names and layouts as llama.cpp's qwen3moe: `blk.{n}.ffn_{gate,up}_exps.weight` ggml [H, I, E] (numpy [E, I, H]),
`ffn_down_exps` [I, H, E]; attn_q [H, heads * head_dim]; attn_{q,k}_norm [head_dim]."""
from __future__ import annotations

import os

import numpy as np

from ...layer_formats import use_more_bits
from . import tokenizer, weights
from ._io import DROP_EVERY, Progress, drop_cache
from .shapes import Shape

EXPERT_TYPES = ("q4_0", "q8_0", "q4_k_m", "q5_k_m", "q4_k", "q5_k", "q6_k")


def expert_types(experts: str, layer: int, n_layers: int):
    """(gate/up GGML type, down GGML type) of a layer."""
    from gguf import GGMLQuantizationType as T

    if experts == "q4_0":
        return T.Q4_0, T.Q4_0
    if experts == "q8_0":
        return T.Q8_0, T.Q8_0
    if experts == "q4_k_m":
        return T.Q4_K, (T.Q6_K if use_more_bits(layer, n_layers) else T.Q4_K)
    if experts == "q5_k_m":
        return T.Q5_K, (T.Q6_K if use_more_bits(layer, n_layers) else T.Q5_K)
    if experts == "q4_k":
        return T.Q4_K, T.Q4_K
    if experts == "q5_k":
        return T.Q5_K, T.Q5_K
    if experts == "q6_k":
        return T.Q6_K, T.Q6_K
    raise ValueError(f"experts={experts!r}: expected one of {EXPERT_TYPES}")


def _file_type(experts: str):
    from gguf import LlamaFileType as F

    return {"q4_0": F.MOSTLY_Q4_0, "q8_0": F.MOSTLY_Q8_0, "q4_k_m": F.MOSTLY_Q4_K_M, "q5_k_m": F.MOSTLY_Q5_K_M,
            "q4_k": F.MOSTLY_Q4_K_S, "q5_k": F.MOSTLY_Q5_K_S, "q6_k": F.MOSTLY_Q6_K}[experts]


def _expert_tensor(seed: int, s: Shape, n: int, proj: str, qtype, random_codes: bool = False) -> np.ndarray:
    """One layer's stacked experts of one projection, as GGUF bytes [E, rows, row bytes]; random_codes draws Q4_0 /
    Q8_0 blocks directly instead of quantizing float weights."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    rows, cols = (s.moe_inter, s.hidden) if proj != "down" else (s.hidden, s.moe_inter)
    blk, size = GGML_QUANT_SIZES[qtype]
    out = np.empty((s.experts, rows, cols // blk * size), np.uint8)
    for e in range(s.experts):
        key = f"model.layers.{n}.mlp.experts.{e}.{proj}_proj.weight"
        k_draw = {T.Q4_K: weights.q4_k_blocks, T.Q5_K: weights.q5_k_blocks, T.Q6_K: weights.q6_k_blocks}.get(qtype)
        if k_draw is not None:
            out[e] = k_draw(weights.rng(seed, key), rows, cols)
        elif random_codes and qtype in (T.Q4_0, T.Q8_0):
            draw = weights.q4_0_blocks if qtype == T.Q4_0 else weights.q8_0_blocks
            out[e] = draw(weights.rng(seed, key), rows, cols)
        else:
            out[e] = weights.gguf_quantize(weights.normal(seed, key, (rows, cols)), qtype)
    return out


def _bf16_matrix(seed: int, key: str, shape: tuple[int, int]) -> np.ndarray:
    out = np.empty((shape[0], shape[1] * 2), np.uint8)
    for r0, a in weights.normal_rows(seed, key, shape):
        out[r0:r0 + a.shape[0]] = weights.gguf_quantize(a, _bf16())
    return out


def _bf16():
    from gguf import GGMLQuantizationType as T

    return T.BF16


def plan(s: Shape, experts: str, seed: int, random_codes: bool = False) -> list[tuple[str, tuple, object, object]]:
    """[(GGUF name, numpy shape of what is stored, GGML type, producer)] in file order."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    def mat(key, shape):
        return (tuple(shape[:-1]) + (shape[-1] * 2,), T.BF16, lambda: _bf16_matrix(seed, key, shape))

    def norm(key, n):
        return ((n,), T.F32, lambda: weights.normal(seed, key, (n,), mean=1.0))

    def quant_shape(rows, cols, qtype):
        blk, size = GGML_QUANT_SIZES[qtype]
        return (s.experts, rows, cols // blk * size)

    out = [("token_embd.weight", *mat("model.embed_tokens.weight", (s.vocab, s.hidden)))]
    for n in range(s.layers):
        p, b = f"model.layers.{n}.", f"blk.{n}."
        gu, dn = expert_types(experts, n, s.layers)
        out += [
            (b + "attn_norm.weight", *norm(p + "input_layernorm.weight", s.hidden)),
            (b + "attn_q.weight", *mat(p + "self_attn.q_proj.weight", (s.q_dim, s.hidden))),
            (b + "attn_k.weight", *mat(p + "self_attn.k_proj.weight", (s.kv_dim, s.hidden))),
            (b + "attn_v.weight", *mat(p + "self_attn.v_proj.weight", (s.kv_dim, s.hidden))),
            (b + "attn_output.weight", *mat(p + "self_attn.o_proj.weight", (s.hidden, s.q_dim))),
            (b + "attn_q_norm.weight", *norm(p + "self_attn.q_norm.weight", s.head_dim)),
            (b + "attn_k_norm.weight", *norm(p + "self_attn.k_norm.weight", s.head_dim)),
            (b + "ffn_norm.weight", *norm(p + "post_attention_layernorm.weight", s.hidden)),
            (b + "ffn_gate_inp.weight", (s.experts, s.hidden), T.F32,
             (lambda k=p + "mlp.gate.weight": weights.normal(seed, k, (s.experts, s.hidden)))),
        ]
        for proj, qt, rows, cols in (("gate", gu, s.moe_inter, s.hidden), ("up", gu, s.moe_inter, s.hidden),
                                     ("down", dn, s.hidden, s.moe_inter)):
            out.append((b + f"ffn_{proj}_exps.weight", quant_shape(rows, cols, qt), qt,
                        (lambda n=n, proj=proj, qt=qt: _expert_tensor(seed, s, n, proj, qt, random_codes))))
    out += [("output_norm.weight", *norm("model.norm.weight", s.hidden)),
            ("output.weight", *mat("lm_head.weight", (s.vocab, s.hidden)))]
    return out


def write(path, s: Shape, experts: str = "q4_0", seed: int = 0, progress: bool = True,
          random_codes: bool = False) -> dict:
    """Write a qwen3moe GGUF file; returns {'path', 'bytes', 'seconds', 'tensors'}."""
    import gguf

    if s.arch != "qwen3moe":
        raise ValueError(f"GGUF output is written for the qwen3moe shape, got {s.arch!r}")
    expert_types(experts, 0, s.layers)  # validates `experts`
    path = os.fspath(path)
    tensors = plan(s, experts, seed, random_codes)
    w = gguf.GGUFWriter(path, arch="qwen3moe")
    w.add_type("model")
    w.add_name(f"synthetic Qwen3-30B-A3B shape ({s.layers} layers, seed {seed})")
    w.add_file_type(_file_type(experts))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(s.layers)
    w.add_context_length(s.max_pos)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.dense_inter)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_expert_feed_forward_length(s.moe_inter)
    tokenizer.add_to_gguf(w, tokenizer.byte_level_bpe(s.vocab))
    for name, shape, qtype, _ in tensors:
        nbytes = int(np.prod(shape)) * (4 if qtype == gguf.GGMLQuantizationType.F32 else 1)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    prog = Progress(s.layers, os.path.basename(path), progress)
    fd, since_drop = w.fout[0].fileno(), 0
    for name, shape, _, make in tensors:
        a = make()
        if a.shape != shape:
            raise AssertionError(f"{name}: produced {a.shape}, declared {shape}")
        w.write_tensor_data(a)
        prog.add(a.nbytes)
        since_drop += a.nbytes
        if since_drop >= DROP_EVERY:
            w.fout[0].flush()
            drop_cache(fd)
            since_drop = 0
        if name.endswith("ffn_down_exps.weight"):
            prog.step()
    w.fout[0].flush()
    drop_cache(fd)
    w.close()
    return {"path": path, "bytes": os.path.getsize(path), "seconds": prog.seconds, "tensors": len(tensors)}
