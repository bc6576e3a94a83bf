"""Decode attention (C ABI 1.11, `cpumoe_attention`): softmax(scale * q k^T, masked) v for a few query tokens over a
bf16 key/value cache, with grouped-query heads (each kv head's `group` query heads read its cache rows once). Only
the positions the mask lets through are read, so a static cache of 4096 positions holding 40 tokens costs 40.
It is what a model's attention runs at decode on the CPU (moe_engine's decode paths); one layer of Qwen3-30B-A3B on
the 2-core Zen 4 VM: 26 us against torch's sdpa's 68 at 34 positions, 27 against 834 on a 4096-position static
cache holding 40 (docs/attention.md).

    att = DecodeAttention()                            # or DecodeAttention(isa="avx2")
    o = att.forward(q, k, v, mask=None, scale=None)    # q [n, Hq, D], k and v [Hkv, L, D] bf16 -> o [n, Hq, D] bf16

Numerics: fp32 dots and sums of the bf16 inputs (a fixed reduction tree: every tier gives the same bits), the
softmax with the row's max subtracted, o rounded once to bf16. NaN and inf follow the float64 reference
(reference.attention); a token whose mask lets no position through gets NaN.
Threads: shareable (the native kernel is stateless; each call has its own scratch); concurrent calls each need
their own `out`. Lifetime: close() (or leaving a `with` block) frees it; later calls raise."""
from __future__ import annotations

import numpy as np

from . import _native
from ._arrays import as_array, check_array, describe
from .kernels import TIERS, NativeHandle, _tier_cap
from .numerics import BF16

# Tiers with a kernel of their own; the others run the highest of these below them.
KERNEL_TIERS = ("scalar", "avx2", "avx512f")


def expected_tier(cap: str) -> str:
    """The tier a DecodeAttention capped at `cap` runs on a CPU that can run `cap`."""
    return max((t for t in KERNEL_TIERS if TIERS.index(t) <= TIERS.index(cap)), key=TIERS.index)


def _rows_last(a: np.ndarray, name: str, ndim: int) -> np.ndarray:
    """a (bf16, ndim axes) with its last axis contiguous and non-negative strides, copied where it is not."""
    if a.ndim != ndim or 0 in a.shape:
        raise ValueError(f"{name}: {describe(a)}; expected {ndim} non-empty axes")
    if a.strides[-1] != 2 or min(a.strides) < 0 or a.ctypes.data % 2:
        a = np.ascontiguousarray(a)
    return a


class DecodeAttention(NativeHandle):
    """Decode attention at one tier (see the module's doc). Threads: shareable (the native kernel is stateless; each
    call has its own scratch); concurrent calls each need their own `out`. Lifetime: close() (or leaving a `with`
    block) frees it; later calls raise RuntimeError."""

    def __init__(self, isa: str | None = None):
        self._k = _native.Attention(_tier_cap(isa))
        self._name, self._tier = self._k.name, TIERS[self._k.tier]

    def __repr__(self) -> str:
        return f"cpumoe_formats.DecodeAttention({self._name}{', closed' if self._k.closed else ''})"

    def forward(self, q, k, v, mask=None, scale: float | None = None, out=None) -> np.ndarray:
        """o [n, Hq, D] bf16. q [n, Hq, D], k and v [Hkv, L, D]: bfloat16, the last axis contiguous (other strides
        free; a copy is made otherwise); Hq a multiple of Hkv. mask: None (every position) or bool [n, L] (True:
        attend). scale: the scores' factor (default 1/sqrt(D)). out: None or a writable bf16 [n, Hq, D] array with
        a contiguous last axis."""
        if self._k.closed:
            raise RuntimeError(f"{self!r} is closed; create a new DecodeAttention")
        arrs = {}
        for name, a, nd in (("q", q, 3), ("k", k, 3), ("v", v, 3)):
            a = as_array(a, name)
            if a.dtype != BF16:
                raise ValueError(f"{name}: {describe(a)}; expected bfloat16")
            arrs[name] = _rows_last(a, name, nd)
        qa, ka, va = arrs["q"], arrs["k"], arrs["v"]
        n, Hq, D = qa.shape
        Hkv, L, Dk = ka.shape
        if Dk != D or va.shape != ka.shape:
            raise ValueError(f"k: {describe(ka)}, v: {describe(va)}; expected both [Hkv, L, {D}] (D = q's last axis)")
        if Hq % Hkv:
            raise ValueError(f"q has {Hq} heads and k {Hkv}: expected a multiple (grouped-query attention)")
        m = None
        if mask is not None:
            m = as_array(mask, "mask")
            if m.dtype != np.bool_ or m.shape != (n, L):
                raise ValueError(f"mask: {describe(m)}; expected bool [{n}, {L}] (True: attend) or None")
            m = np.ascontiguousarray(m)
        if scale is None:
            scale = 1.0 / float(np.sqrt(D))
        if not isinstance(scale, (int, float)) or not np.isfinite(scale):
            raise ValueError(f"scale={scale!r}; expected a finite number")
        if out is None:
            out = np.empty((n, Hq, D), BF16)
        else:
            out = check_array(out, "out", dtype=BF16, shape=(n, Hq, D), writable=True, contiguous=False)
            if out.strides[-1] != 2 or min(out.strides) < 0:
                raise ValueError(f"out: strides {out.strides}; expected a contiguous last axis")
        e = 2  # element strides
        self.run_raw(n, Hq // Hkv, D, L, Hkv, qa.ctypes.data, qa.strides[0] // e, qa.strides[1] // e,
                    ka.ctypes.data, ka.strides[0] // e, ka.strides[1] // e, va.ctypes.data, va.strides[0] // e,
                    va.strides[1] // e, 0 if m is None else m.ctypes.data, L, float(scale), out.ctypes.data,
                    out.strides[0] // e, out.strides[1] // e)
        return out

    def run_raw(self, n: int, group: int, D: int, L: int, Hkv: int, q: int, q_tok: int, q_head: int, k: int,
                k_head: int, k_pos: int, v: int, v_head: int, v_pos: int, mask: int, mask_tok: int, scale: float,
                o: int, o_tok: int, o_head: int) -> None:
        """The kernel on raw addresses and element strides (abi.h cpumoe_attention_args; mask 0 = none), for a
        caller that holds the arrays and has checked their dtypes and extents (moe_engine.attention passes torch
        tensors' data_ptr() here: every attribute read costs microseconds at decode). Sizes and strides are
        checked for sign only; an address that does not hold what the sizes say is undefined behaviour."""
        self._k.run(n, group, D, L, Hkv, q, q_tok, q_head, k, k_head, k_pos, v, v_head, v_pos, mask, mask_tok,
                    float(scale), o, o_tok, o_head)
