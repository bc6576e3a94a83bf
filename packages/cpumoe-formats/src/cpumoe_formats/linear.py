"""The dense bf16 linear (C ABI 1.9, `cpumoe_linear`): y = x @ weight.T (+ bias) for a row-major bf16 weight
[M, K] and a few tokens x [n, K], by the bf16 expert kernels' row dots at the best tier <= the cap (isa= or
CPUMOE_ISA). It is what a model's non-expert projections (attention, routers, the LM head) run at decode on the CPU;
cpumoe_executor.CpuMoeExecutor.linear runs it on the executor's threads, this class on the calling thread (tests,
tools). fp32 accumulation, output bf16 (rounded to nearest even) or float32; NaN and inf propagate as the float64
reference (`reference.linear`) says, except that the avx512bf16 tier reads subnormal bf16 values as zero.

    lin = Linear()                                # or Linear(isa="avx2")
    y = lin.forward(x, weight, bias=None)         # x [n, K] bf16, weight [M, K] bf16 -> y [n, M] bf16
"""
from __future__ import annotations

import numpy as np

from . import _native
from ._arrays import as_array, check_array, describe
from .kernels import TIERS, NativeHandle, _tier_cap
from .numerics import BF16

OUT_DTYPES = {"bfloat16": BF16, "float32": np.dtype(np.float32)}
# Tiers with a linear kernel of their own; the others run the highest of these below them.
KERNEL_TIERS = ("scalar", "avx2", "avx512f", "avx512bf16")


def expected_tier(cap: str) -> str:
    """The tier a Linear capped at `cap` runs on a CPU that can run `cap`: the highest of KERNEL_TIERS <= cap."""
    return max((t for t in KERNEL_TIERS if TIERS.index(t) <= TIERS.index(cap)), key=TIERS.index)


def weight_rows(weight, name: str = "weight") -> tuple[np.ndarray, int]:
    """(bf16 [M, K] array, its row stride in bytes): rows may be strided (a slice of a wider matrix), each row
    contiguous and 2-byte aligned. ValueError naming what is wrong otherwise."""
    w = as_array(weight, name)
    if w.dtype != BF16 or w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"{name}: {describe(w)}; expected a non-empty bfloat16 matrix [M, K] (out_features, "
                         "in_features)")
    if w.strides[1] != 2 or w.strides[0] < 2 * w.shape[1] or w.ctypes.data % 2:
        raise ValueError(f"{name}: strides {w.strides} at {w.ctypes.data:#x}; expected contiguous rows (stride 2 "
                         "bytes along K, rows not overlapping), 2-byte aligned")
    return w, int(w.strides[0])


def check_out_rows(out: np.ndarray) -> np.ndarray:
    """out (already checked for dtype, shape and writability) with each row contiguous: the kernel writes a row of
    M outputs at a time, rows at out.strides[0]. ValueError otherwise."""
    n, M = (int(np.prod(out.shape[:-1])), out.shape[-1]) if out.ndim else (0, 0)
    if n and (out.strides[-1] != out.itemsize or (n > 1 and out.strides[0] < M * out.itemsize)):
        raise ValueError(f"out: strides {out.strides}; expected contiguous rows")
    return out


class Linear(NativeHandle):
    """The dense bf16 linear at one tier. Threads: shareable (the native kernel is stateless; each call prepares x
    on its own); concurrent calls each need their own `out` (an out overlapping memory another call in flight reads
    or writes raises RuntimeError). Lifetime: close() (or leaving a `with` block) frees it; later calls raise."""

    def __init__(self, isa: str | None = None):
        self._k = _native.Linear(_tier_cap(isa))
        self._name, self._tier = self._k.name, TIERS[self._k.tier]

    def __repr__(self) -> str:
        return f"cpumoe_formats.Linear({self._name}{', closed' if self._k.closed else ''})"

    def forward(self, x, weight, bias=None, out=None, *, out_dtype: str = "bfloat16", rows=None) -> np.ndarray:
        """y [n, M] = x @ weight.T (+ bias), single-threaded.

        x [n, K]: bfloat16 (float16 / float32 / float64 are rounded to bf16 first), rows contiguous. weight [M, K]
        bfloat16, rows contiguous (a row stride is allowed). bias: None or bfloat16 [M]. out: None or a writable
        [n, M] array of out_dtype ('bfloat16' or 'float32'), rows contiguous. rows=(r0, r1): compute only output
        columns r0..r1-1 (the others of `out` are left as they are)."""
        if self._k.closed:
            raise RuntimeError(f"{self!r} is closed; create a new Linear")
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype={out_dtype!r}; expected one of {list(OUT_DTYPES)}")
        w, w_stride = weight_rows(weight)
        M, K = w.shape
        xa = as_array(x, "x")
        if xa.ndim != 2 or xa.shape[1] != K:
            raise ValueError(f"x: {describe(xa)}; expected [n, {K}] (K = weight's in_features)")
        if xa.dtype != BF16:
            if xa.dtype not in (np.float16, np.float32, np.float64):
                raise TypeError(f"x: dtype {xa.dtype}; expected bfloat16, float16, float32 or float64")
            xa = xa.astype(np.float32).astype(BF16)
        xa = np.ascontiguousarray(xa)
        n = xa.shape[0]
        b = None
        if bias is not None:
            b = check_array(bias, "bias", dtype=BF16, shape=(M,))
        dt = OUT_DTYPES[out_dtype]
        if out is None:
            out = np.zeros((n, M), dt)
        else:
            out = check_out_rows(check_array(out, "out", dtype=dt, shape=(n, M), writable=True, contiguous=False))
        r0, r1 = (0, M) if rows is None else rows
        if not (isinstance(r0, int) and isinstance(r1, int) and 0 <= r0 < r1 <= M):
            raise ValueError(f"rows={rows!r}; expected (r0, r1) with 0 <= r0 < r1 <= {M}")
        if n:
            self._k.rows(w.ctypes.data, w_stride, K, M, r0, r1, n, xa.ctypes.data, int(xa.strides[0]),
                         0 if b is None else b.ctypes.data, out.ctypes.data, int(out.strides[0]), dt != BF16)
        return out
