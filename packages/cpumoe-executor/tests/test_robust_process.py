"""Process life, every format (conftest.FORMATS): in a forked child (os.fork, and multiprocessing's 'fork' start
method) an executor made in the parent raises RuntimeError saying to create one in the child (it hung in its
second decode: its workers exist only in the parent), even when a parent thread was inside a step at the fork;
an executor made in the child works. Exiting the interpreter with decodes in flight in daemon threads neither
aborts ("terminate called without an active exception") nor hangs. Every wait is bounded."""
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
from conftest import FORMATS, UNDER_TSAN, bits, executor_for, executor_kwargs, step_inputs

import cpumoe_executor as ce
import cpumoe_formats as cf
from cpumoe_executor import _native

TIMEOUT = 30.0
FORKED = r"CpuMoeExecutor\(.*\) was created in process \d+ and this is a forked child .*Create a new executor"
no_tsan = pytest.mark.skipif(UNDER_TSAN, reason="ThreadSanitizer does not support threads in a forked child")


def reported(fn) -> str:
    """'ok', or fn's error with its traceback (what a child sends back), short enough for one pipe write."""
    try:
        fn()
        return "ok"
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        return f"{type(e).__name__}: {e}\n{traceback.format_exc()}"[:8000]


def in_os_fork(fn) -> str:
    """Runs fn in an os.fork() child; its report, or a failure naming the hang (the child is killed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's exit handlers
        os.close(r)
        os.write(w, reported(fn).encode())
        os._exit(0)
    os.close(w)
    end = time.monotonic() + TIMEOUT
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            pytest.fail(f"the forked child hung (killed after {TIMEOUT} s)")
        time.sleep(0.01)
    with os.fdopen(r, "rb") as f:
        return f.read().decode()


def in_mp_fork(fn) -> str:
    """Runs fn in a multiprocessing 'fork' child; its report, or a failure naming the hang."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=lambda: child.send(reported(fn)), daemon=True)
    p.start()
    p.join(TIMEOUT)
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail(f"the multiprocessing child hung (killed after {TIMEOUT} s)")
    assert p.exitcode == 0, p.exitcode
    return parent.recv() if parent.poll(1.0) else "no report"


@no_tsan
@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_forked_child_refuses_the_parents_executor_and_builds_its_own(fmt, how, rng):
    ex, banks, _ = executor_for(fmt, rng)
    steps = [(layer, *step_inputs(rng, ex, T)) for layer, T in ((0, 1), (1, 5))]
    want = [bits(ex.decode(*s)).copy() for s in steps]
    ex.start_coordinator()
    stop = threading.Event()

    def busy():  # a parent thread inside steps (holding the executor's lock) at the moment of the fork
        while not stop.is_set():
            ex.decode(*steps[1])

    def child():
        for call in (lambda: ex.decode(*steps[0]), lambda: ex.decode(*steps[0]), ex.io_arrays, ex.start_coordinator,
                     ex.start_trace, lambda: ex.hostfn_arg(0, 1), lambda: ex.handle):
            with pytest.raises(RuntimeError, match=FORKED):
                call()
        ex.stop_coordinator()
        ex.close()  # forgets the parent's threads: no join, no hang
        with ce.CpuMoeExecutor(fmt, banks, **executor_kwargs(fmt)) as mine:
            for s, wnt in zip(steps, want):
                np.testing.assert_array_equal(bits(mine.decode(*s)), wnt)
            mine.start_coordinator()
            layer, x, w, ids = steps[1]
            a, iob = mine.io_arrays(), mine.io_block()
            T = x.shape[0]
            a["x"][:T], a["w"][:T], a["ids"][:T] = x.astype(cf.numerics.BF16), w, ids
            assert _native.play_gpu(iob["ready"], iob["done"], layer << 32 | T, TIMEOUT)
            np.testing.assert_array_equal(bits(a["y"][:T]), want[1])

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    time.sleep(0.01)
    try:
        report = (in_os_fork if how == "os.fork" else in_mp_fork)(child)
    finally:
        stop.set()
        t.join(TIMEOUT)
    assert report == "ok", report
    for s, wnt in zip(steps, want):  # the parent's executor is untouched
        np.testing.assert_array_equal(bits(ex.decode(*s)), wnt)
    ex.close()


EXIT_SCRIPT = """
import sys, threading, time
import numpy as np
sys.path.insert(0, {tests!r})
from conftest import FORMATS, executor_for, step_inputs
rng = np.random.default_rng({seed})

def loop(ex, s):
    while True:
        ex.decode(0, *s)

for i, fmt in enumerate(FORMATS):
    ex = executor_for(fmt, rng)[0]
    if i % 2:
        ex.start_coordinator()
    threading.Thread(target=loop, args=(ex, step_inputs(rng, ex, 8)), daemon=True).start()
time.sleep(0.2)
print("exiting", flush=True)
"""


def test_exit_with_decodes_in_flight_in_daemon_threads(rng):
    """One daemon thread per format decoding in a loop as the interpreter exits, three times: rc 0, no abort."""
    script = EXIT_SCRIPT.format(tests=str(Path(__file__).parent), seed=int(rng.integers(1 << 31)))
    for attempt in range(3):
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "exiting" in p.stdout and "terminate called" not in p.stderr, \
            (attempt, p.returncode, p.stderr[-2000:])
