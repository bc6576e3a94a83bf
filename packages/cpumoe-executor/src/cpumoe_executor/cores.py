"""Which CPUs the executor's workers run on: the process's usable CPUs (affinity mask, cgroup limit), the worker
cores for a thread count, and whether the caller's OpenMP team can run the steps instead."""
from __future__ import annotations

import logging
import warnings

from . import _native

log = logging.getLogger("cpumoe_executor")


def usable_cpus() -> int:
    """Logical CPUs this process may run on: its affinity mask, capped by the cgroup CPU limit (at least 1). A pure
    function: any thread may call it."""
    n, limit = len(_native.allowed_cpus()) or 1, _native.cgroup_cpu_limit()
    return min(n, limit) if limit > 0 else n


def openmp_team_unusable() -> str:
    """Why an executor's team="openmp" cannot run in this process ("" when it can): no OpenMP runtime loaded (it
    runs on libgomp.so.1 as torch's wheels bring it; nothing is loaded by asking), or a fork of the process that
    loaded this package (GNU libgomp's team does not survive fork()). Any thread."""
    return _native.openmp_team_unusable()


def resolve_cores(threads: int | None = None, core_ids=None) -> tuple[list[int], str]:
    """Worker cores and why: explicit core_ids (repeats allowed: workers sharing a core, on purpose); else
    `threads` cores taken from the physical cores first, then the other logical CPUs, clamped to usable_cpus()
    with a RuntimeWarning saying so (spinning workers sharing a core slow every step down); else one per physical
    core (affinity mask and cgroup CPU limit respected). A pure function: any thread may call it."""
    return _resolve_cores(threads, core_ids)


def _resolve_cores(threads, core_ids) -> tuple[list[int], str]:
    if core_ids is not None:
        cores = [int(c) for c in core_ids]
        allowed = set(_native.allowed_cpus())
        bad = [c for c in cores if c not in allowed]
        if not cores or bad:
            raise ValueError(f"core_ids={list(core_ids)!r}: every id must be in the affinity mask {sorted(allowed)}")
        if threads is not None and threads != len(cores):
            raise ValueError(f"threads={threads} disagrees with len(core_ids)={len(cores)}")
        return cores, "core_ids given"
    default, why = _native.default_cores()
    if threads is None:
        return list(default), why
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads={threads!r} must be a positive int or None")
    phys = list(_native.physical_cores()) or list(default)
    order = phys + [c for c in _native.allowed_cpus() if c not in phys]
    usable = min(usable_cpus(), len(order))
    why = f"threads={threads} requested ({len(phys)} physical cores)"
    if threads > usable:
        msg = (f"threads={threads} is more than the {usable} CPUs this process may use (affinity mask, cgroup CPU "
               f"limit): using threads={usable}. Pass core_ids to place several workers on one core on purpose")
        warnings.warn(msg, RuntimeWarning, stacklevel=3)  # the line calling resolve_cores or CpuMoeExecutor
        log.warning("cpumoe_executor: %s", msg)
        threads, why = usable, f"threads clamped to {usable} usable CPUs ({len(phys)} physical cores)"
    return order[:threads], why
