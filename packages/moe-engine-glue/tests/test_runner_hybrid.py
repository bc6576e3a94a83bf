"""Strategy hybrid's control logic on any machine: the GPU experts run in Triton's interpreter on CPU tensors where no
GPU is present (conftest sets TRITON_INTERPRET=1), the CPU side is the executor. Every route is counted once: the
result matches the float64 reference of all routes, residency 0 is the cpu strategy bit for bit, residency 1 the gpu
strategy bit for bit, and a residency change between steps moves routes between the sides without losing one."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import cuda_missing, make_banks, routes, triton_missing

from moe_engine.reference import TOLERANCE, reference
from moe_engine.runner import MoERunner

pytestmark = pytest.mark.skipif(triton_missing() is not None, reason=str(triton_missing()))
DEVICE = "cpu" if cuda_missing() else "cuda"


def _runner(banks, strategy, residency=None, **kw):
    return MoERunner("bf16", banks, top_k=3, strategy=strategy, device=DEVICE, residency=residency, threads=2,
                     graph_batch_sizes=(1, 3), progress=False, **kw)


def _same(a, b) -> bool:
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def test_hybrid_counts_every_route_once(rng):
    banks, (E, H, _) = make_banks("bf16", rng, E=8)
    T = 3
    x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16).to(DEVICE)
    ids, w = routes(rng, T, 3, E)
    ids, w = ids.to(DEVICE), w.to(DEVICE)
    with _runner(banks, "cpu") as cpu, _runner(banks, "gpu") as gpu:
        want_cpu, want_gpu = cpu.forward(1, x, w, ids), gpu.forward(1, x, w, ids)
    with _runner(banks, "hybrid", residency=0.5, capacity=E) as hy:
        assert hy.residency.capacity == E and 0 < hy.residency.fraction() < 1
        y = hy.forward(1, x, w, ids)
        ref = reference(hy, 1, x, w, ids)
        rel = np.abs(y.float().cpu().numpy() - ref).max() / np.abs(ref).max()
        assert rel < TOLERANCE["native"], rel
        hy.set_residency(1, np.zeros(E, bool))  # every route on the CPU
        assert _same(hy.forward(1, x, w, ids), want_cpu)
        hy.set_residency(1, np.ones(E, bool))  # every route on the GPU: nothing reaches the CPU
        served = hy.executor.health()["served"]
        assert _same(hy.forward(1, x, w, ids), want_gpu)
        assert hy.executor.health()["served"] == served
        m = np.zeros(E, bool)
        m[ids[0, 0].item()] = True  # one route of token 0 moves to the GPU
        hy.set_residency(1, m)
        rel = np.abs(hy.forward(1, x, w, ids).float().cpu().numpy() - ref).max() / np.abs(ref).max()
        assert rel < TOLERANCE["native"], rel


def test_hybrid_prefill_above_max_tokens(rng):
    banks, (E, H, _) = make_banks("bf16", rng, E=8)
    T = 7  # max_tokens = 3
    x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16).to(DEVICE)
    ids, w = routes(rng, T, 3, E)
    ids, w = ids.to(DEVICE), w.to(DEVICE)
    with _runner(banks, "hybrid", residency=0.25, prefill="cpu") as hy:
        y = hy.forward(0, x, w, ids)
        assert hy.last_prefill["how"] == "cpu"
        ref = reference(hy, 0, x, w, ids)
        assert np.abs(y.float().cpu().numpy() - ref).max() / np.abs(ref).max() < TOLERANCE["native"]


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_k"])
def test_hybrid_gguf(fmt, rng):
    """A uniform GGUF model runs hybrid: GPU-resident routes in native mode, the CPU's in the executor's mode (w4a8),
    each as the float64 reference has them; all resident, the runner's result is the gpu strategy's bit for bit."""
    banks, (E, H, _) = make_banks(fmt, rng, E=6)
    T = 3
    x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16).to(DEVICE)
    ids, w = routes(rng, T, 3, E)
    ids, w = ids.to(DEVICE), w.to(DEVICE)
    # qualification's interpreter steps took 77 s for q4_k (test_hybrid_counts_every_route_once qualifies a runner)
    with MoERunner(fmt, banks, top_k=3, strategy="hybrid", device=DEVICE, residency=0.5, capacity=E, threads=2,
                   graph_batch_sizes=(1, 3), progress=False, qualify=False) as hy:
        assert 0 < hy.residency.fraction() < 1
        if DEVICE == "cpu":  # few programs for the interpreter (it pays per program and Triton op)
            from moe_engine.gpu import Config, StageConfig

            bk = 256 if fmt == "q4_k" else 64
            hy.gpu.set_config(None, Config(StageConfig(64, bk), StageConfig(128, bk), grouped=True))
        y = hy.forward(1, x, w, ids)
        ref = reference(hy, 1, x, w, ids)
        rel = np.abs(y.float().cpu().numpy() - ref).max() / np.abs(ref).max()
        assert rel < TOLERANCE[hy.executor.mode], rel
        hy.set_residency(1, np.ones(E, bool))
        y = hy.forward(1, x, w, ids)
        assert _same(y, hy.gpu.forward(1, x, w.float(), hy.residency.slots(1, ids)))
        rel = np.abs(y.float().cpu().numpy() - reference(hy, 1, x, w, ids)).max() / np.abs(ref).max()
        assert rel < TOLERANCE["native"], rel


@pytest.mark.parametrize("repack", [None, False])
def test_hybrid_host_copies(repack, rng):
    """Hybrid keeps the given banks for the GPU's loads (host_banks); repack=None lets the executor repack q4_0 into
    its own layout beside them (two copies on the host), repack=False runs those banks themselves (one copy, what
    from_pretrained picks where host_memory cannot hold two). Both match the float64 reference."""
    from cpumoe_executor import cpu_layout

    banks, (E, H, I) = make_banks("q4_0", rng, E=6)
    if cpu_layout("q4_0", H=H, I=I) == "q4_0":
        pytest.skip("this CPU runs q4_0 unrepacked")
    x = torch.from_numpy(rng.standard_normal((3, H)).astype(np.float32)).to(torch.bfloat16).to(DEVICE)
    ids, w = routes(rng, 3, 3, E)
    ids, w = ids.to(DEVICE), w.to(DEVICE)
    with MoERunner("q4_0", banks, top_k=3, strategy="hybrid", device=DEVICE, residency=0.5, capacity=E, threads=2,
                   graph_batch_sizes=(1, 3), progress=False, qualify=False, repack=repack) as hy:
        ran = hy.executor.layer_banks(1)
        shared = all(np.shares_memory(ran[k], hy.host_banks[1][k]) for k in ran)
        assert (hy.executor.spec.name, shared) == (("q4_0", True) if repack is False else ("q4_0_x16", False))
        if DEVICE == "cpu":  # few programs for the interpreter (it pays per program and Triton op)
            from moe_engine.gpu import Config, StageConfig

            hy.gpu.set_config(None, Config(StageConfig(64, 64), StageConfig(128, 64), grouped=True))
        y = hy.forward(1, x, w, ids)
        ref = reference(hy, 1, x, w, ids)
        assert np.abs(y.float().cpu().numpy() - ref).max() / np.abs(ref).max() < TOLERANCE[hy.executor.mode]


def _few_programs(runner) -> None:
    if DEVICE == "cpu":  # few programs for the interpreter (it pays per program and Triton op)
        from moe_engine.gpu import Config, StageConfig

        runner.gpu.set_config(None, Config(StageConfig(64, 64), StageConfig(128, 64), grouped=True))


@pytest.mark.parametrize("strategy", ["hybrid", "gpu"])
def test_one_host_copy_in_the_cpu_layout(strategy, rng):
    """Banks given in the executor's layout (q4_0_x16): the executor runs them in place, and the GPU's q4_0 experts
    load from them (gpu/moved.py: the layout's bytes copied, put in q4_0's order on the device), one copy on the
    host. The result equals, bit for bit, the runner given the same experts as q4_0 (the GPU loading those, the
    executor repacking them: two copies), before and after a residency change."""
    import cpumoe_formats as cf

    banks, (E, H, I) = make_banks("q4_0", rng, E=6)
    x16 = [cf.get_format("q4_0_x16").repack_from(b) for b in banks]
    x = torch.from_numpy(rng.standard_normal((3, H)).astype(np.float32)).to(torch.bfloat16).to(DEVICE)
    ids, w = routes(rng, 3, 3, E)
    ids, w = ids.to(DEVICE), w.to(DEVICE)
    kw = dict(top_k=3, strategy=strategy, device=DEVICE, capacity=E, threads=2, graph_batch_sizes=(1, 3),
              progress=False, qualify=False, residency=0.5 if strategy == "hybrid" else None)
    with MoERunner("q4_0", banks, **kw) as two, MoERunner("q4_0_x16", x16, **kw) as one:
        assert (one.format, one.gpu_format, two.gpu_format) == ("q4_0_x16", "q4_0", "q4_0")
        assert "gpu_experts=q4_0 (loaded from the host's one copy in q4_0_x16)" in one.describe()
        if one.executor is not None:
            ran = one.executor.layer_banks(1)
            assert one.executor.spec.name == "q4_0_x16"
            assert all(np.shares_memory(ran[k], one.host_banks[1][k]) for k in ran)  # the one copy
        for r in (one, two):
            _few_programs(r)
        assert _same(one.forward(1, x, w, ids), two.forward(1, x, w, ids))
        if strategy == "hybrid":
            mask = ~one.residency.host_mask(1)  # every resident expert moves: E - resident new loads from the layout
            assert one.set_residency(1, mask) == two.set_residency(1, mask) == int(mask.sum())
            y = one.forward(1, x, w, ids)
            assert _same(y, two.forward(1, x, w, ids))
            ref = reference(one, 1, x, w, ids)
            assert np.abs(y.float().cpu().numpy() - ref).max() / np.abs(ref).max() < TOLERANCE["w4a8"]


def test_split_needs_the_gpu_layout_on_the_host(rng):
    """The miss split's zero-copy reads take the host banks as they are: with banks in a CPU layout it is refused by
    name (give the format's own banks for the split)."""
    import cpumoe_formats as cf

    banks, (E, H, I) = make_banks("q4_0", rng, E=6)
    x16 = [cf.get_format("q4_0_x16").repack_from(b) for b in banks]
    with pytest.raises(ValueError, match=r"split=0.3: the miss split's GPU side .* in q4_0_x16 \(the executor's"):
        MoERunner("q4_0_x16", x16, top_k=3, strategy="hybrid", device=DEVICE, residency=0.5, threads=2,
                  progress=False, qualify=False, split=0.3, pin_memory=False)


def test_gpu_side_errors_are_named(rng):
    banks, (E, H, _) = make_banks("ds_fp4", rng, E=8)
    with pytest.raises(ValueError, match="format 'ds_fp4' has no GPU experts kernel"):
        MoERunner("ds_fp4", banks, top_k=2, strategy="hybrid", device=DEVICE, qualify=False, progress=False)
    banks, (E, H, _) = make_banks("bf16", rng, E=8)
    with _runner(banks, "hybrid", residency=0.25) as hy:
        with pytest.raises(ValueError, match=r"residency mask for layer 0: shape \(7,\) .* length E=8"):
            hy.set_residency(0, np.ones(7, bool))
        with pytest.raises(ValueError, match="8 resident experts, expected at most capacity=2"):
            hy.set_residency(0, np.ones(E, bool))
    with pytest.raises(ValueError, match=r"capacity=1: expected an int in \[2, E=8\]"):
        _runner(banks, "hybrid", residency=0.25, capacity=1)
