"""Without a GPU: the package imports, the loader reports "no driver" cleanly,
and CudaSync falls back to the eager path with the reason."""
import json

from conftest import run_py

import gpusync_cuda
from gpusync_cuda import _native


def test_imports_and_versions():
    assert gpusync_cuda.ABI_VERSION == (1, 1)  # 1.1: step_submit, step_finish appended
    assert gpusync_cuda.PROTOCOL_VERSION == 1
    assert _native.CAPSULE_NAME == "gpusync_cuda._native._C_API_v1"
    assert set(_native.PATHS) == {"eager", "memop", "host-func", "kernel"}
    assert [_native.path_name(i) for i in range(4)] == ["eager", "memop", "host-func", "kernel"]


def test_no_driver_is_reported_cleanly():
    r = run_py("""
import json, gpusync_cuda as g
from gpusync_cuda import _native
st = g.driver_status()
try:
    _native.Device(0)
    err = None
except g.NoDriverError as e:
    err = str(e)
print(json.dumps({"st": st, "err": err}))
""", env={"GPUSYNC_LIBCUDA": "/nonexistent/libcuda.so.1"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["st"]["loaded"] is False and out["st"]["initialized"] is False
    assert "no CUDA driver" in out["st"]["error"] and "/nonexistent/libcuda.so.1" in out["st"]["error"]
    assert out["err"] == out["st"]["error"]


def test_cudasync_without_driver_decodes_eagerly():
    r = run_py("""
import numpy as np, warnings
from conftest import make_executor
import gpusync_cuda as g
ex = make_executor(np.random.default_rng(0), layers=1)
s = g.CudaSync(ex)
print(s.path); print(s.summary())
""", env={"GPUSYNC_LIBCUDA": "/nonexistent/libcuda.so.1"})
    assert r.returncode == 0, r.stderr
    path, summary = r.stdout.splitlines()[:2]
    assert path == "eager"
    assert "kernel, memop, host-func: no CUDA driver" in summary


def test_unknown_path_is_rejected():
    import numpy as np
    import pytest
    from conftest import make_executor

    ex = make_executor(np.random.default_rng(0), layers=1)
    with pytest.raises(ValueError, match="unknown paths"):
        gpusync_cuda.CudaSync(ex, paths=("memops",))
    ex.close()


def test_status_is_json_serialisable():
    json.dumps(gpusync_cuda.driver_status())
