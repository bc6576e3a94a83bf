"""Threads: one CpuMoeExecutor shared by several threads, every format (conftest.FORMATS). Each caller gets its
own inputs' result bit for bit (steps run one at a time under the executor's lock), also while the coordinator
serves doorbell tasks; coordinator start / stop from several threads at once and close() under load neither
crash nor hang. Every wait is bounded."""
import threading
import time

import numpy as np
import pytest
from conftest import FORMATS, bits, executor_for, step_inputs

import cpumoe_formats as cf
from cpumoe_executor import _native

N = 4  # threads sharing the executor: twice this machine's 2 cores
ROUNDS = 25
TIMEOUT = 30.0


def jobs(rng, ex):
    """N different steps (batch sizes 1, 3, 6, 8; both layers) and each one's single-thread result."""
    js = [(i % ex.num_layers, *step_inputs(rng, ex, T)) for i, T in enumerate((1, 3, 6, 8)[:N])]
    return js, [bits(ex.decode(*j)).copy() for j in js]


def hammer(fns, timeout=TIMEOUT):
    """Runs each fn on its own thread; re-raises the first error; fails when one is still running after timeout."""
    errors = []

    def run(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    ts = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in fns]
    for t in ts:
        t.start()
    end = time.monotonic() + timeout
    for t in ts:
        t.join(max(0.0, end - time.monotonic()))
    assert not any(t.is_alive() for t in ts), f"a thread is still running after {timeout} s (hang)"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_threads_sharing_decode_get_their_own_results(fmt, rng):
    ex, _, _ = executor_for(fmt, rng)
    js, want = jobs(rng, ex)

    def caller(i):
        def fn():
            out = np.empty((js[i][1].shape[0], ex.H), cf.numerics.BF16)
            for r in range(ROUNDS):
                y = ex.decode(*js[i], out=out if r % 2 else None)
                np.testing.assert_array_equal(bits(y), want[i], err_msg=f"thread {i} round {r}")
        return fn

    hammer([caller(i) for i in range(N)])
    ex.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_never_interleaves_with_a_doorbell_task(fmt, rng):
    """A CPU thread rings tasks on the IO block (as a GPU stream would) while N - 1 threads decode directly."""
    ex, _, _ = executor_for(fmt, rng)
    js, want = jobs(rng, ex)
    T, layer = 5, 1
    x, w, ids = step_inputs(rng, ex, T)
    a, iob = ex.io_arrays(), ex.io_block()
    a["x"][:T], a["w"][:T], a["ids"][:T] = x.astype(cf.numerics.BF16), w, ids
    want_task = bits(ex.decode(layer, a["x"][:T], w, ids)).copy()
    ex.start_coordinator()

    def ringer():
        for r in range(ROUNDS):
            a["y"][:T].view(np.uint16)[...] = 0x7FC1  # poison: a task that wrote nothing shows
            assert _native.play_gpu(iob["ready"], iob["done"], layer << 32 | T, TIMEOUT), "doorbell not answered"
            np.testing.assert_array_equal(bits(a["y"][:T]), want_task, err_msg=f"task {r}")

    def caller(i):
        def fn():
            for r in range(ROUNDS):
                np.testing.assert_array_equal(bits(ex.decode(*js[i])), want[i], err_msg=f"thread {i} round {r}")
        return fn

    hammer([ringer] + [caller(i) for i in range(N - 1)])
    h = ex.health()
    assert h["served"] == ROUNDS and h["error"] == 0, h
    ex.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_coordinator_start_and_stop_from_several_threads(fmt, rng):
    """Threads start and stop the coordinator at once while decoding: no crash (two threads assigning one
    std::thread aborted), every decode still right."""
    ex, _, _ = executor_for(fmt, rng)
    js, want = jobs(rng, ex)

    def caller(i):
        def fn():
            for r in range(8):
                ex.start_coordinator() if (i + r) % 2 else ex.stop_coordinator()
                np.testing.assert_array_equal(bits(ex.decode(*js[i])), want[i], err_msg=f"thread {i} round {r}")
        return fn

    hammer([caller(i) for i in range(N)])
    ex.close()
    assert not ex._x.coordinator_running


@pytest.mark.parametrize("fmt", FORMATS)
def test_close_while_threads_decode(fmt, rng):
    """close() from another thread waits for the step in flight: each decode before it is right, each after it
    raises RuntimeError naming the closed executor, and every caller stops."""
    ex, _, _ = executor_for(fmt, rng)
    js, want = jobs(rng, ex)
    ex.start_coordinator()
    started = threading.Barrier(N + 1)
    deadline = time.monotonic() + TIMEOUT

    def caller(i):
        def fn():
            started.wait(TIMEOUT)
            while time.monotonic() < deadline:
                try:
                    y = ex.decode(*js[i])
                except RuntimeError as e:
                    assert "is closed" in str(e) and "CpuMoeExecutor(" in str(e), e
                    return
                np.testing.assert_array_equal(bits(y), want[i], err_msg=f"thread {i}")
            raise AssertionError("decode kept running after close()")
        return fn

    def closer():
        started.wait(TIMEOUT)
        time.sleep(0.02)
        ex.close()

    hammer([caller(i) for i in range(N)] + [closer])
    assert ex.closed
