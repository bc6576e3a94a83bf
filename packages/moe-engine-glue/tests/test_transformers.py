"""transformers models with their experts through moe_engine (integrations/transformers.py), on the CPU: tiny random
models of every mapped architecture against the unmodified model.

Tolerances are max |ours - reference| / max |reference|, measured on these models (seeds 0-3, every architecture)
and set at 1.5-2.5x the worst value seen:
  LAYER_TOL, one experts module on the same inputs, bf16: measured <= 0.87%. transformers' eager experts round to
    bf16 after each of gate_up, the activation, down, the router weight and the top-k sum; moe_engine accumulates in
    fp32 and rounds the intermediate and the output once each, so they differ by a few bf16 ulps (2^-8 relative).
  LOGITS_TOL, the whole model's logits, bf16: measured <= 0.63% (E = top_k = 4, expert weights N(0, 0.015): no routing
    choice a rounding could flip), the same rounding carried through two MoE layers. These models decode 32 greedy
    tokens identically for GEN_SEEDS (20 of the 24 seeds tried do; the other 4 have a near-tie on the reference's
    path); the teacher-forced logits of every step are checked too.
  QUANT_TOL, quantized formats against the same model whose expert weights are the banks' dequantized values rounded
    to the model's bf16 (that rounding is most of the difference): measured <= 1.32% (fp8_block), 1.03% (mxfp4).
  W4A8_TOL, q4_0's default w4a8 mode, which also quantizes the activations to int8 per 32: measured <= 1.89%.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")

import hf_models as hm  # noqa: E402

import cpumoe_formats as cf  # noqa: E402
from moe_engine.integrations import transformers as mt  # noqa: E402
from moe_engine.integrations.transformers import convert  # noqa: E402

LAYER_TOL, LOGITS_TOL, QUANT_TOL, W4A8_TOL = 2e-2, 1.5e-2, 3e-2, 4e-2
# per architecture: seeds of the E = top_k = 4 model used for the greedy test (see the module docstring)
GEN_SEEDS = {"qwen3_moe": 1, "mixtral": 0, "deepseek_v3": 0, "gpt_oss": 0, "qwen3_next": 0, "qwen3_5_moe": 0}
KW = dict(strategy="cpu", threads=2, progress=False)


def _offload(model, **kw):
    return mt.offload_experts(model, **{**KW, **kw})


# ---- bf16: logits and greedy tokens against the unmodified model ----------------------------------------------------
@pytest.mark.parametrize("arch", hm.ARCHS)
def test_bf16_layers_match_transformers(arch):
    model = hm.build(arch)
    ref = hm.clone(model)
    off = _offload(model, format="bf16")
    assert off.format == "bf16" and off.runner.num_layers == len(off.modules) == 2
    pairs = hm.layer_pairs(ref, model, hm.prompt())
    assert len(pairs) == off.runner.num_layers
    for name, y_ref, y in pairs:
        assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
        assert hm.rel(y.float(), y_ref.float()) < LAYER_TOL, name


@pytest.mark.parametrize("arch", hm.ARCHS)
def test_bf16_logits_and_greedy_generate(arch):
    seed = GEN_SEEDS[arch]
    model = hm.build(arch, seed=seed, experts=4, top_k=4, scale=0.3)
    ref = hm.clone(model)
    ids = hm.prompt(seed=seed)
    want = hm.greedy(ref, ids)
    _offload(model, format="bf16")
    got = hm.greedy(model, ids)
    assert got.shape == want.shape == (1, ids.shape[1] + 32)
    assert torch.equal(got, want), f"{arch}: first differing step {int((got != want).nonzero()[0, 1])}"
    # teacher-forced on the reference's tokens: every step's logits, prefill and decode positions alike
    assert hm.rel(hm.logits(model, want), hm.logits(ref, want)) < LOGITS_TOL


def test_batched_generate_and_prefill_above_max_tokens():
    """A batch of 3 prompts of 20 tokens: prefill runs above max_tokens (8) in chunks, decode at batch 3."""
    model = hm.build("qwen3_moe", seed=1, experts=4, top_k=4, scale=0.3)
    ref = hm.clone(model)
    ids = hm.prompt(batch=3, length=20, seed=1)
    off = _offload(model)
    assert off.runner.max_tokens == 8
    assert hm.rel(hm.logits(model, ids), hm.logits(ref, ids)) < LOGITS_TOL
    assert off.runner.last_prefill["tokens"] == 60
    got, want = hm.greedy(model, ids, steps=8), hm.greedy(ref, ids, steps=8)
    assert (got == want).float().mean() > 0.9  # three paths of 8 steps: a near-tie may flip one late token


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_static_cache_compiled_decode_traces_the_custom_op(arch):
    """transformers' compiled generation (static cache, torch.compile of the decode step, fullgraph) traces the
    experts call as the custom op torch.ops.moe_engine.experts: the same tokens and logits as eager. aot_eager keeps
    the CPU run fast; CUDA graphs are test_transformers_gpu.py's."""
    from transformers import CompileConfig

    model = hm.build(arch, seed=GEN_SEEDS[arch], experts=4, top_k=4, scale=0.3)
    ids = hm.prompt(seed=GEN_SEEDS[arch])
    _offload(model, format="bf16")  # gpt-oss: its biases folded, the pad and bias sum traced too
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static",
              return_dict_in_generate=True, output_logits=True)
    eager = model.generate(ids, disable_compile=True, **kw)
    cc = CompileConfig(backend="aot_eager", fullgraph=True)
    cc._compile_all_devices = True  # transformers compiles on GPUs only unless told
    torch._dynamo.reset()
    compiled = model.generate(ids, compile_config=cc, **kw)
    assert hasattr(model, "_compiled_call")
    assert torch.equal(compiled.sequences, eager.sequences)
    assert all(torch.equal(a, b) for a, b in zip(compiled.logits, eager.logits))


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_hybrid_strategy(arch):
    """Strategy hybrid, half of each layer's experts on the 'GPU' side (here Triton's interpreter on CPU tensors,
    conftest.py; on a GPU host, the GPU): every route counted once, against the unmodified model."""
    from conftest import cuda_missing, triton_missing

    if triton_missing():
        pytest.skip(triton_missing())
    dev = "cpu" if cuda_missing() else "cuda"
    model = hm.build(arch).to(dev)
    ref = hm.clone(model)
    off = _offload(model, format="bf16", strategy="hybrid", residency=0.5, graph_batch_sizes=(1,), max_tokens=16)
    assert off.runner.strategy == "hybrid" and off.runner.residency.fraction() == 0.5
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt().to(dev)):
        assert hm.rel(y.float(), y_ref.float()) < LAYER_TOL, name


# ---- quantized formats against the model with dequantized expert weights ----------------------------------------
def _dequantized_model(model, fmt):
    """A copy of `model` whose expert weights are what `fmt`'s banks of them decode to (cpumoe_formats' float64
    decode, rounded to the model's dtype), built the way offload_experts builds the banks."""
    ref = hm.clone(model)
    spec = cf.get_format(fmt)
    for _, m in hm.experts_modules(ref):
        s = mt.inspect_experts(m)
        gu, dn, gub, dnb = convert.float_chunk(m, s, 0, s.E)
        if gub is not None and "gate_up_bias" in spec.bank_names:
            banks = cf.quantize(fmt, gu, dn, gate_up_bias=gub, down_bias=dnb)
            gub_q, _ = spec.biases(banks)
            gu_q, dn_q = spec.dequantize(banks)
        elif gub is not None:
            gu_q, dn_q = spec.dequantize(cf.quantize(fmt, *convert.fold_bias(gu, dn, gub)))
            gu_q, gub_q, dn_q = gu_q[:, :, :s.H], gu_q[:, :, s.H], dn_q[:, :s.H]
        else:
            gu_q, dn_q = spec.dequantize(cf.quantize(fmt, gu, dn))
            gub_q = None
        _set_float(m, s, gu_q, dn_q, gub_q)
    return ref


def _set_float(m, s, gu, dn, gub=None):
    """Write logical float weights (gate_up [E, 2I, H] gate; up, down [E, H, I]) into the module's own layout."""
    def put(p, a):
        p.copy_(torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(p.dtype))

    with torch.no_grad():
        if s.kind == "gpt_oss":
            w = np.empty((s.E, s.H, 2 * s.I))
            w[..., 0::2], w[..., 1::2] = gu[:, :s.I].transpose(0, 2, 1), gu[:, s.I:].transpose(0, 2, 1)
            put(m.gate_up_proj, w)
            put(m.down_proj, dn.transpose(0, 2, 1))
            b = np.empty((s.E, 2 * s.I))
            b[:, 0::2], b[:, 1::2] = gub[:, :s.I], gub[:, s.I:]
            put(m.gate_up_proj_bias, b)
        else:
            put(m.gate_up_proj, gu)
            put(m.down_proj, dn)


QUANT_CASES = [(a, f) for a in hm.ARCHS for f in ("fp8_block", "q4_0")] + [("gpt_oss", "mxfp4"), ("qwen3_moe", "nvfp4")]


@pytest.mark.parametrize("arch,fmt", QUANT_CASES)
def test_quantized_formats_match_dequantized_weights(arch, fmt):
    model = hm.build(arch)
    ref = _dequantized_model(model, fmt)
    off = _offload(model, format=fmt)
    assert off.format == fmt and off.folded_bias == (arch == "gpt_oss" and fmt != "mxfp4")
    tol = W4A8_TOL if off.runner.executor.mode == "w4a8" else QUANT_TOL
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < tol, (name, off.runner.executor.mode)


def test_q4_0_native_mode():
    model = hm.build("qwen3_moe")
    ref = _dequantized_model(model, "q4_0")
    off = _offload(model, format="q4_0", mode="native")
    assert off.runner.executor.mode == "native"
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < QUANT_TOL, name


# ---- the extension point -------------------------------------------------------------------------------------------
def test_registered_in_both_interfaces():
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert ALL_EXPERTS_FUNCTIONS[mt.NAME] is mt.experts_forward
    assert ALL_FP8_EXPERTS_FUNCTIONS[mt.NAME] is mt.experts_forward


def test_offload_frees_weights_and_switches_the_implementation():
    model = hm.build("deepseek_v3")
    shared = {n: p.clone() for n, p in model.named_parameters() if "shared_experts" in n}
    scaling = [m.gate.routed_scaling_factor for m in model.modules() if hasattr(m, "shared_experts")]
    before = sum(p.numel() for p in model.parameters())
    off = _offload(model)
    assert model.config._experts_implementation == mt.NAME and model.moe_engine is off
    mods = dict(hm.experts_modules(model))
    assert set(mods) == set(off.modules) and off.decoder_layers == [1, 2]
    for m in mods.values():
        assert all(p.numel() == 0 for p in m.parameters()) and m._moe_engine.runner is off.runner
    freed = before - sum(p.numel() for p in model.parameters())
    assert freed == 2 * hm.E * 3 * hm.H * hm.I
    # shared experts and the router's routed_scaling_factor stay in the model, untouched
    for n, p in model.named_parameters():
        if n in shared:
            assert torch.equal(p, shared[n])
    assert scaling == [2.5, 2.5]
    assert off.runner.executor is not None and off.runner.num_layers == 2  # one executor for both layers


def test_experts_implementation_by_name_before_offload():
    """from_pretrained(..., experts_implementation="moe_engine") / set_experts_implementation take the name; until
    offload_experts converts the weights, the experts say what to do."""
    model = hm.build("mixtral")
    model.set_experts_implementation(mt.NAME)
    with pytest.raises(RuntimeError, match="offload_experts"):
        hm.logits(model, hm.prompt())
    _offload(model)
    assert model.config._experts_implementation == mt.NAME
    hm.logits(model, hm.prompt())


def test_from_pretrained_with_the_name(tmp_path):
    from transformers import AutoModelForCausalLM

    model = hm.build("qwen3_moe")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, experts_implementation=mt.NAME)
    assert loaded.config._experts_implementation == mt.NAME
    _offload(loaded)
    for name, y_ref, y in hm.layer_pairs(model, loaded, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < LAYER_TOL, name


def test_fp8_experts_module_goes_through_the_fp8_interface():
    """FP8Experts (transformers' FP8 block experts, dispatched by FP8ExpertsInterface): e4m3 codes and fp32
    weight_scale_inv taken as they are (scales rounded to bf16)."""
    model = hm.build("qwen3_moe")
    ref = hm.clone(model)
    fp8 = hm.clone(model)
    cls = _fp8_experts_class()
    with torch.no_grad():
        for (n, m), (_, r) in zip(hm.experts_modules(fp8), hm.experts_modules(ref)):
            new = cls(config=m.config, block_size=(128, 128))
            for proj in ("gate_up_proj", "down_proj"):
                codes, scale = _fp8_quantize(getattr(m, proj).float())
                getattr(new, proj).data = codes
                getattr(new, proj + "_scale_inv").data = scale
                getattr(r, proj).copy_(_fp8_dequantize(codes, scale).to(torch.bfloat16))
            fp8.set_submodule(n, new)
    assert {type(m).__name__ for _, m in hm.experts_modules(fp8)} == {"FP8Experts"}
    off = _offload(fp8)
    assert off.format == "fp8_block" and 0 < off.deviation()["scale_rounding_max_rel"] <= 2.0 ** -8
    assert fp8.config._experts_implementation == mt.NAME
    for name, y_ref, y in hm.layer_pairs(ref, fp8, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < QUANT_TOL, name


_FP8_CLASS = []


def _fp8_experts_class():
    """FP8Experts decorated as transformers' replace_with_fp8_linear does (once per process)."""
    if not _FP8_CLASS:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
        from transformers.integrations.moe import use_experts_implementation

        _FP8_CLASS.append(use_experts_implementation(experts_class=FP8Experts,
                                                     experts_interface=ALL_FP8_EXPERTS_FUNCTIONS))
    return _FP8_CLASS[0]


def _fp8_quantize(w):
    """DeepSeek-V3's recipe: per 128x128 block, scale = amax / 448 (fp32), codes = e4m3(w / scale)."""
    E, R, K = w.shape
    blocks = w.reshape(E, R // 128, 128, K // 128, 128)
    scale = (blocks.abs().amax(dim=(2, 4)) / 448.0).clamp(min=1e-12)
    codes = (blocks / scale[:, :, None, :, None]).reshape(E, R, K).to(torch.float8_e4m3fn)
    return codes, scale.float()


def _fp8_dequantize(codes, scale):
    E, R, K = codes.shape
    s = scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    return codes.float() * s


def test_mxfp4_triton_experts_are_swapped_for_dispatched_ones(tmp_path):
    """Mxfp4GptOssExperts (not dispatched: its MLP calls the hub's Triton kernels) -> transformers' GptOssMLP around
    the same router and a decorated GptOssExperts, the experts read from the checkpoint's *_blocks / *_scales."""
    from checkpoint_writers import as_mxfp4_triton, mxfp4_reference, write_mxfp4

    model = hm.build("gpt_oss")
    ckpt = write_mxfp4(model, tmp_path / "model.safetensors")
    ref = mxfp4_reference(model, ckpt)
    as_mxfp4_triton(model)
    off = _offload(model, checkpoint=tmp_path)
    assert off.format == "mxfp4" and off.source.startswith("mxfp4 checkpoint")
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["GptOssMLP", "GptOssMLP"]
    assert [type(layer.mlp.experts).__name__ for layer in model.model.layers] == ["GptOssExperts"] * 2
    assert not any("forward" in layer.mlp.__dict__ for layer in model.model.layers)
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < QUANT_TOL, name


def test_errors_name_what_to_do():
    with pytest.raises(ValueError, match="no experts module"):
        _offload(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    model = hm.build("gpt_oss")
    with pytest.raises(ValueError, match="must be multiples of"):  # checked before any weight is freed
        _offload(model, format="ds_fp4")
    assert all(p.numel() > 0 for _, m in hm.experts_modules(model) for p in m.parameters())
    with pytest.raises(ValueError, match="expected one of"):
        _offload(model, strategy="sideways")
