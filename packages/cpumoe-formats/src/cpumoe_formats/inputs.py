"""Validation of a step's inputs (x, router weights, expert ids), shared by the
kernels' entry and the reference."""
from __future__ import annotations

import numpy as np

from ._arrays import as_array, as_input, describe
from .numerics import BF16, bf16_decode

MAX_TOP_K = 64
_FLOAT_X = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64))


def check_x(x, H: int) -> np.ndarray:
    """x [T, H] as float64 values (bf16 arrays decoded exactly)."""
    a = as_array(x, "x")
    if a.ndim != 2 or a.shape[1] != H:
        raise ValueError(f"x: {describe(a)}, expected shape [num_tokens, {H}]")
    if a.dtype == BF16:
        return bf16_decode(a)
    if a.dtype not in _FLOAT_X:
        raise TypeError(f"x: dtype {a.dtype}, expected bfloat16, float16, float32 or float64")
    return a.astype(np.float64)


def x_as_bf16(x, H: int) -> np.ndarray:
    """x [T, H] as a C-contiguous, aligned bf16 array (a copy only when needed)."""
    a = as_array(x, "x")
    if a.ndim != 2 or a.shape[1] != H:
        raise ValueError(f"x: {describe(a)}, expected shape [num_tokens, {H}]")
    if a.dtype != BF16:
        if a.dtype not in _FLOAT_X:
            raise TypeError(f"x: dtype {a.dtype}, expected bfloat16, float16, float32 or float64")
        a = a.astype(np.float32).astype(BF16)
    return as_input(a, "x", BF16, a.shape)


def check_routing(topk_weights, topk_ids, T: int, E: int) -> tuple[np.ndarray, np.ndarray]:
    """(weights float32 [T, top_k] C-contiguous, ids int32 [T, top_k] C-contiguous)."""
    w = as_array(topk_weights, "topk_weights")
    ids = as_array(topk_ids, "topk_ids")
    if ids.ndim != 2 or ids.shape[0] != T:
        raise ValueError(f"topk_ids: {describe(ids)}, expected shape [{T}, top_k]")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"topk_ids: dtype {ids.dtype}, expected an integer dtype (int32)")
    if w.shape != ids.shape:
        raise ValueError(f"topk_weights: {describe(w)}, expected shape {tuple(ids.shape)} like topk_ids")
    if w.dtype not in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64), BF16):
        raise TypeError(f"topk_weights: dtype {w.dtype}, expected float32")
    top_k = ids.shape[1]
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k={top_k} must be in [1, {MAX_TOP_K}]")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < -1 or hi >= E:
            bad = np.argwhere((ids < -1) | (ids >= E))[0]
            raise ValueError(f"topk_ids[{bad[0]}, {bad[1]}] = {int(ids[tuple(bad)])} is not in [-1, {E}) "
                             f"(-1 marks a route not on the CPU)")
    return as_input(w, "topk_weights", np.float32), as_input(ids, "topk_ids", np.int32)
