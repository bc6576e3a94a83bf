"""moe_engine.from_pretrained against transformers' own loading of the same file, on the CPU: each shipped layout's
small synthetic checkpoint (moe_engine.tools.synth: real formats and naming, the qwen3moe / gpt-oss structure at
small dims, 2 decoder layers, random weights), and the refusals that come before anything heavy is read.

Tolerances (pretrained_compare.py says how positions are compared): rel <= 1.1% for bf16, FP8 and MXFP4 experts
(bf16 roundings carried through two layers, as test_transformers.py explains), <= 1.2% for GGUF Q4_0 in q4_0's
default w4a8 mode (the int8 activations), at every position but those where a rounding flips a routing choice: one
of 32 positions at 8.0% here, two at 10.6% and 15.0% on the H100 host (torch 2.11). So: TOL for 90% of positions,
FLIP_TOL for the rest. GGUF Q8_0 / K-quant experts: test_from_pretrained_gguf.py.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("gguf")
pytest.importorskip("safetensors")
pytest.importorskip("accelerate")

from pretrained_compare import compare, gguf_reference  # noqa: E402
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config  # noqa: E402

from moe_engine import from_pretrained  # noqa: E402
from moe_engine.loading import budget  # noqa: E402
from moe_engine.tools import synth  # noqa: E402

TOL = {"gguf-q4_0": 2.5e-2}  # default below
DEFAULT_TOL = 2e-2
KW = dict(strategy="cpu", device="cpu", threads=2, progress=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for kind in ("gguf-q4_0", "bf16", "fp8", "mxfp4"):
        p = root / (f"{kind}.gguf" if kind.startswith("gguf") else kind)
        synth.write(kind, p, small=True, layers=2, seed=11, shard_bytes=4 << 20, progress=False)
        out[kind] = p
    return out


def _reference(kind, path):
    if kind.startswith("gguf"):
        return gguf_reference(path)
    # dequantized to bf16 on the CPU, as a GPU-less transformers does anyway (no GPU kernels needed)
    extra = {"mxfp4": dict(quantization_config=Mxfp4Config(dequantize=True)),
             "fp8": dict(quantization_config=FineGrainedFP8Config(dequantize=True))}.get(kind, {})
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, **extra)


@pytest.mark.parametrize("kind", ["gguf-q4_0", "bf16", "fp8", "mxfp4"])
def test_matches_transformers_loading(files, kind):
    path = files[kind]
    ref = _reference(kind, path)
    model = from_pretrained(path, **KW)
    off = model.moe_engine
    assert off.runner.strategy == "cpu" and off.plan.strategy == "cpu"
    assert not any(p.device.type == "meta" for p in model.parameters())
    compare(model, ref, TOL.get(kind, DEFAULT_TOL))
    off.close()


def test_float_experts_quantized_to_format(files):
    model = from_pretrained(files["bf16"], format="q4_0", **KW)
    assert model.moe_engine.format in ("q4_0", "q4_0_x16")
    ids = torch.tensor([[3, 17, 101, 42]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    model.moe_engine.close()


def test_generate_from_ids_and_tokenizer(files):
    model = from_pretrained(files["gguf-q4_0"], **KW)
    tok = model.moe_engine.tokenizer
    assert tok is not None  # the synthetic GGUF carries a small byte-level BPE
    ids = tok("hello moe", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4
    model.moe_engine.close()


def test_refusals_name_what_is_wrong(files, tmp_path):
    with pytest.raises(FileNotFoundError, match="path='/nonexistent/model': no such file"):
        from_pretrained("/nonexistent/model", **KW)
    with pytest.raises(ValueError, match=r"format='fp8_block', but .* ships its experts as q4_0"):
        from_pretrained(files["gguf-q4_0"], format="fp8_block", **KW)
    with pytest.raises(ValueError, match="gpu_memory='lots'"):
        from_pretrained(files["gguf-q4_0"], gpu_memory="lots", **KW)
    with pytest.raises(ValueError, match="host_memory='lots'"):
        from_pretrained(files["gguf-q4_0"], host_memory="lots", **KW)
    dense = tmp_path / "dense"
    _dense_model(dense)
    with pytest.raises(NotImplementedError, match="no experts module transformers dispatches"):
        from_pretrained(dense, **KW)


def _dense_model(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(path)


def test_gpu_budget_plan():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    kw = dict(non_expert_bytes=3 << 30, kv_bytes=1 << 30, expert_bytes=9 << 20, E=128, layers=48, gpu_kernels=True)
    GiB = 1 << 30
    p = budget.plan("auto", cuda, 16 * GiB, **kw)
    fit = (16 * GiB - (3 << 30) - (1 << 30) - budget.RESERVE) // ((9 << 20) * 48)
    assert p.strategy == "hybrid" and p.experts_per_layer == fit and "on the CPU" in p.why
    assert budget.plan("auto", cuda, 200 * GiB, **kw).strategy == "gpu"
    assert budget.plan("auto", cpu, None, **kw).strategy == "cpu"
    with pytest.raises(ValueError, match=r"gpu_memory=2\.00 GiB is too small: the non-expert weights need 3\.00 GiB"):
        budget.plan("auto", cuda, 2 * GiB, **kw)
    with pytest.raises(ValueError, match="strategy='gpu' keeps all 6144 experts"):
        budget.plan("gpu", cuda, 16 * GiB, **kw)
    # whole layers (residency="layers"): as many layers' experts as fit, the last ones, as llama.cpp's --n-cpu-moe
    w = budget.plan("auto", cuda, 16 * GiB, whole_layers=True, **kw)
    n = (16 * GiB - (3 << 30) - (1 << 30) - budget.RESERVE) // ((9 << 20) * 128)
    assert w.strategy == "hybrid" and w.gpu_layers == n == 9 and f"--n-cpu-moe {48 - n}" in w.why
    assert budget.plan("auto", cuda, 200 * GiB, whole_layers=True, **kw).strategy == "gpu"
    assert budget.plan("cpu", cuda, 16 * GiB, whole_layers=True, **kw).gpu_layers is None
    assert budget.parse_bytes("16GiB") == 16 * GiB and budget.parse_bytes("1.5 GB") == 1_500_000_000
    for bad in ("16 parsecs", "-3GiB", 0, True):
        with pytest.raises((ValueError, TypeError), match="gpu_memory="):
            budget.parse_bytes(bad)


def test_host_copy_rule():
    """Beside a GPU, hybrid's executor repacks (a second copy of the experts on the host) only where both copies, a
    layer and the margin fit the host budget; the boundary is exact, and an unknown budget repacks."""
    GiB = 1 << 30
    kw = dict(base_bytes=12 * GiB, repacked_bytes=12 * GiB, layer_bytes=GiB // 4, limit_name="host_memory",
              base="fp8_block", repacked="fp8_block_x16")
    need = 24 * GiB + GiB // 4 + budget.HOST_MARGIN
    ok, why = budget.host_copy(host_bytes=need, **kw)
    assert ok and "two copies, 24.00 GiB" in why and "fit host_memory" in why
    ok, why = budget.host_copy(host_bytes=need - 1, **kw)
    assert not ok and "runs the GPU's host banks as they are (fp8_block, one copy, 12.00 GiB)" in why
    assert "fp8_block_x16 would add 12.00 GiB" in why and "exceed host_memory" in why
    ok, why = budget.host_copy(host_bytes=None, **kw)
    assert ok and "host memory unknown" in why


def test_host_copy_choice_is_logged(caplog):
    """from_pretrained's host banks for a hybrid Qwen3-30B-A3B-shaped model. Q4_0: one copy in the executor's
    q4_0_x16, whatever the budget (the GPU loads from it, gpu/moved.py). MXFP4 in mode w4a8 runs as mxfp4_x16, which
    is not mxfp4's bytes moved: the file's banks for the GPU, and the executor's repack (None) as a second copy only
    under a budget that holds two, else False. One log line each."""
    from cpumoe_executor import cpu_layout
    from moe_engine import layer_formats
    from moe_engine.integrations.transformers import load

    E, H, I, L = 128, 2048, 768, 48  # noqa: E741
    GiB = 1 << 30
    q4 = [("q4_0", "q4_0")] * L
    with caplog.at_level("INFO", logger="moe_engine"):
        run, repack = load._host_copy(q4, H, I, E, 1, {})
    x16 = cpu_layout("q4_0", H=H, I=I)
    assert (run, repack) == ([(x16, x16)] * L, None)
    if x16 != "q4_0":
        lines = [r.getMessage() for r in caplog.records if "host memory" in r.getMessage()]
        assert len(lines) == 1 and "one copy of the experts, 15.19 GiB in q4_0_x16" in lines[0], lines
    assert load._host_copy([("q4_0_x16", "q4_0_x16")] * L, H, I, E, 1, {}) == ([("q4_0_x16", "q4_0_x16")] * L, None)
    kw = {"mode": "w4a8"}
    if cpu_layout("mxfp4", H=H, I=I, mode="w4a8") != "mxfp4_x16":
        pytest.skip("this CPU does not run mxfp4 as mxfp4_x16 in w4a8")
    mx = [("mxfp4", "mxfp4")] * L
    one = E * L * layer_formats.bytes_per_expert(mx[0], H, I)
    caplog.clear()
    with caplog.at_level("INFO", logger="moe_engine"):
        assert load._host_copy(mx, H, I, E, one + 2 * GiB, kw) == (mx, False)
        assert load._host_copy(mx, H, I, E, 2 * one + 2 * GiB, kw) == (mx, None)
    lines = [r.getMessage() for r in caplog.records if "host memory" in r.getMessage()]
    assert len(lines) == 2 and "one copy" in lines[0] and "two copies" in lines[1], lines


def test_buffers_follow_the_weights(files):
    """The skeleton computes buffers (rope's inv_freq) on the CPU; place_buffers moves every one, persistent or not,
    to the weights' device (on a GPU, one left behind made the cudagraphs backend skip the whole decode step)."""
    from moe_engine.integrations.transformers import skeleton

    src_model = _reference("gguf-q4_0", files["gguf-q4_0"])
    names = [n for n, _ in src_model.named_buffers()]
    assert any("inv_freq" in n for n in names), names  # the case this guards: a non-persistent buffer
    assert skeleton.place_buffers(src_model, torch.device("meta")) == len(names)
    assert {b.device.type for b in src_model.buffers()} == {"meta"}
    assert skeleton.place_buffers(src_model, torch.device("meta")) == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
@pytest.mark.parametrize("strategy", ["cpu", "hybrid"])
def test_gpu_decode_is_captured(files, strategy):
    """On a GPU every parameter and buffer is on it, and moe-engine bench's decode (static cache, the cudagraphs
    backend) captures the step (no cudagraph skip) and gives eager's greedy tokens."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = from_pretrained(files["gguf-q4_0"], strategy=strategy, device="cuda", threads=2, progress=False,
                            gpu_memory="2GiB" if strategy == "hybrid" else None)
    off = model.moe_engine
    assert off.runner.strategy == strategy and off.runner.graphs_ok
    off_gpu = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
               if t.device.type != "cuda" and t.numel()]
    assert off_gpu == []
    ids = torch.tensor([[3, 17, 101, 42]], device="cuda")
    want = model.generate(ids, max_new_tokens=12, do_sample=False)
    torch._dynamo.reset()
    counters.clear()
    cc = CompileConfig(backend="cudagraphs", mode=None)
    for _ in range(2):  # the first call compiles and records, the second replays
        got = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static", compile_config=cc)
        assert torch.equal(got, want)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    off.close()
