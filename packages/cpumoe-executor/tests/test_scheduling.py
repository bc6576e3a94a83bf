"""Scheduling: any team size, and workers that join a step late (asleep when it
starts), give output bit-identical to the single-threaded kernels; the team
policy; the pool stays hot while the coordinator spins and sleeps after its
window. Every wait is bounded."""
import time

import numpy as np
import pytest
from conftest import ACT, FORMATS, bits, make_banks, ran_banks, reference, routing, workers

import cpumoe_executor as ce
import cpumoe_formats as cf
from cpumoe_executor import _native

NCORES = len(ce.resolve_cores()[0])
THREADS = sorted({2, 3, NCORES + 1})  # 3 on this box: a team of 2 out of 3 exists
TIMEOUT = 10.0
POISON = 0x7FC1  # a bf16 NaN no kernel writes


def wait_until(cond, timeout=TIMEOUT):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.002)
    return True


def decode_poisoned(ex, layer, x, w, ids):
    out = np.empty((x.shape[0], ex.H), cf.numerics.BF16)
    out.view(np.uint16)[...] = POISON
    return ex.decode(layer, x, w, ids, out=out)


# bf16, and q4_0 (w4a8): its prep of x and g (int8 blocks) is real work done in the stages
@pytest.mark.parametrize("fmt", [f for f in ("bf16", "q4_0") if f in FORMATS])
def test_team_sizes_and_late_workers_are_bit_identical(fmt, rng):
    banks, (E, H, I) = make_banks(fmt, rng, layers=2)  # noqa: E741
    K, act = 4, ACT.get(fmt, {})
    ebytes = 2 * (3 * H * I)  # about one expert's bytes: units around it give teams in between
    teams = set()
    for threads in THREADS:
        for spin_us in (2000, 0):  # 0: workers are asleep when each step starts and join it late
            ex = ce.CpuMoeExecutor(fmt, banks, top_k=K, max_tokens=8, **workers(threads), spin_us=spin_us, **act)
            run = ran_banks(ex, banks)  # the bits to match: the format that runs, single-threaded
            for unit in (0, 1 << 40, ebytes, 4 * ebytes):
                _native.set_team_unit(ex.handle, unit)
                for T in (1, 3, 8):
                    for layer in range(2):
                        x = rng.standard_normal((T, H)).astype(np.float32)
                        w, ids = routing(rng, T, K, E)
                        nroutes, ngroups = int((ids >= 0).sum()), len(np.unique(ids[ids >= 0]))
                        teams.add((threads, _native.team_size(ex.handle, layer, nroutes, ngroups)))
                        y = decode_poisoned(ex, layer, x, w, ids)
                        want = cf.moe_forward(ex.spec.name, run[layer], x, w, ids, **act)
                        np.testing.assert_array_equal(bits(y), bits(want),
                                                      err_msg=f"threads={threads} spin_us={spin_us} unit={unit} T={T}")
    assert any(1 < t < n for n, t in teams) and (3, 1) in teams and (3, 3) in teams, sorted(teams)


def test_team_policy(rng):
    banks, (E, H, I) = make_banks("bf16", rng, layers=1)  # noqa: E741
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=4, max_tokens=8, **workers(3))
    h = ex.handle
    assert _native.team_unit(h) == 64 << 10
    assert _native.team_size(h, 0, 1, 1) == 1  # a few KB of work: the coordinator alone
    sizes = [_native.team_size(h, 0, r, g) for r, g in ((1, 1), (8, 4), (64, 32), (4096, 64), (1 << 16, 64))]
    assert sizes == sorted(sizes) and sizes[-1] == 3, sizes  # grows with the work, capped at threads
    _native.set_team_unit(h, 0)
    assert _native.team_size(h, 0, 1, 1) == 3  # unit 0: every thread
    _native.set_team_unit(h, 1 << 40)
    assert _native.team_size(h, 0, 1 << 16, 64) == 1
    with pytest.raises(ValueError, match="layer"):
        _native.team_size(h, 1, 1, 1)
    # A wide expert (9 MiB of bf16 weights) takes every thread even for one route.
    big = [cf.get_format("bf16").random_banks(1, 2048, 768, rng)]
    ex2 = ce.CpuMoeExecutor("bf16", big, top_k=1, max_tokens=1, **workers(3))
    assert _native.team_size(ex2.handle, 0, 1, 1) == 3


def test_pool_stays_hot_in_the_coordinator_window_then_sleeps(rng):
    banks, (E, H, I) = make_banks("bf16", rng)  # noqa: E741
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=2, max_tokens=4, threads=2, spin_us=0)
    _native.set_team_unit(ex.handle, 0)  # every step wakes the worker
    x = rng.standard_normal((2, H)).astype(np.float32)
    w, ids = routing(rng, 2, 2, E)
    want = reference(ex, banks, 0, x, w, ids)
    np.testing.assert_array_equal(bits(decode_poisoned(ex, 0, x, w, ids)), bits(want))
    # No coordinator: spin_us=0, so the worker goes to sleep right after its step.
    assert wait_until(lambda: _native.pool_sleepers(ex.handle) == 1)
    ex.start_coordinator()
    try:
        iob, a = ex.io_block(), ex.io_arrays()
        a["x"][:2], a["w"][:2], a["ids"][:2] = x.astype(cf.numerics.BF16), w, ids
        hot_seen = False
        for _ in range(5):  # a loaded machine may oversleep the window once; not five times
            t0 = time.monotonic()
            assert _native.play_gpu(iob["ready"], iob["done"], 2, TIMEOUT)
            time.sleep(0.01)  # past the worker's own spin (0), inside the coordinator's 50 ms window
            awake = _native.pool_sleepers(ex.handle) == 0
            if time.monotonic() - t0 < 0.04:
                assert awake, "the worker slept inside the coordinator's spin window"
                hot_seen = True
                break
        assert hot_seen
        np.testing.assert_array_equal(bits(a["y"][:2]), bits(want))
        # A worker the steps stop using (team sizing: the caller alone) is not kept hot.
        _native.set_team_unit(ex.handle, 1 << 40)
        t0 = time.monotonic()
        for _ in range(70):
            assert _native.play_gpu(iob["ready"], iob["done"], 2, TIMEOUT)
        asleep = wait_until(lambda: _native.pool_sleepers(ex.handle) == 1, 0.03)
        if time.monotonic() - t0 < 0.04:  # still inside the window: only the team rule put it to sleep
            assert asleep, "an unused worker was kept spinning"
        _native.set_team_unit(ex.handle, 0)
        # After the window everything sleeps and the process burns no core.
        assert wait_until(lambda: _native.pool_sleepers(ex.handle) == 1), "the worker never slept after the window"
        time.sleep(0.02)
        c0, t0 = time.process_time(), time.perf_counter()
        time.sleep(0.3)
        busy = (time.process_time() - c0) / (time.perf_counter() - t0)
        assert busy < 0.3, f"idle executor used {busy:.0%} of a core"
        a["y"][:2].view(np.uint16)[...] = POISON
        assert _native.play_gpu(iob["ready"], iob["done"], 2, TIMEOUT)  # and it still answers after sleeping
        np.testing.assert_array_equal(bits(a["y"][:2]), bits(want))
    finally:
        ex.stop_coordinator()


def test_a_step_returns_only_when_every_item_is_done(rng):
    """Oversubscribed (threads > cores), so workers get preempted inside items: y must still be
    complete when decode returns (the caller waits for the last item, not for its own claims)."""
    spec = cf.get_format("bf16")
    E, H, I, K, T = 8, 2048, 64, 4, 8  # noqa: E741 - 64 down items per step
    banks = [spec.random_banks(E, H, I, rng)]
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=K, max_tokens=T, **workers(NCORES + 2))
    _native.set_team_unit(ex.handle, 0)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = routing(rng, T, K, E)
    want = bits(reference(ex, banks, 0, x, w, ids))
    for i in range(300):
        y = decode_poisoned(ex, 0, x, w, ids)
        assert (bits(y) == want).all(), f"step {i}: y incomplete or wrong when decode returned"


def test_step_trace_counts_every_step_and_its_phases(rng):
    banks, (E, H, I) = make_banks("bf16", rng, layers=1)  # noqa: E741
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=4, max_tokens=8, **workers(3))
    _native.set_team_unit(ex.handle, 0)  # every thread joins every step
    x = rng.standard_normal((8, H)).astype(np.float32)
    w, ids = routing(rng, 8, 4, E)
    plain = bits(decode_poisoned(ex, 0, x, w, ids))
    ex._x.set_trace(True)
    for _ in range(5):
        np.testing.assert_array_equal(bits(decode_poisoned(ex, 0, x, w, ids)), plain)  # tracing changes nothing
    ex._x.set_trace(False)
    decode_poisoned(ex, 0, x, w, ids)  # not traced
    t = ex._x.trace()
    assert t["steps"] == 5 and t["step_ns"] > 0
    assert len(t["threads"]) == 3 and t["threads"][0]["steps"] == 5  # the caller runs every step
    for th in t["threads"]:
        assert th["steps"] <= 5
        phases = th["prep_ns"] + th["gate_up_ns"] + th["down_wait_ns"] + th["down_ns"]
        assert min(th[k] for k in th) >= 0
        if th["steps"]:
            # the phases tile the thread's time in the step: enter + phases == exit (one clock, same marks)
            assert th["enter_ns"] + phases == th["exit_ns"], th
    caller = t["threads"][0]
    assert caller["exit_ns"] <= t["step_ns"]  # the caller leaves body() before y is declared complete
    assert caller["gate_up_ns"] > 0 and caller["down_ns"] > 0
    ex._x.set_trace(True)  # restarting clears the sums
    assert ex._x.trace()["steps"] == 0 and all(th["steps"] == 0 for th in ex._x.trace()["threads"])
    assert ex.stop_trace() == {"steps": 0, "raw": ex._x.trace()}
    ex.start_trace()  # the public wrapper: averages in us per step
    for _ in range(3):
        decode_poisoned(ex, 0, x, w, ids)
    s = ex.stop_trace()
    assert s["steps"] == 3 and s["threads"] == 3 and s["step_us"] > 0
    assert 0 <= s["busy_min_us"] <= s["busy_max_us"]
