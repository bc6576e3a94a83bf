"""The fault matrix (issue 5): gpusync-hip's start-up decision and recovery on the
fake HIP runtime, for each capture behaviour and each injected failure. Every
scenario runs in a fresh interpreter with a real bf16 CpuMoeExecutor whose
coordinator polls the signal words, and asserts explicitly on:
  - the probe's decision (path, mechanism, the reason naming the failed call),
  - no residual HIP error afterwards (hipPeekAtLastError == hipSuccess),
  - node rollback (the fake logs every EndCapture: nodes, unjoined nodes, result),
  - eager results still bit-identical to the executor's synchronous decode,
  - unsafe capture refused (CaptureRefusedError naming what to do),
  - and, where a copy path was chosen, graph replay with fresh inputs (two
    graphs, the second built after the first) bit-identical too.
CPU only."""

import pytest
from conftest import fake_run

SCENARIO = """
configure(CONFIG)
out = {}
try:
    s = g.HipSync(ex)
except g.GpuSyncError as e:
    out["raised"] = str(e)
    out["peek_after_raise"] = _native._peek_error()
    FAKE.hipGetLastError()  # the caller deals with its own error ...
    s = g.HipSync(ex)       # ... and then the handshake comes up
out["peek"] = _native._peek_error()  # before anything else can consume it
out["stats"] = stats()
out["path"], out["mechanism"], out["reasons"] = s.path, s.mechanism, s.reasons
out["eager"] = eager_matches(s)  # with the failure still injected
configure(";".join(kv for kv in CONFIG.split(";") if not kv.startswith(("fail=", "sticky="))))  # faults off

# Capture: a copy step on a private capturing stream is recorded only on a proven path.
d, b = s._dev, s._iob
st = d._stream_create()
rng = np.random.default_rng(5)
bufs = []
for layer, T in ((0, 2), (2, 5)):
    bufs.append((layer, T, np.zeros((T, ex.H), cf.numerics.BF16), np.zeros((T, ex.top_k), np.int32),
                 np.zeros((T, ex.top_k), np.float32), np.zeros((T, ex.H), np.uint16)))
def capture(i):
    layer, T, x, ids, w, y = bufs[i]
    d._capture_begin(st)
    try:
        b.step(P["memop"] if s.path.startswith("copy-") else P["host-func"], st, layer, T, x.ctypes.data,
               ids.ctypes.data, w.ctypes.data, y.ctypes.data)
    except g.CaptureRefusedError as e:
        d._graph_destroy(d._capture_end(st), 0)
        return str(e)
    gph = d._capture_end(st)
    return gph, d._graph_instantiate(gph)
graphs = [capture(0), capture(1)]  # graph 1 is built after graph 0: graph 0 must survive the rebuild
if isinstance(graphs[0], str):
    out["refused"] = graphs[0]
else:
    ok = []
    for r in range(4):
        for (layer, T, x, ids, w, y), (gph, exe) in zip(bufs, graphs):
            x[...] = rng.standard_normal(x.shape).astype(np.float32).astype(cf.numerics.BF16)  # in place
            ids[...] = rng.integers(-1, ex.E, ids.shape)
            w[...] = rng.random(w.shape, dtype=np.float32)
            y[...] = 0x7FC1
            d._graph_launch(exe, st)
            assert b.sync(st, 10.0)
            ok.append(bool((y == bits(ex.decode(layer, x, w, ids))).all()))
    out["replays"] = ok
    for gph, exe in graphs:
        d._graph_destroy(gph, exe)
d._stream_destroy(st)
out["peek_end"] = _native._peek_error()
out["pending"] = s.pending()
out["param_entries"] = b.param_entries
del d, b  # the last references are HipSync's: close() frees the words, events and registration
s.close()
out["stats_end"] = stats()
print(json.dumps(out))
"""

UPD, ADD, INFO = "hipStreamUpdateCaptureDependencies", "hipGraphAddBatchMemOpNode", "hipStreamGetCaptureInfo_v2"

# id: (fake config, path, mechanism, substrings of the copy reason, nodes rolled back)
MATRIX = {
    # capture behaviours, no failure
    "hip10_records_memops": ("capture=record", "copy-native", "native", ["memops are recorded under capture"], 0),
    "rocm7_runs_memops_at_capture": (
        "capture=eager",
        "copy-splice",
        "splice",
        ["run at once on a capturing stream and are not recorded"],
        0,
    ),
    "memops_dropped_in_capture": ("capture=drop", "copy-splice", "splice", ["silently dropped"], 0),
    "rocm7_batch_node_bugs_late_payload": (
        "capture=eager;batch=unordered;params=keep;payload=late",
        "copy-splice",
        "splice",
        ["splice: eager ok", "bit-identical"],
        0,
    ),
    "hip10_late_payload": ("capture=record;payload=late", "copy-native", "native", ["native: eager ok"], 0),
    # a failure injected at each API call in turn
    "add_node": (
        f"capture=eager;fail={ADD}",
        "host-func",
        "none",
        [f"{ADD}(done := 0) failed: hipErrorInvalidValue"],
        0,
    ),
    "update_dependencies": (
        f"capture=eager;fail={UPD}",
        "host-func",
        "none",
        [f"{UPD}(done := 0 node) failed: hipErrorInvalidValue", "the node was removed again"],
        1,
    ),
    "update_dependencies_mid_chain": (
        f"capture=eager;fail={UPD}@3:801",
        "host-func",
        "none",
        [f"{UPD}(done >= 1, Gte node) failed: hipErrorNotSupported"],
        1,
    ),
    "capture_info": (f"capture=eager;fail={INFO}", "host-func", "none", [f"{INFO} (splicing done := 0) failed"], 0),
    "begin_capture": (
        "capture=record;fail=hipStreamBeginCapture",
        "host-func",
        "none",
        ["native detection failed: hipStreamBeginCapture failed", "splice: failed at capture"],
        0,
    ),
    "end_capture": (
        "capture=record;fail=hipStreamEndCapture:999",
        "host-func",
        "none",
        [
            "native detection failed: hipStreamEndCapture failed: hipErrorUnknown",
            "splice: failed at capture: hipStreamEndCapture failed",
        ],
        0,
    ),
    "instantiate": (
        "capture=record;fail=hipGraphInstantiate",
        "host-func",
        "none",
        ["hipGraphInstantiate failed", "splice: failed at instantiate"],
        0,
    ),
    "launch": (
        "capture=record;fail=hipGraphLaunch",
        "host-func",
        "none",
        ["hipGraphLaunch failed", "splice: failed at replay"],
        0,
    ),
    "event_record": (
        "capture=record;fail=hipEventRecordWithFlags",
        "host-func",
        "none",
        [
            "native: failed at capture: hipEventRecordWithFlags(system-release event, hipEventRecordExternal) failed",
            "splice: failed at capture",
        ],
        0,
    ),
    "write_under_capture_once": (
        "capture=record;fail=hipStreamWriteValue64@1",
        "copy-splice",
        "splice",
        ["hipStreamWriteValue64 on a capturing stream failed: hipErrorInvalidValue", "splice: eager ok"],
        0,
    ),
    "pre_existing_error": ("capture=record;sticky=700", "copy-native", "native", ["recorded under capture"], 0),
}


class Results(dict):
    def __getitem__(self, case):
        out = super().__getitem__(case)
        if "crashed" in out:  # one scenario's crash fails its own tests, not the module
            pytest.fail(f"scenario {case} crashed: {out['crashed'][-1500:]}")
        return out


@pytest.fixture(scope="module")
def results(fake_hip):
    lib = fake_hip("full")
    res = Results()
    for k, (cfg, *_rest) in MATRIX.items():
        try:
            res[k] = fake_run(lib, f"CONFIG = {cfg!r}\n" + SCENARIO)
        except AssertionError as e:
            res[k] = {"crashed": str(e)}
    return res


@pytest.mark.parametrize("case", list(MATRIX))
def test_probe_decision(results, case):
    _cfg, path, mech, reason_parts, _rolled = MATRIX[case]
    out = results[case]
    assert (out["path"], out["mechanism"]) == (path, mech), out["reasons"]
    for part in reason_parts:
        assert part in out["reasons"]["copy"], (part, out["reasons"]["copy"])
    # host functions are eager-only on ROCm whatever the copy path did
    assert "eager ok; eager only" in out["reasons"]["host-func"]


@pytest.mark.parametrize("case", list(MATRIX))
def test_no_residual_error(results, case):
    out = results[case]
    assert out["peek"] == 0, f"HIP last error {out['peek']} left pending after start-up"
    assert out["stats"]["last_error"] == 0
    assert out["peek_end"] == 0 and out["stats_end"]["last_error"] == 0
    assert not out["pending"]


@pytest.mark.parametrize("case", list(MATRIX))
def test_node_rollback(results, case):
    """A node whose dependency update failed is destroyed: every capture the probe ended
    had no unjoined node, so EndCapture succeeded unless it was the injected failure."""
    cfg, _path, _mech, _reasons, rolled = MATRIX[case]
    out = results[case]
    assert out["stats"]["destroyed_nodes"] == rolled
    for cap in out["stats"]["end_captures"]:
        assert cap["unjoined"] == 0, out["stats"]["end_captures"]
        assert cap["rc"] == (999 if "fail=hipStreamEndCapture" in cfg else 0), out["stats"]["end_captures"]
    # nothing leaked by the probes: graphs, executable graphs, streams (the legacy one stays)
    assert out["stats_end"]["live_graphs"] == 0 and out["stats_end"]["live_execs"] == 0
    assert out["stats_end"]["live_streams"] <= 1 and out["stats_end"]["live_events"] == 0
    assert out["stats_end"]["signal_allocs"] == 0 and out["stats_end"]["wait_timeouts"] == 0


@pytest.mark.parametrize("case", list(MATRIX))
def test_eager_stays_bit_identical(results, case):
    assert results[case]["eager"] == [True, True, True]


@pytest.mark.parametrize("case", list(MATRIX))
def test_capture_refused_or_replayed(results, case):
    out = results[case]
    if out["path"].startswith("copy-"):
        assert out["replays"] == [True] * 8, out["replays"]
        # one param entry per distinct op (done := 0, done >= 1, ready := task for 2 tasks and the
        # probe's 2): stable and deduplicated across both graphs and the probe's capture
        if out["mechanism"] == "splice":
            assert out["param_entries"] == 2 + 2 + 2
    else:
        msg = out["refused"]
        assert "capture refused" in msg and "--cuda-graph-max-bs 0" in msg, msg
        assert "host-function nodes are never used under HIP graph capture" in msg


def test_pre_existing_error_is_raised_and_left_pending(results):
    out = results["pre_existing_error"]
    assert "earlier HIP error is pending on this thread: hipErrorIllegalAddress" in out["raised"]
    assert out["peek_after_raise"] == 700  # not consumed, not hidden


def test_probe_consumes_the_errors_it_creates(fake_hip):
    """Seed 000: the probe's own failures (here every hipGraphAddBatchMemOpNode) must not
    leave a HIP last-error behind for the caller's next ordinary call."""
    out = fake_run(
        fake_hip("full"),
        """
configure("capture=eager;fail=hipGraphAddBatchMemOpNode")
d = _native.Device(0)
b = _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
ex.start_coordinator(ready=b.words["ready"], done=b.words["done"])
safe, eager, report = b.probe(P["memop"], 10.0, _native.MECHANISMS["splice"])
out = {"safe": safe, "report": report, "peek": _native._peek_error(), "stats": stats()}
ex.stop_coordinator()  # off the signal words before the block frees them at exit (else a use after free)
print(json.dumps(out))
""",
    )
    assert not out["safe"] and "hipGraphAddBatchMemOpNode(done := 0) failed" in out["report"]
    assert out["stats"]["calls"]["hipGraphAddBatchMemOpNode"] == 1
    assert out["peek"] == 0, f"the probe left HIP error {out['peek']} pending"
