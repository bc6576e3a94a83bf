"""cpumoe-executor: CPU MoE decode on a pinned worker pool, synchronously or
through the doorbell protocol (v1, docs/protocol.md) from a GPU stream."""
from __future__ import annotations

from pathlib import Path

from . import _native
from .cores import openmp_team_unusable, resolve_cores, usable_cpus
from .cpu_layout import cpu_layout
from .executor import CpuMoeExecutor

__version__ = "0.4.0"
ABI_VERSION = (_native.ABI_MAJOR, _native.ABI_MINOR)
PROTOCOL_VERSION = _native.PROTOCOL_VERSION
C_API_CAPSULE = _native._C_API_v1


def get_include() -> str:
    """Directory holding cpumoe_executor/abi.h, cpumoe_executor/protocol.h and gpusync/abi.h (the sync backends'
    versioned C ABI, implemented by gpusync-cuda and gpusync-hip, consumed by kernelio and engines)."""
    return str(Path(__file__).resolve().parent / "include")


__all__ = ["ABI_VERSION", "C_API_CAPSULE", "PROTOCOL_VERSION", "CpuMoeExecutor", "cpu_layout", "get_include",
           "openmp_team_unusable", "resolve_cores", "usable_cpus"]
