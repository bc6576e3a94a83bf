"""The control logic on a fake libcuda (tests/fake_cuda: CPU threads play the
streams): versioned entry-point resolution, the doorbell against the real
coordinator, the probe's verdicts under injected faults, capture refusal,
errors that name the operation, and bounded waits. Runs without a GPU."""
import json

import pytest
from conftest import run_py

PRELUDE = """
import json, time, warnings
import numpy as np
from conftest import make_executor
import cpumoe_executor as ce, cpumoe_formats as cf
import gpusync_cuda as g
from gpusync_cuda import _native
warnings.simplefilter("ignore")
P = _native.PATHS
ex = make_executor(np.random.default_rng(7), layers=3, H=96, I=40, E=6, top_k=3)
"""


def fake(lib, code, fault=""):
    r = run_py(PRELUDE + code, env={"GPUSYNC_LIBCUDA": str(lib), "FAKE_CUDA_FAULT": fault})
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_resolution_probe_and_fallback_choice(fake_libcuda):
    out = fake(fake_libcuda, """
s = g.CudaSync(ex, qualify=False)
print(json.dumps({"st": g.driver_status(), "path": s.path, "reasons": s.reasons, "summary": s.summary()}))
""")
    assert out["st"]["resolver"] == "cuGetProcAddress_v2(cudaVersion=12000)"
    assert out["st"]["missing"] == [] and out["st"]["memops"]
    # The fake cannot run kernels: kernelio's probe fails and the copies + memops take over.
    assert out["path"] == "memop"
    # With kernelio installed its probe fails on the fake (no kernels run); without it, it is not there.
    import importlib.util

    want = "NO_BINARY_FOR_GPU" if importlib.util.find_spec("kernelio") else "kernelio is not installed"
    assert want in out["reasons"]["kernel"]
    assert "3 replays with changed inputs bit-identical" in out["reasons"]["memop"]
    assert "memop" in out["reasons"]["memop"] and "6 memop" in out["reasons"]["memop"]
    assert "4 host" in out["reasons"]["host-func"]


def test_kernel_wait_choice_on_a_gpu_without_kernels(fake_libcuda):
    """No kernel runs on the fake: no wait is chosen (the kernel path is off); a bad KERNELIO_WAIT is refused."""
    pytest.importorskip("kernelio")
    code = PRELUDE + """
try:
    s = g.CudaSync(ex, qualify=False)
    print(json.dumps({"wait": s.kernel_wait, "path": s.path}))
except ValueError as e:
    print(json.dumps({"error": str(e)}))
"""
    for forced, want in (("", {"wait": None, "path": "memop"}), ("poll", {"wait": None, "path": "memop"})):
        r = run_py(code, env={"GPUSYNC_LIBCUDA": str(fake_libcuda), "KERNELIO_WAIT": forced})
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout.strip().splitlines()[-1]) == want, forced
    r = run_py(code, env={"GPUSYNC_LIBCUDA": str(fake_libcuda), "KERNELIO_WAIT": "spin"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "KERNELIO_WAIT='spin'" in json.loads(r.stdout.strip().splitlines()[-1])["error"]


@pytest.mark.parametrize("path", ["memop", "host-func"])
def test_copy_step_matches_the_executor(fake_libcuda, path):
    out = fake(fake_libcuda, f"""
ex.start_coordinator()
d = _native.Device(0)
b = _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
rng = np.random.default_rng(1)
ok = []
for layer, T in ((0, 1), (2, 5), (1, 8)):
    x = rng.standard_normal((T, ex.H)).astype(np.float32).astype(cf.numerics.BF16)
    ids = rng.integers(-1, ex.E, (T, ex.top_k)).astype(np.int32)
    w = rng.random((T, ex.top_k), dtype=np.float32)
    y = np.full((T, ex.H), 7, np.uint16)
    served = ex.health()["served"]
    b.step(P["{path}"], 0, layer, T, x.ctypes.data, ids.ctypes.data, w.ctypes.data, y.ctypes.data)
    assert b.sync(0, 10.0)
    want = ex.decode(layer, x, w, ids).view(np.uint16)
    ok.append(bool((y == want).all()) and ex.health()["served"] == served + 1)
h = ex.health()
print(json.dumps({{"ok": ok, "ready": h["ready"], "done": h["done"]}}))
""")
    assert out["ok"] == [True] * 3
    assert out["ready"] == 0 and out["done"] == 1  # nothing pending


@pytest.mark.parametrize("fault, memop, hostfn, path", [
    ("drop_memops_in_capture", "memop failed at replay", "ok", "host-func"),
    ("reject_memops_in_capture", "memop failed at capture: cuStreamWriteValue64(done := 0) failed: "
                                 "CUDA_ERROR_INVALID_VALUE", "ok", "host-func"),
    ("no_memop_attr", "attribute 122 = 0", "ok", "host-func"),
    ("no_hostfunc", "ok", "cuLaunchHostFunc missing", "memop"),
    ("no_device", "cuInit(0) failed: CUDA_ERROR_NO_DEVICE", "cuInit(0) failed", "eager"),
])
def test_probe_verdicts_under_faults(fake_libcuda, fault, memop, hostfn, path):
    out = fake(fake_libcuda, """
s = g.CudaSync(ex, qualify=False)
print(json.dumps({"path": s.path, "reasons": s.reasons, "ok": {p: s._usable(p) for p in s.reasons}}))
""", fault)
    assert out["path"] == path
    for p, want in (("memop", memop), ("host-func", hostfn)):
        if want == "ok":
            assert out["ok"][p], out["reasons"][p]
        else:
            assert not out["ok"][p] and want in out["reasons"][p], out["reasons"][p]
    if fault == "reject_memops_in_capture":  # the error says it happened while capturing
        assert "stream is capturing" in out["reasons"]["memop"]


def test_capture_is_refused_until_a_probe_proves_the_path(fake_libcuda):
    out = fake(fake_libcuda, """
ex.start_coordinator()
d = _native.Device(0)
b = _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
s = d._stream_create()
d._capture_begin(s)
try:
    b.submit(P["memop"], s, 0, 1)
    refused = None
except g.CaptureRefusedError as e:
    refused = str(e)
d._capture_end(s)
eager_ok = True
b.submit(P["memop"], s, 0, 1); b.wait(P["memop"], s)  # eager use needs no probe
eager_ok = b.sync(s, 10.0)
safe, report = b.probe(P["memop"], 10.0)
d._capture_begin(s)
b.submit(P["memop"], s, 1, 2); b.wait(P["memop"], s)
types = d._capture_end(s)
d._stream_destroy(s)
print(json.dumps({"refused": refused, "eager_ok": eager_ok, "safe": safe, "types": types}))
""")
    msg = out["refused"]
    assert msg and "capture refused" in msg and "memop" in msg and "not probed" in msg
    assert "--cuda-graph-max-bs 0" in msg
    assert out["eager_ok"] and out["safe"]
    assert out["types"] == {"12": 3}  # write done, write ready, wait: three memop nodes


def test_waits_are_bounded(fake_libcuda):
    out = fake(fake_libcuda, """
d = _native.Device(0)
b = _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)   # no coordinator: nobody answers
s = d._stream_create()
b.submit(P["memop"], s, 0, 1); b.wait(P["memop"], s)
t = time.time()
ok = b.sync(s, 0.3)
dt = time.time() - t
done = ex.health()["done"]
drained = d.sync(s, 5.0)
d._stream_destroy(s)
print(json.dumps({"ok": ok, "dt": dt, "done": done, "drained": drained}))
""")
    assert out["ok"] is False and out["dt"] < 5.0
    assert out["done"] == 0x7FFFFFFFFFFFFFFF and out["drained"]  # released like a shutdown


def test_bad_task_is_rejected(fake_libcuda):
    out = fake(fake_libcuda, """
d = _native.Device(0)
b = _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
errs = []
for layer, T in ((3, 1), (0, 0), (0, 9)):
    try:
        b.submit(P["memop"], 0, layer, T)
    except g.GpuSyncError as e:
        errs.append(str(e))
print(json.dumps(errs))
""")
    assert len(out) == 3 and all("need layer < 3 and 1 <= num_tokens <= max_tokens=8" in e for e in out)
