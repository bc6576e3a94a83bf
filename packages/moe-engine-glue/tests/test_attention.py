"""moe_engine.attention (transformers' attention implementation "moe_engine"): against the unmodified library's sdpa
and the float64 reference on transformers' own tensor layouts; what goes to sdpa goes there bit for bit; a model
switched to it decodes with the native kernel and matches sdpa.

Tolerance against float64: as cpumoe-formats' test_attention (|o - ref| <= 2^-8 |ref| + 1e-5 max |v|: bf16 output
rounding plus fp32 sums). Against sdpa: each output is rounded to bf16 (half a step, 2^-8 of its magnitude) and
sdpa's CPU kernel rounds more inside (measured 1.8e-3 - 3.3e-3 of max |ref| off float64 on these cases, ours
1.6e-3 - 2.7e-3): max |ours - sdpa| <= 1e-2 max |ref|, and ours is never farther from float64 than sdpa.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import cpumoe_formats as cf  # noqa: E402
from moe_engine import attention  # noqa: E402


class _Mod(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        self.num_key_value_groups, self.is_causal = group, True


def _qkv(g, B, Hq, Hkv, n, L, D, dtype=torch.bfloat16):
    q = torch.randn(B, n, Hq, D, generator=g).to(dtype).transpose(1, 2)  # transformers' [B, Hq, n, D] view
    k = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    return q, k, v


def _static_mask(B, n, L, filled):
    """A static cache's decode mask: the first `filled` positions, causal for the n new tokens at its end."""
    m = torch.zeros(B, 1, n, L, dtype=torch.bool)
    for t in range(n):
        m[:, :, t, :filled - n + t + 1] = True
    return m


def _ref(q, k, v, mask, scale):
    B = q.shape[0]
    out = []
    for b in range(B):
        qb = q[b].transpose(0, 1).contiguous().view(torch.int16).numpy().view(cf.numerics.BF16)
        kb, vb = (t[b].contiguous().view(torch.int16).numpy().view(cf.numerics.BF16) for t in (k, v))
        mb = None if mask is None else mask[b, 0].numpy()
        out.append(cf.reference.attention(qb, kb, vb, mb, scale))
    return np.stack(out)  # [B, n, Hq, D]


@pytest.mark.parametrize("B,Hq,Hkv,n,L,D,filled", [(1, 32, 4, 1, 34, 128, 20), (1, 32, 4, 1, 4096, 128, 40),
                                                    (2, 8, 2, 3, 50, 64, 50), (1, 6, 6, 1, 9, 80, 9),
                                                    (1, 4, 1, 16, 40, 32, 40)])
def test_matches_float64_and_sdpa(B, Hq, Hkv, n, L, D, filled):
    g = torch.Generator().manual_seed(B * 1000 + L)
    q, k, v = _qkv(g, B, Hq, Hkv, n, L, D)
    mask = _static_mask(B, n, L, filled)
    mod = _Mod(Hq // Hkv)
    scale = D ** -0.5
    assert attention.native_ok(mod, q, k, v, mask)
    got, w = attention.decode_attention(mod, q, k, v, mask, scaling=scale)
    want = sdpa_attention_forward(mod, q, k, v, mask, scaling=scale)[0]
    assert w is None and got.shape == want.shape == (B, n, Hq, D) and got.dtype == torch.bfloat16
    ref = _ref(q, k, v, mask, scale)
    vmax = float(v.float().abs().max())
    err = (got.double().numpy() - ref).__abs__()
    assert (err <= 2.0**-8 * np.abs(ref) + 1e-5 * vmax).all(), err.max()
    scale_ref = np.abs(ref).max()
    assert float((got.double() - want.double()).abs().max()) <= 1e-2 * scale_ref
    assert np.abs(got.double().numpy() - ref).max() <= np.abs(want.double().numpy() - ref).max()


def test_no_mask_one_token_attends_everything():
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(g, 1, 16, 4, 1, 21, 64)
    mod = _Mod(4)
    got = attention.decode_attention(mod, q, k, v, None, scaling=0.125)[0]
    want = sdpa_attention_forward(mod, q, k, v, None, scaling=0.125)[0]
    assert float((got.float() - want.float()).abs().max()) < 2.0**-7 * float(want.float().abs().max())


@pytest.mark.parametrize("case", ["float32", "prompt", "float_mask", "sinks", "causal_none", "head_mask"])
def test_what_it_does_not_take_goes_to_sdpa_bit_for_bit(case, monkeypatch):
    g = torch.Generator().manual_seed(7)
    n = attention.MAX_TOKENS + 1 if case == "prompt" else (4 if case == "causal_none" else 1)
    q, k, v = _qkv(g, 1, 8, 2, n, 24, 32, torch.float32 if case == "float32" else torch.bfloat16)
    mask = None if case == "causal_none" else _static_mask(1, n, 24, 24)
    kw = {}
    if case == "float_mask":
        mask = torch.zeros(1, 1, n, 24, dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))
    if case == "head_mask":
        mask = mask.expand(1, 8, n, 24)
    if case == "sinks":
        kw["s_aux"] = torch.zeros(8)
    mod = _Mod(4)
    calls = []
    monkeypatch.setattr(attention, "_sdpa", lambda *a, **k: calls.append(1) or sdpa_attention_forward(*a, **k))
    assert not attention.native_ok(mod, q, k, v, mask, **kw)
    got = attention.decode_attention(mod, q, k, v, mask, scaling=0.2, **kw)[0]
    want = sdpa_attention_forward(mod, q, k, v, mask, scaling=0.2, **kw)[0]
    assert calls and torch.equal(got, want)


def test_a_model_switched_to_it_decodes_natively_and_matches_sdpa(monkeypatch):
    """A small Qwen3-MoE on transformers' static cache: greedy tokens equal sdpa's, each decode step's logits within
    bf16 rounding (rel 2e-2: test_decode_path's bound for the static cache), and the native kernel ran every step."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                         num_hidden_layers=2, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                         num_experts_per_tok=2, vocab_size=500)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 500, (1, 12))
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, cache_implementation="static",
              output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        model.set_attn_implementation(attention.register())
        runs = []
        real = attention._native()
        monkeypatch.setattr(attention, "_native", lambda: type("Spy", (), {
            "run_raw": lambda self, *a: runs.append(a[0]) or real.run_raw(*a)})())
        got = model.generate(ids, **kw)
    assert len(runs) == 15 * 2  # every decode step after the prompt, in both layers; one token each
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert float((a.float() - b.float()).abs().max() / b.float().abs().max()) < 2e-2


def test_on_an_executors_threads_the_same_bits():
    """bind(): the executor's tokens x kv heads work items give the calling thread's bits (the kernel's result per
    token and head depends on nothing else)."""
    import cpumoe_executor as ce

    rng = np.random.default_rng(0)
    with ce.CpuMoeExecutor("bf16", [cf.get_format("bf16").random_banks(2, 64, 32, rng)], top_k=2,
                           threads=min(2, ce.usable_cpus()), team="openmp") as ex:
        g = torch.Generator().manual_seed(11)
        q, k, v = _qkv(g, 2, 32, 4, 3, 700, 128)
        mask = _static_mask(2, 3, 700, 650)
        mod = _Mod(8)
        alone = attention.decode_attention(mod, q, k, v, mask, scaling=0.09)[0]
        runs = ex._x.attention_runs
        assert attention.bind(torch.nn.ModuleList([mod]), ex) == 0  # bind() takes modules named *Attention
        mod._moe_engine_executor = ex
        on_ex = attention.decode_attention(mod, q, k, v, mask, scaling=0.09)[0]
        assert ex._x.attention_runs == runs + 2  # one call a batch row
        assert torch.equal(on_ex, alone)
        assert ex.attention_isa == attention._native().name


class Attention(_Mod):  # bind() takes modules whose class name ends in "Attention"
    pass


@pytest.mark.parametrize("on_executor", [False, True])
def test_compiled_it_is_one_opaque_node_with_the_same_bits(on_executor):
    """Under torch.compile a call it takes is torch.ops.moe_engine.attention (sdpa would read and expand every cached
    position): the traced graph holds that op and no sdpa, and returns the eager call's bits, on the calling thread or
    on a bound executor's (its handle made by bind(), outside the trace)."""
    import contextlib

    import cpumoe_executor as ce

    rng = np.random.default_rng(1)
    g = torch.Generator().manual_seed(12)
    q, k, v = _qkv(g, 1, 32, 4, 1, 300, 128)
    mask = _static_mask(1, 1, 300, 37)
    ctx = ce.CpuMoeExecutor("bf16", [cf.get_format("bf16").random_banks(2, 64, 32, rng)], top_k=2, threads=1) \
        if on_executor else contextlib.nullcontext()
    with ctx as ex:
        mod = Attention(8)
        assert attention.bind(mod, ex) == 1 and (mod._moe_engine_handle > 0) == on_executor
        want = attention.decode_attention(mod, q, k, v, mask, scaling=0.07)[0]
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        f = torch.compile(lambda q, k, v, m: attention.decode_attention(mod, q, k, v, m, scaling=0.07)[0],
                          backend=backend, fullgraph=True)
        with torch.no_grad():
            got = f(q, k, v, mask)
        code = graphs[0].code
        assert "moe_engine.attention" in code and "scaled_dot_product" not in code, code
        assert torch.equal(got, want)
        if on_executor:
            runs = ex._x.attention_runs
            f(q, k, v, mask)
            assert ex._x.attention_runs == runs + 1  # the compiled call ran on the executor


def test_the_op_plans_again_on_the_tensors_it_is_given():
    """torch.ops.moe_engine.attention on tensors whose last dimension is strided (as a compiled graph may hand them
    in): the same bits as on contiguous ones; a shape the kernel does not take is a clear error."""
    g = torch.Generator().manual_seed(13)
    q, k, v = _qkv(g, 1, 8, 2, 1, 40, 64)
    mask = _static_mask(1, 1, 40, 40)
    want = torch.ops.moe_engine.attention(q, k, v, mask, 0.1, 0)
    ks = torch.empty(1, 2, 40, 128, dtype=torch.bfloat16)[..., ::2]
    ks.copy_(k)
    assert ks.stride(-1) == 2
    assert torch.equal(torch.ops.moe_engine.attention(q, ks, v, mask, 0.1, 0), want)
    with pytest.raises(ValueError, match="moe_engine.attention: query"):
        torch.ops.moe_engine.attention(q.float(), k, v, mask, 0.1, 0)
