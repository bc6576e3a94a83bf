"""Page-locked host banks: the runner's host banks registered with the CUDA runtime (cudaHostRegister, mapped and
portable) in place, layer by layer while a byte budget lasts, so that expert copies to the GPU run asynchronously at
link speed (pageable memory staged prefill at 4-6 GB/s, docs/moe-engine.md) and GPU kernels can read them directly
(zero-copy.py: a device pointer to registered host memory is the host pointer under unified addressing).

When registration fails (the OS refuses to lock more memory, a range already registered, no GPU), that layer and
those after it stay pageable: copies are synchronous and the miss split leaves the layer's misses to the CPU. One
warning says how much was pinned and why the rest was not; nothing else changes.

Thread contract: owned by its MoERunner; built at start-up, close() at its close."""
from __future__ import annotations

import logging
import os

import numpy as np

log = logging.getLogger("moe_engine")
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
REGISTER_FLAGS = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
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


def _ranges(layer: dict) -> list[tuple[int, int]]:
    """The layer's arrays as page-rounded [start, end) address ranges, merged where they share pages."""
    spans = []
    for a in layer.values():
        a = np.asarray(a)
        if a.nbytes == 0:
            continue
        p = a.__array_interface__["data"][0]
        spans.append((p - p % PAGE, -(-(p + a.nbytes) // PAGE) * PAGE))
    spans.sort()
    out = []
    for s, e in spans:
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _subtract(ranges, taken) -> list[tuple[int, int]]:
    """ranges minus the already registered intervals (layers can share a page at their edges)."""
    out = []
    for s, e in ranges:
        parts = [(s, e)]
        for ts, te in taken:
            parts = [p for a, b in parts for p in ((a, min(b, ts)), (max(a, te), b)) if p[1] > p[0]]
        out += parts
    return out


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


def _cudart():
    import torch

    return torch.cuda.cudart()


class PinnedBanks:
    """Registers `banks` (one dict of numpy arrays per layer) in place. pinned[layer]: True when every array of the
    layer is registered. budget: bytes to lock (None: half of MemAvailable; 0 or False: none)."""

    def __init__(self, banks, device, budget=None, *, runtime=None):
        self.pinned = [False] * len(banks)
        self._done: list[int] = []
        self.bytes = 0
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
        taken: list[tuple[int, int]] = []
        for li, layer in enumerate(banks):
            ranges = _subtract(_ranges(layer), taken)
            need = sum(e - s for s, e in ranges)
            if self.bytes + need > budget:
                self.why = (f"layers {li}..{len(banks) - 1} pageable: the pin budget of {budget / 2**30:.1f} GiB is "
                            f"spent")
                break
            ok = []
            for s, e in ranges:
                ret = self._rt.cudaHostRegister(s, e - s, REGISTER_FLAGS)
                if int(ret) != 0:
                    _clear_last_error(self._rt)  # else torch's next launch check would report it as its own
                    self.why = (f"layers {li}..{len(banks) - 1} pageable: cudaHostRegister failed "
                                f"({_name(self._rt, ret)})")
                    break
                ok.append(s)
                taken.append((s, e))
            self._done += ok
            if len(ok) != len(ranges):
                break
            self.pinned[li] = True
            self.bytes += need
        if self.why:
            log.warning("host banks: %.1f GiB pinned in %d of %d layers; %s", self.bytes / 2**30, sum(self.pinned),
                        len(banks), self.why)

    def summary(self) -> str:
        return f"pinned {sum(self.pinned)}/{len(self.pinned)} layers ({self.bytes / 2**30:.1f} GiB)" + \
            (f"; {self.why}" if self.why else "")

    def close(self) -> None:
        for s in self._done:
            self._rt.cudaHostUnregister(s)
        self._done = []
        self.pinned = [False] * len(self.pinned)
