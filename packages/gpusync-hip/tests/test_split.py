"""The copy step in two halves (Iob.step_submit, Iob.step_finish; HipSync.submit / finish) on the fake HIP
runtime, without a GPU: the fake's trace (every stream operation in issue order) shows that the split issues
exactly what step issues, in the same order, eagerly and under capture with native memops or spliced
batch-memop nodes: the three device-to-host copies, the system-release event, then the doorbell (submit);
the wait, then the host-to-device copy (finish). Another stream operation between the halves lands between
the doorbell and the wait; captured split graphs replay bit-identical to the executor with a late payload;
every call of either half failing in turn names the call, leaves no HIP error behind and the block usable;
the checks run before anything is enqueued. The pending-step rules of HipSync.submit / finish are StepSync's
(cpumoe_executor.sync_torch), tested once for every backend in moe-engine-glue's tests/test_step_sync.py."""


import pytest
from conftest import fake_run

SETUP = """
from ctypes import c_void_p, c_size_t, c_int
FAKE.fakehip_trace.restype = ctypes.c_char_p
FAKE.hipMemcpyAsync.argtypes = [c_void_p, c_void_p, c_size_t, c_int, c_void_p]
def trace(): return json.loads(FAKE.fakehip_trace())
d = _native.Device(0)
b = _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
words = b.words
ex.start_coordinator(ready=words["ready"], done=words["done"])
import atexit
atexit.register(ex.stop_coordinator)  # off the signal words before the block (and they) are freed
rng = np.random.default_rng(5)
mark_src, mark_dst = np.arange(16, dtype=np.uint8), np.zeros(16, np.uint8)

def inputs(T, cpu=True):
    x = rng.standard_normal((T, ex.H)).astype(np.float32).astype(cf.numerics.BF16)
    ids = rng.integers(-1, ex.E, (T, ex.top_k)).astype(np.int32)
    if cpu:
        ids[:, 0] = rng.integers(0, ex.E, T)  # at least one CPU route
    else:
        ids[...] = -1  # no CPU route: the coordinator zeroes y without waking workers
    w = rng.random((T, ex.top_k), dtype=np.float32)
    return x, ids, w, np.full((T, ex.H), 0x7FC1, np.uint16)  # y poisoned

def refill(a, cpu=True):
    x, ids, w, y = a
    n = inputs(x.shape[0], cpu)
    for dst, src in zip(a, n):
        dst[...] = src

def mark(s):  # the caller's other GPU work between the halves: a copy of its own
    assert FAKE.hipMemcpyAsync(mark_dst.ctypes.data, mark_src.ctypes.data, 16, 0, s) == 0

def step(path, s, layer, a, split=False, between=None):
    x, ids, w, y = a
    T = x.shape[0]
    if not split:
        return b.step(P[path], s, layer, T, x.ctypes.data, ids.ctypes.data, w.ctypes.data, y.ctypes.data)
    b.step_submit(P[path], s, layer, T, x.ctypes.data, ids.ctypes.data, w.ctypes.data)
    if between is not None:
        between(s)
    b.step_finish(P[path], s, T, y.ctypes.data)

def matches(layer, a):
    x, ids, w, y = a
    return bool((y == bits(ex.decode(layer, x, w, ids))).all())

def names(tr, a):
    # each traced operation named after what it moves or rings
    x, ids, w, y = a
    io = ex.io_block()
    out = []
    for op in tr:
        k = op["op"]
        if k == "copy":
            out.append({x.ctypes.data: "x", ids.ctypes.data: "ids", w.ctypes.data: "w"}.get(op["src"])
                       or ("y" if op["dst"] == y.ctypes.data else "mark" if op["dst"] == mark_dst.ctypes.data
                           else "copy?"))
        elif k in ("write", "wait"):
            word = {words["ready"]: "ready", words["done"]: "done"}.get(op["addr"], "?")
            out.append(f"{k} {word}" + (" := 0" if k == "write" and op["value"] == 0 else ""))
        elif k == "batch":
            (o, addr, v), = op["ops"]
            word = {words["ready"]: "ready", words["done"]: "done"}.get(addr, "?")
            out.append(("write " if o == 5 else "wait ") + word + (" := 0" if o == 5 and v == 0 else ""))
        elif k == "event":
            out.append("release" + (" (external)" if op["flags"] == 1 else "") if op["release"] else "event")
        else:
            out.append(k)
    return out
"""


def fake(lib, code, config=""):
    return fake_run(lib, SETUP + code, config=config)


MEMOP = ["x", "ids", "w", "release", "write done := 0", "write ready", "wait done", "y"]
HOSTFN = ["x", "ids", "w", "release", "host", "host", "y"]


@pytest.mark.parametrize("path", ["memop", "host-func"])
def test_eager_split_issues_what_step_issues(fake_hip, path):
    out = fake(
        fake_hip("full"),
        f"""
s = d._stream_create()
res = {{}}
for mode in ("step", "split", "between"):
    a = inputs(3)
    FAKE.fakehip_trace_clear()
    step("{path}", s, 2, a, mode != "step", mark if mode == "between" else None)
    ok = b.sync(s, 10.0) and matches(2, a)
    tr = trace()
    res[mode] = {{"names": names(tr, a), "ok": ok, "streams": sorted({{op["stream"] for op in tr}}),
                  "tasks": [op["value"] for op in tr if op["op"] == "write" and op["addr"] == words["ready"]]}}
res["mark"] = bool((mark_dst == mark_src).all())
res["peek"] = _native._peek_error()
d._stream_destroy(s)
print(json.dumps(res))
""",
        config="payload=late;late_ms=20",  # copies reach the host only at the release event (or too late)
    )
    want = MEMOP if path == "memop" else HOSTFN
    assert out["step"]["names"] == want, out["step"]
    assert out["split"] == out["step"]
    assert out["step"]["tasks"] == ([(2 << 32) | 3] if path == "memop" else [])
    # the caller's copy sits after the doorbell and before the wait
    ring = want.index("write ready" if path == "memop" else "host")
    assert out["between"]["names"] == want[: ring + 1] + ["mark"] + want[ring + 1 :], out["between"]
    assert all(out[m]["ok"] for m in ("step", "split", "between")) and out["mark"]
    assert len(out["step"]["streams"]) == 1 and out["peek"] == 0


@pytest.mark.parametrize(
    "config, mechanism",
    [("capture=record;payload=late;late_ms=20", "native"), ("capture=eager;payload=late;late_ms=20", "splice")],
    ids=["native-memops", "spliced-nodes"],
)
def test_captured_split_issues_what_step_issues_and_replays(fake_hip, config, mechanism):
    """Under capture (native memop nodes, or spliced batch-memop nodes where the runtime runs memops at
    capture time): the same nodes in the same order as step, the release event an external event-record node
    before the doorbell; the split graph (the caller's copy between the halves) replays 4 times with fresh
    inputs bit-identical to the executor, a step with no CPU route among them."""
    out = fake(
        fake_hip("full"),
        f"""
b.mechanism = _native.MECHANISMS["{mechanism}"]
b.set_replay_safe(P["memop"], True)
s = d._stream_create()
bufs = [(0, inputs(2)), (2, inputs(5)), (1, inputs(3, cpu=False))]
for layer, a in bufs:  # eager once: each task's release event exists before any capture
    step("memop", s, layer, a, True)
assert b.sync(s, 10.0)
res = {{}}
graphs = {{}}
for mode in ("step", "split", "between"):
    FAKE.fakehip_trace_clear()
    d._capture_begin(s)
    for layer, a in bufs:
        step("memop", s, layer, a, mode != "step", mark if mode == "between" else None)
    graphs[mode] = d._capture_end(s)
    tr = trace()
    per = len(tr) // len(bufs)  # each step issues the same operations
    res[mode] = {{"names": sum((names(tr[i * per:(i + 1) * per], a) for i, (_l, a) in enumerate(bufs)), []),
                  "cap": sorted({{op["cap"] for op in tr}}), "n": len(tr)}}
exe = d._graph_instantiate(graphs["between"])
ok = []
for r in range(4):
    for layer, a in bufs:
        refill(a, cpu=layer != 1)
    mark_dst[...] = 0
    d._graph_launch(exe, s)
    assert b.sync(s, 10.0)
    ok.append([matches(layer, a) for layer, a in bufs] + [bool((mark_dst == mark_src).all())])
d._graph_destroy(0, exe)
for g_ in graphs.values():
    d._graph_destroy(g_, 0)
d._stream_destroy(s)
st = stats()
res.update(ok=ok, peek=_native._peek_error(), live_graphs=st["live_graphs"], live_execs=st["live_execs"])
print(json.dumps(res))
""",
        config=config,
    )
    one = ["x", "ids", "w", "release (external)", "write done := 0", "write ready", "wait done", "y"]
    assert out["step"]["names"] == one * 3, out["step"]
    assert out["split"] == out["step"]
    assert out["step"]["cap"] == [1]
    assert out["between"]["names"] == (one[:6] + ["mark"] + one[6:]) * 3, out["between"]
    assert out["ok"] == [[True] * 4] * 4, out["ok"]
    assert out["peek"] == 0 and out["live_graphs"] == 0 and out["live_execs"] == 0


# Every HIP call of a memop step's halves, in order: (api, nth call since configure, what the error names, half).
CALLS = [
    ("hipMemcpyAsync", 1, "hipMemcpyAsync(x -> IO block)", "submit"),
    ("hipMemcpyAsync", 2, "hipMemcpyAsync(ids -> IO block)", "submit"),
    ("hipMemcpyAsync", 3, "hipMemcpyAsync(w -> IO block)", "submit"),
    ("hipEventRecord", 1, "hipEventRecord(system-release event)", "submit"),
    ("hipStreamWriteValue64", 1, "hipStreamWriteValue64(done := 0)", "submit"),
    ("hipStreamWriteValue64", 2, "hipStreamWriteValue64(ready := 0x100000002)", "submit"),
    ("hipStreamWaitValue64", 1, "hipStreamWaitValue64(done >= 1, Gte)", "finish"),
    ("hipMemcpyAsync", 4, "hipMemcpyAsync(IO block y -> y)", "finish"),
]


def test_each_call_of_the_halves_failing(fake_hip):
    """The half that issues the failing call raises naming it; no HIP error is left on the thread; once the task
    (when it rang) is answered, the next split step on the same block is bit-identical."""
    out = fake(
        fake_hip("full"),
        f"""
s = d._stream_create()
a = inputs(2)
step("memop", s, 1, a, True)  # the task's release event exists (its creation is not what fails here)
assert b.sync(s, 10.0)
res = []
for api, nth, _what, _half in {[(a, n, w, h) for a, n, w, h in CALLS]!r}:
    configure(f"fail={{api}}@{{nth}}")
    served = ex.health()["served"]
    x, ids, w, y = inputs(2)
    failed = err = None
    try:
        b.step_submit(P["memop"], s, 1, 2, x.ctypes.data, ids.ctypes.data, w.ctypes.data)
    except g.GpuSyncError as e:
        failed, err = "submit", str(e)
    if failed is None:
        try:
            b.step_finish(P["memop"], s, 2, y.ctypes.data)
        except g.GpuSyncError as e:
            failed, err = "finish", str(e)
    peek = _native._peek_error()
    configure("")
    drained = b.sync(s, 10.0)
    if failed == "finish":  # the doorbell rang: let that task finish (one in flight)
        t = time.time()
        while ex.health()["served"] == served and time.time() - t < 10:
            time.sleep(0.001)
    a = inputs(3)
    step("memop", s, 2, a, True)
    res.append({{"failed": failed, "err": err, "peek": peek, "after": drained and b.sync(s, 10.0) and matches(2, a)}})
d._stream_destroy(s)
print(json.dumps({{"res": res, "peek": _native._peek_error()}}))
""",
    )
    assert len(out["res"]) == len(CALLS)
    for (api, nth, what, half), r in zip(CALLS, out["res"]):
        assert r["failed"] == half and r["err"] and f"{what} failed: hipErrorInvalidValue" in r["err"], (api, nth, r)
        assert r["peek"] == 0, (api, nth, r)  # the half consumed the error it created
        assert r["after"], (api, nth)
    assert out["peek"] == 0


def test_halves_check_before_enqueuing(fake_hip):
    out = fake(
        fake_hip("full"),
        """
s = d._stream_create()
x, ids, w, y = inputs(2)
errs = {}
def attempt(name, f):
    try:
        f()
        errs[name] = None
    except g.GpuSyncError as e:
        errs[name] = [type(e).__name__, str(e)]
sub = lambda path, layer=0, T=2: b.step_submit(P[path], s, layer, T, x.ctypes.data, ids.ctypes.data, w.ctypes.data)
fin = lambda path, T=2: b.step_finish(P[path], s, T, y.ctypes.data)
FAKE.fakehip_trace_clear()
attempt("submit kernel", lambda: sub("kernel"))
attempt("finish eager", lambda: fin("eager"))
attempt("submit layer", lambda: sub("memop", layer=3))
attempt("finish T0", lambda: fin("memop", T=0))
attempt("finish T9", lambda: fin("memop", T=9))
d._capture_begin(s)
attempt("submit capture", lambda: sub("memop"))
attempt("finish capture", lambda: fin("memop"))
attempt("submit host-func capture", lambda: sub("host-func"))
d._graph_destroy(d._capture_end(s), 0)
ok = b.sync(s, 5.0)
print(json.dumps({"errs": errs, "trace": trace(), "ok": ok, "y_untouched": bool((y == 0x7FC1).all()),
                  "peek": _native._peek_error()}))
""",
    )
    e = out["errs"]
    assert e["submit kernel"] == ["GpuSyncError", "step_submit: path kernel is not a copy path"]
    assert e["finish eager"] == ["GpuSyncError", "step_finish: path eager is not a copy path"]
    assert "need layer < 3 and 1 <= num_tokens <= max_tokens=8" in e["submit layer"][1]
    assert e["finish T0"][1] == "step_finish: num_tokens=0: need 1 <= num_tokens <= max_tokens=8"
    assert e["finish T9"][1].startswith("step_finish: num_tokens=9")
    for k, half in (("submit capture", "step_submit"), ("finish capture", "step_finish")):
        assert e[k][0] == "CaptureRefusedError" and e[k][1].startswith(f"{half}: capture refused: the memop "), e[k]
    assert "host-function nodes are never used under HIP graph capture" in e["submit host-func capture"][1]
    assert out["trace"] == [] and out["ok"] and out["y_untouched"] and out["peek"] == 0


def test_split_through_the_c_table(fake_hip, tmp_path):
    """ABI 1.1: step_submit and step_finish reached through the capsule's table (host-func path, no coordinator:
    the executor runs the task inside the host function) equal the executor bit for bit."""
    out = fake(
        fake_hip("full"),
        """
import ctypes as C
class Api(C.Structure):  # gpusync_api up to the 1.1 entries (abi.h's order)
    _fields_ = [("abi_major", C.c_uint32), ("abi_minor", C.c_uint32), ("struct_size", C.c_uint32),
                ("protocol_version", C.c_uint32), ("build_info", C.c_char_p), ("backend", C.c_char_p)] + \\
               [(f"f{i}", C.c_void_p) for i in range(23)] + [("step_submit", C.c_void_p), ("step_finish", C.c_void_p)]
get = C.pythonapi.PyCapsule_GetPointer
get.restype, get.argtypes = C.c_void_p, [C.py_object, C.c_char_p]
api = Api.from_address(get(g.C_API_CAPSULE, b"gpusync_hip._native._C_API_v1"))
SUB = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_int, C.c_uint64, C.c_uint32, C.c_uint32, C.c_uint64, C.c_uint64,
                  C.c_uint64)(api.step_submit)
FIN = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_int, C.c_uint64, C.c_uint32, C.c_uint64)(api.step_finish)
ex.stop_coordinator()
s = d._stream_create()
res = []
for layer, T in ((0, 1), (2, 4)):
    x, ids, w, y = a = inputs(T)
    rc1 = SUB(C.c_void_p(b.handle), P["host-func"], s, layer, T, x.ctypes.data, ids.ctypes.data, w.ctypes.data)
    rc2 = FIN(C.c_void_p(b.handle), P["host-func"], s, T, y.ctypes.data)
    res.append([rc1, rc2, b.sync(s, 10.0) and matches(layer, a)])
bad = FIN(C.c_void_p(b.handle), P["kernel"], s, 1, 0)
d._stream_destroy(s)
print(json.dumps({"abi": [api.abi_major, api.abi_minor], "size": api.struct_size, "want": C.sizeof(Api),
                  "res": res, "bad": bad}))
""",
    )
    assert out["abi"] == [1, 1] and out["size"] == out["want"]
    assert out["res"] == [[0, 0, True], [0, 0, True]]
    assert out["bad"] == -3  # GPUSYNC_E_INVALID: not a copy path
