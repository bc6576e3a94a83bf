"""The HIP runtime loader, without a GPU: the package imports anywhere; no
library, a wrong library, a library lacking a required entry point, no device
and Debian's 5.2.3 symbol set are each reported cleanly (driver_status() says
which library, which runtime version and why), and HipSync falls back to the
path that is still correct, with the reason."""

import json
from pathlib import Path

import pytest
from conftest import fake_run, make_executor, run_py

import gpusync_hip
from gpusync_hip import _native

STATUS = """
import json, gpusync_hip as g
from gpusync_hip import _native
st = g.driver_status()
try:
    _native.Device(0)
    err = None
except g.NoDriverError as e:
    err = str(e)
print(json.dumps({"st": st, "err": err}))
"""


def status(env):
    r = run_py(STATUS, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_imports_and_versions():
    assert gpusync_hip.ABI_VERSION == (1, 1)  # 1.1: step_submit, step_finish appended
    assert gpusync_hip.PROTOCOL_VERSION == 1
    assert _native.CAPSULE_NAME == "gpusync_hip._native._C_API_v1"
    assert set(_native.PATHS) == {"eager", "memop", "host-func", "kernel"}
    assert dict(_native.MECHANISMS) == {"none": 0, "native": 1, "splice": 2}
    assert (Path(gpusync_hip.get_include()) / "gpusync" / "abi.h").is_file()


def test_no_library():
    out = status({"GPUSYNC_HIP_LIBRARY": "/nonexistent/libamdhip64.so.7"})
    st = out["st"]
    assert st["loaded"] is False and st["initialized"] is False
    assert "no HIP runtime" in st["error"] and "/nonexistent/libamdhip64.so.7" in st["error"]
    assert "GPUSYNC_HIP_LIBRARY" in st["error"]
    assert out["err"] == st["error"]


def test_wrong_library(fake_hip):
    # a shared library that is not a HIP runtime (the C library)
    libc = run_py("import ctypes.util; print(ctypes.util.find_library('c'))").stdout.strip()
    out = status({"GPUSYNC_HIP_LIBRARY": libc})
    assert out["st"]["loaded"] is False
    assert "not a HIP runtime" in out["st"]["error"] and "hipRuntimeGetVersion" in out["st"]["error"]


def test_required_entry_point_missing(fake_hip):
    out = status({"GPUSYNC_HIP_LIBRARY": str(fake_hip("no_stream_create"))})
    assert out["st"]["loaded"] is False
    assert "lacks hipStreamCreateWithFlags" in out["st"]["error"]
    assert str(out["st"]["runtime_version"]) in out["st"]["error"]


def test_no_device(fake_hip):
    out = status({"GPUSYNC_HIP_LIBRARY": str(fake_hip("full")), "FAKEHIP_CONFIG": "devices=0"})
    st = out["st"]
    assert st["loaded"] is True and st["initialized"] is False
    assert st["error"] == "no usable HIP device: hipGetDeviceCount failed: hipErrorNoDevice"
    assert out["err"] == st["error"]


def test_status_names_library_version_and_choice(fake_hip):
    lib = fake_hip("full")
    out = status({"GPUSYNC_HIP_LIBRARY": str(lib), "FAKEHIP_CONFIG": "version=71400000"})
    st = out["st"]
    assert st["initialized"] and out["err"] is None
    assert st["library"] == str(lib) and st["choice"] == "GPUSYNC_HIP_LIBRARY"
    assert st["runtime_version"] == 71400000 and st["device_count"] == 1 and st["missing"] == []
    assert st["memops"] and st["signal_memory"] and st["splice"] and st["captured_release_event"] and st["host_func"]


def test_debian_523_symbol_set(fake_hip):
    """Debian's libamdhip64 5.2.3: no hipLaunchHostFunc, no batch-memop node, no
    hipEventRecordWithFlags. Memops exist but capture cannot be proven: capture is
    refused, eager stays correct, nothing crashes."""
    out = fake_run(
        fake_hip("debian523"),
        """
s = g.HipSync(ex)
st = g.driver_status()
d, b = s._dev, s._iob
stream = d._stream_create()
d._capture_begin(stream)
try:
    b.submit(P["memop"], stream, 0, 1)
    refused = None
except g.CaptureRefusedError as e:
    refused = str(e)
d._graph_destroy(d._capture_end(stream), 0)
d._stream_destroy(stream)
print(json.dumps({"st": st, "path": s.path, "reasons": s.reasons, "eager": eager_matches(s), "refused": refused,
                  "peek": _native._peek_error()}))
""",
        config="capture=eager;version=50221153",
    )
    assert sorted(out["st"]["missing"]) == ["hipEventRecordWithFlags", "hipGraphAddBatchMemOpNode", "hipLaunchHostFunc"]
    assert out["st"]["initialized"] and out["st"]["runtime_version"] == 50221153
    assert out["path"] == "eager"
    assert "hipEventRecordWithFlags missing (HIP < 6.4.2)" in out["reasons"]["copy"]
    assert "eager ok" in out["reasons"]["copy"]  # the copy step itself works eagerly
    assert "hipLaunchHostFunc missing" in out["reasons"]["host-func"]
    assert out["eager"] == [True, True, True]
    assert "capture refused" in out["refused"] and "not proven replay-safe" in out["refused"]
    assert out["peek"] == 0


@pytest.mark.parametrize(
    "variant, path, reason",
    [
        ("no_batch_node", "host-func", "splice: hipGraphAddBatchMemOpNode (HIP 6.4+) or the capture-dependency"),
        ("no_record_with_flags", "host-func", "hipEventRecordWithFlags missing"),
    ],
)
def test_missing_optional_entry_points(fake_hip, variant, path, reason):
    out = fake_run(
        fake_hip(variant),
        """
s = g.HipSync(ex)
print(json.dumps({"path": s.path, "reasons": s.reasons, "missing": g.driver_status()["missing"],
                  "eager": eager_matches(s), "peek": _native._peek_error()}))
""",
        config="capture=eager",
    )
    assert out["path"] == path and reason in out["reasons"]["copy"], out["reasons"]
    assert out["eager"] == [True, True, True] and out["peek"] == 0


def test_forced_paths(fake_hip):
    lib = fake_hip("full")
    code = """
res = {}
for want in ("copy-native", "splice", "host-func", "eager"):
    try:
        s = g.HipSync(ex, path=want)
        res[want] = [s.path, s.mechanism]
        s.close()
    except g.GpuSyncError as e:
        res[want] = ["raised", str(e)]
os.environ["GPUSYNC_HIP_PATH"] = "copy-splice"
s = g.HipSync(ex)
res["env"] = [s.path, s.mechanism]
print(json.dumps(res))
"""
    rec = fake_run(lib, code, config="capture=record")
    assert rec == {
        "copy-native": ["copy-native", "native"],
        "splice": ["copy-splice", "splice"],
        "host-func": ["host-func", "none"],
        "eager": ["eager", "none"],
        "env": ["copy-splice", "splice"],
    }
    old = fake_run(lib, code, config="capture=eager")  # ROCm < 10: forcing native cannot be proven
    assert old["copy-native"][0] == "raised" and "forced path 'copy-native' is unavailable" in old["copy-native"][1]
    assert "forced native: stream memops run at once on a capturing stream" in old["copy-native"][1]
    assert old["splice"] == ["copy-splice", "splice"]


def test_bad_arguments():
    import numpy as np

    ex = make_executor(np.random.default_rng(0), layers=1)
    with pytest.raises(ValueError, match="path='memops'.*is not one of"):
        gpusync_hip.HipSync(ex, path="memops")
    with pytest.raises(ValueError, match="ordinal=-1"):
        gpusync_hip.HipSync(ex, ordinal=-1)
    ex.close()


def test_hipsync_without_runtime_decodes_eagerly():
    r = run_py(
        """
import numpy as np
from conftest import make_executor
import gpusync_hip as g
ex = make_executor(np.random.default_rng(0), layers=1)
s = g.HipSync(ex)
print(s.path); print(s.summary())
""",
        env={"GPUSYNC_HIP_LIBRARY": "/nonexistent/libamdhip64.so"},
    )
    assert r.returncode == 0, r.stderr
    path, summary = r.stdout.splitlines()[:2]
    assert path == "eager" and "copy: no HIP runtime" in summary and "host-func: no HIP runtime" in summary


SYSTEM_HIP = [
    p for p in ("/usr/lib/x86_64-linux-gnu/libamdhip64.so.5", "/opt/rocm/lib/libamdhip64.so") if Path(p).exists()
]


@pytest.mark.skipif(not SYSTEM_HIP, reason="no HIP runtime library installed on this machine")
def test_real_runtime_library_without_gpu():
    """The distribution's real libamdhip64 (Debian: 5.2.3) on a machine without an AMD GPU:
    found by the default search, its version read, its missing 6.x entry points listed."""
    out = status({})
    st = out["st"]
    assert st["loaded"] is True, st
    assert st["choice"].startswith(("first found of libamdhip64", "already loaded")), st["choice"]
    assert st["runtime_version"] > 50000000
    if st["runtime_version"] < 60400000:
        assert "hipGraphAddBatchMemOpNode" in st["missing"] and "hipEventRecordWithFlags" in st["missing"]
    if not st["initialized"]:
        assert st["error"].startswith("no usable HIP device") and out["err"] == st["error"]
