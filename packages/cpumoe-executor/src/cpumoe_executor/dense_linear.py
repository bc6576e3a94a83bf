"""CpuMoeExecutor.linear's two call paths into the native executor's dense bf16 linear (cpumoe-formats C ABI 1.9):
CPU bf16 torch tensors checked and passed in place (a model's case, where every attribute read costs microseconds),
and anything else converted or refused with an error naming the argument. `xn` is the executor's native object;
its linear() runs under the step lock on the executor's threads. Threads: the executor's decode contract."""
from __future__ import annotations

import numpy as np

from cpumoe_formats.arrays import as_array, check_array, describe
from cpumoe_formats.linear import OUT_DTYPES, check_out_rows, weight_rows
from cpumoe_formats.numerics import BF16


def run_torch(xn, torch, x, w, bias):
    """y [..., M] (a new bf16 tensor) for CPU bf16 tensors that need no conversion; None for anything else (the
    general path then converts it or names what is wrong). A few attribute reads and ops: cold caches between a
    model's layers make each cost microseconds."""
    bf = torch.bfloat16
    if x.dtype is not bf or w.dtype is not bf or w.dim() != 2 or not x.is_cpu or not w.is_cpu:
        return None
    M, K = w.shape
    if x.dim() == 2:  # rows may be strided
        n, xs = x.shape[0], x.stride(0)
        if x.shape[1] != K or x.stride(1) != 1 or (n > 1 and xs < K):
            return None
    elif x.dim() > 2 and x.shape[-1] == K and x.is_contiguous():
        n, xs = x.numel() // max(K, 1), K
    else:
        return None
    if n < 1 or M < 1 or K < 1 or w.stride(1) != 1 or (M > 1 and w.stride(0) < K):
        return None
    bp = 0
    if bias is not None:
        if bias.dtype is not bf or bias.shape != (M,) or not bias.is_cpu or not bias.is_contiguous():
            return None
        bp = bias.data_ptr()
    y = torch.empty((*x.shape[:-1], M), dtype=bf)
    xn.linear(w.data_ptr(), 2 * w.stride(0), M, K, n, x.data_ptr(), 2 * xs, bp, y.data_ptr(), 2 * M, False)
    return y


def run_general(xn, x, weight, bias, out):
    """y for numpy arrays or tensors of any layout: x [..., K] bf16 (copied where its rows are not contiguous),
    out None (a new bf16 array; a bf16 tensor where x was a tensor) or a writable bf16 / float32 array."""
    torch_in = str(getattr(x, "dtype", "")).startswith("torch.")
    w, w_stride = weight_rows(weight)
    M, K = w.shape
    xa = as_array(x, "x")
    lead = xa.shape[:-1]
    if xa.ndim < 2 or xa.shape[-1] != K or xa.size == 0:
        raise ValueError(f"x: {describe(xa)}; expected [n, {K}] (or [..., {K}]) with n >= 1 (K = weight's "
                         "in_features)")
    if xa.dtype != BF16:
        raise ValueError(f"x: {describe(xa)}; expected bfloat16 (convert it first: the linear reads bf16)")
    if xa.ndim > 2:
        xa = np.ascontiguousarray(xa).reshape(-1, K)
    if xa.strides[1] != 2 or (xa.shape[0] > 1 and xa.strides[0] < 2 * K) or xa.ctypes.data % 2:
        xa = np.ascontiguousarray(xa)
    n = xa.shape[0]
    bp = 0 if bias is None else check_array(bias, "bias", dtype=BF16, shape=(M,)).ctypes.data
    if out is None:
        out = np.empty((*lead, M), BF16)
    else:
        out = check_out_rows(check_array(out, "out", dtype=tuple(OUT_DTYPES.values()), shape=(*lead, M),
                                         writable=True, contiguous=len(lead) > 1))
    o2 = out.reshape(n, M)  # a view: out's rows are contiguous
    xn.linear(w.ctypes.data, w_stride, M, K, n, xa.ctypes.data, int(xa.strides[0]), bp, o2.ctypes.data,
              int(o2.strides[0]), out.dtype != BF16)
    if torch_in and out.dtype == BF16:
        import torch

        return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
    return out
