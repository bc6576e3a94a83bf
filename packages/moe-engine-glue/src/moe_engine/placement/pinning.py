"""Page-locked host banks: the runner's host banks registered with the CUDA runtime (cudaHostRegister, mapped and
portable) in place, layer by layer while a byte budget lasts, so that expert copies to the GPU run asynchronously at
link speed (pageable memory staged prefill at 4-6 GB/s, docs/moe-engine.md) and GPU kernels can read them directly
(zero-copy.py: a device pointer to registered host memory is the host pointer under unified addressing).

The runtime refuses (cudaErrorInvalidValue) an asynchronous copy of host memory that starts in a registered page and
runs past the registration, so no other allocation may share a registered page: a torch tensor allocated on the heap
beside a small bank array failed its next copy to the GPU (the H100 profile bench, fp8_block's scales). An array
whose pages are not wholly its own is therefore copied to pages of its own first (`banks`: the banks as registered;
the executor's layouts from cpumoe_formats.aligned_empty and numpy's large, mmap-backed arrays are used in place).

When registration fails (the OS refuses to lock more memory, a range already registered, no GPU), that layer and
those after it stay pageable: copies are synchronous and the miss split leaves the layer's misses to the CPU. One
warning says how much was pinned and why the rest was not; nothing else changes.

Thread contract: owned by its MoERunner; built at start-up, close() at its close."""
from __future__ import annotations

import logging
import os
import platform

import numpy as np

from cpumoe_formats import aligned_copy

log = logging.getLogger("moe_engine")
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
REGISTER_FLAGS = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
_LIBC = platform.libc_ver()[0]
DEFAULT_FRACTION = 0.5  # of MemAvailable: page-locking the rest could starve the OS and the page cache


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _mmapped_chunk(p: int) -> tuple[int, int] | None:
    """[start, end) of the anonymous mapping glibc's malloc made for the allocation at `p` alone (its chunk header:
    size at p - 8 with bit 2 IS_MMAPPED, the alignment offset at p - 16), or None. Read only where p - 16 lies in
    p's own page, which is mapped."""
    if _LIBC != "glibc" or p % PAGE < 16:
        return None
    import ctypes

    size = ctypes.c_size_t.from_address(p - 8).value
    if not size & 2:
        return None
    lead = ctypes.c_size_t.from_address(p - 16).value
    return p - 16 - lead, p - 16 + (size & ~7)


def _handler(a) -> str | None:
    try:
        from numpy._core.multiarray import get_handler_name
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import get_handler_name
    return get_handler_name(a)


def _allocation(root: np.ndarray) -> tuple[int, int, bool] | None:
    """The allocation under a base array: (address, bytes, whether malloc made it), or None where unknown."""
    if root.flags.owndata:
        return root.ctypes.data, root.nbytes, _handler(root) == "default_allocator"
    base = root.base
    if hasattr(base, "untyped_storage"):  # a CPU torch tensor's .numpy(): its storage (posix_memalign'd)
        st = base.untyped_storage()
        return st.data_ptr(), st.nbytes(), base.device.type == "cpu" and not base.is_pinned()
    return None


def owns_pages(a) -> bool:
    """True when every page `a` touches holds only `a`'s allocation (so registering them takes in no other object):
    the allocation covers them, or glibc mapped it alone (numpy's and torch's large arrays)."""
    import mmap

    a = np.asarray(a)
    s, e = _page_range(a)
    root = _root(a)
    if isinstance(root.base, mmap.mmap):
        return True  # a mapping is whole pages; its other views are the caller's
    alloc = _allocation(root)
    if alloc is None:
        return False
    p, n, malloced = alloc
    if p <= s and e <= p + n:
        return True
    chunk = _mmapped_chunk(p) if malloced else None
    return chunk is not None and chunk[0] <= s and e <= chunk[1]


def own_pages(layer: dict) -> tuple[dict, int]:
    """The layer with each array whose pages are not wholly its own copied to ones that are; bytes copied."""
    out, copied = dict(layer), 0
    for name, a in layer.items():
        a = np.asarray(a)
        if a.nbytes and not owns_pages(a):
            out[name] = aligned_copy(a, PAGE)
            copied += a.nbytes
    return out, copied


def _ranges(layer: dict) -> list[tuple[int, int]]:
    """The layer's arrays as page-rounded [start, end) address ranges, merged where they share pages."""
    return _merge(_page_range(a) for a in layer.values() if np.asarray(a).nbytes)


def _page_range(a) -> tuple[int, int]:
    a = np.asarray(a)
    p = a.__array_interface__["data"][0]
    return p - p % PAGE, -(-(p + a.nbytes) // PAGE) * PAGE


def _merge(ranges) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(ranges):
        if out and s < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def spans(banks) -> tuple[list[tuple[int, int]], list[set[int]]]:
    """The registration units: every array of every layer page-rounded, merged wherever two share a page, across
    layers too; and per layer the units its arrays lie in. Each array lies inside one unit, so it is either wholly
    inside one registration or outside all: the CUDA runtime refuses (cudaErrorInvalidValue) an asynchronous copy
    whose host range runs over the end of the registration its start lies in, which per-layer ranges trimmed where
    two layers share a page produced (small arrays packed on the heap; hybrid's set_residency copies failed)."""
    owned = [(r, li) for li, layer in enumerate(banks) for a in layer.values() if np.asarray(a).nbytes
             for r in [_page_range(a)]]
    units = _merge(r for r, _ in owned)
    starts = [s for s, _ in units]
    of_layer: list[set[int]] = [set() for _ in banks]
    for (s, _e), li in owned:
        of_layer[li].add(int(np.searchsorted(starts, s, side="right")) - 1)
    return units, of_layer


def _name(rt, ret) -> str:
    try:
        return str(rt.cudaGetErrorString(ret))
    except Exception:  # noqa: BLE001 - only the message is lost
        return f"error {int(ret)}"


def _clear_last_error(rt) -> None:
    """Reset the runtime's last error after a failed registration (not sticky, but reported by the next
    cudaGetLastError, which torch calls after its kernel launches)."""
    f = getattr(rt, "cudaGetLastError", None)
    if f is not None:
        f()
        return
    import ctypes

    for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def _spans_text(layers: list[int]) -> str:
    """[2, 3, 4, 7] -> '2..4, 7'."""
    out, i = [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        out.append(f"{layers[i]}" if i == j else f"{layers[i]}..{layers[j]}")
        i = j + 1
    return ", ".join(out)


def _cudart():
    import torch

    return torch.cuda.cudart()


class PinnedBanks:
    """Registers `banks` (one dict of numpy arrays per layer) in place, each array that shares a page with other
    memory copied first: `banks` is then the layers as registered, which the GPU's copies and reads must use.
    pinned[layer]: True when every array of the layer is registered. copied: bytes copied to pages of their own.
    budget: bytes to lock (None: half of MemAvailable; 0 or False: none)."""

    def __init__(self, banks, device, budget=None, *, runtime=None):
        self.pinned = [False] * len(banks)
        self.banks = list(banks)
        self._done: list[int] = []
        self.bytes = self.copied = 0
        self.why = ""
        if budget is False or budget == 0:
            self.why = "pin_memory=0: host banks left pageable"
            return
        if getattr(device, "type", str(device)) != "cuda" and runtime is None:
            self.why = "no GPU: nothing to pin for"
            return
        if budget is None:
            avail = mem_available()
            budget = int(DEFAULT_FRACTION * avail) if avail else 0
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"pin_memory={budget!r}: expected bytes to page-lock (an int >= 0), None or False")
        self._rt = runtime or _cudart()
        for li, layer in enumerate(banks):
            self.banks[li], n = own_pages(layer)
            self.copied += n
        banks = self.banks
        units, of_layer = spans(banks)
        done: set[int] = set()
        for li in range(len(banks)):
            todo = sorted(of_layer[li] - done)
            need = sum(units[u][1] - units[u][0] for u in todo)
            if self.bytes + need > budget:
                self.why = f"the pin budget of {budget / 2**30:.1f} GiB is spent"
                break
            failed = False
            for u in todo:
                s, e = units[u]
                ret = self._rt.cudaHostRegister(s, e - s, REGISTER_FLAGS)
                if int(ret) != 0:
                    _clear_last_error(self._rt)  # else torch's next launch check would report it as its own
                    self.why = f"cudaHostRegister failed ({_name(self._rt, ret)})"
                    failed = True
                    break
                self._done.append(s)
                done.add(u)
                self.bytes += e - s
            if failed:
                break
        # a unit registered for one layer may hold another layer's arrays: a layer is pinned when all of its are
        self.pinned = [of_layer[li] <= done for li in range(len(banks))]
        if self.why:
            rest = [li for li, p in enumerate(self.pinned) if not p]
            self.why = f"layers {_spans_text(rest)} pageable: {self.why}"
            log.warning("host banks: %.1f GiB pinned in %d of %d layers; %s", self.bytes / 2**30, sum(self.pinned),
                        len(banks), self.why)

    def summary(self) -> str:
        return f"pinned {sum(self.pinned)}/{len(self.pinned)} layers ({self.bytes / 2**30:.1f} GiB" + \
            (f", {self.copied / 2**20:.1f} MiB copied to pages of their own" if self.copied else "") + ")" + \
            (f"; {self.why}" if self.why else "")

    def close(self) -> None:
        failed = []
        for s in self._done:
            ret = self._rt.cudaHostUnregister(s)
            if int(ret) != 0:
                failed.append(_name(self._rt, ret))
        if failed:
            # else torch's next operation reports it as its own (suspected where the H100's split bench failed with
            # "invalid argument" at the next format's first copy; a fresh process ran that format)
            _clear_last_error(self._rt)
            log.warning("host banks: cudaHostUnregister failed for %d of %d ranges (%s)", len(failed),
                        len(self._done), failed[0])
        self._done = []
        self.pinned = [False] * len(self.pinned)
