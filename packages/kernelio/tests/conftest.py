"""kernelio test machinery: the GPU gate (through gpusync-cuda's loader) and
the fake libcuda of gpusync-cuda's tests, for CPU-only fallback checks."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FAKE_SRC = HERE.parent.parent / "gpusync-cuda" / "tests" / "fake_cuda" / "fake_libcuda.cpp"


def pytest_configure(config):
    for m in ("cuda: needs an NVIDIA GPU and the CUDA driver", "gpu: needs some GPU (combine with cuda or rocm)"):
        config.addinivalue_line("markers", m)


def gpu_missing() -> str | None:
    try:
        import gpusync_cuda
    except ImportError:
        return "gpusync-cuda is not installed (kernelio loads its kernels through it)"
    st = gpusync_cuda.driver_status()
    if not st["initialized"]:
        return st["error"]
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


cuda = [pytest.mark.cuda, pytest.mark.gpu]


@pytest.fixture(scope="session")
def fake_libcuda(tmp_path_factory) -> Path:
    # the fake CUDA driver is driven through gpusync-cuda: a session with another backend (rocm) lacks it
    pytest.importorskip("gpusync_cuda", reason="the fake-driver tests run the CUDA backend (gpusync-cuda)")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None or not FAKE_SRC.is_file():
        pytest.skip("needs a C++ compiler and gpusync-cuda's fake libcuda source (monorepo checkout)")
    out = tmp_path_factory.mktemp("fakecuda") / "libcuda.so.1"
    subprocess.run([cxx, "-std=c++17", "-shared", "-fPIC", "-O1", "-pthread", "-o", str(out), str(FAKE_SRC)],
                   check=True, capture_output=True)
    return out


def run_py(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(HERE)] + sys.path)
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=timeout)
