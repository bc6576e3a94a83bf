"""moe_engine.checkpoints: tiny checkpoints written in the real layouts (safetensors as DeepSeek-V3 / Qwen FP8,
gpt-oss MXFP4 and ModelOpt NVFP4 ship them; a GGUF file through the gguf writer), read back into banks, compared
with an independent decode of the same tensors (torch / transformers' own / gguf's dequantizers), then run in a
transformers model against that model with its expert weights replaced by the decoded values.

Exactness: mxfp4 and GGUF Q4_0 banks decode to the checkpoint's values bit for bit; fp8_block's bf16 block scales
differ from the checkpoint's fp32 ones by at most 2^-8 relative (nearest even to 8 significant bits) and nvfp4's fp16
per-row global from ModelOpt's fp32 per-tensor one by at most 2^-11; both are measured here and in the loaders'
reports (docs/transformers.md)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("safetensors")

import hf_models as hm  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from test_transformers import QUANT_TOL, W4A8_TOL  # noqa: E402

import cpumoe_formats as cf  # noqa: E402
from moe_engine import checkpoints  # noqa: E402
from moe_engine.integrations import transformers as mt  # noqa: E402

KW = dict(strategy="cpu", threads=2, progress=False)
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _moe_layers(model):
    """(decoder layer index, experts module, logical gate_up [E, 2I, H], down [E, H, I]) float32."""
    out = []
    for name, m in hm.experts_modules(model):
        s = mt.inspect_experts(m)
        gu, dn, _, _ = mt._float_chunk(m, s, 0, s.E)
        out.append((mt._decoder_layer(name, 0), m, s, torch.from_numpy(gu), torch.from_numpy(dn)))
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
    for n, _, s, gu, dn in _moe_layers(model):
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
        n = mt._decoder_layer(name, 0)
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
            p = f"model.layers.{mt._decoder_layer(name, 0)}.mlp.experts."
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
    for n, _, s, gu, dn in _moe_layers(model):
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
    for n, _, s, gu, dn in _moe_layers(model):
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


def _reference(model, ref_weights):
    ref = hm.clone(model)
    for n, m, s, _, _ in _moe_layers(ref):
        _put(m, s, *ref_weights[n])
    return ref


def _banks_decode(loaded, n_index):
    return cf.get_format(loaded.format).dequantize(loaded.banks[n_index])


# ---- the tests -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,naming,shards", [("qwen3_moe", "per_expert", 1), ("deepseek_v3", "per_expert", 2),
                                                 ("mixtral", "mixtral", 2)])
def test_fp8_block_checkpoint(tmp_path, arch, naming, shards):
    model = hm.build(arch)
    path, want = write_fp8(model, tmp_path / ("ckpt" if shards > 1 else "model.safetensors"), naming, shards)
    layers = sorted(want)
    got = checkpoints.load_experts(path, layers, E=hm.E, H=hm.H, I=hm.I, model_type=model.config.model_type)
    assert got.layout == "fp8_block" and got.format == "fp8_block"
    dev = got.deviation()["scale_rounding_max_rel"]
    assert 0 < dev <= 2.0 ** -8
    for i, n in enumerate(layers):
        gu, dn = _banks_decode(got, i)
        for a, b in ((gu, want[n][0].numpy()), (dn, want[n][1].numpy())):
            # each weight is off by its block scale's rounding, nothing else (the codes are copied)
            np.testing.assert_array_less(np.abs(a - b), dev * np.abs(b) * (1 + 1e-6) + 1e-30)
    ref = _reference(model, want)
    off = mt.offload_experts(model, checkpoint=path, **KW)
    assert off.format == "fp8_block" and off.source.startswith("fp8_block checkpoint")
    assert off.deviation()["scale_rounding_max_rel"] == dev
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < QUANT_TOL, name


def test_fp8_block_ue8m0_scales_are_exact(tmp_path):
    model = hm.build("deepseek_v3")
    path, want = write_fp8(model, tmp_path / "m.safetensors", ue8m0=True)
    got = checkpoints.load_experts(path, [1, 2], E=hm.E, H=hm.H, I=hm.I)
    assert all(r["exact"] for r in got.report.values()) and got.deviation()["scale_rounding_max_rel"] == 0.0
    for i, n in enumerate([1, 2]):
        gu, dn = _banks_decode(got, i)
        np.testing.assert_array_equal(gu, want[n][0].numpy())
        np.testing.assert_array_equal(dn, want[n][1].numpy())


def test_fp8_block_scale_rounding_effect_on_outputs(tmp_path):
    """The measured effect of bf16 block scales on one layer's float64 output (docs/transformers.md)."""
    model = hm.build("qwen3_moe")
    path, want = write_fp8(model, tmp_path / "m.safetensors")
    got = checkpoints.load_experts(path, [0], E=hm.E, H=hm.H, I=hm.I)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, hm.H))
    ids = np.stack([rng.choice(hm.E, 2, replace=False) for _ in range(16)]).astype(np.int32)
    w = rng.random((16, 2)) + 0.1
    gu, dn = _banks_decode(got, 0)
    exact = [(want[0][0].numpy(), want[0][1].numpy()), (gu, dn)]
    ys = []
    for g, d in exact:
        y = np.zeros((16, hm.H))
        for t in range(16):
            for k in range(2):
                h = g[ids[t, k]] @ x[t]
                a = h[:hm.I] / (1 + np.exp(-h[:hm.I])) * h[hm.I:]
                y[t] += w[t, k] * (d[ids[t, k]] @ a)
        ys.append(y)
    rel = np.abs(ys[1] - ys[0]).max() / np.abs(ys[0]).max()
    print(f"fp8_block bf16 scales: weights <= {got.deviation()['scale_rounding_max_rel']:.2e}, outputs {rel:.2e}")
    assert rel < 2 * 2.0 ** -8


def test_mxfp4_checkpoint_is_bit_exact(tmp_path):
    from safetensors import safe_open
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = hm.build("gpt_oss")
    path = write_mxfp4(model, tmp_path / "model.safetensors")
    got = checkpoints.load_experts(path, [0, 1], E=hm.E, H=hm.H, I=hm.I, model_type="gpt_oss")
    assert got.layout == "mxfp4" and all(r["exact"] for r in got.report.values()) and got.deviation() == {}
    spec = cf.get_format("mxfp4")
    with safe_open(str(path), framework="pt") as f:
        for i in range(2):
            p = f"model.layers.{i}.mlp.experts."
            gu, dn = spec.dequantize(got.banks[i])  # logical: gate rows, then up rows
            gub, dnb = spec.biases(got.banks[i])
            w = convert_moe_packed_tensors(f.get_tensor(p + "gate_up_proj_blocks"),
                                           f.get_tensor(p + "gate_up_proj_scales"),
                                           dtype=torch.float32).double().numpy()  # [E, H, 2I] interleaved
            np.testing.assert_array_equal(gu[:, :hm.I], w[..., 0::2].transpose(0, 2, 1))
            np.testing.assert_array_equal(gu[:, hm.I:], w[..., 1::2].transpose(0, 2, 1))
            d = convert_moe_packed_tensors(f.get_tensor(p + "down_proj_blocks"), f.get_tensor(p + "down_proj_scales"),
                                           dtype=torch.float32).double().numpy()  # [E, I, H]
            np.testing.assert_array_equal(dn, d.transpose(0, 2, 1))
            b = f.get_tensor(p + "gate_up_proj_bias").double().numpy()
            np.testing.assert_array_equal(gub, np.concatenate([b[:, 0::2], b[:, 1::2]], 1))
            np.testing.assert_array_equal(dnb, f.get_tensor(p + "down_proj_bias").double().numpy())
    ref = mxfp4_reference(model, path)
    off = mt.offload_experts(model, checkpoint=path, **KW)
    assert off.format == "mxfp4" and off.runner.act.name == "swigluoai"
    assert off.runner.act.alpha == pytest.approx(1.702) and off.runner.act.limit == pytest.approx(7.0)
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < QUANT_TOL, name


def test_nvfp4_modelopt_checkpoint(tmp_path):
    model = hm.build("qwen3_moe")
    path, want = write_nvfp4(model, tmp_path / "model.safetensors")
    got = checkpoints.load_experts(path, [0, 1], E=hm.E, H=hm.H, I=hm.I)
    assert got.layout == "nvfp4"
    dev = got.deviation()["global_rounding_max_rel"]
    assert 0 < dev <= 2.0 ** -11 and all(r["globals_outside_fp16_normal"] == 0 for r in got.report.values())
    for i in range(2):
        gu, dn = _banks_decode(got, i)
        for a, b in ((gu, want[i][0].numpy()), (dn, want[i][1].numpy())):
            np.testing.assert_array_less(np.abs(a - b), dev * np.abs(b) * (1 + 1e-6) + 1e-30)
    ref = _reference(model, want)
    off = mt.offload_experts(model, checkpoint=path, **KW)
    assert off.format == "nvfp4"
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < QUANT_TOL, name


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_gguf_q4_0_is_bit_exact(tmp_path, arch):
    pytest.importorskip("gguf")
    model = hm.build(arch)
    path, want = write_gguf(model, tmp_path / "model.gguf")
    got = checkpoints.load_experts(path, [0, 1], E=hm.E, H=hm.H, I=hm.I)
    assert got.layout == "gguf_q4_0" and got.format == "q4_0" and got.deviation() == {}
    for i in range(2):
        gu, dn = _banks_decode(got, i)
        np.testing.assert_array_equal(gu, want[i][0].numpy())
        np.testing.assert_array_equal(dn, want[i][1].numpy())
    ref = _reference(model, want)
    off = mt.offload_experts(model, checkpoint=tmp_path, **KW)  # a directory holding one .gguf
    assert off.format == "q4_0" and off.runner.executor.mode == "w4a8"
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < W4A8_TOL, name


def test_loader_errors_name_the_tensor(tmp_path):
    model = hm.build("qwen3_moe")
    path, _ = write_fp8(model, tmp_path / "m.safetensors")
    from safetensors.torch import load_file

    t = load_file(str(path))
    del t["model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"]
    save_file(t, str(tmp_path / "broken.safetensors"))
    with pytest.raises(KeyError, match="experts.5.up_proj.weight_scale_inv"):
        checkpoints.load_experts(tmp_path / "broken.safetensors", [0, 1], E=hm.E, H=hm.H, I=hm.I,
                                 layout="fp8_block")
    with pytest.raises(KeyError, match="layer 7"):
        checkpoints.load_experts(path, [7], E=hm.E, H=hm.H, I=hm.I)
    with pytest.raises(ValueError, match="multiple of 128"):
        checkpoints.load_experts(path, [0], E=hm.E, H=hm.H, I=64, layout="fp8_block")
    with pytest.raises(ValueError, match="format='q4_0'"):
        mt.offload_experts(model, checkpoint=path, format="q4_0", **KW)
