"""Facts about this machine that benchmarks record beside their figures (CPU model, last-level cache, usable ISA
tiers, versions), and the summary of repeated timings they report. Thread contract: plain functions."""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from .kernels import usable_tiers, x16_prefetch


def _size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMGB") or 0) * mult


def llc_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """Last-level cache size: the level-3 cache, else the largest data/unified one; None if unknown."""
    found = []
    for d in sorted(Path(root).glob("index*")):
        try:
            if (d / "type").read_text().strip() == "Instruction":
                continue
            found.append((int((d / "level").read_text()), _size((d / "size").read_text())))
        except (OSError, ValueError):
            continue
    l3 = [s for lvl, s in found if lvl == 3]
    if l3:
        return max(l3)
    return max((s for _, s in found), default=None) or None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(llc: int | None) -> dict:
    from . import BUILD_INFO, __version__

    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "llc_bytes": llc, "usable_tiers": usable_tiers(),
            "x16_prefetch": x16_prefetch(), "build_info": BUILD_INFO, "cpumoe_formats": __version__,
            "python": platform.python_version(),
            "numpy": np.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def stats(samples) -> dict:
    s = [float(v) for v in samples]
    return {"median": statistics.median(s), "min": min(s), "max": max(s), "samples": s}
