"""from_pretrained's decode= (integrations/transformers/decode.py): each non-expert decode path against transformers'
defaults (eager) on the small GGUF Q4_0 checkpoint (moe_engine.tools.synth, 2 layers), the log line, bad values.

Tolerances, per generated position (12 greedy tokens after an 8-token prompt), rel = max |path - eager| / max |eager|
over the vocabulary:
  packed: the same bf16 products with fp32 accumulation, summed in oneDNN's order: measured 0 (bit-identical here);
    bound 1e-2 (bf16's relative step is 3.9e-3: a product that rounds differently shows up, a wrong weight does not
    stay under it).
  static: the static cache, its attention through moe_engine.attention (fp32 softmax and sums, reading the masked
    positions only) where eager's sdpa reads the dynamic cache: measured <= 7.7e-3; bound 2e-2.
  gemv: static's cache, and the bf16 products summed in fp32 by cpumoe_formats' dense linear (4 chains a row):
    the same bound as static, 2e-2.
  compile: inductor fuses the norms and rotary in fp32: measured <= 3.2e-2 but 1.2e-1 at a routing flip (E = 16,
    top-4 near-ties, as test_from_pretrained.py explains); bound 5e-2 at 90% of positions, 0.3 elsewhere.
Greedy tokens equal eager's wherever eager's top-2 margin exceeds twice that position's max |error|.
"""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("gguf")

from moe_engine import from_pretrained  # noqa: E402
from moe_engine.integrations.transformers import decode  # noqa: E402
from moe_engine.tools import synth  # noqa: E402

KW = dict(strategy="cpu", device="cpu", threads=2, progress=False)
PROMPT = torch.tensor([[3, 17, 101, 42, 7, 250, 99, 12]])


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    p = tmp_path_factory.mktemp("decode") / "q4_0.gguf"
    synth.write("gguf-q4_0", p, small=True, layers=2, seed=11, progress=False)
    return p


def _generate(path, mode, n=12):
    model = from_pretrained(path, decode=mode, **KW)
    try:
        with torch.no_grad():
            out = model.generate(PROMPT, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        return model, out
    finally:
        model.moe_engine.close()


@pytest.fixture(scope="module")
def eager(gguf):
    return _generate(gguf, "eager")[1]


def _check(out, ref, tol, flip_tol=None, share=1.0):
    rels, n_ok = [], 0
    for i, (a, b) in enumerate(zip(out.logits, ref.logits)):
        a, b = a[0].float(), b[0].float()
        err = (a - b).abs().max()
        rel = float(err / b.abs().max())
        rels.append(rel)
        n_ok += rel <= tol
        assert rel <= (flip_tol or tol), f"position {i}: rel {rel:.2e} > {flip_tol or tol}"
        top = b.topk(2).values
        if out.sequences[0, 8 + i] != ref.sequences[0, 8 + i]:
            assert top[0] - top[1] <= 2 * err, f"position {i}: token differs with a top-2 margin of {top[0] - top[1]}"
            break  # the sequences part: later positions see different inputs
    assert n_ok >= share * len(rels), f"rel per position {['%.1e' % r for r in rels]}: fewer than {share:.0%} <= {tol}"
    return rels


@pytest.mark.parametrize("mode,tol", [("packed", 1e-2), ("static", 2e-2)])
def test_path_matches_eager(gguf, eager, mode, tol):
    model, out = _generate(gguf, mode)
    assert model.moe_engine.decode[0] == mode
    packed = [n for n, m in model.named_modules() if isinstance(m, decode.PackedLinear)]
    assert "lm_head" in packed and any(n.endswith("self_attn.q_proj") for n in packed)
    assert (model.generation_config.cache_implementation == "static") == (mode == "static")
    _check(out, eager, tol)


@pytest.mark.slow  # inductor compiles the 2-layer graph: ~25 s on a quiet 2-core VM, a minute on a busy one
def test_compile_matches_eager(gguf, eager):
    """With the runner's CPU executor the compiled step keeps gemv's linears and decode attention (opaque nodes)."""
    from moe_engine.dense import DenseLinear

    model, out = _generate(gguf, "compile", n=8)
    assert model.generation_config.compile_config.fullgraph
    assert any(isinstance(m, DenseLinear) for m in model.modules())
    assert model.config._attn_implementation == "moe_engine"
    _check(out, eager, 5e-2, flip_tol=0.3, share=0.9)


def test_gemv_matches_eager(gguf, eager):
    from moe_engine.dense import DenseLinear, DenseWeight

    model, out = _generate(gguf, "gemv")
    assert model.moe_engine.decode[0] == "gemv"
    dense = [n for n, m in model.named_modules() if isinstance(m, DenseLinear)]
    assert "lm_head" in dense and any(n.endswith("self_attn.q_proj") for n in dense)
    assert all(type(m.gate.weight) is DenseWeight for m in model.modules() if hasattr(m, "gate")
               and type(m.gate).__name__.endswith("Router"))
    assert model.generation_config.cache_implementation == "static"
    _check(out, eager, 2e-2)


def test_auto_picks_gemv_with_a_cpu_executor_and_logs_why(gguf, caplog):
    with caplog.at_level(logging.INFO, logger="moe_engine"):
        model = from_pretrained(gguf, **KW)
    ex = model.moe_engine.runner.executor
    with torch.no_grad():
        runs, att = ex._x.linear_runs, ex._x.attention_runs
        model(torch.tensor([[5]]))
        assert ex._x.linear_runs > runs  # the linears ran there
        assert ex._x.attention_runs == att + 2  # and each layer's attention (2 layers)
    model.moe_engine.close()
    line = [r.getMessage() for r in caplog.records if "decode path" in r.getMessage()]
    assert len(line) == 1 and line[0].startswith("from_pretrained: decode path gemv (CPU executor: its dense bf16 "
                                                 f"linear ({ex.linear_isa})"), line
    assert "linears and 2 routers on the executor" in line[0]
    assert f"attention on cpumoe_formats' decode attention ({ex.attention_isa}, on the executor's threads)" in line[0]
    assert model.config._attn_implementation == "moe_engine"
    assert model.moe_engine.decode[0] == "gemv"
    assert decode.resolve("auto", torch.device("cuda"))[0] == "eager"
    assert decode.resolve("auto", torch.device("cpu"))[0] == "static"  # no runner: oneDNN's packed path


def test_gemv_needs_a_cpu_executor():
    with pytest.raises(ValueError, match="decode='gemv' runs the linears on the experts' CPU executor"):
        decode.resolve("gemv", torch.device("cpu"))


def test_packed_linear_against_float64():
    g = torch.Generator().manual_seed(5)
    for k, n, bias in ((72, 33, True), (2048, 96, False)):  # ragged sizes, with and without a bias
        lin = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
        lin.weight.data = torch.randn(n, k, generator=g).to(torch.bfloat16)
        if bias:
            lin.bias.data = torch.randn(n, generator=g).to(torch.bfloat16)
        p = decode.PackedLinear(lin)
        for shape in ((1, k), (5, k), (1, 3, k)):
            x = torch.randn(*shape, generator=g).to(torch.bfloat16)
            want = x.double() @ lin.weight.double().t() + (lin.bias.double() if bias else 0)
            got = p(x)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-2  # bf16 output rounding
        x = torch.randn(2, k, generator=g)  # fp32 input: computed in bf16, returned in fp32
        assert p(x).dtype == torch.float32
        xn = torch.randn(1, k, generator=g).to(torch.bfloat16)
        xn[0, 3] = float("nan")
        assert torch.isnan(p(xn)).all()  # NaN reaches every output, as in the reference
        with pytest.raises(ValueError, match=f"expected {k}"):
            p(torch.zeros(1, k + 1, dtype=torch.bfloat16))


def test_pack_linears_frees_each_weight_as_it_goes(monkeypatch):
    """Each original bf16 weight is freed once its packed copy exists, so packing never holds every weight twice
    (the full-size file's peak RSS rose 2 GB when it did)."""
    import weakref

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64).to(torch.bfloat16) for _ in range(4)])
    refs = [weakref.ref(m.weight) for m in model]
    alive_at_pack = []
    real = decode.PackedLinear.__init__

    def counting(self, linear):
        alive_at_pack.append(sum(r() is not None for r in refs))
        real(self, linear)

    monkeypatch.setattr(decode.PackedLinear, "__init__", counting)
    model.get_input_embeddings = lambda: None
    assert decode.pack_linears(model) == 4
    assert alive_at_pack == [4, 3, 2, 1], alive_at_pack
    assert all(r() is None for r in refs)


def test_attention_sdpa_keeps_transformers_own(gguf, caplog):
    with caplog.at_level(logging.INFO, logger="moe_engine"):
        model = from_pretrained(gguf, attention="sdpa", **KW)
    model.moe_engine.close()
    assert model.config._attn_implementation == "sdpa"
    assert any("attention sdpa (asked for)" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"attention='flash': expected one of auto, sdpa"):
        from_pretrained(gguf, attention="flash", **KW)


def test_bad_decode_value_is_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match=r"decode='fast': expected one of auto, eager, packed, static, compile, gemv"):
        from_pretrained(tmp_path / "missing.gguf", decode="fast", **KW)
    with pytest.raises(ValueError, match="decode=None"):
        decode.check(None)
