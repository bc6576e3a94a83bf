"""CpuMoeExecutor(team="openmp"): the steps run on the calling thread's OpenMP team (the libgomp torch loads)
instead of workers of our own. Bit-identical to the pool for every team size and batch, every thread of the team
takes part, nothing of ours is started; from two threads at once, and from inside another parallel region (the
caller alone); refused by name without a loaded runtime, in a forked child, with NUMA groups or a doorbell."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import UNDER_TSAN, bits, executor_for, reference, step_inputs
from test_robust_process import in_os_fork

import cpumoe_executor as ce
import cpumoe_formats as cf

torch = pytest.importorskip("torch")  # brings libgomp.so.1 into the process
HERE = Path(__file__).resolve().parent


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
    """A process that has not loaded libgomp (no torch): openmp_team_unusable() says so and team='openmp' raises a
    ValueError naming the team, the runtime and the way out; nothing is loaded by asking."""
    code = ("import numpy as np, cpumoe_executor as ce, cpumoe_formats as cf\n"
            "assert 'no OpenMP runtime' in ce.openmp_team_unusable()\n"
            "b = [cf.get_format('bf16').random_banks(4, 64, 32, np.random.default_rng(0))]\n"
            "try:\n    ce.CpuMoeExecutor('bf16', b, top_k=2, team='openmp')\nexcept ValueError as e:\n    print(e)\n"
            "assert ce.openmp_team_unusable()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "team='openmp': no OpenMP runtime (libgomp.so.1) is loaded in this process" in out.stdout
    assert "import torch" in out.stdout and "team='pool'" in out.stdout
    assert ce.openmp_team_unusable() == ""  # here torch brought it


@pytest.mark.skipif(UNDER_TSAN, reason="ThreadSanitizer does not support threads in a forked child")
def test_a_forked_child_gets_no_team(rng):
    """GNU libgomp does not survive fork() (a child's region waits for the parent's threads forever): in a child
    team='openmp' is refused by name before anything runs, and a pool of its own still works."""
    ex, banks, _ = executor_for("bf16", rng, team="openmp")
    x, w, ids = step_inputs(rng, ex, 3)
    ex.decode(0, x, w, ids)  # the parent's team exists

    def child():
        assert "fork" in ce.openmp_team_unusable()
        with pytest.raises(ValueError, match=r"team='openmp': this process is a fork .*team='pool'.*'spawn'"):
            executor_for("bf16", rng, team="openmp")
        with executor_for("bf16", rng, team="pool", threads=1)[0] as own:
            own.decode(0, x, w, ids)

    assert in_os_fork(child) == "ok"
    with ex:
        np.testing.assert_array_equal(bits(ex.decode(1, x, w, ids)), bits(reference(ex, banks, 1, x, w, ids)))


def test_two_calling_threads_each_run_on_a_team_of_their_own(rng):
    """Steps from two threads at once take turns (the step lock); each caller starts its own OpenMP team (libgomp
    keeps one per thread that starts regions). Every y is the reference's."""
    ex, banks, _ = executor_for("q4_0", rng, threads=2, team="openmp")
    inputs = [step_inputs(rng, ex, T) for T in (1, 5)]
    want = [[bits(reference(ex, banks, layer, *s)) for layer in range(2)] for s in inputs]
    errors = []

    def caller(k):
        try:
            for i in range(30):
                np.testing.assert_array_equal(bits(ex.decode(i % 2, *inputs[k])), want[k][i % 2])
        except Exception as e:  # noqa: BLE001 - reported by the test's thread
            errors.append(e)

    with ex:
        threads = [threading.Thread(target=caller, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads) and not errors, errors


def region_consumer(tmp: Path):
    """tests/omp_region.c built against the executor's C ABI with -fopenmp (its libgomp: the one torch loaded)."""
    so = tmp / ("omp_region" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-fopenmp", "-O1", "-Wall", "-Werror",
                    f"-I{sysconfig.get_paths()['include']}", f"-I{ce.get_include()}", str(HERE / "omp_region.c"),
                    "-o", str(so)], check=True, capture_output=True,
                   env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})  # the compiler: unsanitized
    spec = importlib.util.spec_from_file_location("omp_region", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_inside_a_parallel_region_the_caller_runs_the_step_alone(tmp_path, rng):
    """Called from the threads of another parallel region (the C ABI), a step's region is nested: libgomp gives it
    the caller alone, who claims every work item; the steps take turns and y is the reference's."""
    mod = region_consumer(tmp_path)
    ex, banks, _ = executor_for("q4_0", rng, threads=2, team="openmp")
    with ex:
        a = ex.io_arrays()
        x, w, ids = step_inputs(rng, ex, 5)
        xb = x.astype(cf.numerics.BF16)
        a["x"][:5], a["ids"][:5], a["w"][:5] = xb, ids, w
        want = reference(ex, banks, 1, xb, w, ids)
        ex.start_trace()
        assert mod.run_in_region(ex.handle, 1, 5, 2) == [(0, 2), (0, 2)]  # both outer threads ran a step
        t = ex.stop_trace()["raw"]["threads"]
        np.testing.assert_array_equal(bits(a["y"][:5]), bits(want))
        assert [s["steps"] for s in t] == [2, 0]  # tid 0 alone, twice: no nested thread joined


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
