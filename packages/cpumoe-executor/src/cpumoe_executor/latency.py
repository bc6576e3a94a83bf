"""The doorbell's latency tools, for benchmarks (cpumoe_executor.doorbell_bench, gpusync_cuda.bench): a CPU thread
plays the GPU, so the coordinator's round trip and a task's own time are measured without PCIe. Each takes an
executor (its handle is read here) and returns nanoseconds per iteration.

    ring_loop(ready, done, tasks, ids_dst, ids_plans, nplans, plan_ints, n, warmup, timeout_s, core=-1)
        ring the doorbell words at host addresses ready / done n times (tasks cycled, ids rewritten from plans)
    task_loop(executor, tasks, ids_dst, ids_plans, nplans, plan_ints, n, warmup, core=-1, spin_core=-1)
        the same tasks run directly (no doorbell)
    ping_pong(n, ring_core=-1, echo_core=-1)
        two threads passing a word back and forth: the machine's floor
    allowed_cpus()
        the CPUs this process may run on (affinity and cgroup limits)
"""
from __future__ import annotations

from . import _native

ring_loop = _native.ring_loop
ping_pong = _native.ping_pong
allowed_cpus = _native.allowed_cpus


def task_loop(executor, *args, **kwargs):
    """`executor`'s tasks run directly, timed per task (see the module docstring for the arguments)."""
    return _native.task_loop(executor.handle, *args, **kwargs)


__all__ = ["allowed_cpus", "ping_pong", "ring_loop", "task_loop"]
