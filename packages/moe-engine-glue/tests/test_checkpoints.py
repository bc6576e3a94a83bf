"""moe_engine.checkpoints: tiny checkpoints written in the real layouts (safetensors as DeepSeek-V3 / Qwen FP8,
gpt-oss MXFP4 and ModelOpt NVFP4 ship them; a GGUF file through the gguf writer), read back into banks, compared
with an independent decode of the same tensors (torch / transformers' own / gguf's dequantizers), then run in a
transformers model against that model with its expert weights replaced by the decoded values.

Exactness: mxfp4 and GGUF Q4_0 banks decode to the checkpoint's values bit for bit; fp8_block's bf16 block scales
differ from the checkpoint's fp32 ones by at most 2^-8 relative (nearest even to 8 significant bits) and nvfp4's fp16
per-row global from ModelOpt's fp32 per-tensor one by at most 2^-11; both are measured here and in the loaders'
reports (docs/transformers.md)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("safetensors")

import checkpoint_writers as cw  # noqa: E402
import hf_models as hm  # noqa: E402
from test_transformers import QUANT_TOL, W4A8_TOL  # noqa: E402

import cpumoe_formats as cf  # noqa: E402
from moe_engine import checkpoints  # noqa: E402
from moe_engine.integrations import transformers as mt  # noqa: E402

KW = dict(strategy="cpu", threads=2, progress=False)


# ---- the tests -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,naming,shards", [("qwen3_moe", "per_expert", 1), ("deepseek_v3", "per_expert", 2),
                                                 ("mixtral", "mixtral", 2)])
def test_fp8_block_checkpoint(tmp_path, arch, naming, shards):
    model = hm.build(arch)
    path, want = cw.write_fp8(model, tmp_path / ("ckpt" if shards > 1 else "model.safetensors"), naming, shards)
    layers = sorted(want)
    got = checkpoints.load_experts(path, layers, E=hm.E, H=hm.H, I=hm.I, model_type=model.config.model_type)
    assert got.layout == "fp8_block" and got.format == "fp8_block"
    dev = got.deviation()["scale_rounding_max_rel"]
    assert 0 < dev <= 2.0 ** -8
    for i, n in enumerate(layers):
        gu, dn = cw.banks_decode(got, i)
        for a, b in ((gu, want[n][0].numpy()), (dn, want[n][1].numpy())):
            # each weight is off by its block scale's rounding, nothing else (the codes are copied)
            np.testing.assert_array_less(np.abs(a - b), dev * np.abs(b) * (1 + 1e-6) + 1e-30)
    ref = cw.reference_model(model, want)
    off = mt.offload_experts(model, checkpoint=path, **KW)
    assert off.format == "fp8_block" and off.source.startswith("fp8_block checkpoint")
    assert off.deviation()["scale_rounding_max_rel"] == dev
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < QUANT_TOL, name


def test_fp8_block_ue8m0_scales_are_exact(tmp_path):
    model = hm.build("deepseek_v3")
    path, want = cw.write_fp8(model, tmp_path / "m.safetensors", ue8m0=True)
    got = checkpoints.load_experts(path, [1, 2], E=hm.E, H=hm.H, I=hm.I)
    assert all(r["exact"] for r in got.report.values()) and got.deviation()["scale_rounding_max_rel"] == 0.0
    for i, n in enumerate([1, 2]):
        gu, dn = cw.banks_decode(got, i)
        np.testing.assert_array_equal(gu, want[n][0].numpy())
        np.testing.assert_array_equal(dn, want[n][1].numpy())


def test_fp8_block_scale_rounding_effect_on_outputs(tmp_path):
    """The measured effect of bf16 block scales on one layer's float64 output (docs/transformers.md)."""
    model = hm.build("qwen3_moe")
    path, want = cw.write_fp8(model, tmp_path / "m.safetensors")
    got = checkpoints.load_experts(path, [0], E=hm.E, H=hm.H, I=hm.I)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, hm.H))
    ids = np.stack([rng.choice(hm.E, 2, replace=False) for _ in range(16)]).astype(np.int32)
    w = rng.random((16, 2)) + 0.1
    gu, dn = cw.banks_decode(got, 0)
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
    path = cw.write_mxfp4(model, tmp_path / "model.safetensors")
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
    ref = cw.mxfp4_reference(model, path)
    off = mt.offload_experts(model, checkpoint=path, **KW)
    assert off.format == "mxfp4" and off.runner.act.name == "swigluoai"
    assert off.runner.act.alpha == pytest.approx(1.702) and off.runner.act.limit == pytest.approx(7.0)
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < QUANT_TOL, name


def test_nvfp4_modelopt_checkpoint(tmp_path):
    model = hm.build("qwen3_moe")
    path, want = cw.write_nvfp4(model, tmp_path / "model.safetensors")
    got = checkpoints.load_experts(path, [0, 1], E=hm.E, H=hm.H, I=hm.I)
    assert got.layout == "nvfp4"
    dev = got.deviation()["global_rounding_max_rel"]
    assert 0 < dev <= 2.0 ** -11 and all(r["globals_outside_fp16_normal"] == 0 for r in got.report.values())
    for i in range(2):
        gu, dn = cw.banks_decode(got, i)
        for a, b in ((gu, want[i][0].numpy()), (dn, want[i][1].numpy())):
            np.testing.assert_array_less(np.abs(a - b), dev * np.abs(b) * (1 + 1e-6) + 1e-30)
    ref = cw.reference_model(model, want)
    off = mt.offload_experts(model, checkpoint=path, **KW)
    assert off.format == "nvfp4"
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < QUANT_TOL, name


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_gguf_q4_0_is_bit_exact(tmp_path, arch):
    pytest.importorskip("gguf")
    model = hm.build(arch)
    path, want = cw.write_gguf(model, tmp_path / "model.gguf")
    got = checkpoints.load_experts(path, [0, 1], E=hm.E, H=hm.H, I=hm.I)
    assert got.layout == "gguf_q4_0" and got.format == "q4_0" and got.deviation() == {}
    for i in range(2):
        gu, dn = cw.banks_decode(got, i)
        np.testing.assert_array_equal(gu, want[i][0].numpy())
        np.testing.assert_array_equal(dn, want[i][1].numpy())
    ref = cw.reference_model(model, want)
    off = mt.offload_experts(model, checkpoint=tmp_path, **KW)  # a directory holding one .gguf
    assert off.format == "q4_0" and off.runner.executor.mode == "w4a8"
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < W4A8_TOL, name


def test_loader_errors_name_the_tensor(tmp_path):
    model = hm.build("qwen3_moe")
    path, _ = cw.write_fp8(model, tmp_path / "m.safetensors")
    from safetensors.torch import load_file, save_file

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
