"""gpusync-hip test machinery: small executors, the fake HIP runtime
(tests/fake_hip, compiled here per variant) and a runner that executes a
snippet in a fresh interpreter against it (the runtime is loaded once per
process, so every scenario gets its own)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
FAKE_SRC = HERE / "fake_hip" / "fake_libamdhip64.cpp"
# Compile-time variants of the fake: which entry points it does not export.
VARIANTS = {
    "full": [],
    "no_batch_node": ["-DFAKEHIP_NO_BATCH_NODE"],
    "no_record_with_flags": ["-DFAKEHIP_NO_RECORD_WITH_FLAGS"],
    # Debian bookworm's libamdhip64 5.2.3: no hipLaunchHostFunc, nothing from 6.x.
    "debian523": ["-DFAKEHIP_NO_HOSTFUNC", "-DFAKEHIP_NO_BATCH_NODE", "-DFAKEHIP_NO_RECORD_WITH_FLAGS"],
    "no_stream_create": ["-DFAKEHIP_NO_STREAM_CREATE"],
}


def pytest_configure(config):
    for m in ("rocm: needs an AMD GPU and the ROCm runtime", "gpu: needs some GPU (combine with cuda or rocm)"):
        config.addinivalue_line("markers", m)


@pytest.fixture
def rng():
    seed = int(os.environ.get("CPUMOE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"CPUMOE_TEST_SEED={seed}")
    return np.random.default_rng(seed)


def make_executor(rng, *, E=6, H=96, I=40, layers=3, top_k=3, max_tokens=8, threads=2):  # noqa: E741
    import cpumoe_executor as ce
    import cpumoe_formats as cf

    spec = cf.get_format("bf16")
    banks = [spec.random_banks(E, H, I, rng) for _ in range(layers)]
    return ce.CpuMoeExecutor("bf16", banks, top_k=top_k, max_tokens=max_tokens, threads=threads)


class FakeLibs:
    """Builds fake_libamdhip64.cpp variants on demand into one tmp dir."""

    def __init__(self, root: Path):
        self.root, self.cxx = root, os.environ.get("CXX", "c++")

    def __call__(self, variant: str = "full") -> Path:
        out = self.root / variant / "libamdhip64.so.7"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = [
                self.cxx,
                "-std=c++17",
                "-shared",
                "-fPIC",
                "-O1",
                "-pthread",
                *VARIANTS[variant],
                "-o",
                str(out),
                str(FAKE_SRC),
            ]
            r = subprocess.run(cmd, capture_output=True, text=True)
            assert r.returncode == 0, f"building the fake HIP runtime failed:\n{' '.join(cmd)}\n{r.stderr}"
        return out


@pytest.fixture(scope="session")
def fake_hip(tmp_path_factory) -> FakeLibs:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler to build the fake HIP runtime")
    return FakeLibs(tmp_path_factory.mktemp("fakehip"))


def run_py(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (the HIP runtime is loaded once per process)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(HERE)] + sys.path)
    e.pop("GPUSYNC_HIP_PATH", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=timeout)


PRELUDE = """
import ctypes, json, os, time, warnings
import numpy as np
from conftest import make_executor
import cpumoe_executor as ce, cpumoe_formats as cf
import gpusync_hip as g
from gpusync_hip import _native
warnings.simplefilter("ignore")
P = _native.PATHS
FAKE = ctypes.CDLL(os.environ["GPUSYNC_HIP_LIBRARY"])  # the same instance gpusync_hip loads
FAKE.fakehip_stats.restype = ctypes.c_char_p
def configure(spec): FAKE.fakehip_configure(spec.encode())
def stats(): return json.loads(FAKE.fakehip_stats())
ex = make_executor(np.random.default_rng(7))
def bits(a): return np.ascontiguousarray(a).view(np.uint16)
def eager_matches(sync_or_iob, trials=3, seed=11):
    # the copy step on raw host pointers ("device memory" is host memory in the fake) vs executor.decode
    b = getattr(sync_or_iob, "_iob", sync_or_iob)
    rng = np.random.default_rng(seed)
    ok = []
    for i in range(trials):
        layer, T = i % ex.num_layers, 1 + (3 * i) % ex.max_tokens
        x = rng.standard_normal((T, ex.H)).astype(np.float32).astype(cf.numerics.BF16)
        ids = rng.integers(-1, ex.E, (T, ex.top_k)).astype(np.int32)
        w = rng.random((T, ex.top_k), dtype=np.float32)
        y = np.full((T, ex.H), 0x7FC1, np.uint16)
        b.step(P["memop"], 0, layer, T, x.ctypes.data, ids.ctypes.data, w.ctypes.data, y.ctypes.data)
        assert b.sync(0, 10.0)
        ok.append(bool((y == bits(ex.decode(layer, x, w, ids))).all()))
    return ok
"""


def fake_run(lib: Path, code: str, config: str = "", env: dict | None = None):
    """Run PRELUDE + code against the fake library `lib` configured with `config`;
    the last stdout line is JSON."""
    r = run_py(PRELUDE + code, env={"GPUSYNC_HIP_LIBRARY": str(lib), "FAKEHIP_CONFIG": config, **(env or {})})
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])
