"""Lifetimes, every format (conftest.FORMATS): after close() every call raises naming the closed executor (a
listed contract: a new public member must be placed on it); what the executor handed out stays safe (io_arrays
views and io_block's owner keep the IO block alive after close() and `del`; the C ABI handle and hostfn
arguments fail through the error word); closed executors hold no thread, and a create/close loop is flat in
threads and RSS (/proc/self/status)."""
import gc
import time

import numpy as np
import pytest
from conftest import FORMATS, UNDER_ASAN, bits, executor_for, step_inputs, workers

import cpumoe_executor as ce
import cpumoe_formats as cf
from cpumoe_executor import _native

CLOSED = r"CpuMoeExecutor\(.*\) is closed"
# Every public member once closed: calls that raise (with a sample call) and those still fine.
RAISE = {
    "decode": lambda ex, s: ex.decode(0, *s),
    "decode_routed": lambda ex, s: ex.decode_routed(0, *router_tensors(s)),
    "io_block": lambda ex, s: ex.io_block(),
    "io_arrays": lambda ex, s: ex.io_arrays(),
    "start_coordinator": lambda ex, s: ex.start_coordinator(),
    "hostfn_arg": lambda ex, s: ex.hostfn_arg(0, 1),
    "handle": lambda ex, s: ex.handle,
    "read_bandwidth": lambda ex, s: ex.read_bandwidth(np.ones(1 << 12, np.uint8)),
    "health": lambda ex, s: ex.health(),
    "raise_if_unhealthy": lambda ex, s: ex.raise_if_unhealthy(),
    "clear_error": lambda ex, s: ex.clear_error(),
    "start_trace": lambda ex, s: ex.start_trace(),
    "stop_trace": lambda ex, s: ex.stop_trace(),
    "layer_banks": lambda ex, s: ex.layer_banks(0),
    "team_unit": lambda ex, s: ex.team_unit,
    "set_team_unit": lambda ex, s: ex.set_team_unit(0),
    "numa_report": lambda ex, s: ex.numa_report(),
    "linear": lambda ex, s: ex.linear(np.zeros((1, 8), cf.numerics.BF16), np.zeros((4, 8), cf.numerics.BF16)),
    "attention_raw": lambda ex, s: _attention_raw(ex),
    "work": lambda ex, s: ex.work(),
}
FINE = {"close", "stop_coordinator", "closed", "isa", "threads", "numa",  # teardown stays idempotent; descriptions stay
        "spec", "given_format", "layer_formats", "given_layer_formats", "mixed", "layer_spec", "kernel_isas",
        "linear_isa", "attention_isa"}


def _attention_raw(ex):
    """One token, one head of 8 over one position, on arrays of its own (the call checks sizes, then closed)."""
    a = np.zeros(8, cf.numerics.BF16)
    o = np.zeros(8, cf.numerics.BF16)
    ex.attention_raw(1, 1, 8, 1, 1, a.ctypes.data, 8, 8, a.ctypes.data, 8, 8, a.ctypes.data, 8, 8, 0, 0, 0.5,
                     o.ctypes.data, 8, 8)


def router_tensors(s):
    """A step's (x, w, ids) as the torch tensors decode_routed reads in place (x bf16, ids int64); without torch
    (the executor's own test venv) the arrays as they are: a closed executor refuses those too."""
    try:
        import torch
    except ImportError:
        return s
    x, w, ids = s
    return torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(w), torch.from_numpy(ids).long()


def proc_status() -> dict:
    """VmRSS (bytes) and Threads of this process."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "Threads"):
                out[k] = int(v.split()[0]) * (1024 if k == "VmRSS" else 1)
    return out


def test_every_public_member_has_a_closed_contract():
    members = {n for n in dir(ce.CpuMoeExecutor) if not n.startswith("_")}
    assert members == set(RAISE) | FINE, "place each new public member in RAISE or FINE"


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_call_after_close_raises_naming_the_executor(fmt, rng):
    ex, _, _ = executor_for(fmt, rng)
    s = step_inputs(rng, ex, 3)
    ex.start_coordinator()
    ex.decode(0, *s)
    assert not ex.closed
    ex.close()
    ex.close()  # twice is fine
    assert ex.closed and "closed" in repr(ex)
    for name, call in RAISE.items():
        with pytest.raises(RuntimeError, match=CLOSED):
            call(ex, s)
            pytest.fail(f"{name} ran on a closed executor")
    ex.stop_coordinator()  # a no-op
    assert ex.isa and ex.threads >= 1
    assert ex.spec.name == ex.layer_formats[0][0] == ex.layer_spec(0, "down").name and ex.given_format == fmt
    assert not ex.mixed and list(ex.kernel_isas.values()) == [ex.isa]


@pytest.mark.parametrize("fmt", FORMATS)
def test_with_block_closes(fmt, rng):
    ex, _, _ = executor_for(fmt, rng)
    s = step_inputs(rng, ex, 2)
    with ex as e:
        assert e is ex
        e.start_coordinator()
        e.decode(1, *s)
    with pytest.raises(RuntimeError, match=CLOSED):
        ex.decode(1, *s)
    with pytest.raises(RuntimeError, match=CLOSED):
        with ex:
            pass


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("end", ["close", "del", "close+del"])
def test_handed_out_views_outlive_the_executor(fmt, end, rng):
    """io_arrays() views and io_block()'s owner keep the IO block's memory: writing them after close() or del is
    safe (it was a SIGSEGV: the block was unmapped with the executor)."""
    ex, _, _ = executor_for(fmt, rng)
    ex.start_coordinator()
    a, iob = ex.io_arrays(), ex.io_block()
    if "close" in end:
        ex.close()
    if "del" in end:
        del ex
        gc.collect()
    for i, v in enumerate(a.values()):
        v.view(np.uint8)[...] = 0xA0 + i
    for i, v in enumerate(a.values()):
        assert (v.view(np.uint8) == 0xA0 + i).all()
    _native.store_u64(iob["ready"], 7)  # through the addresses, while the dict holds the owner
    assert _native.load_u64(iob["ready"]) == 7 and _native.load_u64(iob["base"]) == _native.IOB_MAGIC


@pytest.mark.parametrize("fmt", FORMATS)
def test_c_entry_points_of_a_closed_executor_fail_through_the_error_word(fmt, rng):
    """The hostfn argument (captured in graphs) stays valid while the object lives; once closed, submit runs
    nothing and sets the error word (CPUMOE_ERR_INTERNAL = 4), wait returns: no crash, no hang."""
    ex, _, _ = executor_for(fmt, rng)
    arg, iob = ex.hostfn_arg(1, 2), ex.io_block()
    a = ex.io_arrays()
    x, w, ids = step_inputs(rng, ex, 2)
    a["x"][:2], a["w"][:2], a["ids"][:2] = x.astype(cf.numerics.BF16), w, ids
    a["y"][:2].view(np.uint16)[...] = 0x7FC1
    ex.close()
    _native.call_hostfn(arg, True)
    _native.call_hostfn(arg, False)
    assert _native.load_u64(iob["error"]) == 4
    assert "is closed" in ex._x.last_error()
    assert (bits(a["y"][:2]) == 0x7FC1).all(), "a closed executor ran a task"


@pytest.mark.parametrize("fmt", FORMATS)
def test_closed_executors_hold_no_thread(fmt, rng):
    """close() joins the workers and the coordinator: 20 closed executors, kept, add no thread."""
    executor_for(fmt, rng)[0].close()  # warm: imports, the formats library's own pools
    before = proc_status()["Threads"]
    kept = []
    for i in range(20):
        ex, _, _ = executor_for(fmt, rng, **workers(2))
        if i % 2:
            ex.start_coordinator()
        ex.close()
        kept.append(ex)
    # another test's short-lived threads (a repack's thread pool, a subprocess reader) may still be leaving: the count
    # must come back to `before` within a second, never stay above it
    end = time.monotonic() + 1.0
    while proc_status()["Threads"] > before and time.monotonic() < end:
        time.sleep(0.01)
    assert proc_status()["Threads"] <= before


def test_create_close_loop_is_flat(rng):
    """200 executors created, used and closed, and kept: threads and RSS stay where they were (each held about
    0.9 MB of repacked q4_0 banks and its workers before close() freed them: about 180 MB)."""
    E, H, I = 4, 512, 256
    banks = [cf.get_format("q4_0").random_banks(E, H, I, rng)]
    x = rng.standard_normal((4, H)).astype(np.float32)
    w, ids = rng.random((4, 2), np.float32), rng.integers(0, E, (4, 2)).astype(np.int32)

    def cycle(i):
        ex = ce.CpuMoeExecutor("q4_0", banks, top_k=2, max_tokens=4, **workers(2))
        if i % 4 == 0:
            ex.start_coordinator()
        ex.decode(0, x, w, ids)
        ex.io_arrays()
        ex.close()
        return ex

    for i in range(10):  # warm: allocator arenas, thread stacks cached for reuse
        cycle(i)
    gc.collect()
    before = proc_status()
    kept = [cycle(i) for i in range(200)]
    gc.collect()
    after = proc_status()
    assert len(kept) == 200 and after["Threads"] == before["Threads"], (before, after)
    grew = (after["VmRSS"] - before["VmRSS"]) / 2**20
    assert grew < 16 or UNDER_ASAN, f"RSS grew {grew:.1f} MB over 200 closed executors"
