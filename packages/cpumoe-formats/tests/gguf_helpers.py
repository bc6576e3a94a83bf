"""Shared machinery of the GGUF block formats' tests (test_q8_0.py, test_q4_k.py, test_q5_k.py, test_q6_k.py): one
work item at a time through a kernel's C entry points, its float64 reference, random fp16 scale codes of every kind,
gguf's own dequantizer (the file bytes are the banks, so gguf.quants must read them as we do), and ggml's Q4_K / Q5_K
block search written out line by line."""
from __future__ import annotations

import numpy as np
import pytest

import cpumoe_formats as cf
from cpumoe_formats.numerics import BF16

GGUF_TYPE = {"q8_0": "Q8_0", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}


def gguf_dequantize(fmt: str, rows: np.ndarray) -> np.ndarray:
    """gguf.quants.dequantize of a bank's rows [..., row bytes] (float32 weights, as float64)."""
    gq = pytest.importorskip("gguf.quants")
    import gguf

    return gq.dequantize(np.ascontiguousarray(rows), getattr(gguf.GGMLQuantizationType, GGUF_TYPE[fmt])).astype(
        np.float64)


def bf16(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(BF16)


def kernel_for(fmt: str, E: int, H: int, I: int, mode: str, tier: str, **kw) -> cf.Kernel:  # noqa: E741
    k = cf.Kernel(fmt, E, H, I, mode=mode, isa=tier, **kw)
    assert k.name == tier + ("+w4a8" if mode == "w4a8" else "")
    return k


def prep(kernel: cf.Kernel, v_bf16: np.ndarray) -> np.ndarray:
    """The kernel's prepared activation of a bf16 vector (raw bytes, 0xAB past what prep writes)."""
    K = v_bf16.shape[0]
    src = np.ascontiguousarray(v_bf16)
    n = kernel._k.act_bytes(K)
    dst = cf.aligned_empty((n + 64,), np.uint8)
    dst[...] = 0xAB
    kernel._k.prep_act(src.ctypes.data, K, dst.ctypes.data)
    return dst


def down_rows(kernel: cf.Kernel, banks, e: int, h0: int, h1: int, g_bf16: np.ndarray) -> np.ndarray:
    """One down work item for a single route of weight 1: fp32 dot(down[e, h], g) for h in [h0, h1), as float64."""
    spec = kernel.spec
    arrays, _ = spec.validate(banks)
    act = prep(kernel, g_bf16)
    acc = np.zeros((1, h1 - h0), np.float32)
    kernel._k.down(spec.bank_views(arrays), h0, h1, [(0, e, 1.0, act.ctypes.data)], acc.ctypes.data, h1 - h0)
    return acc[0].astype(np.float64)


def down_routes(kernel: cf.Kernel, banks, e: int, gs_bf16: np.ndarray) -> np.ndarray:
    """One down work item over all rows for n routes of expert e (route j = token j, weight 1): fp32 [n, H]."""
    spec = kernel.spec
    arrays, (_, H, _) = spec.validate(banks)
    acts = [prep(kernel, g) for g in gs_bf16]
    acc = np.zeros((len(acts), H), np.float32)
    kernel._k.down(spec.bank_views(arrays), 0, H, [(j, e, 1.0, a.ctypes.data) for j, a in enumerate(acts)],
                   acc.ctypes.data, H)
    return acc


def gate_up_item(kernel: cf.Kernel, banks, e: int, i0: int, i1: int, xs_bf16: list) -> np.ndarray:
    """One gate_up work item: bf16 g bits [n, I], poisoned (0x7FC1) outside rows [i0, i1)."""
    spec = kernel.spec
    arrays, (_, _, I) = spec.validate(banks)  # noqa: E741
    bufs = [prep(kernel, x) for x in xs_bf16]
    g = cf.aligned_empty((len(bufs), I), np.uint16)
    g[...] = 0x7FC1
    kernel._k.gate_up(spec.bank_views(arrays), e, i0, i1, [b.ctypes.data for b in bufs], [1.0] * len(bufs),
                      [g[j].ctypes.data for j in range(len(bufs))])
    return g


def dot_ref(spec, banks, e: int, h0: int, h1: int, g_bf16: np.ndarray, mode: str):
    """float64 reference of down_rows: (y, sum |w * a| per row)."""
    dn = spec.dequantize(banks)[1][e, h0:h1]
    a = spec.act_in(g_bf16.astype(np.float64), mode)
    return dn @ a, np.abs(dn) @ np.abs(a)


def fp16_bits(rng, kind: str, n: int, scale: float = 0.01) -> np.ndarray:
    """n fp16 codes: 'subnormal' (exponent 0, nonzero, random sign), 'mixed' (normal +-, subnormal, +0, -0),
    'normal' (|v| in [0.5, 1.5) * scale, random sign)."""
    sub = rng.integers(1, 0x400, n)
    sign = rng.integers(0, 2, n) << 15
    normal = np.abs(rng.uniform(0.5, 1.5, n) * scale).astype(np.float16).view(np.uint16)
    if kind == "subnormal":
        return (sub | sign).astype(np.uint16)
    if kind == "normal":
        return (normal | sign).astype(np.uint16)
    pick = rng.integers(0, 5, n)
    bits = np.where(pick == 0, normal, np.where(pick == 1, normal | 0x8000,
                    np.where(pick == 2, sub | sign, np.where(pick == 3, 0, 0x8000))))
    return bits.astype(np.uint16)


def put_fp16(blocks: np.ndarray, off: int, bits: np.ndarray) -> None:
    """Write fp16 codes `bits` (one per block) at byte `off` of every block of blocks [..., nb, block bytes]."""
    blocks[..., off:off + 2] = bits.reshape(blocks.shape[:-1] + (1,)).astype("<u2").view(np.uint8).reshape(
        blocks.shape[:-1] + (2,))


def finite_random_blocks(rng, n: int, block_bytes: int, fp16_offsets) -> np.ndarray:
    """n random blocks (uniform bytes) whose fp16 fields at `fp16_offsets` are finite codes of every kind (normal
    of any exponent, subnormal, +-0): exponent 31 (inf / NaN) replaced."""
    raw = np.frombuffer(rng.bytes(n * block_bytes), np.uint8).copy().reshape(n, block_bytes)
    for off in fp16_offsets:
        bits = raw[:, off:off + 2].copy().view("<u2")[:, 0]
        bad = (bits & 0x7C00) == 0x7C00
        bits = np.where(bad, bits & ~np.uint16(0x4000), bits).astype(np.uint16)  # exponent 31 -> 15
        raw[:, off:off + 2] = bits.astype("<u2").view(np.uint8).reshape(n, 2)
    return raw


def kquant_mag_terms(fmt: str, bank_rows: np.ndarray) -> np.ndarray:
    """float64 [..., K] of q4_k or q5_k rows [..., nb*block bytes]: |d sc q| + |dmin m| per element, the two terms
    each weight is the difference of (the w4a8 kernels fold them separately, so their fp32 error scales with these,
    not with |w|)."""
    from cpumoe_formats.formats import q4_k, q5_k

    mod = {"q4_k": q4_k, "q5_k": q5_k}[fmt]
    b = bank_rows.reshape(bank_rows.shape[:-1] + (-1, mod.BLOCK_BYTES))
    d = np.abs(np.ascontiguousarray(b[..., 0:2]).view("<f2")[..., 0].astype(np.float64))
    dmin = np.abs(np.ascontiguousarray(b[..., 2:4]).view("<f2")[..., 0].astype(np.float64))
    sc, m = q4_k.scales_mins(b[..., 4:16])
    codes = q4_k.nibbles(b[..., 16:]) if fmt == "q4_k" else q5_k.codes(b)
    q = codes.reshape(b.shape[:-1] + (8, 32)).astype(np.float64)
    t = (d[..., None] * sc)[..., None] * q + (dmin[..., None] * m)[..., None]
    return t.reshape(bank_rows.shape[:-1] + (-1,))


# ---- ggml's Q4_K / Q5_K block search, scalar (the quantizers' independent check) -----------------------------------
def qkx2_scalar(x, wts, nmax, rmin, nstep):
    """ggml make_qkx2_quants(32, nmax, x, weights, ..., rmin, 0.1, nstep, false) with numpy float32 scalars, line by
    line."""
    f = np.float32
    n = len(x)
    mn, mx, sum_w, sum_x = x[0], x[0], wts[0], f(wts[0] * x[0])
    for i in range(1, n):
        mn, mx = min(mn, x[i]), max(mx, x[i])
        sum_w = f(sum_w + wts[i])
        sum_x = f(sum_x + f(wts[i] * x[i]))
    if mn > 0:
        mn = f(0)
    if mx == mn:
        return f(0), f(-mn), np.zeros(n, np.uint8)
    iscale = f(f(nmax) / f(mx - mn))
    scale = f(f(1) / iscale)
    L = np.array([min(nmax, max(0, int(np.rint(f(iscale * f(x[i] - mn)))))) for i in range(n)], np.uint8)
    best = f(0)
    for i in range(n):
        d = f(f(f(scale * f(L[i])) + mn) - x[i])
        best = f(best + f(wts[i] * f(d * d)))
    for step in range(nstep + 1):
        isc = f(f(f(f(rmin) + f(f(0.1) * f(step))) + f(nmax)) / f(mx - mn))
        La = np.array([min(nmax, max(0, int(np.rint(f(isc * f(x[i] - mn)))))) for i in range(n)], np.uint8)
        sl = sl2 = sxl = f(0)
        for i in range(n):
            wl = f(wts[i] * f(La[i]))
            sl, sl2, sxl = f(sl + wl), f(sl2 + f(wl * f(La[i]))), f(sxl + f(wl * x[i]))
        D = f(f(sum_w * sl2) - f(sl * sl))
        if D > 0:
            ts = f(f(f(sum_w * sxl) - f(sum_x * sl)) / D)
            tm = f(f(f(sl2 * sum_x) - f(sl * sxl)) / D)
            if tm > 0:
                tm, ts = f(0), f(sxl / sl2)
            cur = f(0)
            for i in range(n):
                d = f(f(f(ts * f(La[i])) + tm) - x[i])
                cur = f(cur + f(wts[i] * f(d * d)))
            if cur < best:
                L, best, scale, mn = La, cur, ts, tm
    return scale, f(-mn), L


def kquant_block_scalar(x, nmax, rmin, nstep):
    """The block search of ggml quantize_row_q4_K_ref (nmax 15, rmin -1, 20 steps) / quantize_row_q5_K_ref (31, -0.5,
    15) for one block of 256 float32, line by line (numpy float32 scalars): (fp16 d, fp16 dmin, sc [8], m [8],
    codes [256])."""
    f = np.float32
    scales, mins, L = np.zeros(8, f), np.zeros(8, f), np.zeros(256, np.uint8)
    max_scale = max_min = f(0)
    for j in range(8):
        xs = x[32 * j:32 * j + 32]
        s2 = f(0)
        for v in xs:
            s2 = f(s2 + f(v * v))
        av = f(np.sqrt(f(s2 / f(32))))
        wts = np.array([f(av + abs(v)) for v in xs], f)
        scales[j], mins[j], L[32 * j:32 * j + 32] = qkx2_scalar(xs, wts, nmax, rmin, nstep)
        max_scale = scales[j] if scales[j] > max_scale else max_scale
        max_min = mins[j] if mins[j] > max_min else max_min
    inv_s = f(f(63) / max_scale) if max_scale > 0 else f(0)
    inv_m = f(f(63) / max_min) if max_min > 0 else f(0)
    ls = np.array([min(63, int(np.rint(f(inv_s * scales[j]))) & 255) for j in range(8)], np.uint8)
    lm = np.array([min(63, int(np.rint(f(inv_m * mins[j]))) & 255) for j in range(8)], np.uint8)
    d16, dm16 = np.float16(f(max_scale / f(63))), np.float16(f(max_min / f(63)))
    for j in range(8):
        d = f(f(d16) * f(ls[j]))
        if d == 0:
            continue
        dm = f(f(dm16) * f(lm[j]))
        for i in range(32):
            L[32 * j + i] = min(nmax, max(0, int(np.rint(f(f(x[32 * j + i] + dm) / d)))))
    return d16, dm16, ls, lm, L
