"""gpusync-cuda test machinery: small executors, a GPU gate that skips with a
reason, and the fake libcuda (tests/fake_cuda) built on demand for CPU-only
tests of the control logic."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    for m in ("cuda: needs an NVIDIA GPU and the CUDA driver", "gpu: needs some GPU (combine with cuda or rocm)"):
        config.addinivalue_line("markers", m)


@pytest.fixture
def rng():
    seed = int(os.environ.get("CPUMOE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"CPUMOE_TEST_SEED={seed}")
    return np.random.default_rng(seed)


def make_executor(rng, *, E=8, H=256, I=64, layers=4, top_k=4, max_tokens=8, threads=2):  # noqa: E741
    import cpumoe_executor as ce
    import cpumoe_formats as cf

    spec = cf.get_format("bf16")
    banks = [spec.random_banks(E, H, I, rng) for _ in range(layers)]
    return ce.CpuMoeExecutor("bf16", banks, top_k=top_k, max_tokens=max_tokens, threads=threads)


def gpu_missing() -> str | None:
    """Why the CUDA tests cannot run here, or None."""
    import gpusync_cuda

    st = gpusync_cuda.driver_status()
    if not st["initialized"]:
        return st["error"]
    try:
        import torch
    except ImportError:
        return "torch is not installed (the GPU tests drive the streams through torch)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


cuda = [pytest.mark.cuda, pytest.mark.gpu]


@pytest.fixture(scope="session")
def fake_libcuda(tmp_path_factory) -> Path:
    """tests/fake_cuda/fake_libcuda.cpp built into libcuda.so.1 (skips without a C++ compiler)."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}) to build the fake libcuda")
    out = tmp_path_factory.mktemp("fakecuda") / "libcuda.so.1"
    subprocess.run([cxx, "-std=c++17", "-shared", "-fPIC", "-O1", "-pthread", "-o", str(out),
                    str(HERE / "fake_cuda" / "fake_libcuda.cpp")], check=True, capture_output=True)
    return out


def run_py(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (the driver is loaded once per process)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(HERE)] + sys.path)
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=timeout)


# The head of every fake-driver script (run in a fresh interpreter by fake_run): the fake libcuda's controls, a
# 3-layer executor, fresh step inputs with y poisoned, and the check against the executor's synchronous decode.
FAKE_PRELUDE = """
import ctypes, gc, json, os, time
import numpy as np
from conftest import make_executor
import cpumoe_executor as ce, cpumoe_formats as cf
import gpusync_cuda as g
from gpusync_cuda import _native
P = _native.PATHS
lib = ctypes.CDLL(os.environ["GPUSYNC_LIBCUDA"])  # the same loaded instance as the driver's
lib.fake_cuda_state.restype = lib.fake_cuda_last_graph.restype = ctypes.c_char_p
lib.fake_cuda_fail.argtypes = (ctypes.c_char_p, ctypes.c_int, ctypes.c_int)
state = lambda: json.loads(lib.fake_cuda_state())
ex = make_executor(np.random.default_rng(7), layers=3, H=96, I=40, E=6, top_k=3)
rng = np.random.default_rng(5)

def inputs(T):
    x = rng.standard_normal((T, ex.H)).astype(np.float32).astype(cf.numerics.BF16)
    ids = rng.integers(-1, ex.E, (T, ex.top_k)).astype(np.int32)
    ids[:, 0] = rng.integers(0, ex.E, T)  # at least one CPU route: the coordinator runs the task
    w = rng.random((T, ex.top_k), dtype=np.float32)
    return x, ids, w, np.full((T, ex.H), 0x7FC1, np.uint16)  # y poisoned (a NaN no result has)

def matches(layer, a):
    x, ids, w, y = a
    return bool((y == ex.decode(layer, x, w, ids).view(np.uint16)).all())
"""


def fake_run(lib, prelude: str, code: str, **env):
    """FAKE_PRELUDE + prelude + code under the fake driver `lib`; the JSON its last line prints (dicts get stderr)."""
    import json

    r = run_py(FAKE_PRELUDE + prelude + code, env={"GPUSYNC_LIBCUDA": str(lib), **env})
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if isinstance(out, dict):
        out["stderr"] = r.stderr
    return out

