"""The check every `out=` buffer passes before a native call writes into it."""
from __future__ import annotations

import numpy as np

from cpumoe_formats._arrays import as_array
from cpumoe_formats.numerics import BF16


def check_out(out, shape: tuple, dtype=BF16, name: str = "out") -> np.ndarray:
    """`out` (a numpy array or CPU torch tensor) as the numpy array native code may write `shape` values of
    `dtype` into: the dtype (TypeError), then the shape, writability (a read-only array, e.g. over a bytes object
    or a PROT_READ mapping, is never written through), C-contiguity and alignment to the item size (the kernels
    store whole items) (ValueError). Each error names `name` and what was expected. A pure function."""
    a = as_array(out, name)
    f = a.flags
    if a.dtype == dtype and a.shape == shape and f.writeable and f.c_contiguous and f.aligned:
        return a  # the per-step path: no message is built (that took 3 us a call)
    dtype, shape = np.dtype(dtype), tuple(int(n) for n in shape)
    want = f"expected a writable, aligned, C-contiguous {dtype} array of shape {shape}"
    if a.dtype != dtype:
        raise TypeError(f"{name}: dtype {a.dtype}, {want}")
    if a.shape != shape:
        raise ValueError(f"{name}: shape {a.shape}, {want}")
    if not a.flags.writeable:
        raise ValueError(f"{name}: a read-only array, {want}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: strides {a.strides} (not C-contiguous), {want}")
    if not a.flags.aligned:
        raise ValueError(f"{name}: data at {a.ctypes.data:#x}, not aligned to its {dtype.itemsize}-byte items, {want}")
    return a
