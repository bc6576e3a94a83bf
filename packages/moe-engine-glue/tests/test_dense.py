"""moe_engine.dense: a model's dense bf16 linears on the CPU executor's threads (DenseLinear, DenseWeight,
torch.ops.moe_engine.linear) against torch's own bf16 F.linear and float64.

Tolerance against float64: fp32 accumulation of exact bf16 products, one rounding to bf16: |y - ref| <= 2^-8 |ref|
(half a bf16 step) + 1e-5 max |ref| (fp32 sums, K <= 2048). torch's bf16 F.linear meets the same bound, so the two
differ by at most a bf16 step of each output (measured: most outputs bit-equal). NaN / inf: the same outputs are NaN,
+inf and -inf as torch's."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import cpumoe_executor as ce
import cpumoe_formats as cf
from moe_engine import dense

BF = torch.bfloat16


@pytest.fixture(scope="module")
def ex():
    rng = np.random.default_rng(0)
    with ce.CpuMoeExecutor("bf16", [cf.get_format("bf16").random_banks(2, 64, 32, rng)], top_k=2,
                           threads=min(2, ce.usable_cpus()), team="openmp") as e:
        yield e


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _close_to_float64(y, x, w, b=None):
    ref = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    err = (y.double() - ref).abs()
    bound = 2.0**-8 * ref.abs() + 1e-5 * ref.abs().max()
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max()):.3e}"


@pytest.mark.parametrize("K,M", [(1, 3), (259, 37), (2048, 128), (2048, 512)])
@pytest.mark.parametrize("shape", [(1,), (1, 1), (3,), (2, 4), (8,)])
def test_linear_matches_float64_and_torch(ex, K, M, shape):
    g = _g(K * M + len(shape))
    x = torch.randn(*shape, K, generator=g).to(BF)
    w = torch.randn(M, K, generator=g).to(BF)
    b = torch.randn(M, generator=g).to(BF)
    runs = ex._x.linear_runs
    for bias in (None, b):
        y = dense.linear(ex, x, w, bias)
        assert y.shape == (*shape, M) and y.dtype == BF
        _close_to_float64(y, x, w, bias)
        t = torch.nn.functional.linear(x, w, bias)
        assert float((y.float() - t.float()).abs().max()) <= float(t.float().abs().max()) * 2**-7
    assert ex._x.linear_runs == runs + 2  # it ran on the executor, not through F.linear


def test_more_tokens_a_gradient_or_other_dtypes_go_to_torch(ex):
    g = _g(1)
    w = torch.randn(48, 64, generator=g).to(BF)
    runs = ex._x.linear_runs
    x9 = torch.randn(9, 64, generator=g).to(BF)
    assert torch.equal(dense.linear(ex, x9, w), torch.nn.functional.linear(x9, w))  # 9 > MAX_TOKENS rows
    xf = torch.randn(2, 64, generator=g)
    assert torch.equal(dense.linear(ex, xf, w.float()), torch.nn.functional.linear(xf, w.float()))
    wg = w.clone().requires_grad_()
    y = dense.linear(ex, x9[:2], wg)  # gradient wanted: torch's own, differentiable
    y.sum().backward()
    assert wg.grad is not None
    assert dense.linear(None, x9[:2], w).shape == (2, 48)
    with pytest.raises(RuntimeError):  # F.linear's own error for a mismatched K
        dense.linear(ex, torch.zeros(1, 63, dtype=BF), w)
    assert ex._x.linear_runs == runs


@pytest.mark.parametrize("kind", ["nan", "inf", "-inf"])
def test_nonfinite_like_torch(ex, kind):
    """A NaN / inf in x, in a weight (against a zero and a nonzero x) or in the bias: the same outputs NaN, +inf and
    -inf as torch's bf16 F.linear, the others finite."""
    v = float(kind)
    g = _g(3)
    x = torch.randn(2, 96, generator=g).to(BF)
    w = torch.randn(40, 96, generator=g).to(BF)
    b = torch.randn(40, generator=g).to(BF)
    x[0, 7] = 0
    for where in ("x", "w", "w0", "b"):
        xb, wb, bb = x.clone(), w.clone(), b.clone()
        if where == "x":
            xb[1, 50] = v
        elif where == "w":
            wb[4, 50] = v
        elif where == "w0":
            wb[4, 7] = v  # meets x[0, 7] = 0: NaN for token 0
        else:
            bb[11] = v
        y, t = dense.linear(ex, xb, wb, bb).float(), torch.nn.functional.linear(xb, wb, bb).float()
        assert torch.equal(y.isnan(), t.isnan()), where
        assert torch.equal(y.isposinf(), t.isposinf()) and torch.equal(y.isneginf(), t.isneginf()), where
        assert not y.isfinite().all()


def test_dense_linear_module(ex):
    g = _g(4)
    lin = torch.nn.Linear(130, 70).to(BF)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(70, 130, generator=g))
        lin.bias.copy_(torch.randn(70, generator=g))
    d = dense.DenseLinear(lin, ex)
    assert d.weight is lin.weight and d.bias is lin.bias and isinstance(d, torch.nn.Linear)
    assert list(d.state_dict()) == ["weight", "bias"]
    assert "up to 8 tokens on the executor" in repr(d)
    x = torch.randn(1, 1, 130, generator=g).to(BF)
    with torch.no_grad():
        _close_to_float64(d(x), x, lin.weight, lin.bias)
        xp = torch.randn(1, 20, 130, generator=g).to(BF)  # a prompt: F.linear
        assert torch.equal(d(xp), torch.nn.functional.linear(xp, lin.weight, lin.bias))


def test_dense_weight_routes_f_linear_only(ex):
    """A router's weight: F.linear on it runs on the executor; any other op gives plain tensors; state_dict, pickle
    and deepcopy keep working."""
    g = _g(5)
    m = torch.nn.Module()
    w = torch.randn(128, 256, generator=g).to(BF)
    m.weight = dense.DenseWeight(w.clone(), ex)
    assert isinstance(m.weight, torch.nn.Parameter) and "weight" in dict(m.named_parameters())
    x = torch.randn(3, 256, generator=g).to(BF)
    runs = ex._x.linear_runs
    with torch.no_grad():
        y = torch.nn.functional.linear(x, m.weight)
    assert ex._x.linear_runs == runs + 1 and type(y) is torch.Tensor
    _close_to_float64(y, x, w)
    assert type(m.weight.float()) is torch.Tensor and type(m.weight * 2) is torch.Tensor
    assert torch.equal(m.weight.float(), w.float())
    sd = m.state_dict()
    assert type(sd["weight"]) is torch.Tensor and torch.equal(sd["weight"], w)
    assert torch.equal(pickle.loads(pickle.dumps(sd))["weight"], w)
    m2 = copy.deepcopy(m)
    assert type(m2.weight) is dense.DenseWeight and torch.equal(torch.nn.functional.linear(x, m2.weight), y)
    with torch.no_grad():
        m.weight.copy_(torch.zeros_like(w))  # an in-place update reaches the kernel (same storage)
        assert torch.equal(torch.nn.functional.linear(x, m.weight), torch.zeros(3, 128, dtype=BF))


def test_custom_op_is_the_same_and_compiles(ex):
    from moe_engine import MoERunner

    rng = np.random.default_rng(1)
    banks = [cf.get_format("bf16").random_banks(4, 64, 32, rng)]
    r = MoERunner("bf16", banks, top_k=2, strategy="cpu", device="cpu", threads=1, qualify=False)
    try:
        g = _g(6)
        x = torch.randn(2, 64, generator=g).to(BF)
        w = torch.randn(24, 64, generator=g).to(BF)
        y = torch.ops.moe_engine.linear(x, w, None, r.handle)
        assert torch.equal(y, dense.linear(r.executor, x, w))
        fn = torch.compile(lambda a: torch.ops.moe_engine.linear(a, w, None, r.handle) * 2, fullgraph=True)
        assert torch.equal(fn(x), y * 2)
    finally:
        r.close()


def test_compiled_modules_trace_without_a_graph_break(ex):
    """torch.compile(fullgraph=True) over a DenseWeight's F.linear and a DenseLinear without a runner handle: both
    trace (torch's own product inside the graph) and agree with the eager kernel within a bf16 step."""
    g = _g(7)
    x = torch.randn(3, 128, generator=g).to(BF)
    w = torch.randn(40, 128, generator=g).to(BF)
    dw = dense.DenseWeight(w, ex)
    lin = torch.nn.Linear(128, 24, bias=True).to(BF)
    dl = dense.DenseLinear(lin, ex)
    for eager, fn in ((lambda a: torch.nn.functional.linear(a, dw), lambda a: torch.nn.functional.linear(a, dw)),
                      (dl, dl)):
        with torch.no_grad():
            y = eager(x)
            yc = torch.compile(fn, fullgraph=True)(x)
        assert yc.dtype == BF and yc.shape == y.shape
        assert bool(((yc.float() - y.float()).abs() <= 2.0**-7 * y.float().abs() + 1e-3).all())
