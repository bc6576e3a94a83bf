"""The copy step's fork/join (GPUSYNC_COPY_FORK) on the fake libcuda: the
captured graph's edges with the fork on (x, ids, w and done := 0 concurrent,
the doorbell after all of them) and off (one chain), replays and eager steps
bit-identical with copies slowed down (a missing edge loses the race), every
new driver call failing in turn (a clear error, no capture left open, nothing
leaked, the block still usable), and a bad value of the variable."""


import pytest
from conftest import fake_run

PRELUDE = """
def step(b, path, s, layer, args):
    x, ids, w, y = args
    b.step(P[path], s, layer, x.shape[0], x.ctypes.data, ids.ctypes.data, w.ctypes.data, y.ctypes.data)

def open_block():  # coordinator running, device 0, the executor's IO block registered
    ex.start_coordinator()
    d = _native.Device(0)
    return d, _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
"""

FORK = {"1": "copies forked (GPUSYNC_COPY_FORK=1", "0": "copies serial (GPUSYNC_COPY_FORK=0)"}


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


def label(node, io, hosts):
    if node["op"] == "copy":
        into = {io["x"]: "x", io["ids"]: "ids", io["w"]: "w"}.get(node["dst"])
        return into or ("y" if node["src"] == io["y"] else "?")
    if node["op"] == "write":
        return {io["done"]: "done:=0", io["ready"]: "ready"}.get(node["addr"], "?")
    if node["op"] == "host":  # hostfn_submit then hostfn_wait, in each step
        hosts.append(node)
        return "ring" if len(hosts) % 2 else "wait"
    return node["op"]


@pytest.mark.parametrize("fork", ["1", "0"])
@pytest.mark.parametrize("path", ["memop", "host-func"])
def test_captured_step_graph(fake_libcuda, path, fork):
    out = fake(
        fake_libcuda,
        f"""
d, b = open_block()
b.set_replay_safe(P["{path}"], True)
s = d._stream_create()
args = [inputs(1), inputs(3)]
d._capture_begin(s)
step(b, "{path}", s, 0, args[0]); step(b, "{path}", s, 2, args[1])
types = d._capture_end(s)
st = state()
d._stream_destroy(s)
io = {{k: ex.io_block()[k] for k in ("x", "ids", "w", "y", "ready", "done")}}
print(json.dumps({{"types": types, "graph": json.loads(lib.fake_cuda_last_graph()), "io": io, "state": st}}))
""",
        GPUSYNC_COPY_FORK=fork,
    )
    graph, hosts = out["graph"], []
    names = [label(n, out["io"], hosts) for n in graph]
    memop = path == "memop"
    one = ["x", "ids", "w"] + (["done:=0", "ready", "wait"] if memop else ["ring", "wait"]) + ["y"]
    assert names == one * 2, names  # creation order: the same nodes either way
    assert out["types"] == ({"1": 8, "12": 6} if memop else {"1": 8, "3": 4})  # no extra nodes for events
    assert out["state"]["capturing"] == 0  # the side streams left the capture with it
    n = len(one)
    for k in range(2):
        at = {name: k * n + i for i, name in enumerate(one)}
        before = set(range(k * n))  # every node of the previous step
        ring = at["ready" if memop else "ring"]
        inputs_ = [at[c] for c in ("x", "ids", "w", "done:=0") if c in at]
        # The protocol, either way: the doorbell after every copy (and done := 0), done := 0 after the
        # previous step's wait, the wait after the doorbell, y after the wait.
        assert set(inputs_) <= ancestors(graph, ring)
        assert all(before <= ancestors(graph, i) for i in inputs_)
        assert ancestors(graph, at["y"]) >= {at["wait"], ring}
        if fork == "1":
            # Siblings: each depends on the previous step's last node and on nothing of its own step (a side
            # stream's set is the union of its own last node and the fork's, as in CUDA: the extra edge from the
            # previous step's copy on that stream is implied by the first).
            for i in inputs_:
                deps = set(graph[i]["deps"])
                assert (k * n - 1 in deps if k else not deps) and deps <= before, (names[i], graph[i])
            # The doorbell joins them all (host-func: s itself queued nothing since the fork, so its own last
            # node, the previous step's y copy, is a dependency too).
            assert set(inputs_) <= set(graph[ring]["deps"]) <= set(inputs_) | {k * n - 1}
        else:
            for i in range(k * n, (k + 1) * n):
                assert graph[i]["deps"] == ([i - 1] if i else []), (names[i], graph[i])


@pytest.mark.parametrize("fork", ["1", "0"])
@pytest.mark.parametrize("path", ["memop", "host-func"])
def test_slow_copies_stay_ordered(fake_libcuda, path, fork):
    """Every copy sleeps 3 ms first: eager steps and the probe's replays (each graph node on its own thread,
    started when its dependencies are done) still match the synchronous CPU result bit for bit."""
    out = fake(
        fake_libcuda,
        f"""
d, b = open_block()
s = d._stream_create()
ok = []
for layer, T in ((0, 1), (2, 5), (1, 8)):
    a = inputs(T)
    served = ex.health()["served"]
    step(b, "{path}", s, layer, a)
    ok.append(b.sync(s, 20.0) and matches(layer, a) and ex.health()["served"] == served + 1)
safe, report = b.probe(P["{path}"], 20.0)
d._stream_destroy(s)
h = ex.health()
print(json.dumps({{"ok": ok, "safe": safe, "report": report, "ready": h["ready"], "done": h["done"]}}))
""",
        GPUSYNC_COPY_FORK=fork,
        FAKE_CUDA_COPY_DELAY_US="3000",
    )
    assert out["ok"] == [True] * 3
    assert out["safe"], out["report"]
    assert FORK[fork] in out["report"] and "3 replays with changed inputs bit-identical" in out["report"]
    assert out["ready"] == 0 and out["done"] == 1  # nothing pending


# Every driver call of a forked memop step, in order, with what its error must name.
FORKED_STEP_CALLS = [
    ("cuEventRecord", 1, "cuEventRecord(copy fork, caller's stream)"),
    ("cuStreamWaitEvent", 1, "cuStreamWaitEvent(side stream for x waits for the fork)"),
    ("cuStreamWaitEvent", 2, "cuStreamWaitEvent(side stream for ids waits for the fork)"),
    ("cuStreamWaitEvent", 3, "cuStreamWaitEvent(side stream for w waits for the fork)"),
    ("cuMemcpyDtoHAsync", 1, "cuMemcpyDtoHAsync(x -> IO block, side stream)"),
    ("cuMemcpyDtoHAsync", 2, "cuMemcpyDtoHAsync(ids -> IO block, side stream)"),
    ("cuMemcpyDtoHAsync", 3, "cuMemcpyDtoHAsync(w -> IO block, side stream)"),
    ("cuStreamWriteValue64", 1, "cuStreamWriteValue64(done := 0)"),
    ("cuEventRecord", 2, "cuEventRecord(copy join, side stream for x)"),
    ("cuStreamWaitEvent", 4, "cuStreamWaitEvent(caller's stream waits for the x copy)"),
    ("cuEventRecord", 3, "cuEventRecord(copy join, side stream for ids)"),
    ("cuStreamWaitEvent", 5, "cuStreamWaitEvent(caller's stream waits for the ids copy)"),
    ("cuEventRecord", 4, "cuEventRecord(copy join, side stream for w)"),
    ("cuStreamWaitEvent", 6, "cuStreamWaitEvent(caller's stream waits for the w copy)"),
    ("cuStreamWriteValue64", 2, "cuStreamWriteValue64(ready := 0x100000002)"),
    ("cuStreamWaitValue64", 1, "cuStreamWaitValue64(done >= 1, GEQ)"),
    ("cuMemcpyHtoDAsync", 1, "cuMemcpyHtoDAsync(IO block y -> y)"),
]


def test_each_call_of_a_forked_step_failing(fake_libcuda):
    """Each call failing in turn, eagerly and under capture: the error names the call (and the capture), the
    capture ends cleanly (no side stream left in it), the armed failure was the one hit, and the next eager
    step on the same block is correct; afterwards no stream or event is left over."""
    out = fake(
        fake_libcuda,
        f"""
ex.start_coordinator()
calls = {[(n, k) for n, k, _ in FORKED_STEP_CALLS]!r}
rang = {{("cuStreamWaitValue64", 1), ("cuMemcpyHtoDAsync", 1)}}  # failing after ready := task
d = _native.Device(0)
base = state()
b = _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
b.set_replay_safe(P["memop"], True)
s = d._stream_create()
res = []
for mode in ("eager", "capture"):
    for name, nth in calls:
        lib.fake_cuda_fail(name.encode(), nth, 999)
        if mode == "capture":
            d._capture_begin(s)
        served = ex.health()["served"]
        try:
            step(b, "memop", s, 1, inputs(2))
            err = None
        except g.GpuSyncError as e:
            err = str(e)
        end = None
        if mode == "capture":
            try:
                d._capture_end(s)
                end = "ok"
            except g.GpuSyncError as e:
                end = str(e)
        armed, capturing = state()["fail_armed"], state()["capturing"]
        drained = b.sync(s, 10.0)
        if mode == "eager" and (name, nth) in rang:  # the doorbell rang: let that task finish (one in flight)
            t = time.time()
            while ex.health()["served"] == served and time.time() - t < 10:
                time.sleep(0.001)
            drained = drained and ex.health()["served"] == served + 1
        a = inputs(3)
        step(b, "memop", s, 2, a)  # the block and its side streams still work
        res.append({{"mode": mode, "call": [name, nth], "err": err, "end": end, "armed": armed,
                     "capturing": capturing, "after": drained and b.sync(s, 10.0) and matches(2, a)}})
d._stream_destroy(s)
del b
gc.collect()
print(json.dumps({{"res": res, "base": base, "final": state()}}))
""",
        GPUSYNC_COPY_FORK="1",
    )
    want = {(n, k): w for n, k, w in FORKED_STEP_CALLS}
    assert len(out["res"]) == 2 * len(FORKED_STEP_CALLS)
    for r in out["res"]:
        name, nth = r["call"]
        where = f"{r['mode']} {name}#{nth}"
        assert r["err"] and f"{want[(name, nth)]} failed: CUDA_ERROR_UNKNOWN" in r["err"], (where, r["err"])
        assert ("[stream is capturing" in r["err"]) == (r["mode"] == "capture"), (where, r["err"])
        assert not r["armed"] and r["capturing"] == 0, (where, r)
        assert r["end"] == (None if r["mode"] == "eager" else "ok"), (where, r["end"])
        assert r["after"], where
    base, final = out["base"], out["final"]
    assert (final["streams"], final["events"], final["graphs"]) == (base["streams"], base["events"], base["graphs"])


@pytest.mark.parametrize("fork", ["1", "0"])
def test_side_streams_and_events_are_created_and_released(fake_libcuda, fork):
    """Fork on: 3 side streams and 4 events per block, released with it; off: none. Each creation call failing in
    turn: a clear error, nothing left (no stream, event or registration)."""
    out = fake(
        fake_libcuda,
        """
d = _native.Device(0)
base = state()
b = _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
live = state()
del b
gc.collect()
after = state()
fails = []
for name, nth in [("cuStreamCreate", k) for k in (1, 2, 3)] + [("cuEventCreate", k) for k in (1, 2, 3, 4)]:
    lib.fake_cuda_fail(name.encode(), nth, 999)
    try:
        _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
        err = None
    except g.GpuSyncError as e:
        err = str(e)
    gc.collect()
    fails.append({"call": [name, nth], "err": err, "state": state()})
lib.fake_cuda_fail(b"cuEventDestroy", 1, 999)  # teardown: a failing release does not stop the others
b = _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
del b
gc.collect()
print(json.dumps({"base": base, "live": live, "after": after, "fails": fails, "teardown": state()}))
""",
        GPUSYNC_COPY_FORK=fork,
    )
    base, live = out["base"], out["live"]
    on = fork == "1"
    assert live["streams"] - base["streams"] == (3 if on else 0) and live["events"] - base["events"] == (4 if on else 0)
    assert live["registered"] == base["registered"] + 1
    assert out["after"] == base
    names = [
        "copy side stream for x",
        "copy side stream for ids",
        "copy side stream for w",
        "copy fork event",
        "copy join event for x",
        "copy join event for ids",
        "copy join event for w",
    ]
    for f, what in zip(out["fails"], names):
        if on:
            assert f["err"] and what in f["err"] and "failed: CUDA_ERROR_UNKNOWN" in f["err"], f
        else:  # nothing is created: the armed failure is never reached
            assert f["err"] is None, f
        st = dict(f["state"], fail_armed=False)
        assert st == base, f
    td = out["teardown"]
    assert td["streams"] == base["streams"] and td["registered"] == base["registered"]
    assert td["events"] == base["events"] + (1 if on else 0)  # only the event whose release failed
    said = "cuEventDestroy(copy join event for x) failed at teardown: CUDA_ERROR_UNKNOWN"
    assert (said in out["stderr"]) == on, out["stderr"]


def test_bad_copy_fork_value_is_refused(fake_libcuda):
    code = """
d = _native.Device(0)
try:
    _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
    err = None
except g.GpuSyncError as e:
    err = str(e)
try:
    s = g.CudaSync(ex, paths=("memop", "eager"), qualify=False)
    path, memop, py_err = s.path, s.reasons["memop"], None
    s.close()
except ValueError as e:
    path = memop = None
    py_err = str(e)
print(json.dumps({"err": err, "py_err": py_err, "path": path, "memop": memop, "state": state()}))
"""
    for bad in ("2", "yes", " 1", "true"):
        out = fake(fake_libcuda, code, GPUSYNC_COPY_FORK=bad)
        assert out["err"] and f"GPUSYNC_COPY_FORK='{bad}': expected 0" in out["err"] and "or 1" in out["err"], out
        # CudaSync refuses it up front with a ValueError naming the variable and the accepted values.
        assert out["path"] is None and f"GPUSYNC_COPY_FORK='{bad}': expected 0" in out["py_err"], out
        assert out["state"]["streams"] == 0 and out["state"]["events"] == 0
    for good, mode in (("", "0"), ("1", "1"), ("0", "0")):  # unset or empty: serial, the default
        out = fake(fake_libcuda, code, GPUSYNC_COPY_FORK=good)
        assert out["err"] is None and out["py_err"] is None, (good, out)
        assert out["path"] == "memop" and FORK[mode] in out["memop"], (good, out)
