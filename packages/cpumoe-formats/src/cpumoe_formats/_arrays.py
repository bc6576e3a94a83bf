"""Array intake: numpy arrays, or anything torch-like, by duck typing (no torch import)."""
from __future__ import annotations

import numpy as np

from .numerics import BF16, E4M3, E8M0

_TORCH_DTYPES = {
    "torch.bfloat16": (np.uint16, BF16), "torch.float16": (np.float16, None), "torch.float32": (np.float32, None),
    "torch.float64": (np.float64, None), "torch.int32": (np.int32, None), "torch.int64": (np.int64, None),
    "torch.int16": (np.int16, None), "torch.uint8": (np.uint8, None), "torch.int8": (np.int8, None),
    "torch.float8_e4m3fn": (np.uint8, E4M3), "torch.float8_e8m0fnu": (np.uint8, E8M0),
    "torch.uint16": (np.uint16, None),
}


def as_array(a, name: str) -> np.ndarray:
    """A host numpy view of `a` (zero-copy for numpy and CPU torch tensors)."""
    if isinstance(a, np.ndarray):
        return a
    dt = str(getattr(a, "dtype", ""))
    if dt.startswith("torch."):
        if getattr(getattr(a, "device", None), "type", "cpu") != "cpu":
            raise ValueError(f"{name} must be a host (CPU) tensor, got device {a.device}")
        if dt not in _TORCH_DTYPES:
            raise TypeError(f"{name} has unsupported dtype {dt}")
        raw, view = _TORCH_DTYPES[dt]
        import torch  # only reached when given a torch tensor

        t = a.detach()
        if raw is np.uint16 and dt == "torch.bfloat16":
            t = t.view(torch.int16)
        elif raw is np.uint8 and dt.startswith("torch.float8"):
            t = t.view(torch.uint8)
        arr = t.numpy()
        if raw is np.uint16:
            arr = arr.view(np.uint16)
        return arr.view(view) if view is not None else arr
    raise TypeError(f"{name} must be a numpy array or a CPU torch tensor, got {type(a).__name__}")


def describe(a: np.ndarray) -> str:
    return f"shape {tuple(a.shape)} dtype {a.dtype}"


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dtype).reshape(shape)


def aligned_copy(a: np.ndarray, align: int = 64) -> np.ndarray:
    out = aligned_empty(a.shape, a.dtype, align)
    out[...] = a
    return out


