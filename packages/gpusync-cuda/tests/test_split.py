"""The copy step in two halves (Iob.step_submit, Iob.step_finish; CudaSync.submit / finish) without a GPU:
on the fake libcuda the split captures exactly the graph step captures (same nodes, same order, same edges)
with the fork on and off, another stream operation between the halves lands between the doorbell and the wait,
eager split steps equal the executor's synchronous decode with slow copies, every call of either half failing
in turn names the call and leaves the block usable, and the checks run before anything is enqueued. The pending-step
rules of CudaSync.submit / finish are StepSync's (cpumoe_executor.sync_torch), tested once for every backend in
moe-engine-glue's tests/test_step_sync.py."""


import pytest
from conftest import fake_run

PRELUDE = """ex.start_coordinator()
d = _native.Device(0)
b = _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
scratch = np.zeros(8, np.uint64)  # a registered word the caller's "other GPU work" writes between the halves
scratch_d = d._host_register(scratch.ctypes.data, scratch.nbytes)

def step(path, s, layer, a, split=False, between=None):
    x, ids, w, y = a
    T = x.shape[0]
    if not split:
        return b.step(P[path], s, layer, T, x.ctypes.data, ids.ctypes.data, w.ctypes.data, y.ctypes.data)
    b.step_submit(P[path], s, layer, T, x.ctypes.data, ids.ctypes.data, w.ctypes.data)
    if between is not None:
        between()
    b.step_finish(P[path], s, T, y.ctypes.data)

def captured(s, body):
    d._capture_begin(s)
    try:
        body()
    finally:
        types = d._capture_end(s)
    return types, json.loads(lib.fake_cuda_last_graph())
"""


def fake(lib, code, **env):
    return fake_run(lib, PRELUDE, code, **env)


def ancestors(graph, i):
    seen, todo = set(), list(graph[i]["deps"])
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(graph[n]["deps"])
    return seen


@pytest.mark.parametrize("fork", ["0", "1"])
@pytest.mark.parametrize("path", ["memop", "host-func"])
def test_split_captures_the_same_graph_as_step(fake_libcuda, path, fork):
    out = fake(
        fake_libcuda,
        f"""
b.set_replay_safe(P["{path}"], True)
s = d._stream_create()
args = [inputs(1), inputs(3)]
def run(split, between=None):
    step("{path}", s, 0, args[0], split, between); step("{path}", s, 2, args[1], split, between)
t_step, g_step = captured(s, lambda: run(False))
t_split, g_split = captured(s, lambda: run(True))
mark = lambda: d._write64(s, scratch_d, 77)
t_mid, g_mid = captured(s, lambda: run(True, mark))
st = state()
d._stream_destroy(s)
io = {{k: ex.io_block()[k] for k in ("ready", "done")}}
print(json.dumps({{"step": [t_step, g_step], "split": [t_split, g_split], "mid": [t_mid, g_mid], "io": io,
                  "scratch": int(scratch_d), "capturing": st["capturing"]}}))
""",
        GPUSYNC_COPY_FORK=fork,
    )
    assert out["split"] == out["step"]  # node for node: types, what each does, its dependencies
    assert out["capturing"] == 0
    # With a write of the caller's between the halves: the same nodes plus that one, after the doorbell and
    # before the wait (stream order), and nothing else moved.
    g_step, g_mid = out["step"][1], out["mid"][1]
    extra = [i for i, n in enumerate(g_mid) if n["op"] == "write" and n["addr"] == out["scratch"]]
    assert len(extra) == 2 and len(g_mid) == len(g_step) + 2, g_mid
    kept = [n for i, n in enumerate(g_mid) if i not in extra]
    assert [(n["type"], n["op"]) for n in kept] == [(n["type"], n["op"]) for n in g_step]
    memop = path == "memop"
    for e in extra:
        ring = max(i for i in range(e) if (g_mid[i]["op"] == "write" and g_mid[i]["addr"] == out["io"]["ready"])
                   or (not memop and g_mid[i]["op"] == "host"))
        wait = min(i for i in range(e + 1, len(g_mid)) if g_mid[i]["op"] in ("wait", "host"))
        assert ring in ancestors(g_mid, e) and e in ancestors(g_mid, wait), (ring, e, wait)


@pytest.mark.parametrize("fork", ["0", "1"])
@pytest.mark.parametrize("path", ["memop", "host-func"])
def test_eager_split_matches_the_executor(fake_libcuda, path, fork):
    """Every copy sleeps 2 ms first: split steps with the caller's write between the halves equal the
    synchronous CPU result bit for bit, and the write ran."""
    out = fake(
        fake_libcuda,
        f"""
s = d._stream_create()
ok = []
for i, (layer, T) in enumerate(((0, 1), (2, 5), (1, 8), (2, 2))):
    a = inputs(T)
    served = ex.health()["served"]
    step("{path}", s, layer, a, True, lambda: d._write64(s, scratch_d, 100 + i))
    ok.append(b.sync(s, 20.0) and matches(layer, a) and ex.health()["served"] == served + 1
              and int(scratch[0]) == 100 + i)
d._stream_destroy(s)
h = ex.health()
print(json.dumps({{"ok": ok, "ready": h["ready"], "done": h["done"]}}))
""",
        GPUSYNC_COPY_FORK=fork,
        FAKE_CUDA_COPY_DELAY_US="2000",
    )
    assert out["ok"] == [True] * 4
    assert out["ready"] == 0 and out["done"] == 1


# The driver calls of each half of a serial memop step, in order, with what the error must name.
SUBMIT_CALLS = [
    ("cuMemcpyDtoHAsync", 1, "cuMemcpyDtoHAsync(x -> IO block)"),
    ("cuMemcpyDtoHAsync", 2, "cuMemcpyDtoHAsync(ids -> IO block)"),
    ("cuMemcpyDtoHAsync", 3, "cuMemcpyDtoHAsync(w -> IO block)"),
    ("cuStreamWriteValue64", 1, "cuStreamWriteValue64(done := 0)"),
    ("cuStreamWriteValue64", 2, "cuStreamWriteValue64(ready := 0x100000002)"),
]
FINISH_CALLS = [
    ("cuStreamWaitValue64", 1, "cuStreamWaitValue64(done >= 1, GEQ)"),
    ("cuMemcpyHtoDAsync", 1, "cuMemcpyHtoDAsync(IO block y -> y)"),
]


def test_each_call_of_the_halves_failing(fake_libcuda):
    """Each call failing in turn, eagerly and under capture: the half that issues it raises naming the call (and
    the capture), the capture ends cleanly, and after the task (if it rang) is answered the next split step on
    the same block is correct."""
    calls = [(n, k, "submit") for n, k, _ in SUBMIT_CALLS] + [(n, k, "finish") for n, k, _ in FINISH_CALLS]
    out = fake(
        fake_libcuda,
        f"""
b.set_replay_safe(P["memop"], True)
s = d._stream_create()
res = []
for mode in ("eager", "capture"):
    for name, nth, half in {calls!r}:
        lib.fake_cuda_fail(name.encode(), nth, 999)
        if mode == "capture":
            d._capture_begin(s)
        served = ex.health()["served"]
        x, ids, w, y = inputs(2)
        failed, err = None, None
        try:
            b.step_submit(P["memop"], s, 1, 2, x.ctypes.data, ids.ctypes.data, w.ctypes.data)
        except g.GpuSyncError as e:
            failed, err = "submit", str(e)
        if failed is None:
            try:
                b.step_finish(P["memop"], s, 2, y.ctypes.data)
            except g.GpuSyncError as e:
                failed, err = "finish", str(e)
        end = None
        if mode == "capture":
            try:
                d._capture_end(s)
                end = "ok"
            except g.GpuSyncError as e:
                end = str(e)
        drained = b.sync(s, 10.0)
        if mode == "eager" and failed == "finish":  # the doorbell rang: let that task finish (one in flight)
            t = time.time()
            while ex.health()["served"] == served and time.time() - t < 10:
                time.sleep(0.001)
        a = inputs(3)
        step("memop", s, 2, a, True)
        res.append({{"mode": mode, "call": [name, nth, half], "failed": failed, "err": err, "end": end,
                     "armed": state()["fail_armed"], "after": drained and b.sync(s, 10.0) and matches(2, a)}})
d._stream_destroy(s)
print(json.dumps({{"res": res, "final": state()}}))
""",
    )
    want = {(n, k): w for n, k, w in SUBMIT_CALLS + FINISH_CALLS}
    assert len(out["res"]) == 2 * len(want)
    for r in out["res"]:
        name, nth, half = r["call"]
        where = f"{r['mode']} {name}#{nth}"
        assert r["failed"] == half, (where, r)
        assert r["err"] and f"{want[(name, nth)]} failed: CUDA_ERROR_UNKNOWN" in r["err"], (where, r["err"])
        assert ("[stream is capturing" in r["err"]) == (r["mode"] == "capture"), (where, r["err"])
        assert not r["armed"] and r["end"] == (None if r["mode"] == "eager" else "ok"), (where, r)
        assert r["after"], where
    assert out["final"]["capturing"] == 0


def test_halves_check_before_enqueuing(fake_libcuda):
    """Refused with the reason and nothing enqueued: a kernel or eager path, a bad task, a bad num_tokens for
    finish, capture on an unproven path (each half on its own), a path the driver lacks."""
    out = fake(
        fake_libcuda,
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
served = ex.health()["served"]
sub = lambda path, layer=0, T=2: b.step_submit(P[path], s, layer, T, x.ctypes.data, ids.ctypes.data, w.ctypes.data)
fin = lambda path, T=2: b.step_finish(P[path], s, T, y.ctypes.data)
attempt("submit kernel", lambda: sub("kernel"))
attempt("submit eager", lambda: sub("eager"))
attempt("finish kernel", lambda: fin("kernel"))
attempt("submit layer", lambda: sub("memop", layer=3))
attempt("submit T", lambda: sub("memop", T=9))
attempt("finish T0", lambda: fin("memop", T=0))
attempt("finish T9", lambda: fin("memop", T=9))
d._capture_begin(s)
attempt("submit capture", lambda: sub("memop"))
attempt("finish capture", lambda: fin("host-func"))
types = d._capture_end(s)
ok = b.sync(s, 5.0)
print(json.dumps({"errs": errs, "types": types, "served": ex.health()["served"] - served, "y_untouched":
                  bool((y == 0x7FC1).all()), "ok": ok, "done": ex.health()["done"]}))
""",
    )
    e = out["errs"]
    assert e["submit kernel"] == ["GpuSyncError", "step_submit: path kernel is not a copy path"]
    assert e["submit eager"] == ["GpuSyncError", "step_submit: path eager is not a copy path"]
    assert e["finish kernel"] == ["GpuSyncError", "step_finish: path kernel is not a copy path"]
    for k in ("submit layer", "submit T"):
        assert "need layer < 3 and 1 <= num_tokens <= max_tokens=8" in e[k][1], e[k]
    assert e["finish T0"][1] == "step_finish: num_tokens=0: need 1 <= num_tokens <= max_tokens=8"
    assert e["finish T9"][1].startswith("step_finish: num_tokens=9")
    for k, half, path in (("submit capture", "step_submit", "memop"), ("finish capture", "step_finish", "host-func")):
        assert e[k][0] == "CaptureRefusedError" and e[k][1].startswith(f"{half}: capture refused: the {path} "), e[k]
        assert "--cuda-graph-max-bs 0" in e[k][1]
    assert out["types"] == {}  # nothing was recorded
    assert out["served"] == 0 and out["y_untouched"] and out["ok"] and out["done"] == 1
