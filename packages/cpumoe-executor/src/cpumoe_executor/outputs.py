"""The check every `out=` buffer passes before a native call writes into it."""
from __future__ import annotations

import numpy as np

from cpumoe_formats._arrays import as_array, describe
from cpumoe_formats.numerics import BF16


def check_out(out, shape: tuple, dtype=BF16, name: str = "out") -> np.ndarray:
    """`out` (a numpy array or CPU torch tensor) as the numpy array native code may write `shape` values of
    `dtype` into, else ValueError naming `name`, what it is and what was expected: the dtype and shape, C-contiguity,
    writability (a read-only array, e.g. over a bytes object or a PROT_READ mapping, is never written through) and
    alignment to the item size (the kernels store whole items). Wording as cpumoe_formats' check_array. A pure
    function."""
    a = as_array(out, name)
    f = a.flags
    if a.dtype == dtype and a.shape == shape and f.writeable and f.c_contiguous and f.aligned:
        return a  # the per-step path: no message is built (that took 3 us a call)
    dtype, shape = np.dtype(dtype), tuple(int(n) for n in shape)
    want = f"expected C-contiguous {dtype} of shape {shape}, writable, data {dtype.itemsize}-byte aligned"
    if a.dtype != dtype or a.shape != shape:
        problem = describe(a)
    elif not f.c_contiguous:
        problem = f"{describe(a)} with strides {a.strides} (not C-contiguous)"
    elif not f.writeable:
        problem = f"{describe(a)}, read-only"
    else:
        problem = f"{describe(a)} at address {a.ctypes.data:#x} (not {dtype.itemsize}-byte aligned)"
    raise ValueError(f"{name}: {problem}; {want}")
