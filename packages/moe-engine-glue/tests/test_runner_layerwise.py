"""residency="layers" (placement/layerwise.py): whole layers' experts on the GPU, none elsewhere, each layer on one
side only. A GPU layer's result is the gpu strategy's bit for bit and never reaches the CPU executor; a CPU layer's is
the cpu strategy's bit for bit and holds no GPU slot; qualification replays a layer of each path."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import cuda_missing, make_banks, routes, triton_missing

from moe_engine.placement import layerwise
from moe_engine.qualify import graph_layers
from moe_engine.runner import MoERunner

pytestmark = pytest.mark.skipif(triton_missing() is not None, reason=str(triton_missing()))
DEVICE = "cpu" if cuda_missing() else "cuda"


def _runner(banks, strategy, **kw):
    kw.setdefault("qualify", False)  # the interpreter pays per program; test_layers_qualify_each_path qualifies
    return MoERunner("bf16", banks, top_k=3, strategy=strategy, device=DEVICE, threads=2, graph_batch_sizes=(1, 3),
                     progress=False, **kw)


def _same(a, b) -> bool:
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def _inputs(rng, T, H, E):
    x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16).to(DEVICE)
    ids, w = routes(rng, T, 3, E)
    return x, w.to(DEVICE), ids.to(DEVICE)


def test_layers_run_each_layer_on_one_side(rng):
    banks, (E, H, _) = make_banks("bf16", rng, layers=3, E=8)
    x, w, ids = _inputs(rng, 3, H, E)
    with _runner(banks, "cpu") as cpu, _runner(banks, "gpu") as gpu:
        want_cpu = [cpu.forward(li, x, w, ids) for li in range(3)]
        want_gpu = [gpu.forward(li, x, w, ids) for li in range(3)]
    for gl, on in ((1, [2]), ([0, 2], [0, 2])):
        with _runner(banks, "hybrid", residency="layers", gpu_layers=gl) as hy:
            assert hy.layer_path == ["gpu" if li in on else "cpu" for li in range(3)]
            assert hy.residency.caps == [E if li in on else 0 for li in range(3)]
            assert [g is None for g, _ in hy.gpu.where] == [li not in on for li in range(3)]  # no slots off the GPU
            assert hy.residency.fraction() == pytest.approx(len(on) / 3)
            calls = []
            for side, obj, names in (("cpu", hy.sync, ("submit", "decode")), ("gpu", hy.gpu, ("forward",))):
                for nm in names:
                    f = getattr(obj, nm)
                    setattr(obj, nm, lambda *a, _f=f, _s=side, _c=calls, **k: (_c.append(_s), _f(*a, **k))[1])
            for li in range(3):
                calls.clear()
                y = hy.forward(li, x, w, ids)
                if li in on:  # no CPU hand-over at all
                    assert _same(y, want_gpu[li]) and calls == ["gpu"]
                else:  # no GPU experts' kernels (a GPU handshake's decode is its own submit + finish)
                    assert _same(y, want_cpu[li]) and calls and set(calls) == {"cpu"}
            assert f"layers {len(on)}/3 on the GPU" in hy.describe()


def test_layers_qualify_each_path(rng):
    banks, (E, H, _) = make_banks("bf16", rng, layers=3, E=8)
    with _runner(banks, "hybrid", residency="layers", gpu_layers=1, qualify=True) as hy:
        assert graph_layers(hy) == [2, 0]
    with _runner(banks, "hybrid", residency="layers", gpu_layers=[0]) as hy:
        assert graph_layers(hy) == [2, 0]
    with _runner(banks, "hybrid", residency=0.5, capacity=E) as hy:
        assert graph_layers(hy) == [2]


def test_layers_bad_input(rng):
    banks, (E, H, _) = make_banks("bf16", rng, layers=3, E=8)
    with pytest.raises(ValueError, match="gpu_layers=None: residency='layers' needs the number of layers"):
        _runner(banks, "hybrid", residency="layers")
    with pytest.raises(ValueError, match=r"gpu_layers=4: expected an int \[0, 3\]"):
        _runner(banks, "hybrid", residency="layers", gpu_layers=4)
    with pytest.raises(ValueError, match="a layer is named twice"):
        _runner(banks, "hybrid", residency="layers", gpu_layers=[1, 1])
    with pytest.raises(ValueError, match="pass gpu_layers= instead"):
        _runner(banks, "hybrid", residency="layers", gpu_layers=1, capacity=8)
    with pytest.raises(ValueError, match="gpu_layers=1 goes with residency='layers', not residency='random'"):
        _runner(banks, "hybrid", residency="random", gpu_layers=1)
    with pytest.raises(ValueError, match="residency='layers' gives each layer one side"):
        _runner(banks, "hybrid", residency="layers", gpu_layers=1, split=0.5)
    with _runner(banks, "hybrid", residency="layers", gpu_layers=1) as hy:
        with pytest.raises(ValueError, match="keeps every expert of layer 2 on the GPU"):
            hy.set_residency(2, np.arange(E) < 4)
        with pytest.raises(ValueError, match="1 resident experts, expected at most capacity=0"):
            hy.set_residency(0, np.arange(E) < 1)
        with pytest.raises(ValueError, match="layer 0 keeps no experts on the GPU"):
            hy.gpu.load(0, 0, banks[0], 0)
    with pytest.raises(ValueError, match="layer 1 keeps 4 of 8 experts on the GPU; expected all or none"):
        layerwise.paths([np.zeros(8, bool), np.arange(8) < 4], 8)
