"""gpusync-cuda: the CUDA side of the CPU MoE doorbell handshake (protocol v1,
docs/protocol.md): stream memops on the IO block's ready/done words, the
host-function fallback, a start-up probe, and a versioned C ABI (capsule
_C_API_v1, header gpusync/abi.h, shipped by cpumoe-executor) that gpusync-hip implements too.

The CUDA driver is dlopen'd at run time (no libcuda/cudart at link time), so
this imports on a machine without a GPU; driver_status() says why the GPU
paths are unavailable there.
"""
from __future__ import annotations

from . import _native
from ._native import CaptureRefusedError, GpuSyncError, NoDriverError
from .sync import PATHS, CudaSync

__version__ = "0.3.0"
ABI_VERSION = (_native.ABI_MAJOR, _native.ABI_MINOR)
PROTOCOL_VERSION = _native.PROTOCOL_VERSION
C_API_CAPSULE = _native._C_API_v1


def get_include() -> str:
    """Directory holding gpusync/abi.h: the backend-neutral header cpumoe-executor ships (one copy for both
    backends and kernelio), beside cpumoe_executor/abi.h."""
    import cpumoe_executor

    return cpumoe_executor.get_include()


def driver_status() -> dict:
    """How the CUDA driver loaded: library, resolver, version, missing optional entries, or why not."""
    return _native.driver_status()


__all__ = ["ABI_VERSION", "C_API_CAPSULE", "PATHS", "PROTOCOL_VERSION", "CaptureRefusedError", "CudaSync",
           "GpuSyncError", "NoDriverError", "driver_status", "get_include"]
