"""The fake HIP runtime models the ROCm behaviours the fault matrix relies on
(else a passing matrix would prove nothing), shown with raw HIP calls through
ctypes, without gpusync-hip's safeguards:
  - capture=eager: a memop on a capturing stream runs at once and is not recorded;
  - batch=unordered: a two-op batch-memop node runs its ops in reverse order;
  - params=keep: a node reads the caller's paramArray at every replay;
  - payload=late: the host sees the doorbell before a copied payload unless a
    system-release event was recorded between them.
And the gpusync-hip side: bounded waits, bad tasks rejected."""

import pytest
from conftest import fake_run

RAW = """
from ctypes import byref, c_void_p, c_uint64, c_int, c_size_t, POINTER, Structure, Union
H = FAKE
def ok(rc):
    assert rc == 0, rc
def stream():
    s = c_void_p(); ok(H.hipStreamCreateWithFlags(byref(s), 1)); return s
def signal():
    p = c_void_p(); ok(H.hipExtMallocWithFlags(byref(p), c_size_t(8), 2)); return p
def word(p): return c_uint64.from_address(p.value)
def sync(s): ok(H.hipStreamSynchronize(s))
class Op(Structure):
    _fields_ = [("operation", c_int), ("address", c_void_p), ("value64", c_uint64), ("flags", c_int),
                ("alias", c_void_p), ("pad", c_uint64)]
class NodeParams(Structure):
    _fields_ = [("ctx", c_void_p), ("count", c_int), ("paramArray", POINTER(Op)), ("flags", c_int)]
H.hipStreamWriteValue64.argtypes = [c_void_p, c_void_p, c_uint64, c_int]
H.hipStreamWaitValue64.argtypes = [c_void_p, c_void_p, c_uint64, c_int, c_uint64]
def capture_graph(s, body):
    ok(H.hipStreamBeginCapture(s, 1)); body()
    g = c_void_p(); ok(H.hipStreamEndCapture(s, byref(g)))
    e = c_void_p(); ok(H.hipGraphInstantiate(byref(e), g, None, None, c_size_t(0))); return g, e
"""


def test_memops_run_at_capture_time_before_hip10(fake_hip):
    out = fake_run(
        fake_hip("full"),
        RAW
        + """
s, w = stream(), signal()
g, e = capture_graph(s, lambda: ok(H.hipStreamWriteValue64(s, w, 42, 0)))
sync(s)
at_capture = word(w).value
word(w).value = 0
ok(H.hipGraphLaunch(e, s)); sync(s)
print(json.dumps({"at_capture": at_capture, "after_replay": word(w).value}))
""",
        config="capture=eager",
    )
    assert out == {"at_capture": 42, "after_replay": 0}  # executed once, never replayed


@pytest.mark.parametrize("config, want", [("", [1, 2]), ("batch=unordered", [2, 1])])
def test_two_op_batch_node_order(fake_hip, config, want):
    """One node holding write(a := 1) and write(a := 2): in order a ends at 2; unordered, at 1.
    This is why gpusync-hip never puts two ops whose order matters in one node."""
    out = fake_run(
        fake_hip("full"),
        RAW
        + """
s, a = stream(), signal()
ops = (Op * 2)(Op(5, a, 1, 0), Op(5, a, 2, 0))
def body():
    st, gr, deps, n = c_int(), c_void_p(), c_void_p(), c_size_t()
    ok(H.hipStreamGetCaptureInfo_v2(s, byref(st), None, byref(gr), byref(deps), byref(n)))
    node = c_void_p()
    ok(H.hipGraphAddBatchMemOpNode(byref(node), gr, deps, n, byref(NodeParams(None, 2, ops, 0))))
    ok(H.hipStreamUpdateCaptureDependencies(s, byref(node), c_size_t(1), 1))
g, e = capture_graph(s, body)
ok(H.hipGraphLaunch(e, s)); sync(s)
print(json.dumps({"final": word(a).value}))
""",
        config=config,
    )
    assert out["final"] == want[-1]


@pytest.mark.parametrize("config, want", [("", 7), ("params=keep", 9)])
def test_batch_node_param_lifetime(fake_hip, config, want):
    """The caller changes its param array after adding the node: a deep copy replays 7,
    a kept pointer replays the new 9 (a freed array would replay garbage)."""
    out = fake_run(
        fake_hip("full"),
        RAW
        + """
s, a = stream(), signal()
ops = (Op * 1)(Op(5, a, 7, 0))
def body():
    st, gr, deps, n = c_int(), c_void_p(), c_void_p(), c_size_t()
    ok(H.hipStreamGetCaptureInfo_v2(s, byref(st), None, byref(gr), byref(deps), byref(n)))
    node = c_void_p()
    ok(H.hipGraphAddBatchMemOpNode(byref(node), gr, deps, n, byref(NodeParams(None, 1, ops, 0))))
    ok(H.hipStreamUpdateCaptureDependencies(s, byref(node), c_size_t(1), 1))
g, e = capture_graph(s, body)
ops[0].value64 = 9
ok(H.hipGraphLaunch(e, s)); sync(s)
print(json.dumps({"final": word(a).value}))
""",
        config=config,
    )
    assert out["final"] == want


@pytest.mark.parametrize("release, want_stale", [(False, True), (True, False)])
def test_late_payload_unless_released(fake_hip, release, want_stale):
    """payload=late: copy 8 bytes to host memory, then ring: a host thread that reacts to
    the doorbell reads the OLD payload unless a ReleaseToSystem event sat in between."""
    out = fake_run(
        fake_hip("full"),
        RAW
        + f"""
import threading
s, ready = stream(), signal()
src, dst = (c_uint64 * 1)(0xBEEF), (c_uint64 * 1)(0x0)
seen = []
def watcher():
    t0 = time.time()
    while word(ready).value == 0 and time.time() - t0 < 10: pass
    seen.append(dst[0])
t = threading.Thread(target=watcher); t.start()
from ctypes import addressof, c_uint
H.hipEventCreateWithFlags.argtypes = [c_void_p, c_uint]
ev = c_void_p(); ok(H.hipEventCreateWithFlags(byref(ev), 0x80000002))  # ReleaseToSystem | DisableTiming
H.hipMemcpyAsync.argtypes = [c_void_p, c_void_p, c_size_t, c_int, c_void_p]
ok(H.hipMemcpyAsync(addressof(dst), addressof(src), 8, 2, s))  # device -> host
if {release}:
    ok(H.hipEventRecord(ev, s))
ok(H.hipStreamWriteValue64(s, ready, 1, 0))
t.join(); sync(s)
print(json.dumps({{"seen": seen[0], "after_sync": dst[0]}}))
""",
        config="payload=late;late_ms=300",  # a wide window: the watcher is a Python thread
    )
    assert (out["seen"] == 0) == want_stale and out["after_sync"] == 0xBEEF


def test_waits_are_bounded(fake_hip):
    out = fake_run(
        fake_hip("full"),
        """
d = _native.Device(0)
b = _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)   # no coordinator: nobody answers
s = d._stream_create()
b.submit(P["memop"], s, 0, 1); b.wait(P["memop"], s)
t = time.time()
ok = b.sync(s, 0.3)
dt = time.time() - t
done = b.load_word(b.words["done"])
drained = d.sync(s, 5.0)
d._stream_destroy(s)
print(json.dumps({"ok": ok, "dt": dt, "done": done, "drained": drained, "peek": _native._peek_error()}))
""",
    )
    assert out["ok"] is False and out["dt"] < 5.0
    assert out["done"] == 0x7FFFFFFFFFFFFFFF and out["drained"]  # released like a shutdown
    assert out["peek"] == 0


def test_bad_task_is_rejected(fake_hip):
    out = fake_run(
        fake_hip("full"),
        """
d = _native.Device(0)
b = _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
errs = []
for layer, T in ((3, 1), (0, 0), (0, 9)):
    try:
        b.submit(P["memop"], 0, layer, T)
    except g.GpuSyncError as e:
        errs.append(str(e))
try:
    b.set_replay_safe(P["host-func"], True)
except g.GpuSyncError as e:
    errs.append(str(e))
print(json.dumps(errs))
""",
    )
    assert len(out) == 4 and all("need layer < 3 and 1 <= num_tokens <= max_tokens=8" in e for e in out[:3])
    assert "host-func is never replay-safe on ROCm" in out[3]
