"""Array intake: numpy arrays, or anything torch-like, by duck typing (no torch import)."""
from __future__ import annotations

import mmap

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


def check_array(a, name: str, *, dtype=None, shape=None, writable: bool = False, contiguous: bool = True,
                align: int | None = None) -> np.ndarray:
    """`a` as a numpy array (as_array) that a native call may use as is, else ValueError naming `name`, what it
    is and everything expected of it. The one check every entry point applies to its arrays before a pointer goes to
    native code: dtype (one or a tuple of them), shape (None = any), C-contiguity (`contiguous`), writability
    (`writable`: out arrays; a read-only view of bytes or of a PROT_READ mapping would be written through), and
    base alignment (`align` bytes; default the dtype's own, as numpy's `aligned` flag).
    Threads: any; it only reads `a`'s metadata."""
    if type(a) is not np.ndarray:
        a = as_array(a, name)
    f = a.flags
    ok_dtype = dtype is None or (a.dtype in dtype if isinstance(dtype, tuple) else a.dtype == dtype)
    ok_shape = shape is None or a.shape == tuple(shape)
    aligned = f.aligned if align is None else a.ctypes.data % align == 0
    if (ok_dtype and ok_shape and (f.c_contiguous or not contiguous) and (f.writeable or not writable)
            and (aligned or not a.size)):
        return a
    dtypes = None if dtype is None else tuple(np.dtype(d) for d in (dtype if isinstance(dtype, tuple) else (dtype,)))
    want_align = align if align is not None else (dtypes[0].itemsize if dtypes else a.dtype.itemsize)
    want = " ".join(w for w in ("C-contiguous" if contiguous else "", " or ".join(str(d) for d in dtypes)
                                if dtypes else "array", f"of shape {tuple(shape)}" if shape is not None else "") if w)
    want += f"{', writable' if writable else ''}, data {want_align}-byte aligned"
    got = f"{describe(a)}"
    if not ok_dtype or not ok_shape:
        problem = got
    elif contiguous and not f.c_contiguous:
        problem = f"{got} with strides {a.strides} (not C-contiguous)"
    elif writable and not f.writeable:
        problem = f"{got}, read-only"
    else:
        problem = f"{got} at address {a.ctypes.data:#x} (not {want_align}-byte aligned)"
    raise ValueError(f"{name}: {problem}; expected {want}")


def as_input(a, name: str, dtype, shape=None) -> np.ndarray:
    """An input array for a native call: `a` converted to `dtype`, C-contiguous and aligned (a copy only when it is
    not already), checked by check_array."""
    arr = np.ascontiguousarray(as_array(a, name), dtype)
    if not arr.flags.aligned:
        arr = arr.copy()  # a fresh allocation is aligned
    return check_array(arr, name, dtype=dtype, shape=shape)


PAGE = mmap.PAGESIZE
PAGE_OWNED_MIN = 64 << 10  # bytes: from here an array gets whole pages of its own (at most 8 KiB, 12.5%, more)


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary (a view of a larger numpy
    array, which it keeps alive). With align >= PAGE, or from PAGE_OWNED_MIN bytes, it starts on a page and no other
    allocation shares its last page: a bank page-locked for a GPU then takes no other object into its registration
    (the CUDA runtime refuses a copy of memory that starts in a registered page and runs past it). Threads: any."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    slack = 0
    if n >= PAGE_OWNED_MIN or align >= PAGE:
        align, slack = max(align, PAGE), PAGE
    raw = np.empty(n + align + slack, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dtype).reshape(shape)


def aligned_copy(a: np.ndarray, align: int = 64) -> np.ndarray:
    """A copy of `a` by aligned_empty. Threads: any (`a` must not change meanwhile)."""
    out = aligned_empty(a.shape, a.dtype, align)
    out[...] = a
    return out




def usable_cpus() -> int:
    """CPUs this process may run on (its affinity), at least 1."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def split_experts(fn, banks, threads: int | None = None) -> dict:
    """fn(banks) -> dict of arrays, run on `threads` slices of the experts at once (default: usable_cpus()) and
    joined along the first axis into 64-byte aligned arrays. Every bank's and every result's first axis must be
    the expert (banks that do not share one run fn whole). fn's numpy copies release the GIL, so threads scale."""
    from concurrent.futures import ThreadPoolExecutor

    arrays = {k: as_array(v, k) for k, v in banks.items()}
    E = {a.shape[0] if a.ndim else -1 for a in arrays.values()}
    n = min(threads or usable_cpus(), next(iter(E)) if len(E) == 1 else 1)
    if n <= 1:
        return fn(banks)
    E = E.pop()
    cut = [E * i // n for i in range(n + 1)]
    with ThreadPoolExecutor(n, thread_name_prefix="cpumoe-repack") as ex:
        parts = list(ex.map(lambda i: fn({k: a[cut[i]:cut[i + 1]] for k, a in arrays.items()}), range(n)))
        out = {k: aligned_empty((E, *v.shape[1:]), v.dtype) for k, v in parts[0].items()}

        def put(i):
            for k, v in out.items():
                v[cut[i]:cut[i + 1]] = parts[i][k]

        list(ex.map(put, range(n)))
    return out
