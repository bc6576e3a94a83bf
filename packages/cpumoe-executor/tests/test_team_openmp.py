"""CpuMoeExecutor(team="openmp"): the steps run on the calling thread's OpenMP team (the libgomp torch loads)
instead of workers of our own. Bit-identical to the pool for every team size and batch, every thread of the team
takes part, nothing of ours is started; refused by name without a loaded runtime, with NUMA groups or a doorbell."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import UNDER_TSAN, bits, executor_for, reference, step_inputs

import cpumoe_executor as ce

torch = pytest.importorskip("torch")  # brings libgomp.so.1 into the process

# libgomp is not built with ThreadSanitizer: the order its barriers give our threads is invisible to it
pytestmark = pytest.mark.skipif(UNDER_TSAN, reason="libgomp's synchronisation is not instrumented for TSan")


@pytest.mark.parametrize("fmt", ["q4_0", "bf16"])
def test_openmp_team_is_bit_identical_to_the_pool(fmt, rng):
    for threads in (1, 2, 3):
        ex, banks, _ = executor_for(fmt, rng, threads=min(threads, ce.usable_cpus()), team="openmp")
        if threads > ce.usable_cpus():  # more team threads than CPUs: libgomp makes them, nothing is pinned
            ex.close()
            ex, banks, _ = executor_for(fmt, rng, core_ids=[0] * threads, team="openmp")
        with ex:
            assert ex.team == "openmp" and ex.threads == threads
            for T in (1, 3, 8):
                x, w, ids = step_inputs(rng, ex, T)
                for layer in range(ex.num_layers):
                    y = ex.decode(layer, x, w, ids)
                    np.testing.assert_array_equal(bits(y), bits(reference(ex, banks, layer, x, w, ids)),
                                                  err_msg=f"threads={threads} T={T}")


def test_every_thread_of_the_team_works_and_none_of_ours_starts(rng):
    ex0, _, _ = executor_for("q4_0", rng, threads=2, team="openmp")  # a repack's short-lived threads come and go
    ex0.close()
    before = len(os.listdir("/proc/self/task"))
    ex, _, _ = executor_for("q4_0", rng, threads=2, team="openmp", repack=False)
    with ex:
        assert len(os.listdir("/proc/self/task")) <= before  # a pool would have started its worker here
        x, w, ids = step_inputs(rng, ex, 8)
        ex.start_trace()
        for i in range(20):
            ex.decode(i % 2, x, w, ids)
        t = ex.stop_trace()
        assert t["steps"] == 20 and t["threads"] == 2  # both team threads ran work items
        assert ex._x.pinned == 0


def test_refused_by_name(rng):
    with pytest.raises(ValueError, match=r"team='gomp': expected one of \['pool', 'openmp'\]"):
        executor_for("bf16", rng, team="gomp")
    with pytest.raises(ValueError, match="numa='split' with team='openmp': an OpenMP team is one pool"):
        executor_for("bf16", rng, team="openmp", numa="split")
    ex, _, _ = executor_for("bf16", rng, team="openmp")
    with ex, pytest.raises(RuntimeError, match="team='openmp'.*a doorbell needs team='pool'"):
        ex.start_coordinator()


def test_without_a_loaded_runtime_it_says_what_to_do():
    """A process that has not loaded libgomp (no torch): openmp_team_loaded() is False and team='openmp' names the
    runtime and the way out; nothing is loaded by asking."""
    code = ("import numpy as np, cpumoe_executor as ce, cpumoe_formats as cf\n"
            "assert not ce.openmp_team_loaded()\n"
            "b = [cf.get_format('bf16').random_banks(4, 64, 32, np.random.default_rng(0))]\n"
            "try:\n    ce.CpuMoeExecutor('bf16', b, top_k=2, team='openmp')\nexcept ValueError as e:\n    print(e)\n"
            "assert not ce.openmp_team_loaded()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no OpenMP runtime (libgomp.so.1) is loaded in this process" in out.stdout
    assert "team='pool'" in out.stdout
    assert ce.openmp_team_loaded()  # here torch brought it


def test_a_late_team_thread_makes_the_next_steps_the_callers():
    """A subprocess with every thread on one CPU and torch's OpenMP worker at SCHED_IDLE: that thread runs only once
    the caller has finished a step (a core taken by other work, made certain), and the region's end waits for it.
    After such a late step the next 32 run on the caller alone (no region to wait for); the bits stay the
    reference's. Without the fallback the late thread enters every step: 40 of 40."""
    code = """if True:
        import os, sys, numpy as np, torch
        import cpumoe_executor as ce, cpumoe_formats as cf
        a = torch.randn(256, 256)
        (a @ a).sum()  # torch's team exists
        cpu, main = min(os.sched_getaffinity(0)), os.getpid()
        for t in map(int, os.listdir("/proc/self/task")):
            os.sched_setaffinity(t, {cpu})
            if t != main:
                os.sched_setscheduler(t, os.SCHED_IDLE, os.sched_param(0))
        rng = np.random.default_rng(0)
        banks = [cf.get_format("q4_0").random_banks(8, 256, 128, rng) for _ in range(2)]
        ex = ce.CpuMoeExecutor("q4_0", banks, top_k=4, core_ids=[cpu, cpu], team="openmp")
        x = rng.standard_normal((3, 256)).astype(np.float32)
        ids = rng.integers(-1, 8, (3, 4)).astype(np.int32)
        w = rng.random((3, 4), dtype=np.float32)
        want = cf.moe_forward(ex.spec.name, cf.get_format("q4_0").to_layout(banks[1], ex.spec.name), x, w, ids,
                              mode=ex.mode)
        ex.start_trace()
        for i in range(40):
            y = ex.decode(1, x, w, ids)
            assert (np.asarray(y).view(np.uint16) == np.asarray(want).view(np.uint16)).all(), i
        print([t["steps"] for t in ex.stop_trace()["raw"]["threads"]])
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    caller, second = eval(out.stdout.strip().splitlines()[-1])
    assert caller == 40 and second <= 2, (caller, second)  # late steps only: the first and the probe 33 later
