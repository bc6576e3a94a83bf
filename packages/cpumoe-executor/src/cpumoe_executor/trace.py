"""The executor's step trace (CpuMoeExecutor.start_trace / stop_trace) as microseconds per step."""
from __future__ import annotations


def trace_summary(t: dict) -> dict:
    """The executor's step trace as microseconds per step: the step, then each phase averaged over the threads
    that ran (enter: from the step's start to the thread's; tail: how long before y was complete the thread ran
    out of work, 0 for the thread that completed y and for one that left after: never negative), and the spread
    of the threads' busy time (gate_up + down). A pure function."""
    steps = max(1, t["steps"])
    th = [x for x in t["threads"] if x["steps"]]
    per = lambda k: sum(x[k] / x["steps"] for x in th) / len(th) / 1e3  # noqa: E731
    busy = [(x["gate_up_ns"] + x["down_ns"]) / x["steps"] / 1e3 for x in th]
    step = t["step_ns"] / steps / 1e3
    return {"step_us": step, "enter_us": per("enter_ns"), "prep_us": per("prep_ns"), "gate_up_us": per("gate_up_ns"),
            "down_wait_us": per("down_wait_ns"), "down_us": per("down_ns"), "tail_us": per("tail_ns"),
            "busy_min_us": min(busy), "busy_max_us": max(busy), "threads": len(th)}
