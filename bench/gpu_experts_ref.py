"""bench/gpu_experts.py's weights and float64 reference: random expert weights written into a GpuExperts' device
layout (every format, GGUF blocks included), routes, and the float64 torch reference computed from that layout."""
from __future__ import annotations

import torch

GGUF = ("q4_0", "q8_0", "q4_k", "q6_k")  # --formats q4_0,q4_k,q4_k/q6_k (a gate_up/down pair: Q4_K_M's layers)


def matrix_format(fmt, which):
    """The format of one matrix ('gu' / 'gate_up' or 'dn' / 'down') of a format or a pair."""
    if isinstance(fmt, str):
        return fmt
    return fmt[0] if which in ("gu", "gate_up") else fmt[1]


# ---- weights and routes -----------------------------------------------------------------------------------
def fill_random(ge, seed):
    """Random codes of the format's usual magnitudes, straight into the GPU tensors (never zeros)."""
    g = torch.Generator(device=ge.device).manual_seed(seed)
    for name, t in ge.parts.items():
        fmt = matrix_format(ge.formats, name[:2])
        if fmt in GGUF:
            _fill_gguf(fmt, name[3:], t, g)
            continue
        if fmt == "fp8_block" and name.endswith("_v"):
            continue  # the 0x7F / 0xFF flags, from the codes below
        if name.endswith("_w"):
            if fmt == "bf16":
                t.normal_(0.0, 0.02, generator=g)
            else:
                t.random_(0, 256, generator=g)
                if fmt == "fp8_block":  # as a saturating quantizer leaves them: no 0x7F / 0xFF (+-480) codes
                    t[(t & 0x7F) == 0x7F] -= 1
        elif name.endswith("_s"):
            if fmt == "fp8_block":
                t.uniform_(0.5 * 0.02 / 64, 1.5 * 0.02 / 64, generator=g)
            elif fmt == "mxfp4":
                t.random_(119, 122, generator=g)
            else:
                t.random_(0x30, 0x3D, generator=g)
        else:  # _v: mxfp4 bias, nvfp4 global
            if fmt == "mxfp4":
                t.normal_(0.0, 0.01, generator=g)
            else:
                t.uniform_(0.008, 0.012, generator=g)
    for m in ("gu", "dn"):
        if matrix_format(ge.formats, m) == "fp8_block":
            w = ge.parts[f"{m}_w"]
            ge.parts[f"{m}_v"].copy_(((w & 0x7F) == 0x7F).flatten(2).any(-1, keepdim=True).to(torch.int32))


# fp16 d magnitudes of cpumoe_formats' random_banks (weights ~0.01-0.1 rms)
_GGUF_D = {"q4_0": 0.0025, "q8_0": 1e-4, "q4_k": 1e-4, "q6_k": 2.0 ** -14}


def _fill_gguf(fmt, part, t, g):
    """One GGUF plane (layouts.py): random codes and packed scales, fp16 d (and dmin) of +-[1, 2) x _GGUF_D."""
    if t.dtype == torch.float16:
        t.uniform_(1.0, 2.0, generator=g)
        t.mul_(torch.randint(0, 2, t.shape, generator=g, device=t.device).to(t.dtype) * 2 - 1)
        t.mul_(_GGUF_D[fmt])
    elif t.dtype == torch.int8:
        t.random_(-128, 128, generator=g)
    else:
        t.random_(0, 256, generator=g)
def routes(T, E, K, L, device, seed):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32) for _ in range(L)]
    ws = [torch.softmax(torch.randn(T, K, generator=g), dim=-1) for _ in range(L)]
    return [i.to(device) for i in ids], [w.to(device) for w in ws]


# ---- float64 torch reference on the GPU layout ----------------------------------------------------------------
def _e4m3_table(device):
    t = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    t[0x7F], t[0xFF] = 480.0, -480.0
    return t.double().to(device)


_E2M1 = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]


def _dequant_gguf(fmt, w, s, v):
    """float64 [N, K] of one GGUF matrix's planes (layouts.py), as cpumoe_formats' decode_blocks."""
    N = w.shape[0]
    if fmt == "q4_0":
        b = w.long().view(N, -1, 16)
        q = torch.cat([(b & 15) - 8, (b >> 4) - 8], dim=-1).double()
        return (q * s.double()[:, :, None]).reshape(N, -1)
    if fmt == "q8_0":
        return (w.double().view(N, -1, 32) * s.double()[:, :, None]).reshape(N, -1)
    if fmt == "q4_k":
        b = w.long().view(N, -1, 4, 32)
        q = torch.stack([b & 15, b >> 4], dim=-2).reshape(N, -1, 8, 32).double()
        p = s.long().view(N, -1, 12)
        a, bb, c = p[..., 0:4], p[..., 4:8], p[..., 8:12]
        sc = torch.cat([a & 63, (c & 15) | ((a >> 6) << 4)], dim=-1).double()
        m = torch.cat([bb & 63, (c >> 4) | ((bb >> 6) << 4)], dim=-1).double()
        dd = v.double().view(N, -1, 2)
        wt = (dd[..., 0:1] * sc)[..., None] * q - (dd[..., 1:2] * m)[..., None]
        return wt.float().double().reshape(N, -1)  # one fp32 rounding, as ggml's dequantize
    b = w.long().view(N, -1, 192)
    ql, qh = b[..., :128].view(N, -1, 2, 2, 32), b[..., 128:].view(N, -1, 2, 32)
    q = torch.stack([((ql[:, :, :, gi % 2] >> (4 * (gi // 2))) & 15) | (((qh >> (2 * gi)) & 3) << 4)
                     for gi in range(4)], dim=3)  # [N, nb, half, g, l]: element 128 half + 32 g + l
    q = q.reshape(N, -1, 16, 16).double() - 32
    return (v.double()[:, :, None, None] * s.double().view(N, -1, 16)[..., None] * q).reshape(N, -1)


def dequant(ge, layer, slot, which):
    """(w [N, K] float64, bias [N] or None) of one slot, from the GPU tensors."""
    w = ge.parts[f"{which}_w"][layer, slot]
    dev = w.device
    fmt = matrix_format(ge.formats, which)
    if fmt in GGUF:
        part = ge.parts.get(f"{which}_v")
        return _dequant_gguf(fmt, w, ge.parts[f"{which}_s"][layer, slot],
                             None if part is None else part[layer, slot]), None
    if fmt == "bf16":
        return w.double(), None
    if fmt == "fp8_block":
        s = ge.parts[f"{which}_s"][layer, slot].double()
        v = _e4m3_table(dev)[w.long()]
        N, K = v.shape
        return v * s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K], None
    tab = torch.tensor(_E2M1, dtype=torch.float64, device=dev)
    b = w.long()
    v = torch.stack([tab[b & 15], tab[b >> 4]], dim=-1).reshape(w.shape[0], -1)
    s = ge.parts[f"{which}_s"][layer, slot]
    extra = ge.parts[f"{which}_v"][layer, slot].double()
    if fmt == "mxfp4":
        sc = torch.pow(2.0, torch.clamp(s.double(), max=254) - 127)
        return v * sc.repeat_interleave(32, 1), extra
    sc = _e4m3_table(dev)[s.long()]
    return v * sc.repeat_interleave(16, 1) * extra[:, None], None


def reference(ge, layer, x, slots, w):
    """float64 y [T, H] (before the output's bf16 rounding), silu, router weight on the output."""
    T, K = slots.shape
    I = ge.I  # noqa: E741
    y = torch.zeros((T, ge.H), dtype=torch.float64, device=x.device)
    cache = {}
    xd = x.double()
    for t in range(T):
        for k in range(K):
            s = int(slots[t, k])
            if s < 0:
                continue
            if s not in cache:
                cache[s] = (dequant(ge, layer, s, "gu"), dequant(ge, layer, s, "dn"))
            (gu, gb), (dn, db) = cache[s]
            a = gu @ xd[t]
            if gb is not None:
                a = a + gb
            gate, up = a[:I], a[I:]
            g = (gate / (1 + torch.exp(-gate)) * up).float().bfloat16().double()
            o = dn @ g
            if db is not None:
                o = o + db
            y[t] += float(w[t, k]) * o
    return y


def rel_err(y, ref):
    return float((y.double() - ref).abs().max() / ref.abs().max())
