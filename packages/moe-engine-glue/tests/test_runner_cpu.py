"""MoERunner on a CPU-only host: strategy cpu against the executor it wraps (bit for bit) and the float64 reference,
prefill in chunks, the custom op (opcheck, torch.compile), bad input named before anything runs."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import ACT, make_banks, routes

from moe_engine.reference import TOLERANCE, reference
from moe_engine.runner import MoERunner

FORMATS = ["bf16", "fp8_block", "nvfp4", "mxfp4", "q4_0"]


def runner(fmt, rng, **kw):
    banks, (E, H, I) = make_banks(fmt, rng)
    kw.setdefault("top_k", 3)
    r = MoERunner(fmt, banks, strategy="cpu", device="cpu", threads=2, graph_batch_sizes=(1, 4), progress=False,
                  **ACT.get(fmt, {}), **kw)
    return r, E, H


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 3, 4])
def test_cpu_strategy_is_the_executor(fmt, T, rng):
    r, E, H = runner(fmt, rng)
    with r:
        for layer in range(r.num_layers):
            x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16)
            ids, w = routes(rng, T, r.top_k, E)
            y = r.forward(layer, x, w, ids)
            want = r.executor.decode(layer, x, w, ids)
            assert y.dtype == torch.bfloat16 and y.shape == (T, H)
            assert torch.equal(y.view(torch.int16), want.view(torch.int16))
            ref = reference(r, layer, x, w, ids)
            rel = np.abs(y.float().numpy() - ref).max() / (np.abs(ref).max() + 1e-6)
            assert rel < TOLERANCE[r.executor.mode], (fmt, rel)


def test_repack_reaches_the_executor(rng):
    """repack=False runs the banks as given (from_pretrained's one-copy choice beside a GPU), None repacks q4_0 into
    q4_0_x16 where that layout pays; both within the float64 reference's tolerance."""
    from cpumoe_executor import cpu_layout

    banks, (E, H, I) = make_banks("q4_0", rng)
    if cpu_layout("q4_0", H=H, I=I) == "q4_0":
        pytest.skip("this CPU runs q4_0 unrepacked")
    x = torch.from_numpy(rng.standard_normal((3, H)).astype(np.float32)).to(torch.bfloat16)
    ids, w = routes(rng, 3, 3, E)
    got = {}
    for repack in (False, None):
        with MoERunner("q4_0", banks, strategy="cpu", device="cpu", threads=2, top_k=3, progress=False,
                       repack=repack) as r:
            ran = r.executor.spec.name
            assert (ran == "q4_0") == (repack is False), (repack, ran)
            assert ("as q4_0_x16" in r.describe()) == (repack is None)
            got[repack] = r.forward(0, x, w, ids).float().numpy()
            ref = reference(r, 0, x, w, ids)
            assert np.abs(got[repack] - ref).max() / np.abs(ref).max() < TOLERANCE[r.executor.mode]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_output_has_the_input_dtype(dtype, rng):
    r, E, H = runner("bf16", rng)
    with r:
        x = torch.randn(2, H, dtype=dtype)
        ids, w = routes(rng, 2, 3, E)
        y = r.forward(0, x, w.double(), ids.long())
        assert y.dtype == dtype
        want = r.executor.decode(0, x.to(torch.bfloat16), w, ids)
        assert torch.equal(y, want.to(dtype))


def test_prefill_runs_in_chunks_of_max_tokens(rng):
    r, E, H = runner("fp8_block", rng)
    with r:
        T = 11  # max_tokens = 4: chunks of 4, 4, 3
        x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16)
        ids, w = routes(rng, T, 3, E)
        y = r.forward(1, x, w, ids)
        assert r.last_prefill["how"] == "cpu" and r.last_prefill["tokens"] == T
        for t0 in range(0, T, 4):
            want = r.executor.decode(1, x[t0:t0 + 4], w[t0:t0 + 4], ids[t0:t0 + 4])
            assert torch.equal(y[t0:t0 + 4].view(torch.int16), want.view(torch.int16))


def test_custom_op_and_compile(rng):
    r, E, H = runner("bf16", rng)
    with r:
        x = torch.randn(3, H).to(torch.bfloat16)
        ids, w = routes(rng, 3, 3, E)
        torch.library.opcheck(torch.ops.moe_engine.experts.default, (x, w, ids, r.handle, 1),
                              test_utils=("test_schema", "test_faketensor"))
        f = torch.compile(lambda a, b, c: r.op(1, a, b, c) * 2, backend="aot_eager", fullgraph=True)
        assert torch.equal(f(x, w, ids), r.forward(1, x, w, ids) * 2)


def test_bad_input_is_named(rng):
    r, E, H = runner("bf16", rng)
    x = torch.randn(2, H).to(torch.bfloat16)
    ids, w = routes(rng, 2, 3, E)
    cases = [
        ((5, x, w, ids), ValueError, r"layer=5: expected an int in \[0, 2\)"),
        ((0, x[:, :-1], w, ids), ValueError, r"hidden_states: shape \(2, 95\), expected \[num_tokens, H=96\]"),
        ((0, x.to(torch.int8), w, ids), TypeError, r"hidden_states: dtype torch.int8"),
        ((0, x, w, ids[:, :2]), ValueError, r"topk_ids: shape \(2, 2\), expected \(2, top_k=3\)"),
        ((0, x, w, ids.float()), TypeError, r"topk_ids: dtype torch.float32, expected an integer dtype"),
        ((0, x, w.int(), ids), TypeError, r"topk_weights: dtype torch.int32, expected a floating dtype"),
        ((0, x, ids, w), TypeError, r"topk_weights: dtype torch.int32, expected a floating dtype \(swapped\? the "
                                    r"order is \(layer, hidden_states, topk_weights, topk_ids\)"),
        ((0, x, w, ids + E), ValueError, r"topk_ids\[0, 0\] = \d+ is not in \[-1, 6\)"),
        ((0, x, w, ids - 5), ValueError, r"topk_ids\[\d, \d\] = -\d is not in \[-1, 6\)"),
        ((0, [1, 2], w, ids), TypeError, r"hidden_states: expected a torch tensor"),
    ]
    with r:
        for args, exc, msg in cases:
            with pytest.raises(exc, match=msg):
                r.forward(*args)
        assert r.executor.health()["error"] == 0  # nothing reached the executor


def test_construction_errors_are_named(rng, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # with it, the GPU experts may run on CPU tensors
    banks, (E, H, I) = make_banks("bf16", rng)
    with pytest.raises(ValueError, match="strategy='hybrid' runs experts on a GPU, but device=cpu"):
        MoERunner("bf16", banks, top_k=2, strategy="hybrid", device="cpu", qualify=False, progress=False)
    with pytest.raises(ValueError, match="strategy='warp'"):
        MoERunner("bf16", banks, top_k=2, strategy="warp", progress=False)
    with pytest.raises(ValueError, match="exactly one of banks= .* or weights="):
        MoERunner("bf16", top_k=2, progress=False)
    with pytest.raises(ValueError, match=r"max_tokens=2: expected an int >= the largest graph batch size \(8\)"):
        MoERunner("bf16", banks, top_k=2, device="cpu", max_tokens=2, progress=False)
    with pytest.raises(ValueError, match=r"top_k=0: expected an int in \[1, 6\]"):
        MoERunner("bf16", banks, top_k=0, device="cpu", progress=False)
    with pytest.raises(ValueError, match="prefill='later'"):
        MoERunner("bf16", banks, top_k=2, device="cpu", prefill="later", progress=False)
    with pytest.raises(ValueError, match="prefill='gpu' stages experts on a GPU"):  # at construction, not at a prompt
        MoERunner("bf16", banks, top_k=2, device="cpu", prefill="gpu", progress=False)
    with MoERunner("bf16", banks, top_k=2, device="cpu", progress=False) as r:
        with pytest.raises(ValueError, match="prefill='sometimes'"):
            r.prefill_policy.set("sometimes")
        r.prefill_policy.set("cpu")
        assert r.prefill_policy.policy == "cpu"
    bad = [dict(banks[0]), banks[1]]
    bad[0]["gate_up"] = bad[0]["gate_up"][:, :10]
    with pytest.raises(ValueError, match=r"banks\[0\]: "):
        MoERunner("bf16", bad, top_k=2, device="cpu", progress=False)


def test_weights_are_quantized_like_cpumoe_formats(rng):
    import cpumoe_formats as cf

    E, H, I = 4, 256, 128
    weights = [(rng.standard_normal((E, 2 * I, H)).astype(np.float32) * 0.05,
                torch.from_numpy(rng.standard_normal((E, H, I)).astype(np.float32) * 0.05)) for _ in range(2)]
    banks = [cf.quantize("fp8_block", gu, np.asarray(dn)) for gu, dn in weights]
    x = torch.randn(2, H).to(torch.bfloat16)
    ids, w = routes(rng, 2, 2, E)
    kw = dict(top_k=2, device="cpu", threads=1, progress=False)
    with MoERunner("fp8_block", weights=weights, **kw) as a, MoERunner("fp8_block", banks, **kw) as b:
        assert torch.equal(a.forward(1, x, w, ids).view(torch.int16), b.forward(1, x, w, ids).view(torch.int16))


def test_public_names_import_from_the_package():
    import moe_engine

    assert moe_engine.MoERunner is MoERunner
    from moe_engine import CaptureRefusedError, HostSync  # noqa: F401
    from moe_engine import MoERunner as R

    assert R is MoERunner and "offload_experts" in dir(moe_engine) and "from_pretrained" in moe_engine.__all__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        moe_engine.nope  # noqa: B018


@pytest.mark.parametrize("residency, msg", [
    (1.5, r"residency=1.5: expected a fraction in \[0, 1\]"),
    ([np.ones(7, bool), np.ones(6, bool)], r"residency\[0\]: shape \(7,\), expected a bool mask of length E=6"),
    ([np.ones(6, bool)], r"residency: 1 masks, expected one per layer \(2\)"),
    (0.5, r"residency=0.5 keeps experts on the GPU, but strategy='cpu' runs every expert on the CPU"),
])
def test_residency_is_checked_with_strategy_cpu(residency, msg, rng):
    banks, _ = make_banks("bf16", rng)
    with pytest.raises(ValueError, match=msg):
        MoERunner("bf16", banks, top_k=2, strategy="cpu", device="cpu", residency=residency, progress=False)
    with MoERunner("bf16", banks, top_k=2, strategy="cpu", device="cpu", residency=0.0, progress=False) as r:
        assert r.strategy == "cpu"  # nothing on the GPU: consistent, accepted


def test_calls_after_close_raise(rng):
    r, E, H = runner("bf16", rng)
    x = torch.randn(2, H).to(torch.bfloat16)
    ids, w = routes(rng, 2, 3, E)
    r.forward(0, x, w, ids)
    r.close()
    r.close()  # idempotent
    with pytest.raises(RuntimeError, match=r"MoERunner \(bf16, 2 layers\) is closed"):
        r.forward(0, x, w, ids)
    assert r.executor is None and r.sync is None


def test_device_without_a_gpu_names_the_argument(rng):
    banks, _ = make_banks("bf16", rng)
    bad = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ValueError, match=rf"device='{bad}'"):
        MoERunner("bf16", banks, top_k=2, device=bad, progress=False)
    with pytest.raises(ValueError, match=r"device='tpu': "):
        MoERunner("bf16", banks, top_k=2, device="tpu", progress=False)


def test_format_name_errors_list_formats_only(rng):
    banks, _ = make_banks("q4_0", rng)
    with pytest.raises(ValueError, match=r"format='Q4_0' is not a known weight format \(names are lower case: did "
                                         r"you mean 'q4_0'\?\)") as e:
        MoERunner("Q4_0", banks, top_k=2, device="cpu", progress=False)
    assert "bf16_x16" not in str(e.value) and "mxfp4_panel" not in str(e.value) and "'q4_0'" in str(e.value)


def test_one_runner_shared_by_threads_gives_each_its_own_result(rng):
    """8 threads call forward on one runner: the lock orders their steps; each gets its own y, bit for bit."""
    import threading

    r, E, H = runner("q4_0", rng)
    inputs = []
    for i in range(8):
        T = 1 + i % 4
        x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16)
        ids, w = routes(rng, T, r.top_k, E)
        inputs.append((i % 2, x, w, ids))
    with r:
        want = [r.forward(*a) for a in inputs]
        wrong, start = [], threading.Barrier(8)

        def work(i):
            start.wait()
            for _ in range(20):
                if not torch.equal(r.forward(*inputs[i]).view(torch.int16), want[i].view(torch.int16)):
                    wrong.append(i)

        ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not wrong


def test_decode_step_runs_no_torch_op_but_the_output(rng):
    """A decode step on transformers' router outputs (x bf16, weights bf16, ids int64 from topk) reaches the
    executor's native step with no conversion: between a model's layers each torch op costs tens of microseconds
    (cold caches), 48 layers a token. Bit-equal to the step on converted inputs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    r, E, H = runner("q4_0", rng)
    with r:
        x = torch.from_numpy(rng.standard_normal((1, H)).astype(np.float32)).to(torch.bfloat16)
        ids, w = routes(rng, 1, r.top_k, E)
        ids, w = ids.long(), w.to(torch.bfloat16)
        with Ops() as m:
            y = r.forward(1, x, w, ids)
        assert m.ops == ["aten.empty_like.default"]
        want = r.executor.decode(1, x.view(torch.int16).numpy().view(np.uint16).view(cf_bf16()), w.float().numpy(),
                                 ids.int().numpy())
        assert np.array_equal(y.view(torch.int16).numpy().view(np.uint16), np.asarray(want).view(np.uint16))


def cf_bf16():
    import cpumoe_formats as cf

    return cf.numerics.BF16


def test_cpu_activations_run_on_torchs_openmp_team(rng):
    """With the activations on the CPU the executor's steps run on torch's OpenMP threads (team="openmp"): no pool of
    our own beside them on the same cores. team="pool" keeps our pinned workers; both give the same bits."""
    banks, (E, H, I) = make_banks("q4_0", rng)
    kw = dict(top_k=3, strategy="cpu", device="cpu", threads=2, graph_batch_sizes=(1, 4), progress=False)
    with MoERunner("q4_0", banks, **kw) as r, MoERunner("q4_0", banks, team="pool", **kw) as p:
        assert r.executor.team == "openmp" and "team=openmp" in r.describe()
        assert p.executor.team == "pool" and p.executor._x.pinned == p.executor.threads - 1
        for layer in range(r.num_layers):
            for T in (1, 4):
                x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16)
                ids, w = routes(rng, T, r.top_k, E)
                assert torch.equal(r.forward(layer, x, w, ids).view(torch.int16),
                                   p.forward(layer, x, w, ids).view(torch.int16))


def test_a_forked_child_defaults_to_the_pool():
    """GNU libgomp does not survive fork(): in a forked child the runner's default team is "pool" (no torch op runs
    in the child: a parallel region there would wait for the parent's threads)."""
    from moe_engine.runner import _torch_on_openmp

    if not _torch_on_openmp():
        pytest.skip("torch's parallel backend here is not libgomp")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"pool" if not _torch_on_openmp() else b"openmp")
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        assert f.read() == b"pool"
