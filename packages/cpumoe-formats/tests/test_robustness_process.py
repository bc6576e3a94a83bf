"""Process life (docs/formats.md "Contracts"): the interpreter exiting while daemon threads are inside every
GIL-releasing entry point (Kernel.forward of every registered format, moe_forward, a bound step, peak_loop and the
work-item hooks) exits with status 0, no abort, in bounded time; a Kernel built in a parent is used in a forked
child (while another parent thread was inside it at the fork) with the parent's results, without a hang."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
from robustness_helpers import bits, problem

import cpumoe_formats as cf

_EXIT_SCRIPT = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {tests!r})
    import numpy as np
    import cpumoe_formats as cf
    from robustness_helpers import problem

    def forever(fn):
        threading.Thread(target=lambda: [fn() for _ in iter(int, 1)], daemon=True).start()

    started = []
    for fmt in cf.FORMATS:
        banks, x, w, ids = problem(fmt)
        k = cf.Kernel(fmt, *cf.validate_banks(fmt, banks))
        forever(lambda k=k, b=banks, x=x, w=w, ids=ids: k.forward(b, x, w, ids))
    banks, x, w, ids = problem("q4_0")
    forever(lambda: cf.moe_forward("q4_0", banks, x, w, ids))
    k = cf.Kernel("q4_0", *cf.validate_banks("q4_0", banks))
    step, xb, out = k.bind(banks), x.astype(cf.numerics.BF16), np.empty((len(x), x.shape[1]), cf.numerics.BF16)
    forever(lambda: step(xb, w, ids, out))
    forever(lambda: cf.peak_loop("fp32", "scalar", 1 << 16))
    act = cf.aligned_empty((k._k.act_bytes(x.shape[1]),), np.uint8)
    forever(lambda: k._k.prep_act(xb.ctypes.data, x.shape[1], act.ctypes.data))
    time.sleep(0.3)
    print("exiting", flush=True)
""")


def test_exit_with_calls_in_flight():
    """Three runs: rc 0, 'exiting' printed, no 'terminate called' (pybind11's gil_scoped_release re-took the GIL in
    a noexcept destructor, which CPython's pthread_exit of a daemon thread at finalization unwinds: abort)."""
    script = _EXIT_SCRIPT.format(tests=os.path.dirname(__file__))
    for run in range(3):
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "exiting" in r.stdout and "terminate" not in r.stderr, (
            f"run {run}: rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        assert time.monotonic() - t0 < 60


def _wait(pid: int, timeout: float) -> int | None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


def test_fork_child_uses_parent_kernels():
    """Every format's Kernel made in the parent gives the parent's bits in a forked child, also the one a parent
    thread was inside at the fork (its scratch is marked busy forever in the child: the child's calls take their
    own); a new Kernel in the child works too. The child exits 0 within 60 s."""
    ks, want = {}, {}
    for fmt in cf.FORMATS:
        banks, x, w, ids = problem(fmt)
        ks[fmt] = (cf.Kernel(fmt, *cf.validate_banks(fmt, banks)), banks, x, w, ids)
        want[fmt] = bits(ks[fmt][0].forward(banks, x, w, ids)).copy()
    k, banks, x, w, ids = ks["bf16"]
    stop = threading.Event()
    busy = threading.Thread(target=lambda: [k.forward(banks, np.repeat(x, 16, 0), np.repeat(w, 16, 0),
                                                      np.repeat(ids, 16, 0)) for _ in iter(stop.is_set, True)])
    busy.start()
    try:
        time.sleep(0.01)
        pid = os.fork()
        if pid == 0:  # the child: no pytest machinery, exit code only
            code = 0
            try:
                for fmt, (kk, b, xx, ww, ii) in ks.items():
                    for _ in range(2):
                        if not np.array_equal(bits(kk.forward(b, xx, ww, ii)), want[fmt]):
                            code = 3
                    with cf.Kernel(fmt, *cf.validate_banks(fmt, b)) as fresh:
                        if not np.array_equal(bits(fresh.forward(b, xx, ww, ii)), want[fmt]):
                            code = 4
            except BaseException:  # noqa: BLE001
                code = 5
            os._exit(code)
        rc = _wait(pid, 60)
    finally:
        stop.set()
        busy.join(60)
    assert rc == 0, "the child hung" if rc is None else f"the child exited {rc} (3/4: wrong bits, 5: an error)"

