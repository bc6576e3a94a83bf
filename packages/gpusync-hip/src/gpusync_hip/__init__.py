"""gpusync-hip: the HIP/ROCm side of the CPU MoE doorbell handshake (protocol
v1, docs/protocol.md): ready/done words in signal memory, stream memops that
are native where the runtime records them under capture and spliced
batch-memop graph nodes where it does not (decided by a start-up capture,
instantiate and replay, never by version), seed 000's error recovery, a
system-release event between the copies and the doorbell, and the same
versioned C ABI as gpusync-cuda (capsule gpusync_hip._native._C_API_v1).

The HIP runtime is dlopen'd at run time (no libamdhip64 at link time), so this
imports on a machine without ROCm; driver_status() says what loaded and why.
"""

from __future__ import annotations

from . import _native
from ._native import CaptureRefusedError, GpuSyncError, NoDriverError
from .sync import PATHS, HipSync

__version__ = "0.3.0"
ABI_VERSION = (_native.ABI_MAJOR, _native.ABI_MINOR)
PROTOCOL_VERSION = _native.PROTOCOL_VERSION
C_API_CAPSULE = _native._C_API_v1


def get_include() -> str:
    """Directory holding gpusync/abi.h: the backend-neutral header cpumoe-executor ships (one copy, not two)."""
    import cpumoe_executor

    return cpumoe_executor.get_include()


def driver_status() -> dict:
    """How the HIP runtime loaded: library, why it was chosen, versions, missing optional entries, or why not."""
    return _native.driver_status()


__all__ = [
    "ABI_VERSION",
    "C_API_CAPSULE",
    "PATHS",
    "PROTOCOL_VERSION",
    "CaptureRefusedError",
    "GpuSyncError",
    "HipSync",
    "NoDriverError",
    "driver_status",
    "get_include",
]
