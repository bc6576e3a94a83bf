"""MoERunner on a CUDA GPU: every strategy qualifies under graphs at start-up; a captured multi-layer step replays
with changing inputs, routes and residency equal to eager bit for bit; refused graphs raise; prefill on the GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import cuda_missing, make_banks, routes

from moe_engine.reference import TOLERANCE, reference
from moe_engine.runner import CaptureRefusedError, MoERunner

pytestmark = [pytest.mark.gpu, pytest.mark.cuda,
              pytest.mark.skipif(cuda_missing() is not None, reason=str(cuda_missing()))]
DEV = "cuda"


def _runner(fmt, banks, strategy, **kw):
    kw.setdefault("graph_batch_sizes", (1, 4))
    return MoERunner(fmt, banks, top_k=3, strategy=strategy, device=DEV, threads=4, progress=False, **kw)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block"])
@pytest.mark.parametrize("strategy", ["cpu", "hybrid", "gpu"])
def test_strategies_qualify_under_graphs(fmt, strategy, rng):
    banks, (E, H, _) = make_banks(fmt, rng, E=8)
    with _runner(fmt, banks, strategy, residency=0.5 if strategy == "hybrid" else None) as r:
        assert r.graphs_ok, r.graphs_reason
        if strategy != "gpu":
            assert r.sync.path == "kernel", r.sync.summary()
        x = torch.randn(4, H, device=DEV).to(torch.bfloat16)
        ids, w = routes(rng, 4, 3, E)
        ids, w = ids.to(DEV), w.to(DEV)
        y = r.forward(1, x, w, ids)
        ref = reference(r, 1, x, w, ids)
        assert np.abs(y.float().cpu().numpy() - ref).max() / np.abs(ref).max() < TOLERANCE["native"]
        if strategy == "cpu":
            want = r.executor.decode(1, x.cpu(), w.cpu(), ids.cpu())
            assert torch.equal(y.cpu().view(torch.int16), want.view(torch.int16))


def test_replays_follow_inputs_and_residency(rng):
    banks, (E, H, _) = make_banks("bf16", rng, layers=3, E=12)
    L, T = 3, 4
    with _runner("bf16", banks, "hybrid", residency=0.25, capacity=6) as r:
        xs = torch.zeros(T, H, device=DEV, dtype=torch.bfloat16)
        ids_s = torch.zeros(L, T, 3, device=DEV, dtype=torch.int32)
        w_s = torch.zeros(L, T, 3, device=DEV)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                outs = [r.forward(li, xs, w_s[li], ids_s[li]) for li in range(L)]
            for i in range(60):
                if i % 10 == 9:
                    for li in range(L):
                        m = np.zeros(E, bool)
                        m[rng.choice(E, int(rng.integers(0, 7)), replace=False)] = True
                        r.set_residency(li, m)
                x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
                per = [routes(rng, T, 3, E, minus_one=i % 3 == 0) for _ in range(L)]
                xs.copy_(x)
                ids_s.copy_(torch.stack([p[0] for p in per]).to(DEV))
                w_s.copy_(torch.stack([p[1] for p in per]).to(DEV))
                g.replay()
                got = [o.clone() for o in outs]
                want = [r.forward(li, x, w_s[li].clone(), ids_s[li].clone()) for li in range(L)]
                r.sync.synchronize(s)
                for li in range(L):
                    assert torch.equal(got[li].view(torch.int16), want[li].view(torch.int16)), (i, li)
        torch.cuda.current_stream().wait_stream(s)


def test_refused_graphs_raise_under_capture(rng):
    banks, (E, H, _) = make_banks("bf16", rng, E=8)
    with _runner("bf16", banks, "cpu") as r:
        r.graphs_ok, r.graphs_reason = False, "graph replay failed: test"
        x = torch.randn(1, H, device=DEV).to(torch.bfloat16)
        ids, w = (t.to(DEV) for t in routes(rng, 1, 3, E))
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            g = torch.cuda.CUDAGraph()
            with pytest.raises(CaptureRefusedError, match="graph replay failed: test"):
                with torch.cuda.graph(g, stream=s):
                    r.forward(0, x, w, ids)
        y = r.forward(0, x, w, ids)  # eager stays correct
        want = r.executor.decode(0, x.cpu(), w.cpu(), ids.cpu())
        assert torch.equal(y.cpu().view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("how", ["gpu", "cpu", "auto"])
def test_prefill_on_a_gpu(how, rng):
    banks, (E, H, _) = make_banks("fp8_block", rng, E=8)
    T = 37
    with _runner("fp8_block", banks, "hybrid", residency=0.25, prefill=how) as r:
        for _ in range(2):  # auto: the first measures, the second chooses
            x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
            ids, w = (t.to(DEV) for t in routes(rng, T, 3, E))
            y = r.forward(0, x, w, ids)
            ref = reference(r, 0, x, w, ids)
            assert np.abs(y.float().cpu().numpy() - ref).max() / np.abs(ref).max() < TOLERANCE["native"]
        if how == "auto":  # both estimates measured by the second prefill, and the cheaper one taken
            est = r.last_prefill
            assert est["cpu_s"] is not None and est["gpu_copy_s"] is not None, est
            assert est["how"] == ("gpu" if est["gpu_copy_s"] < est["cpu_s"] else "cpu"), est
        else:
            assert r.last_prefill["how"] == how
