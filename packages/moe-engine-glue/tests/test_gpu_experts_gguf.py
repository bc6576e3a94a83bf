"""GpuExperts for the GGUF formats (q4_0, q8_0, q4_k, q6_k) and (gate_up, down) format pairs against cpumoe_formats'
float64 reference in mode "native", on CUDA or, without a GPU, in Triton's interpreter on CPU tensors.

Each case: fresh random GGUF block bytes (random_banks: random codes, 6-bit scales and mins, int8 scales) with edge
blocks planted (d = +-0, the smallest fp16 subnormals, q4_k dmin 0 and subnormal, q6_k scales -128 / 0 / 127);
several blocks per row for the K-quants (gate_up K = H = 512, two 256-blocks); routes with slot -1 and one slot =
capacity (not resident), experts shared by several tokens, a token with no resident route; the output poisoned
with NaN first. The pairs' reference is cpumoe_formats.reference.moe given the gate_up format's dequantized
gate_up and the down format's dequantized down (`dequantized=`; native mode reads the activations as they are).

Tolerance, as tests/test_gpu_experts.py: the reference is float64 before the output's bf16 rounding, so the error
is at least half a bf16 ulp (2^-9 of |y|); fp32 accumulation in another order (tensor cores, block sizes, q4_k's
dot path folding d * sc and dmin * m after the sums) may flip the intermediate's or the output's bf16 rounding
now and then: max|y - ref| / max|ref| < 1e-2 and at most 5% of the elements differing from bf16(reference) beyond
what near-tie intermediates explain (check_close in test_gpu_experts.py). Measured in the interpreter
(GPU_EXPERTS_STATS=1; q4_k/q6_k over 17 seeds at T = 1 and 8): max error 1.4e-3 .. 3.4e-3 of max|ref|; 0-0.4% of the
elements differing, and 6.1% in one case (CPUMOE_TEST_SEED=560613285, T=1: one intermediate 0.49998 ulps from its
tie rounded the other way; 0% beyond the ties' slack).

The interpreter runs the kernels with large row blocks (cpu_config: it pays per Triton op and program); on a GPU
the same cases run the default configs (config.py), and test_kernel_variants runs the other kernel combinations.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gpu_experts import DEVICES, HAVE_CUDA, TIE_ULPS, check_close, gpu

import cpumoe_formats as cf

GpuExperts, Config, StageConfig = gpu.GpuExperts, gpu.Config, gpu.StageConfig
round_bf16 = cf.numerics.round_bf16

GGUF = ("q4_0", "q8_0", "q4_k", "q6_k")
# (E, H, I): 32-block formats ragged (not powers of two), K-quants two 256-blocks per gate_up row
SHAPES = {"q4_0": (5, 160, 96), "q8_0": (5, 160, 96), "q4_k": (5, 512, 256), "q6_k": (5, 512, 256)}
PAIRS = [("q4_k", "q6_k"), ("q4_k", "q4_k"), ("q8_0", "q4_0")]
TOP_K, CAPACITY = 2, 3
RESIDENT = (0, 2, 3)  # expert of slot 0..2


def _stage(fmt, bn, dot):
    return StageConfig(bn, 256 if fmt in ("q4_k", "q6_k") else 64, dot=dot)


def cpu_config(fmts, T):
    """Few programs for the interpreter: batch 1 per-route FMA with the per-token down, larger batches grouped
    tensor-core tiles (the two kernel families every format has)."""
    a, b = fmts
    if T == 1:
        return Config(gate_up=_stage(a, 64, False), down=_stage(b, 128, False), grouped=False, down_mode="token")
    return Config(gate_up=_stage(a, 128, True), down=_stage(b, 256, True), grouped=True, down_mode="group")


def _plant_edges(fmt, banks, rng):
    """Edge blocks: zero and subnormal fp16 d (and dmin), extreme q6_k scales, in a few random blocks of each bank."""
    B = {"q4_0": 18, "q8_0": 34, "q4_k": 144, "q6_k": 210}[fmt]
    for name in ("gate_up", "down"):
        blocks = banks[name].reshape(-1, B)
        idx = rng.choice(blocks.shape[0], 8, replace=False)
        d_at = 208 if fmt == "q6_k" else 0
        for n, i in enumerate(idx):
            v = [0x0000, 0x8000, 0x0001, 0x83FF][n % 4]  # +0, -0, 2^-24, -(largest subnormal)
            blocks[i, d_at:d_at + 2] = [v & 0xFF, v >> 8]
            if fmt == "q4_k":
                w = [0x0000, 0x0001, 0x8200, 0x0000][n % 4]
                blocks[i, 2:4] = [w & 0xFF, w >> 8]
        if fmt == "q6_k":
            sc = blocks[:, 192:208]
            sc[idx[:3]] = np.asarray([-128, 0, 127], np.int8).view(np.uint8)[:, None]
    return banks


def _banks(fmts, rng):
    """(banks for GpuExperts, full banks of the gate_up format, the float64 (gate_up, down))."""
    a, b = fmts
    E, H, I = SHAPES[a]  # noqa: E741
    ba = _plant_edges(a, cf.get_format(a).random_banks(E, H, I, rng), rng)
    bb = ba if b == a else _plant_edges(b, cf.get_format(b).random_banks(E, H, I, rng), rng)
    deq = (cf.get_format(a).dequantize(ba)[0], cf.get_format(b).dequantize(bb)[1])
    return {"gate_up": ba["gate_up"], "down": bb["down"]}, ba, deq


def _experts(fmts, banks, device, T):
    E, H, I = SHAPES[fmts[0]]  # noqa: E741
    ge = GpuExperts(fmts if fmts[0] != fmts[1] else fmts[0], num_layers=2, capacity=CAPACITY, E=E, H=H, I=I,
                    top_k=TOP_K, max_tokens=8, device=device)
    if device == "cpu":
        ge.set_config(T, cpu_config(fmts, T))
    for slot, e in enumerate(RESIDENT):
        ge.load(1, slot, banks, e)
    return ge


def _routes(rng, T, E):
    """slots (-1 where not resident; token 0's first non-resident route gets slot = capacity, also skipped), weights,
    ids for the reference; every token routes to expert 0 (resident: an expert serves several tokens), except the
    last token of T >= 3, which has no resident route."""
    slot_of = {e: s for s, e in enumerate(RESIDENT)}
    ids = np.zeros((T, TOP_K), np.int32)
    ids[:, 1] = rng.integers(1, E, T)
    if T >= 3:
        ids[-1] = [e for e in range(E) if e not in slot_of][:TOP_K]
    slots = np.array([[slot_of.get(int(e), -1) for e in row] for row in ids], np.int32)
    if (slots[0] < 0).any():
        slots[0, np.argmax(slots[0] < 0)] = CAPACITY
    w = (rng.random((T, TOP_K), dtype=np.float32) * 0.9 + 0.1).astype(np.float32)
    ids_ref = np.where((slots >= 0) & (slots < CAPACITY), ids, -1).astype(np.int32)
    return slots, w, ids_ref


def _run(fmts, banks, ge, x, rng, device):
    E, H, _ = SHAPES[fmts[0]]
    T = x.shape[0]
    slots, w, ids_ref = _routes(rng, T, E)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=device)
    y = ge.forward(1, x.to(device), torch.from_numpy(w).to(device), torch.from_numpy(slots).to(device), out=out)
    assert y is out
    return y.float().cpu().numpy().astype(np.float64), w, ids_ref


def _reference(fmts, full_a, deq, x, w, ids_ref, tie_slack=None):
    return cf.reference.moe(fmts[0], full_a, x.float().numpy(), w, ids_ref, mode="native", dequantized=deq,
                            tie_slack=tie_slack)


def _check(fmts, T, device, rng):
    banks, full_a, deq = _banks(fmts, rng)
    ge = _experts(fmts, banks, device, T)
    H = SHAPES[fmts[0]][1]
    x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16)
    y, w, ids_ref = _run(fmts, banks, ge, x, rng, device)
    ref, slack = _reference(fmts, full_a, deq, x, w, ids_ref, tie_slack=TIE_ULPS)
    check_close(f"{fmts} T={T} device={device}", y, ref, slack)
    if T >= 3:
        assert (y[-1] == 0).all()  # no resident route
    return ge


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("fmt", GGUF)
def test_format(fmt, T, device, rng):
    _check((fmt, fmt), T, device, rng)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("pair", PAIRS, ids="/".join)
def test_pair(pair, T, device, rng):
    ge = _check(pair, T, device, rng)
    assert ge.formats == pair and ge.format == (pair if pair[0] != pair[1] else pair[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("fmt", GGUF)
def test_nan_inf_propagate(fmt, T, device):
    """NaN in one element of token 0 and +inf in one of token 1 (T = 3): the non-finite outputs are the reference's,
    NaN where it is NaN, the rest finite and close."""
    rng = np.random.default_rng(31)
    fmts = (fmt, fmt)
    banks, full_a, deq = _banks(fmts, rng)
    ge = _experts(fmts, banks, device, T)
    H = SHAPES[fmt][1]
    xf = rng.standard_normal((T, H)).astype(np.float32)
    xf[0, 7] = np.nan
    if T > 1:
        xf[1, 40] = np.inf
    x = torch.from_numpy(xf).to(torch.bfloat16)
    with np.errstate(invalid="ignore", over="ignore"):  # the interpreter's numpy meets inf * 0 as the GPU does
        y, w, ids_ref = _run(fmts, banks, ge, x, rng, device)
        ref = _reference(fmts, full_a, deq, x, w, ids_ref)
    assert (np.isnan(y) == np.isnan(ref)).all()
    assert (np.isfinite(y) == np.isfinite(ref)).all()
    assert np.isnan(y[0]).all()  # token 0's resident route reads the NaN
    if T > 2:
        assert np.isfinite(y[2]).all()  # the token without a non-finite x
        assert np.abs(y[2] - ref[2]).max() <= 1e-2 * np.abs(ref[2]).max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_kernel_variants(fmt, device):
    """The other kernel combinations (the wrappers are the same code for every format, so the two cheap formats):
    per-route FMA gate_up with the grouped down, grouped FMA with the per-token down, tensor cores without
    grouping."""
    rng = np.random.default_rng(17)
    fmts = (fmt, fmt)
    banks, full_a, deq = _banks(fmts, rng)
    ge = _experts(fmts, banks, device, 8)
    H = SHAPES[fmt][1]
    for cfg in (Config(_stage(fmt, 64, False), _stage(fmt, 128, False), grouped=False, down_mode="group"),
                Config(_stage(fmt, 64, False), _stage(fmt, 128, False), grouped=True, down_mode="token"),
                Config(_stage(fmt, 128, True), _stage(fmt, 256, True), grouped=False, down_mode="group")):
        ge.set_config(4, cfg)
        x = torch.from_numpy(rng.standard_normal((4, H)).astype(np.float32)).to(torch.bfloat16)
        y, w, ids_ref = _run(fmts, banks, ge, x, rng, device)
        ref = _reference(fmts, full_a, deq, x, w, ids_ref)
        assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-2, cfg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_k"])
def test_quantized_banks(fmt, device):
    """Banks from cf.quantize of random float weights (ggml's quantizers), the router weight on the input."""
    rng = np.random.default_rng(3)
    E, H, I = SHAPES[fmt]  # noqa: E741
    banks = cf.quantize(fmt, (rng.standard_normal((E, 2 * I, H)) * 0.02).astype(np.float32),
                        (rng.standard_normal((E, H, I)) * 0.02).astype(np.float32))
    ge = GpuExperts(fmt, num_layers=2, capacity=CAPACITY, E=E, H=H, I=I, top_k=TOP_K, max_tokens=8, device=device,
                    apply_router_weight_on_input=True)
    for slot, e in enumerate(RESIDENT):
        ge.load(1, slot, banks, e)
    if device == "cpu":
        ge.set_config(3, cpu_config((fmt, fmt), 3))
    x = torch.from_numpy(rng.standard_normal((3, H)).astype(np.float32)).to(torch.bfloat16)
    y, w, ids_ref = _run((fmt, fmt), banks, ge, x, rng, device)
    ref = cf.reference.moe(fmt, banks, x.float().numpy(), w, ids_ref, mode="native", apply_router_weight_on_input=True)
    assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-2


def test_layout_bytes_and_validation():
    """The device copy holds the file's bytes per expert; bad pairs, banks and configs are refused by name."""
    dev = "cuda" if HAVE_CUDA else "cpu"
    E, H, I = 2, 512, 256  # noqa: E741
    for fmts in [(f, f) for f in GGUF] + PAIRS + [("q4_k", "bf16")]:
        ge = GpuExperts(fmts, num_layers=1, capacity=1, E=E, H=H, I=I, top_k=2, max_tokens=1, device=dev)
        want = sum(b.nbytes // E for b in (cf.get_format(fmts[0]).random_banks(E, H, I, np.random.default_rng(0))
                                           ["gate_up"], cf.get_format(fmts[1]).random_banks(
                                               E, H, I, np.random.default_rng(0))["down"]))
        assert ge.bytes_per_expert == want, fmts
    rng = np.random.default_rng(1)
    ge = GpuExperts(("q4_k", "q6_k"), num_layers=1, capacity=1, E=E, H=H, I=I, top_k=2, max_tokens=1, device=dev)
    q4k, q6k = (cf.get_format(f).random_banks(E, H, I, rng) for f in ("q4_k", "q6_k"))
    with pytest.raises(ValueError, match=r"down bank 'down' \(q6_k\): shape .*expected \(2, 512, 210\)"):
        ge.load(0, 0, {"gate_up": q4k["gate_up"], "down": q4k["down"]}, 0)  # q4_k down bytes for q6_k
    with pytest.raises(ValueError, match=r"missing \['down'\]"):
        ge.load(0, 0, {"gate_up": q4k["gate_up"]}, 0)
    with pytest.raises(TypeError, match=r"gate_up bank 'gate_up' \(q4_k\): dtype int8"):
        ge.load(0, 0, {"gate_up": q4k["gate_up"].view(np.int8), "down": q6k["down"]}, 0)
    ge.load(0, 0, {"gate_up": q4k["gate_up"], "down": q6k["down"]}, 1)
    with pytest.raises(ValueError, match=r"\(down 'ds_fp4'\): GpuExperts runs"):
        GpuExperts(("q4_k", "ds_fp4"), num_layers=1, capacity=1, E=E, H=H, I=I, top_k=2, max_tokens=1, device=dev)
    with pytest.raises(ValueError, match="pair"):
        GpuExperts(("q4_k", "q6_k", "q4_k"), num_layers=1, capacity=1, E=E, H=H, I=I, top_k=2, max_tokens=1,
                   device=dev)
    with pytest.raises(ValueError, match="q6_k: H and I must be positive multiples of 256"):
        GpuExperts(("q4_0", "q6_k"), num_layers=1, capacity=1, E=E, H=H, I=96, top_k=2, max_tokens=1, device=dev)
    with pytest.raises(ValueError, match=r"q6_k: Config.down.block_k=128 must be 256"):
        ge.set_config(1, Config(StageConfig(16, 256), StageConfig(16, 128), grouped=False))
    with pytest.raises(ValueError, match=r"q4_0: Config.gate_up.block_k=16 must be a multiple of 32"):
        GpuExperts("q4_0", num_layers=1, capacity=1, E=E, H=H, I=I, top_k=2, max_tokens=1, device=dev,
                   config=Config(StageConfig(16, 16), StageConfig(16, 64), grouped=False))


def test_every_format_names_its_matrices():
    """The pair validation splits a format's banks by name (gate_up..., down...): every GPU format's banks do."""
    for name in GpuExperts.FORMATS:
        spec = cf.get_format(name)
        assert all(b.name.split("_")[0] in ("gate", "down") for b in spec.banks), name
        assert any(b.name == "gate_up" or b.name.startswith("gate_up_") for b in spec.banks), name


@pytest.mark.gpu
@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU (graph capture)")
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("fmts", [(f, f) for f in GGUF] + PAIRS[:1], ids="/".join)
def test_cuda_graph_replay(fmts, T):
    """forward captured once, replayed 20 times with new x / slots / weights: bit for bit the eager result."""
    rng = np.random.default_rng(41 + T)
    E, H, _ = SHAPES[fmts[0]]
    banks, _, _ = _banks(fmts, rng)
    ge = _experts(fmts, banks, "cuda", T)
    x = torch.zeros((T, H), dtype=torch.bfloat16, device="cuda")
    s = torch.zeros((T, TOP_K), dtype=torch.int32, device="cuda")
    w = torch.zeros((T, TOP_K), dtype=torch.float32, device="cuda")
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
        slots, wt, _ = _routes(rng, T, E)
        xi = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16).cuda()
        si, wi = torch.from_numpy(slots).cuda(), torch.from_numpy(wt).cuda()
        x.copy_(xi)
        s.copy_(si)
        w.copy_(wi)
        out.fill_(float("nan"))
        g.replay()
        eager = ge.forward(1, xi, wi, si)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmts", [(f, f) for f in GGUF] + PAIRS, ids="/".join)
def test_load_range_equals_loads(fmts, device, rng):
    """load_range (a staged prefill's one copy per bank) leaves the slots bit for bit as load() per expert does."""
    banks, _, _ = _banks(fmts, rng)
    E, H, I = SHAPES[fmts[0]]  # noqa: E741
    fmt = fmts if fmts[0] != fmts[1] else fmts[0]
    one, many = (GpuExperts(fmt, num_layers=1, capacity=E, E=E, H=H, I=I, top_k=TOP_K, max_tokens=8, device=device)
                 for _ in range(2))
    for e in range(E):
        one.load(0, e, banks, e)
    many.load_range(0, 0, banks, 0, E)
    for name in one.parts:
        a, b = one.parts[name][0], many.parts[name][0]
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
