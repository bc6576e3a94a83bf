"""transformers models on a CUDA GPU with their experts through moe_engine, strategies cpu (every expert on the host)
and hybrid (half on the GPU): each experts module against the unmodified model on the GPU, and decode under
transformers' static cache with CUDA graphs (torch.compile backend "cudagraphs": the eager kernels captured, so the
tokens and logits equal eager's bit for bit; mode "reduce-overhead" with inductor: the same tokens). CompileConfig's
default mode must be cleared for the cudagraphs backend: torch 2.11's rejects a `mode` argument (2.13's ignores it)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")

import hf_models as hm  # noqa: E402
from conftest import cuda_missing, triton_missing  # noqa: E402
from test_transformers import GEN_SEEDS, LAYER_TOL, LOGITS_TOL  # noqa: E402

from moe_engine.integrations import transformers as mt  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.cuda,
              pytest.mark.skipif(cuda_missing() is not None, reason=str(cuda_missing())),
              pytest.mark.skipif(triton_missing() is not None, reason=str(triton_missing()))]
DEV = "cuda"
ARCHS = ("qwen3_moe", "gpt_oss", "deepseek_v3")


def _offload(model, strategy, **kw):
    """Decode graphs at batch 1 (the generate() calls below), a prompt in one eager step (max_tokens 16)."""
    kw.setdefault("residency", 0.5 if strategy == "hybrid" else None)
    return mt.offload_experts(model, format="bf16", strategy=strategy, threads=4, progress=False,
                              graph_batch_sizes=(1,), max_tokens=16, **kw)


@pytest.mark.parametrize("strategy", ["cpu", "hybrid"])
@pytest.mark.parametrize("arch", ARCHS)
def test_layers_on_the_gpu_match_transformers(arch, strategy):
    model = hm.build(arch).to(DEV)
    ref = hm.clone(model)
    off = _offload(model, strategy)
    assert off.runner.device.type == "cuda" and off.runner.strategy == strategy
    assert off.runner.graphs_ok, off.runner.graphs_reason
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt().to(DEV)):
        assert y.device.type == "cuda"
        assert hm.rel(y.float(), y_ref.float()) < LAYER_TOL, name
    # the experts' weights left the GPU
    assert all(p.numel() == 0 for _, m in hm.experts_modules(model) for p in m.parameters())


def _generate(model, ids, steps=16, **kw):
    out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0,
                         cache_implementation="static", return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences, torch.stack(out.logits, 1).float()


@pytest.mark.parametrize("strategy", ["cpu", "hybrid"])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_cache_cuda_graphs_equal_eager(arch, strategy):
    from transformers import CompileConfig

    seed = GEN_SEEDS[arch]
    model = hm.build(arch, seed=seed, experts=4, top_k=4, scale=0.3).to(DEV)
    ref = hm.clone(model)
    ids = hm.prompt(seed=seed).to(DEV)
    off = _offload(model, strategy)
    assert off.runner.graphs_ok, off.runner.graphs_reason
    eager_ids, eager_logits = _generate(model, ids, disable_compile=True)
    graphs_ids, graphs_logits = _generate(model, ids, compile_config=CompileConfig(backend="cudagraphs", mode=None))
    assert hasattr(model, "_compiled_call")  # the decode steps ran compiled
    assert torch.equal(graphs_ids, eager_ids)
    assert torch.equal(graphs_logits, eager_logits)  # the same kernels, replayed
    # and the unmodified model, teacher-forced on those tokens, gives the same logits within the bf16 tolerance
    assert hm.rel(hm.logits(model, eager_ids), hm.logits(ref, eager_ids)) < LOGITS_TOL


def test_inductor_reduce_overhead_gives_the_eager_tokens():
    """transformers' default compiled generation (inductor, mode reduce-overhead: CUDA graphs of inductor's kernels
    for the rest of the model, our op captured inside), hybrid experts."""
    from transformers import CompileConfig

    seed = GEN_SEEDS["qwen3_moe"]
    model = hm.build("qwen3_moe", seed=seed, experts=4, top_k=4, scale=0.3).to(DEV)
    ids = hm.prompt(seed=seed).to(DEV)
    _offload(model, "hybrid")
    eager_ids, eager_logits = _generate(model, ids, disable_compile=True)
    ind_ids, ind_logits = _generate(model, ids, compile_config=CompileConfig(mode="reduce-overhead"))
    assert torch.equal(ind_ids, eager_ids)
    assert hm.rel(ind_logits, eager_logits) < LOGITS_TOL
