"""Doorbell round trip without a GPU: a native CPU thread plays the GPU's part of
protocol v1 (copy the step's ids in, done := 0, ready := task, spin until done >= 1)
and times ring -> done, for the near-empty task of `python -m gpusync_cuda.bench`
(one route per token to an expert of width I=8, H=2048, top_k=8, E=16, 4 layers)
and for an empty ring (every id -1: the coordinator zero-fills y, no pool). Next to
them, in the same run: the CPU task alone (run_task on the coordinator's core, no
doorbell) and a pure two-thread ping-pong, this machine's floor for any handshake.

    python -m cpumoe_executor.bench --doorbell [--threads 1,2] [--batch 1,4,8] [--rings 5000]
        [--repeats 3] [--json FILE]

"overhead" = round trip - CPU task alone (medians): what the handshake itself costs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

import cpumoe_formats as cf

from . import _native
from .executor import CpuMoeExecutor

SHAPE = {"H": 2048, "I": 8, "E": 16, "top_k": 8, "layers": 4}  # gpusync_cuda.bench's near-empty task


def log(msg: str) -> None:
    print(f"[doorbell] {msg}", file=sys.stderr, flush=True)


def summary(ns_runs: list[list[int]]) -> dict:
    """Per-run medians (best and median of them) and p99 over every sample, in microseconds."""
    meds = [statistics.median(r) / 1e3 for r in ns_runs]
    every = np.concatenate([np.asarray(r, np.int64) for r in ns_runs]) / 1e3
    return {"median": statistics.median(meds), "best_median": min(meds), "p99": float(np.percentile(every, 99)),
            "min": float(every.min()), "run_medians": meds, "n": int(every.size)}


def plans(rng, T: int, K: int, E: int, n: int, empty: bool) -> np.ndarray:
    """n id plans [T, K]: one CPU route per token (column 0) to a random expert, the rest -1."""
    ids = np.full((n, T, K), -1, np.int32)
    if not empty:
        ids[:, :, 0] = rng.integers(0, E, size=(n, T))
    return ids


def bench_threads(threads: int, opts, rng) -> dict:
    s = dict(SHAPE, H=opts.hidden)
    spec = cf.get_format("bf16")
    banks = [spec.random_banks(s["E"], s["H"], s["I"], rng) for _ in range(s["layers"])]
    ex = CpuMoeExecutor("bf16", banks, top_k=s["top_k"], max_tokens=max(opts.batch), threads=threads)
    if opts.team_unit is not None:
        _native.set_team_unit(ex.handle, opts.team_unit)
    core = ex.core_ids[0]
    free = [c for c in _native.allowed_cpus() if c not in ex.core_ids]
    ring_core = free[0] if free else -1  # the ringer on a core of its own when there is one
    a, iob = ex.io_arrays(), ex.io_block()
    a["x"][...] = rng.standard_normal(a["x"].shape).astype(np.float32).astype(cf.numerics.BF16)
    a["w"][...] = 1.0
    out = {"threads": ex.threads, "cores": ex.core_ids, "ring_core": ring_core, "isa": ex.isa,
           "team_unit": _native.team_unit(ex.handle), "batches": {}}
    for T in opts.batch:
        row = {}
        for kind, empty in (("task", False), ("empty", True)):
            p = plans(rng, T, s["top_k"], s["E"], 64, empty)
            tasks = [layer << 32 | T for layer in range(s["layers"])]
            # The task alone: the same tasks and plans in the same order through run_task on the coordinator's
            # core, coordinator stopped (so the weights come from the same cache level as in the rings).
            seq = (tasks, iob["ids"], p.ctypes.data, len(p), T * s["top_k"], opts.rings, 200)
            alone = [_native.task_loop(ex.handle, *seq, core, ring_core if opts.spinner else -1)
                     for _ in range(opts.repeats)]
            ex.start_coordinator()
            rt = []
            try:
                for _ in range(opts.repeats):
                    rt.append(_native.ring_loop(iob["ready"], iob["done"], *seq, 10.0, ring_core))
            finally:
                ex.stop_coordinator()
            if ex.health()["error"]:
                raise RuntimeError(ex.health()["error_message"])
            r, t = summary(rt), summary(alone)
            row[kind] = {"round_trip_us": r, "task_alone_us": t, "overhead_us": r["median"] - t["median"]}
            log(f"threads={ex.threads} batch={T} {kind:5}: round trip {r['median']:.2f} us (p99 {r['p99']:.2f}), "
                f"task alone {t['median']:.2f}, overhead {r['median'] - t['median']:.2f}")
        out["batches"][T] = row
    ex.close()
    return out


def table(report: dict) -> str:
    pp = report["ping_pong_us"]
    lines = [f"ping-pong floor (two threads, same run): median {pp['median']:.2f} us, p99 {pp['p99']:.2f}",
             f"{'thr':>3} {'batch':>5} {'ring':<6} {'round trip':>10} {'best':>6} {'p99':>7} {'task alone':>10} "
             f"{'overhead':>8} {'- floor':>7}"]
    for e in report["runs"]:
        for T, row in e["batches"].items():
            for kind, v in row.items():
                r = v["round_trip_us"]
                lines.append(f"{e['threads']:>3} {T:>5} {kind:<6} {r['median']:>10.2f} {r['best_median']:>6.2f} "
                             f"{r['p99']:>7.2f} {v['task_alone_us']['median']:>10.2f} {v['overhead_us']:>8.2f} "
                             f"{v['overhead_us'] - pp['median']:>7.2f}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cpumoe_executor.bench --doorbell", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2", help="comma list of executor thread counts (coordinator included)")
    p.add_argument("--batch", default="1,4,8", help="comma list of batch sizes")
    p.add_argument("--hidden", type=int, default=SHAPE["H"], help="H (smaller: less work, the handshake shows)")
    p.add_argument("--rings", type=int, default=5000, help="timed rings per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    p.add_argument("--team-unit", type=int, default=None,
                   help="bytes of work per thread of a step's team (0: every thread; default: the executor's)")
    p.add_argument("--no-spinner", dest="spinner", action="store_false",
                   help="time the task alone without a thread spinning where the ringer does")
    p.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    o = p.parse_args(argv)
    o.threads = [int(v) for v in o.threads.split(",")]
    o.batch = [int(v) for v in o.batch.split(",")]
    if o.quick:
        o.rings, o.repeats = 200, 1
    if o.rings < 4 or o.repeats < 1 or min(o.threads) < 1 or min(o.batch) < 1:
        p.error("--rings >= 4, --repeats >= 1, threads and batch sizes >= 1")
    return o


def main(argv=None) -> int:
    opts = parse_args(argv)
    rng = np.random.default_rng(opts.seed)
    cpus = list(_native.allowed_cpus())  # echo where the coordinator sits, ring where the ringer does
    pp_cores = {"ring_core": cpus[1] if len(cpus) > 1 else -1, "echo_core": cpus[0]}
    pp = summary([_native.ping_pong(opts.rings, **pp_cores) for _ in range(opts.repeats)])
    report = {"shape": dict(SHAPE, H=opts.hidden), "settings": {k: v for k, v in vars(opts).items() if k != "json"},
              "ping_pong_us": pp, "runs": [bench_threads(t, opts, rng) for t in opts.threads]}
    report["ping_pong_after_us"] = summary([_native.ping_pong(opts.rings, **pp_cores) for _ in range(opts.repeats)])
    print(table(report))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1)
        log(f"JSON written to {opts.json}")
    return 0
