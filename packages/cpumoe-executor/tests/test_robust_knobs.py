"""Knobs set or read wrong: threads past the usable CPUs are clamped with a RuntimeWarning saying what happened
(accepted silently before: 64 spinning workers on 2 cores); the step trace's tail is never negative, every format
(conftest.FORMATS; a worker that woke after y was complete gave tail_us of -20 to -55 us on 2 cores)."""
import warnings

import numpy as np
import pytest
from conftest import FORMATS, executor_for, make_banks, step_inputs, workers

import cpumoe_executor as ce
from cpumoe_executor import _native


def test_threads_past_the_usable_cpus_are_clamped_with_a_warning(rng):
    banks, _ = make_banks("bf16", rng)
    n = ce.usable_cpus()
    with pytest.warns(RuntimeWarning, match=rf"threads={n + 62} is more than the {n} CPUs .*using threads={n}\."):
        ex = ce.CpuMoeExecutor("bf16", banks, top_k=2, threads=n + 62)
    assert ex.threads == n and len(set(ex.core_ids)) == n
    with pytest.warns(RuntimeWarning, match=f"threads={n + 1} is more"):
        cores, why = ce.resolve_cores(threads=n + 1)
    assert len(cores) == n and "clamped" in why
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(ce.resolve_cores(threads=n)[0]) == n
        # several workers on one core on purpose: core_ids, no warning
        ex2 = ce.CpuMoeExecutor("bf16", banks, top_k=2, core_ids=[ex.core_ids[0]] * (n + 1))
    assert ex2.threads == n + 1
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=rf"threads={bad!r} must be a positive int"):
            ce.resolve_cores(threads=bad)


@pytest.mark.parametrize("fmt", FORMATS)
def test_trace_tail_is_never_negative(fmt, rng):
    """Three workers on two cores, asleep at each step's start (spin_us=0) and all in every step's team: some
    wake after y is complete. Each thread's tail is in [0, the steps' time]."""
    ex, _, _ = executor_for(fmt, rng, spin_us=0, **workers(3))
    _native.set_team_unit(ex.handle, 0)
    steps = [(layer, *step_inputs(rng, ex, T)) for layer, T in ((0, 1), (1, 8))]
    ex.start_trace()
    for i in range(60):
        ex.decode(*steps[i % 2])
    t = ex.stop_trace()
    assert t["steps"] == 60 and 0 <= t["tail_us"] <= t["step_us"] * 1.5, t
    for th in t["raw"]["threads"]:
        assert 0 <= th["tail_ns"] <= t["raw"]["step_ns"], (th, t["raw"]["step_ns"])
    assert np.isfinite([v for k, v in t.items() if k.endswith("_us")]).all()
    ex.close()
