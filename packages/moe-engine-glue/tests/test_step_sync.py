"""cpumoe_executor.sync_torch.StepSync, the one base of every sync backend (CudaSync, HipSync, HostSync): the
pending-step rules (one task in flight, nothing pending after an error, an issued task drained before it is
forgotten), the thread contract, the synchronous path against the executor bit for bit, and one check per step.
A fake GPU backend (its halves recorded, y computed by the executor) stands in for the native calls; the real
backends run these rules through the same base on the GPU host (gpusync tests, sync_qualify)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import make_banks

from cpumoe_executor import CpuMoeExecutor
from cpumoe_executor.sync_torch import Pending, StepSync
from moe_engine.sync import HostSync


class Stream:
    cuda_stream = 0x5EED


class FakeGpuSync(StepSync):
    """A GPU path whose first half records the call and computes y on the CPU, and whose second half returns it."""

    path = "fake"

    def __init__(self, ex):
        super().__init__(ex, "cpu", timeout_s=1.0)
        self.calls, self.fail_finish, self.polls = [], False, 0

    def _enqueue(self, torch, path, layer, T, x, w, ids, mask, target):
        self.calls.append("enqueue")
        y = self.executor.decode(layer, x, w, ids.to(torch.int32))
        return Pending(layer, T, path, x.device, stream=Stream(), y=y)

    def _complete(self, torch, pend, out, partial):
        self.calls.append("complete")
        if self.fail_finish:
            raise RuntimeError("cuStreamWaitValue64 failed")
        y = pend.y
        return partial.add_(y) if partial is not None else out.copy_(y) if out is not None else y

    def synchronize(self, stream=None, timeout_s=None):
        self.calls.append("synchronize")

    def pending(self):  # the CPU answers at the third look
        self.polls += 1
        return self.polls % 3 != 0


@pytest.fixture(autouse=True)
def one_stream(monkeypatch):
    """The fake GPU path's finish compares the current stream with the submit's: one fake stream here."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())


@pytest.fixture
def ex(rng):
    banks, _ = make_banks("bf16", rng, layers=3)
    with CpuMoeExecutor("bf16", banks, top_k=3, max_tokens=8, threads=2) as e:
        yield e


def step(ex, rng, T=2):
    x = torch.from_numpy(rng.standard_normal((T, ex.H)).astype(np.float32)).to(torch.bfloat16)
    w = torch.rand(T, ex.top_k) + 0.05
    ids = torch.from_numpy(np.stack([rng.choice(ex.E, ex.top_k, replace=False) for _ in range(T)]).astype(np.int32))
    return x, w, ids


def bits(t):
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("kind", ["host", "gpu"])
def test_pending_step_rules(kind, ex, rng):
    s = HostSync(ex) if kind == "host" else FakeGpuSync(ex)
    x, w, ids = step(ex, rng)
    with pytest.raises(RuntimeError, match=r"finish\(layer=0\): no task is pending"):
        s.finish(0)
    s.submit(1, x, w, ids)
    assert s.pending_layer == 1
    with pytest.raises(RuntimeError, match=r"submit\(layer=2\): layer 1's task is still pending"):
        s.submit(2, x, w, ids)
    with pytest.raises(RuntimeError, match="layer 1's task is still pending"):
        s.decode(2, x, w, ids)
    assert s.pending_layer == 1
    if kind == "gpu":
        s.calls.clear()
    with pytest.raises(ValueError, match=r"finish\(layer=2\): layer 1 was submitted, not layer 2; .* abandoned"):
        s.finish(2)
    assert s.pending_layer is None
    if kind == "gpu":
        assert s.calls == ["synchronize"] and s.polls % 3 == 0  # drained: the stream, then the CPU's answer
    want = ex.decode(1, x, w, ids)
    s.submit(1, x, w, ids)
    assert torch.equal(bits(s.finish(1)), bits(want))
    with pytest.raises(ValueError, match=r"x: shape \(2, 95\)"):
        s.submit(0, x[:, :-1], w, ids)
    assert s.pending_layer is None  # refused before anything was enqueued
    with pytest.raises(ValueError, match="give out= or partial=, not both"):
        s.decode(0, x, w, ids, out=x.clone(), partial=x.clone())
    with pytest.raises(ValueError, match=r"out/partial: shape \(3, 96\)"):
        s.decode(0, x, w, ids, out=torch.empty(3, ex.H, dtype=torch.bfloat16))
    assert s.pending_layer is None
    if kind == "gpu":
        s.fail_finish = True
        s.submit(0, x, w, ids)
        s.calls.clear()
        with pytest.raises(RuntimeError, match="cuStreamWaitValue64 failed"):
            s.finish(0)
        assert s.pending_layer is None and s.calls == ["complete", "synchronize"]
    s.submit(2, x, w, ids)
    s.close()
    assert s.pending_layer is None


@pytest.mark.parametrize("kind", ["host", "gpu"])
def test_halves_match_decode(kind, ex, rng):
    s = HostSync(ex) if kind == "host" else FakeGpuSync(ex)
    mask = torch.zeros(ex.E, dtype=torch.bool)
    mask[1::2] = True
    for layer, T, m in ((0, 1, None), (2, 5, mask), (1, 8, mask)):
        x, w, ids = step(ex, rng, T)
        y = s.decode(layer, x, w, ids, m)
        p, q = (torch.randn(T, ex.H).to(torch.bfloat16) for _ in range(2))
        s.submit(layer, x, w, ids, m)
        part = p + q  # other work between the halves
        got = s.finish(layer, partial=part)
        assert got is part
        assert torch.equal(bits(got), bits(((p + q).float() + y.float()).to(torch.bfloat16)))
        o = torch.empty(T, ex.H, dtype=torch.bfloat16)
        s.submit(layer, x, w, ids, m)
        assert s.finish(layer, out=o) is o and torch.equal(bits(o), bits(y))
        if kind == "host":  # any float dtypes and int ids, as the executor takes them
            s.submit(layer, x.float(), w.double(), ids.long(), m)
            assert torch.equal(bits(s.finish(layer)), bits(y))


def test_checks_run_once_and_name_the_argument(ex, rng):
    s = HostSync(ex)
    x, w, ids = step(ex, rng)
    cases = [((0, torch.zeros(9, ex.H), torch.rand(9, 3), torch.zeros(9, 3, dtype=torch.int32)),
              r"batch size 9 is not in \[1, max_tokens=8\]"),
             ((3, x, w, ids), r"layer=3 is not in \[0, 3\)"),
             ((0, x, w, ids.float()), r"topk_ids: dtype torch.float32, expected an integer dtype"),
             ((0, x, w, ids, torch.zeros(ex.E + 1, dtype=torch.bool)), r"residency_mask: shape \(7,\), expected \[6\]")]
    for args, msg in cases:
        with pytest.raises((ValueError, TypeError), match=msg):
            s.submit(*args)
        assert s.pending_layer is None
    g = FakeGpuSync(ex)
    g.submit(0, x, w, ids, check=False)  # the caller checked: straight to the backend's half
    assert g.calls == ["enqueue"]
    g.finish(0)


def test_another_thread_cannot_finish_or_submit(ex, rng):
    s = FakeGpuSync(ex)
    x, w, ids = step(ex, rng)
    s.submit(0, x, w, ids)
    err = {}

    def other():
        for name, f in (("finish", lambda: s.finish(0)), ("submit", lambda: s.submit(1, x, w, ids))):
            try:
                f()
            except RuntimeError as e:
                err[name] = str(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert "submitted by another thread" in err["finish"]
    assert "still pending (submitted by another thread" in err["submit"]
    assert s.pending_layer == 0
    s.finish(0)


def test_concurrent_decodes_never_swap_results(ex, rng):
    """8 threads decode through one HostSync: each gets its own result or a RuntimeError saying a step is pending,
    never another thread's y."""
    s = HostSync(ex)
    inputs = [step(ex, np.random.default_rng(i), T=1 + i % 4) for i in range(8)]
    want = [ex.decode(0, *a) for a in inputs]
    got, busy, wrong = [0] * 8, [0] * 8, []
    start = threading.Barrier(8)

    def work(i):
        start.wait()
        for _ in range(30):
            try:
                y = s.decode(0, *inputs[i])
            except RuntimeError as e:
                assert "still pending" in str(e)
                busy[i] += 1
                continue
            if not torch.equal(bits(y), bits(want[i])):
                wrong.append(i)
            got[i] += 1

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not wrong and sum(got) > 0 and sum(got) + sum(busy) == 240 and s.pending_layer is None
