"""GpuExperts (moe_engine.gpu) against cpumoe_formats' float64 reference, every format, on CUDA or, without a GPU,
in Triton's interpreter on CPU tensors.

Each case: fresh random banks (random_banks, or cf.quantize of random float weights; fp8_block / nvfp4 / mxfp4
scale codes include the edge codes 0x7F / 0xFF (+-480) and e8m0 0 / 1), ragged H and I (not powers of two,
fp8_block's 128-blocks partial), some experts not resident (routes with slot -1, and one slot >= capacity),
experts shared by several tokens, a token with no resident route, the output poisoned with NaN first. The
reference runs on the same routes (ids of non-resident routes set to -1).

Tolerance. The reference is float64 before the output's bf16 rounding, so the kernel's error is at least that
rounding: half a bf16 ulp, up to 2^-8 = 3.9e-3 of |y|. Measured in the interpreter over this file's 83 checks
(GPU_EXPERTS_STATS=1 prints them): every element equal to bf16(reference) bit for bit (the intermediate's bf16
rounding of fp32 values matched the reference's each time), max|y - ref| / max|ref| between 1.9e-4 and 3.7e-3.
The checks allow fp32 accumulation in another order (tensor cores, other block sizes) to flip a rounding of the
intermediate or the output now and then: max|y - ref| / max|ref| < 1e-2 (2.5x the rounding bound) and at most 5%
of the elements differing from bf16(reference) beyond what intermediates within 1e-2 ulps of a rounding tie explain
(check_close; the reference's tie_slack). One such intermediate flipping moves every output by w * ulp(g_j) *
down[:, j] at once: q4_k/q6_k, CPUMOE_TEST_SEED=560613285, T=1, flipped 6.1% of the outputs that way.

Runs: the interpreter (no GPU) 62 passed, 68 skipped (the [cuda] cases and the graph replays); one H200 (torch
2.11, Triton 3.6, pytest -n 8) 70 passed, 60 skipped (the [cpu] cases), before config.py's defaults became the
sweep's best (those configs were checked on the H200 by bench/gpu_experts.py at Qwen3-30B-A3B's shape).
"""
from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()
if not HAVE_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated


def _gpu_package():
    """moe_engine.gpu, in interpreter mode on a CPU-only host even if something imported it before the variable
    was set (its kernels are decorated at import: the modules are re-imported)."""
    import moe_engine.gpu as gpu
    from moe_engine.gpu import _tl

    if not HAVE_CUDA and not _tl.INTERPRET:
        for name in sorted([m for m in sys.modules if m.startswith("moe_engine.gpu.")], key=len):
            del sys.modules[name]
        del sys.modules["moe_engine.gpu"]
        gpu = importlib.import_module("moe_engine.gpu")
    return gpu


cf = pytest.importorskip("cpumoe_formats")
gpu = _gpu_package()
from moe_engine.gpu import _tl  # noqa: E402  (after the interpreter switch)

GpuExperts, Config, StageConfig = gpu.GpuExperts, gpu.Config, gpu.StageConfig
round_bf16 = cf.numerics.round_bf16

# the cpu flavour needs the interpreter (no GPU in the process); on a GPU host the same cases run as [cuda]
DEVICES = [
    pytest.param("cpu", marks=[pytest.mark.cpu, pytest.mark.skipif(
        not _tl.INTERPRET, reason="a GPU is present: the kernels are compiled, the same cases run as [cuda]")]),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.cuda, pytest.mark.skipif(
        not HAVE_CUDA, reason="no CUDA GPU (the same cases run as [cpu] in Triton's interpreter)")]),
]

# the formats this file covers (the GGUF formats and format pairs: test_gpu_experts_gguf.py)
FORMATS = ("bf16", "fp8_block", "mxfp4", "nvfp4")
# ragged shapes the interpreter runs in about a second per forward: (E, H, I)
SHAPES = {"bf16": (6, 200, 72), "fp8_block": (6, 200, 72), "mxfp4": (6, 160, 96), "nvfp4": (6, 176, 80)}
TOP_K, CAPACITY = 3, 4
RESIDENT = (0, 2, 3, 5)  # expert of slot 0..3


def _edge_codes(fmt, banks, rng):
    """Plant the formats' edge codes in a few places of random banks."""
    def plant(a, values, n=24):
        flat = a.reshape(-1).view(np.uint8)
        idx = rng.choice(flat.size, n, replace=False)
        flat[idx] = rng.choice(np.asarray(values, np.uint8), n)

    if fmt == "fp8_block":
        plant(banks["gate_up"], [0x7F, 0xFF, 0x01, 0x81])  # +-480 and the subnormal 2^-9
        plant(banks["down"], [0x7F, 0xFF, 0x01, 0x81])
    elif fmt == "nvfp4":
        plant(banks["gate_up_scale"], [0x7F, 0xFF, 0x01])
        plant(banks["down_scale"], [0x7F, 0xFF, 0x01])
    elif fmt == "mxfp4":
        plant(banks["gate_up_scales"], [0, 1, 126, 127], 8)
        plant(banks["down_scales"], [0, 1, 126, 127], 8)
    return banks


def _banks(fmt, rng, quantized=False):
    E, H, I = SHAPES[fmt]
    if quantized:
        gu = (rng.standard_normal((E, 2 * I, H)) * 0.02).astype(np.float32)
        dn = (rng.standard_normal((E, H, I)) * 0.02).astype(np.float32)
        kw = {}
        if fmt == "mxfp4":
            kw = {"gate_up_bias": (rng.standard_normal((E, 2 * I)) * 0.01).astype(np.float32),
                  "down_bias": (rng.standard_normal((E, H)) * 0.01).astype(np.float32)}
        return cf.quantize(fmt, gu, dn, **kw)
    return _edge_codes(fmt, cf.get_format(fmt).random_banks(E, H, I, rng), rng)


def _experts(fmt, banks, device, max_tokens=8, **kw):
    E, H, I = SHAPES[fmt]
    ge = GpuExperts(fmt, num_layers=2, capacity=CAPACITY, E=E, H=H, I=I, top_k=TOP_K, max_tokens=max_tokens,
                    device=device, **kw)
    for slot, e in enumerate(RESIDENT):
        ge.load(1, slot, banks, e)
    return ge


def _routes(rng, T, E):
    """ids [T, top_k] distinct per token, slots (-1 where not resident; one route's slot = capacity, also not on
    the GPU), weights in (0, 1]; the last token of T >= 3 has no resident route."""
    slot_of = {e: s for s, e in enumerate(RESIDENT)}
    ids = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(T)]).astype(np.int32)
    if T >= 3:
        ids[-1] = [e for e in range(E) if e not in slot_of][:TOP_K] + [1] * (TOP_K - 2)
    slots = np.array([[slot_of.get(int(e), -1) for e in row] for row in ids], np.int32)
    if T >= 2 and (slots[0] < 0).any():
        slots[0, np.argmax(slots[0] < 0)] = CAPACITY  # out of range: skipped like -1
    w = (rng.random((T, TOP_K), dtype=np.float32) * 0.9 + 0.1).astype(np.float32)
    ids_ref = np.where((slots >= 0) & (slots < CAPACITY), ids, -1).astype(np.int32)
    return slots, w, ids_ref


TIE_ULPS = 1e-2  # intermediates this near a bf16 rounding tie may round either way (fp32 sums: ~1e-3 ulps off)


def check_close(what, y, ref, slack):
    """y (the kernel's bf16 output, float64) against the float64 reference: max error < 1e-2 of max|ref|, and at most
    5% of the elements differing from bf16(ref) beyond what near-tie intermediates explain (slack: the reference's
    tie_slack) and half the gap from y to its bf16 neighbour on ref's side."""
    assert np.isfinite(y).all(), "output not fully written (NaN poison left) or not finite"
    scale = np.abs(ref).max()
    assert scale > 0
    err = np.abs(y - ref).max() / scale
    off = y != round_bf16(ref)
    differ = float(np.mean(off))
    unexplained = float(np.mean(off & (np.abs(y - ref) > 0.5 * cf.numerics.gap_bf16(y, ref) * (1 + TIE_ULPS) + slack)))
    if os.environ.get("GPU_EXPERTS_STATS"):
        print(f"STATS {what} err={err:.3e} differ={differ:.4f} unexplained={unexplained:.4f}", file=sys.stderr)
    assert err < 1e-2 and unexplained <= 0.05, \
        f"{what}: max err {err:.3g} of max|ref|, {differ:.1%} != bf16(ref), {unexplained:.1%} beyond near ties"
    return err


def _check(fmt, banks, ge, rng, T, device, **ref_kw):
    E, H, I = SHAPES[fmt]
    slots, w, ids_ref = _routes(rng, T, E)
    x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=device)
    y = ge.forward(1, x.to(device), torch.from_numpy(w).to(device), torch.from_numpy(slots).to(device), out=out)
    assert y is out
    y = y.float().cpu().numpy().astype(np.float64)
    ref, slack = cf.reference.moe(fmt, banks, x.float().numpy(), w, ids_ref, tie_slack=TIE_ULPS, **ref_kw)
    err = check_close(f"{fmt} T={T} device={device}", y, ref, slack)
    if T >= 3:
        assert (y[-1] == 0).all()  # no resident route
    return err


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_config(fmt, T, device):
    rng = np.random.default_rng(100 + T)
    banks = _banks(fmt, rng)
    _check(fmt, banks, _experts(fmt, banks, device), rng, T, device)


def _cfg(fmt, mode):
    bk = 128 if fmt in ("bf16", "fp8_block") else 64
    dot = mode.startswith("dot")
    st = StageConfig(16, bk, dot=dot)
    return Config(gate_up=StageConfig(8 if dot else 16, bk // 2, dot=dot), down=st, grouped="grouped" in mode,
                  down_mode="token" if mode.endswith("token") else "group", sum_block=64)


MODES = ["fma-direct-token", "fma-grouped-token", "fma-grouped-group", "dot-grouped-group", "dot-direct-group"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_variants(fmt, mode, device):
    """Every kernel combination (per-route or grouped gate_up, per-token or grouped down, FMA or tensor cores)."""
    rng = np.random.default_rng(7)
    banks = _banks(fmt, rng)
    ge = _experts(fmt, banks, device)
    ge.set_config(None, _cfg(fmt, mode))
    _check(fmt, banks, ge, rng, 8, device)


ACTS = [("gelu", None, None), ("gelu_tanh", None, None), ("swigluoai", 1.702, 0.15), ("swiglu_clamp", 1.0, 0.1),
        ("swigluoai", 1.702, None)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ACTS, ids=lambda a: f"{a[0]}-{a[2]}")
@pytest.mark.parametrize("fmt", FORMATS)
def test_activations(fmt, act, device):
    """Limits of 0.1-0.15 clamp (gate and up are ~0.3 rms here)."""
    name, alpha, limit = act
    rng = np.random.default_rng(11)
    banks = _banks(fmt, rng)
    ge = _experts(fmt, banks, device, activation=name, alpha=alpha, limit=limit)
    ge.set_config(3, _cfg(fmt, "dot-grouped-group"))
    _check(fmt, banks, ge, rng, 3, device, activation=name, alpha=alpha, limit=limit)
    _check(fmt, banks, ge, rng, 1, device, activation=name, alpha=alpha, limit=limit)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "nvfp4"])
def test_router_weight_on_input(fmt, device):
    rng = np.random.default_rng(5)
    banks = _banks(fmt, rng)
    ge = _experts(fmt, banks, device, apply_router_weight_on_input=True)
    for T in (1, 3):
        _check(fmt, banks, ge, rng, T, device, apply_router_weight_on_input=True)


def test_router_weight_on_input_mxfp4_refused():
    E, H, I = SHAPES["mxfp4"]
    with pytest.raises(ValueError, match="router weight on the output"):
        GpuExperts("mxfp4", num_layers=1, capacity=1, E=E, H=H, I=I, top_k=2, max_tokens=1,
                   apply_router_weight_on_input=True, device="cuda" if HAVE_CUDA else "cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_banks(fmt, device):
    """Banks from cf.quantize of random float weights (mxfp4 with biases)."""
    rng = np.random.default_rng(3)
    banks = _banks(fmt, rng, quantized=True)
    _check(fmt, banks, _experts(fmt, banks, device), rng, 3, device)


@pytest.mark.parametrize("device", DEVICES)
def test_large_batch_eager(device):
    """T above max_tokens runs eagerly with the same kernels (groups of up to 20 tokens per expert)."""
    rng = np.random.default_rng(9)
    banks = _banks("bf16", rng)
    _check("bf16", banks, _experts("bf16", banks, device, max_tokens=4), rng, 20, device)


def test_bytes_and_validation():
    dev = "cuda" if HAVE_CUDA else "cpu"
    E, H, I = 4, 256, 128
    for fmt, per in (("bf16", 3 * H * I * 2), ("fp8_block", 3 * H * I + 4 * (2 * 1 * 2 + 2 * 1) + 2 * 4),
                     ("mxfp4", 3 * H * I // 2 + 3 * H * I // 32 + 4 * (2 * I + H)),
                     ("nvfp4", 3 * H * I // 2 + 3 * H * I // 16 + 4 * (2 * I + H))):
        ge = GpuExperts(fmt, num_layers=1, capacity=2, E=E, H=H, I=I, top_k=2, max_tokens=4, device=dev)
        assert ge.bytes_per_expert == per, fmt
    ge = GpuExperts("bf16", num_layers=1, capacity=2, E=E, H=H, I=I, top_k=2, max_tokens=4, device=dev)
    banks = cf.get_format("bf16").random_banks(E, H, I, np.random.default_rng(0))
    with pytest.raises(ValueError, match="slot"):
        ge.load(0, 2, banks, 0)
    with pytest.raises(ValueError, match="expert"):
        ge.load(0, 0, banks, E)
    with pytest.raises(ValueError):
        ge.load(0, 0, cf.get_format("bf16").random_banks(E, H + 16, I, np.random.default_rng(0)), 0)
    with pytest.raises(ValueError, match="format"):
        GpuExperts("ds_fp4", num_layers=1, capacity=1, E=E, H=H, I=I, top_k=2, max_tokens=1, device=dev)
    with pytest.raises(ValueError, match="block_k"):
        ge2 = GpuExperts("fp8_block", num_layers=1, capacity=1, E=E, H=H, I=I, top_k=2, max_tokens=1, device=dev)
        ge2.set_config(1, Config(StageConfig(16, 256), StageConfig(16, 128), grouped=False))
    x = torch.zeros((0, H), dtype=torch.bfloat16, device=dev)
    e = torch.zeros((0, 2), dtype=torch.int32, device=dev)
    assert ge.forward(0, x, e.float(), e).shape == (0, H)


@pytest.mark.gpu
@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU (graph capture)")
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_graph_replay(fmt, T):
    """forward captured once, replayed 20 times with new x / slots / weights: bit for bit the eager result."""
    rng = np.random.default_rng(21 + T)
    E, H, I = SHAPES[fmt]
    banks = _banks(fmt, rng)
    ge = _experts(fmt, banks, "cuda", max_tokens=8)
    x = torch.zeros((T, H), dtype=torch.bfloat16, device="cuda")
    s = torch.zeros((T, TOP_K), dtype=torch.int32, device="cuda")
    w = torch.zeros((T, TOP_K), dtype=torch.float32, device="cuda")

    def fresh():
        slots, wt, _ = _routes(rng, T, E)
        return (torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16).cuda(),
                torch.from_numpy(slots).cuda(), torch.from_numpy(wt).cuda())

    for a, b in zip((x, s, w), fresh()):
        a.copy_(b)
    out = torch.empty((T, H), dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ge.forward(1, x, w, s, out=out)  # warm-up (compiles) off the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ge.forward(1, x, w, s, out=out)
    for _ in range(20):
        xi, si, wi = fresh()
        x.copy_(xi)
        s.copy_(si)
        w.copy_(wi)
        out.fill_(float("nan"))
        g.replay()
        eager = ge.forward(1, xi, wi, si)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


def _same_slots(a, b, layer, slots) -> None:
    for name in a.parts:
        x, y = a.parts[name][layer, slots], b.parts[name][layer, slots]
        assert torch.equal(x.view(torch.uint8) if x.is_floating_point() else x,
                           y.view(torch.uint8) if y.is_floating_point() else y), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_load_range_equals_loads(fmt, device):
    """load_range (one copy per bank for a range of experts: staged prefill) leaves the slots bit for bit as load()
    per expert does, edge codes and mxfp4's de-interleave included; a bad range is refused by name."""
    rng = np.random.default_rng(7)
    banks = _banks(fmt, rng)
    E, H, I = SHAPES[fmt]  # noqa: E741
    one = GpuExperts(fmt, num_layers=2, capacity=E, E=E, H=H, I=I, top_k=TOP_K, max_tokens=8, device=device)
    rng_ = GpuExperts(fmt, num_layers=2, capacity=E, E=E, H=H, I=I, top_k=TOP_K, max_tokens=8, device=device)
    for slot, e in enumerate(range(1, E - 1)):
        one.load(1, slot + 2, banks, e)
    rng_.load_range(1, 2, banks, 1, E - 1)
    _same_slots(one, rng_, 1, slice(0, E))
    with pytest.raises(ValueError, match=r"expected 0 <= lo < hi <= E=6 and slot \+ \(hi - lo\) <= capacity=6"):
        rng_.load_range(1, 1, banks, 0, E)
