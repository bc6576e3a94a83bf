"""Shared machinery of the GGUF block formats' tests (test_q8_0.py, test_q4_k.py, test_q6_k.py): one work item at a
time through a kernel's C entry points, its float64 reference, random fp16 scale codes of every kind, and gguf's own
dequantizer (the file bytes are the banks, so gguf.quants must read them as we do)."""
from __future__ import annotations

import numpy as np
import pytest

import cpumoe_formats as cf
from cpumoe_formats.numerics import BF16

GGUF_TYPE = {"q8_0": "Q8_0", "q4_k": "Q4_K", "q6_k": "Q6_K"}


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


def q4_k_mag_terms(bank_rows: np.ndarray) -> np.ndarray:
    """float64 [..., K] of q4_k rows [..., nb*144]: |d sc q| + |dmin m| per element, the two terms each weight is the
    difference of (the w4a8 kernels fold them separately, so their fp32 error scales with these, not with |w|)."""
    from cpumoe_formats.formats import q4_k

    b = bank_rows.reshape(bank_rows.shape[:-1] + (-1, q4_k.BLOCK_BYTES))
    d = np.abs(np.ascontiguousarray(b[..., 0:2]).view("<f2")[..., 0].astype(np.float64))
    dmin = np.abs(np.ascontiguousarray(b[..., 2:4]).view("<f2")[..., 0].astype(np.float64))
    sc, m = q4_k.scales_mins(b[..., 4:16])
    q = q4_k.nibbles(b[..., 16:]).reshape(b.shape[:-1] + (8, 32)).astype(np.float64)
    t = (d[..., None] * sc)[..., None] * q + (dmin[..., None] * m)[..., None]
    return t.reshape(bank_rows.shape[:-1] + (-1,))
