# Called by: noxfile.py (imports missing() to gate the GPU sessions); by hand: python ci/detect_gpu.py cuda|rocm.
"""Can this machine run the cuda / rocm backend? Needs both a device and a toolchain.

    python ci/detect_gpu.py cuda      exit 0 when usable, else print why and exit 1

The noxfile imports `missing()`; GPU sessions skip with its reason (REQUIRE_GPU=1 makes that an error).
"""
from __future__ import annotations

import ctypes
import glob
import os
import shutil
import sys


def _tool(name: str, *homes: str) -> str | None:
    found = shutil.which(name)
    for var in homes:
        if not found and os.environ.get(var):
            cand = os.path.join(os.environ[var], "bin", name)
            found = cand if os.access(cand, os.X_OK) else None
    return found


def _loads(lib: str) -> bool:
    try:
        ctypes.CDLL(lib)
        return True
    except OSError:
        return False


def missing(backend: str) -> str | None:
    """None when `backend` is usable here, else the reason it is not."""
    if backend == "cpu":
        return None
    if backend == "cuda":
        if not glob.glob("/dev/nvidia[0-9]*"):
            return "no NVIDIA GPU (/dev/nvidia<N> absent)"
        if not _loads("libcuda.so.1"):
            return "NVIDIA driver library libcuda.so.1 cannot be loaded"
        if not _tool("nvcc", "CUDA_HOME", "CUDA_PATH"):
            return "CUDA toolchain absent (nvcc not on PATH, CUDA_HOME unset)"
        return None
    if backend == "rocm":
        if not os.path.exists("/dev/kfd") or not glob.glob("/dev/dri/renderD*"):
            return "no AMD GPU (/dev/kfd or /dev/dri/renderD* absent)"
        if not _tool("hipcc", "ROCM_PATH", "HIP_PATH") and not os.access("/opt/rocm/bin/hipcc", os.X_OK):
            return "ROCm toolchain absent (hipcc not on PATH or in /opt/rocm/bin)"
        return None
    raise ValueError(f"unknown backend {backend!r}; expected cpu, cuda or rocm")


if __name__ == "__main__":
    why = missing(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    print(why or "available")
    sys.exit(why is not None)
