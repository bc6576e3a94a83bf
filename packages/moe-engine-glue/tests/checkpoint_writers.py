"""Tiny checkpoints in the real layouts, written from a transformers model's experts (test_checkpoints.py,
test_checkpoint_robustness.py, test_offload_transaction.py, test_transformers.py): safetensors as DeepSeek-V3 / Qwen
FP8, gpt-oss MXFP4 and ModelOpt NVFP4 ship them, a GGUF file through gguf's own writer, each with the float64 values
its tensors decode to; and the byte-level edits the robustness suite makes to them (truncate, retype, reshape,
poison a scale)."""
from __future__ import annotations

import json
import re
import struct

import hf_models as hm
import numpy as np
import torch
from safetensors.torch import save_file

import cpumoe_formats as cf
from moe_engine.integrations import transformers as mt
from moe_engine.integrations.transformers import convert

E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def moe_layers(model):
    """(decoder layer index, experts module, logical gate_up [E, 2I, H], down [E, H, I]) float32."""
    out = []
    for name, m in hm.experts_modules(model):
        s = mt.inspect_experts(m)
        gu, dn, _, _ = convert.float_chunk(m, s, 0, s.E)
        out.append((mt.decoder_layer(name, 0), m, s, torch.from_numpy(gu), torch.from_numpy(dn)))
    return out


def _put(m, s, gu, dn):
    """Logical float weights back into a standard (gate; up) experts module."""
    with torch.no_grad():
        m.gate_up_proj.copy_(gu.to(m.gate_up_proj.dtype))
        m.down_proj.copy_(dn.to(m.down_proj.dtype))


def _extra(model):
    """A few non-expert tensors, as a real checkpoint holds them beside the experts."""
    return {"model.embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
            "lm_head.weight": model.lm_head.weight.detach().clone()}


def _save(tensors: dict, path, shards: int = 1):
    """One safetensors file, or `shards` files plus model.safetensors.index.json in directory `path`."""
    if shards == 1:
        save_file(tensors, str(path))
        return path
    path.mkdir(exist_ok=True)
    keys, wm = sorted(tensors), {}
    for i in range(shards):
        f = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[i::shards]}
        save_file(part, str(path / f))
        wm.update({k: f for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return path


# ---- FP8 block (DeepSeek-V3 / Qwen FP8) ---------------------------------------------------------------------------
def _fp8(w, ue8m0=False):
    """[R, K] -> (e4m3 codes, weight_scale_inv [R/128, K/128]): per block scale = amax / 448 in fp32, or (ue8m0, as
    DeepSeek-V3.1-style checkpoints) that rounded up to a power of two, stored as float8_e8m0fnu."""
    R, K = w.shape
    b = w.reshape(R // 128, 128, K // 128, 128)
    s = (b.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12).float()
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    codes = (b / s[:, None, :, None]).reshape(R, K).to(torch.float8_e4m3fn)
    return codes, (s.to(torch.float8_e8m0fnu) if ue8m0 else s)


def _fp8_decode(codes, s):
    return codes.double() * s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)


def write_fp8(model, path, naming="per_expert", shards=1, ue8m0=False):
    """(path, {decoder layer: (gate_up, down) decoded float64}) with experts stored per expert in `naming`."""
    proj = {"per_expert": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}[naming]
    sub = "block_sparse_moe" if naming == "mixtral" else "mlp"
    t, ref = _extra(model), {}
    for n, _, s, gu, dn in moe_layers(model):
        dgu, ddn = torch.empty(s.E, 2 * s.I, s.H, dtype=torch.float64), torch.empty(s.E, s.H, s.I, dtype=torch.float64)
        t[f"model.layers.{n}.{sub}.gate.weight"] = torch.zeros(s.E, s.H)
        for e in range(s.E):
            for p, w, dst in ((proj[0], gu[e, :s.I], dgu[e, :s.I]), (proj[1], gu[e, s.I:], dgu[e, s.I:]),
                              (proj[2], dn[e], ddn[e])):
                c, sc = _fp8(w, ue8m0)
                t[f"model.layers.{n}.{sub}.experts.{e}.{p}.weight"] = c
                t[f"model.layers.{n}.{sub}.experts.{e}.{p}.weight_scale_inv"] = sc
                dst.copy_(_fp8_decode(c, sc.float()))
        ref[n] = (dgu, ddn)
    return _save(t, path, shards), ref


# ---- gpt-oss MXFP4 --------------------------------------------------------------------------------------------------
def _mxfp4(w):
    """[R, K] float -> (blocks [R, K/32, 16] uint8, scales [R, K/32] uint8): e8m0 exponent so amax / 2^e <= 6."""
    R, K = w.shape
    b = w.double().reshape(R, K // 32, 32)
    amax = b.abs().amax(-1).clamp(min=2.0 ** -126)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    q = b / torch.exp2(e)[..., None]
    mag = (q.abs()[..., None] - E2M1[:8]).abs().argmin(-1)
    codes = (mag | ((q < 0) & (mag > 0)).to(torch.int64) << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (e + 127).to(torch.uint8)


def write_mxfp4(model, path):
    """gpt-oss's per-layer fused tensors (rows = the model's interleaved gate_up columns)."""
    t = _extra(model)
    for name, m in hm.experts_modules(model):
        n = mt.decoder_layer(name, 0)
        p = f"model.layers.{n}.mlp.experts."
        for proj, w, bias in (("gate_up_proj", m.gate_up_proj, m.gate_up_proj_bias),
                              ("down_proj", m.down_proj, m.down_proj_bias)):
            wt = w.detach().float().transpose(1, 2)  # [E, rows, K]
            bl, sc = zip(*(_mxfp4(wt[e]) for e in range(wt.shape[0])))
            t[p + proj + "_blocks"], t[p + proj + "_scales"] = torch.stack(bl), torch.stack(sc)
            t[p + proj + "_bias"] = bias.detach().to(torch.bfloat16).clone()
        t[f"model.layers.{n}.mlp.router.weight"] = torch.zeros(8, hm.H)
    save_file(t, str(path))
    return path


def mxfp4_reference(model, path):
    """A copy of the gpt-oss model whose experts hold transformers' own dequantization of the checkpoint."""
    from safetensors import safe_open
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ref = hm.clone(model)
    with safe_open(str(path), framework="pt") as f, torch.no_grad():
        for name, m in hm.experts_modules(ref):
            p = f"model.layers.{mt.decoder_layer(name, 0)}.mlp.experts."
            for proj in ("gate_up_proj", "down_proj"):
                w = convert_moe_packed_tensors(f.get_tensor(p + proj + "_blocks"), f.get_tensor(p + proj + "_scales"),
                                               dtype=torch.float32)
                getattr(m, proj).copy_(w.to(torch.bfloat16))
                getattr(m, proj + "_bias").copy_(f.get_tensor(p + proj + "_bias"))
    return ref


# ---- ModelOpt NVFP4 -------------------------------------------------------------------------------------------------
def _nvfp4(w):
    """[R, K] -> (weight [R, K/2] uint8, weight_scale [R, K/16] e4m3, weight_scale_2 fp32 scalar), ModelOpt's recipe."""
    R, K = w.shape
    w = w.double()
    g = (w.abs().max() / (6.0 * 448.0)).float()
    b = w.reshape(R, K // 16, 16)
    sc = (b.abs().amax(-1) / (6.0 * g.double())).float().clamp(max=448).to(torch.float8_e4m3fn)
    q = b / (sc.double() * g.double()).clamp(min=1e-30)[..., None]
    mag = (q.abs()[..., None] - E2M1[:8]).abs().argmin(-1)
    codes = (mag | ((q < 0) & (mag > 0)).to(torch.int64) << 3).to(torch.uint8).reshape(R, K)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), sc, g.reshape(())


def _nvfp4_decode(packed, sc, g):
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    return (E2M1[codes].reshape(packed.shape[0], -1, 16) * sc.double()[..., None]).reshape(packed.shape[0], -1) \
        * float(g)


def write_nvfp4(model, path):
    t, ref = _extra(model), {}
    for n, _, s, gu, dn in moe_layers(model):
        dgu, ddn = torch.empty(s.E, 2 * s.I, s.H, dtype=torch.float64), torch.empty(s.E, s.H, s.I, dtype=torch.float64)
        for e in range(s.E):
            for p, w, dst in (("gate_proj", gu[e, :s.I], dgu[e, :s.I]), ("up_proj", gu[e, s.I:], dgu[e, s.I:]),
                              ("down_proj", dn[e], ddn[e])):
                k = f"model.layers.{n}.mlp.experts.{e}.{p}."
                t[k + "weight"], t[k + "weight_scale"], t[k + "weight_scale_2"] = _nvfp4(w)
                t[k + "input_scale"] = torch.tensor(1.0)
                dst.copy_(_nvfp4_decode(t[k + "weight"], t[k + "weight_scale"], t[k + "weight_scale_2"]))
        ref[n] = (dgu, ddn)
    save_file(t, str(path))
    return path, ref


# ---- GGUF Q4_0 ------------------------------------------------------------------------------------------------------
def write_gguf(model, path):
    import gguf

    w = gguf.GGUFWriter(str(path), arch="qwen3moe")
    w.add_block_count(2)
    w.add_expert_count(hm.E)
    w.add_tensor("token_embd.weight", model.model.embed_tokens.weight.detach().float().numpy())
    ref = {}
    for n, _, s, gu, dn in moe_layers(model):
        parts = {"gate": gu[:, :s.I].numpy(), "up": gu[:, s.I:].numpy(), "down": dn.numpy()}
        deq = {}
        for k, a in parts.items():
            q = gguf.quants.quantize(np.ascontiguousarray(a, np.float32), gguf.GGMLQuantizationType.Q4_0)
            w.add_tensor(f"blk.{n}.ffn_{k}_exps.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
            deq[k] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_0).astype(np.float64)
        ref[n] = (torch.from_numpy(np.concatenate([deq["gate"], deq["up"]], 1)), torch.from_numpy(deq["down"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, ref


def reference_model(model, ref_weights):
    ref = hm.clone(model)
    for n, m, s, _, _ in moe_layers(ref):
        _put(m, s, *ref_weights[n])
    return ref


def banks_decode(loaded, n_index):
    return cf.get_format(loaded.format).dequantize(loaded.banks[n_index])



def as_mxfp4_triton(model) -> None:
    """Give a gpt-oss model's layers transformers' Mxfp4GptOssExperts (weights on the meta device), as
    replace_with_mxfp4_linear does where the hub's Triton kernels load."""
    from transformers.integrations import mxfp4

    for layer in model.model.layers:
        with torch.device("meta"):
            experts = mxfp4.Mxfp4GptOssExperts(model.config)
        if hasattr(mxfp4, "Mxfp4GptOssMLP"):  # transformers 5.2x: an MLP class of its own
            layer.mlp = mxfp4.Mxfp4GptOssMLP(layer.mlp.router, experts)
        else:  # 5.17: GptOssMLP keeps its class, its forward is replaced on the instance
            from types import MethodType

            layer.mlp.experts = experts
            layer.mlp.forward = MethodType(mxfp4.mlp_forward, layer.mlp)


# ---- one clean checkpoint per layout, and the edits that corrupt it -------------------------------------------------
ARCH_OF = {"fp8_block": "qwen3_moe", "mxfp4": "gpt_oss", "nvfp4": "qwen3_moe", "gguf_q4_0": "qwen3_moe"}
# the layer the corruptions hit: the second, so a loader that reads layer 0 first must still find them
LAYER = 1


def write_layout(layout: str, model, directory):
    """A checkpoint of `model`'s experts in `layout` under `directory`; returns its path."""
    writers = {"fp8_block": lambda p: write_fp8(model, p)[0], "mxfp4": lambda p: write_mxfp4(model, p),
               "nvfp4": lambda p: write_nvfp4(model, p)[0], "gguf_q4_0": lambda p: write_gguf(model, p)[0]}
    return writers[layout](directory / ("model.gguf" if layout == "gguf_q4_0" else "model.safetensors"))


def safetensors_index(path) -> tuple[int, dict]:
    """(header length, {name: (dtype, shape, absolute begin, absolute end)}) read straight from the file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))
    meta.pop("__metadata__", None)
    return n, {k: (v["dtype"], tuple(v["shape"]), 8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
               for k, v in meta.items()}


def gguf_index(path) -> dict:
    """{name: (GGML type name, numpy shape of its data, absolute data offset, bytes, tensor info offset)}."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, t.data.shape, t.data_offset, t.n_bytes, t.field.offset) for t in r.tensors}


def expert_tensors(path, layout: str, layer: int = LAYER) -> list[str]:
    """The layer's expert tensors a loader reads: for per-expert names, those of expert 3."""
    names = gguf_index(path) if layout == "gguf_q4_0" else safetensors_index(path)[1]
    pat = re.compile(rf"(^blk\.{layer}\.ffn_.*_exps\.weight$)|(layers\.{layer}\.mlp\.experts\.(3\.|[a-z]))")
    return sorted(n for n in names if pat.search(n) and not n.endswith("input_scale"))


def truncated(src, dst, size: int):
    data = open(src, "rb").read()
    open(dst, "wb").write(data[:size])
    return dst


def poke(src, dst, offset: int, value: bytes):
    data = bytearray(open(src, "rb").read())
    data[offset:offset + len(value)] = value
    open(dst, "wb").write(bytes(data))
    return dst


def resave_safetensors(src, dst, name: str, edit):
    """dst = src with tensor `name` replaced by edit(that tensor)."""
    from safetensors.torch import load_file

    t = load_file(str(src))
    t[name] = edit(t[name])
    save_file({k: v.contiguous() for k, v in t.items()}, str(dst))
    return dst


def rewrite_gguf(src, dst, name: str, data, ggml_type):
    """dst = src's tensors (the types and bytes it has) with `name` replaced by `data` of `ggml_type` (byte rows
    for a quantized type, values otherwise)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch="qwen3moe")
    w.add_block_count(2)
    w.add_expert_count(hm.E)
    for t in r.tensors:
        d, ty = (data, ggml_type) if t.name == name else (np.array(t.data), t.tensor_type)
        w.add_tensor(t.name, d, raw_dtype=ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
