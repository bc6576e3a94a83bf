"""Shared by tests-integration: markers and the CUDA gate for the GPU composition tests."""
from __future__ import annotations

import pytest


def pytest_configure(config):
    for m in ("cuda: needs an NVIDIA GPU and the CUDA driver", "gpu: needs some GPU (combine with cuda or rocm)",
              "slow: takes minutes"):
        config.addinivalue_line("markers", m)


def cuda_missing() -> str | None:
    """Why the executor + gpusync-cuda + kernelio composition cannot run here, or None."""
    try:
        import gpusync_cuda
        import kernelio  # noqa: F401
    except ImportError as e:
        return f"{e.name} is not installed"
    st = gpusync_cuda.driver_status()
    if not st["initialized"]:
        return st["error"]
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


cuda = [pytest.mark.cuda, pytest.mark.gpu]
