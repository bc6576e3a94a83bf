"""Multi-thread decode bench of the executor: steps/s and effective GB/s of
expert weights read, next to this machine's multi-thread read bandwidth
measured in the same run with the same threads.

    python -m cpumoe_executor.bench [--format bf16,nvfp4,q4_k_m,q4_k/q6_k] [--model qwen3-30b | --shape H,I,E,TOPK]
        [--batch 1,4,8] [--threads N] [--working-set dram|cache] [--routing random|shared|both]
        [--numa auto,off,split,replicate] [--repeats 5] [--steps 20] [--json FILE] [--plot PNG] [--quick]
    python -m cpumoe_executor.bench --doorbell [...]   (doorbell round trip: see doorbell_bench.py)

dram: the bank holds at least 4 x LLC of experts, cut (per batch size and
routing) into disjoint windows of the experts one step can touch (top_k x batch;
top_k for shared routing), and each step routes into the next window, so a step
reads experts no step touched in the last 4 x LLC of the rotation: from DRAM.
(Windows sized for the largest batch let batch 1 re-read 1/8 of the bank: on a
300 MB L3 that fit in cache and read above the DRAM ceiling; fixed 2026-11-29.)
cache: every step reuses the same window (one route plan per batch size and routing,
the same experts every step), and one untimed step after each ceiling window
loads them back into the cache before the timed steps. random routing sends each
token to top_k distinct random experts of the window (the experts a step reads
are counted once: grouped decode reads each expert once per step); shared sends
every token to the same top_k experts (the batch costs no extra weight bytes).
The draws are route_plans' (a splitmix64 stream per batch size and routing), which
the ggml harness (bench/llamacpp) repeats: both read the same experts every step.

formats: a name, a GGUF mix (PAIRS: q4_k_m = q4_k gate_up with a q6_k down, as
the Q4_K_M files' use_more_bits layers hold) or an explicit 'gate_up/down' pair:
the executor gets that (gate_up, down) pair as its one layer's formats.

ceiling: before every timed repeat, one window of whole-buffer reads by the
executor's own pool (all its threads), as long as the last repeat (1 to 16
passes): the kernel and the ceiling are each averaged over windows of the same
length, interleaved. (Single ~5 ms passes swung 14-33 GB/s on the 2-vCPU dev VM
where ~70 ms windows read 24-31 GB/s, median unchanged.)

repeats: each repeat runs every (routing, batch) of a format once, forward then
backward in turn, so the ratios the acceptance asks for are also taken within
one repeat: % of the ceiling against the window just before, and batch N over
batch 1 (`*_paired`: median, min, max over the repeats).

numa (docs/numa.md): --numa runs each format with an executor per mode listed
(auto: the executor's default) on the same banks, their runs interleaved in
every repeat (each mode over off is paired per repeat: `over_off`). Before the
formats, the NUMA read ceilings are measured once: each node's workers reading
a buffer on their own node (per node, alone),
all nodes at once (all_nodes), and every thread reading one buffer the main
thread wrote (one_buffer: what a single pool's banks on one node allow). Each
result reports its GB/s as % of all_nodes (`pct_of_all_nodes`); a split or
replicate run's paired windows read node-local buffers (all nodes at once).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

import cpumoe_formats as cf
from cpumoe_formats.bench import PRESETS, build_banks
from cpumoe_formats.machine import llc_bytes, machine_info, stats

from .cores import resolve_cores
from .executor import CpuMoeExecutor
from .trace import trace_summary

MiB = 1 << 20


@dataclass(frozen=True)
class Model:
    H: int
    I: int  # noqa: E741
    E: int
    top_k: int
    activation: str = "silu"
    alpha: float | None = None
    limit: float | None = None


# Model shapes (spec §7): name -> (shape, formats it ships in)
MODELS = {
    "qwen3-30b": (Model(2048, 768, 128, 8), ("bf16", "bf16_x16", "q8_0", "q4_k", "q5_k", "q6_k", "q4_k_x16",
                                                 "q8_0_x16", "q6_k_x16", "q5_k_x16")),
    "qwen3.6": (Model(2048, 512, 256, 8), ("bf16", "fp8_block", "nvfp4", "fp8_block_x16", "nvfp4_x16")),
    "gemma4-26b": (Model(2816, 704, 128, 8, "gelu_tanh"), ("q4_0", "bf16", "nvfp4", "q4_0_x16")),
    "gpt-oss-120b": (Model(2880, 2880, 128, 4, "swigluoai", 1.702, 7.0), ("mxfp4", "mxfp4_panel", "mxfp4_x16")),
    "gpt-oss-20b": (Model(2880, 2880, 32, 4, "swigluoai", 1.702, 7.0), ("mxfp4", "mxfp4_panel", "mxfp4_x16")),
    "dsv4-flash": (Model(4096, 2048, 256, 6, "swiglu_clamp", 1.0, 10.0), ("ds_fp4", "ds_fp4_x16")),
    "glm4.7": (Model(5120, 1536, 160, 8), ("nvfp4", "bf16")),
    "minimax-m2.5": (Model(3072, 1536, 256, 8), ("nvfp4",)),
}
# Each format at its model shape (the acceptance shapes).
FORMAT_MODEL = {"bf16": "qwen3-30b", "fp8_block": "qwen3.6", "nvfp4": "qwen3.6", "mxfp4": "gpt-oss-120b",
                "ds_fp4": "dsv4-flash", "q4_0": "gemma4-26b", "mxfp4_panel": "gpt-oss-120b",
                "q4_0_x16": "gemma4-26b", "fp8_block_x16": "qwen3.6", "nvfp4_x16": "qwen3.6",
                "ds_fp4_x16": "dsv4-flash", "bf16_x16": "qwen3-30b", "mxfp4_x16": "gpt-oss-120b",
                "q8_0": "qwen3-30b", "q4_k": "qwen3-30b", "q6_k": "qwen3-30b", "q4_k_x16": "qwen3-30b",
                "q8_0_x16": "qwen3-30b", "q5_k": "qwen3-30b", "q6_k_x16": "qwen3-30b",
                "q5_k_x16": "qwen3-30b"}


# GGUF mixes as a (gate_up, down) pair: the layers of a Q4_K_M (Q5_K_M) file whose down projections llama.cpp's
# use_more_bits rule stores as Q6_K
PAIRS = {"q4_k_m": ("q4_k", "q6_k"), "q5_k_m": ("q5_k", "q6_k")}


def format_pair(fmt: str) -> tuple:
    """A --format entry as (gate_up, down) format names: a format ("q8_0": both), a PAIRS name or 'gate_up/down'."""
    if fmt in PAIRS:
        return PAIRS[fmt]
    gate_up, sep, down = fmt.partition("/")
    return (gate_up, down) if sep else (fmt, fmt)


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


REPACK = {"auto": None, "on": True, "off": False}  # --repack -> CpuMoeExecutor(repack=)


def model_for(fmt: str, opts) -> Model:
    fmt = format_pair(fmt)[0]  # a pair: its gate_up format's preset
    if opts.shape:
        H, I, E, K = (int(v) for v in opts.shape.split(","))  # noqa: E741
        p = PRESETS.get(fmt)
        return Model(H, I, E, K, *(asdict(p)[k] for k in ("activation", "alpha", "limit"))) if p else Model(H, I, E, K)
    return MODELS[opts.model or FORMAT_MODEL[fmt]][0]


def parse_modes(text: str | None) -> dict:
    """--mode: 'w4a8' (every format that has that mode; the others keep their default), or per format
    'nvfp4=w4a8,mxfp4=native'. Unknown formats or modes raise ValueError naming the accepted ones."""
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        fmt, _, mode = item.rpartition("=")
        fmts = [cf.get_format(fmt).name] if fmt else [n for n, sp in cf.FORMATS.items() if mode in sp.modes]
        if not fmts:
            modes = sorted({m for sp in cf.FORMATS.values() for m in sp.modes})
            raise ValueError(f"--mode {item!r}: no format has mode {mode!r}; expected one of {modes}")
        for f in fmts:
            if mode not in cf.get_format(f).modes:
                raise ValueError(f"--mode {item!r}: format {f!r} has modes {list(cf.get_format(f).modes)}")
            out[f] = mode
    return out


def mode_for(fmt: str, modes: dict) -> str | None:
    return modes.get(cf.get_format(fmt).name)


M64 = (1 << 64) - 1


def _splitmix64(state: int) -> tuple:
    """(next state, 64-bit value): splitmix64, as bench/llamacpp/util.cpp's."""
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def route_plans(seed: int, n_plans: int, w: int, T: int, K: int, shared: bool) -> list:
    """The route plans of one (batch T, routing): plan j sends each token (random) or all tokens (shared) to K
    distinct experts of window j (experts j*w .. (j+1)*w - 1), [T, K] int32 each. A partial Fisher-Yates shuffle of
    the window driven by one splitmix64 stream per (seed, T, routing, w): the ggml harness (bench/llamacpp, util.cpp
    route_plans) draws the same plans, so both sides read the same experts in every step."""
    state = (seed * 0x100000001B3 + T * 0x9E3779B97F4A7C15 + shared * 0xD1B54A32D192ED03 + w) & M64
    plans = []
    for j in range(n_plans):
        rows = []
        for _ in range(1 if shared else T):
            pool = list(range(j * w, (j + 1) * w))
            for q in range(K):
                state, r = _splitmix64(state)
                k = q + r % (w - q)
                pool[q], pool[k] = pool[k], pool[q]
            rows.append(pool[:K])
        plans.append(np.array(rows * T if shared else rows, dtype=np.int32))
    return plans


def routes_digest(plans) -> str:
    """FNV-1a 64 over the plans' ids in order (hex): equal on both sides of bench/llamacpp/compare.sh when they
    read the same experts in the same steps."""
    h = 0xCBF29CE484222325
    for p in plans:
        for v in np.asarray(p, dtype=np.int32).ravel().tolist():
            h = ((h ^ (v & 0xFFFFFFFF)) * 0x100000001B3) & M64
    return f"{h:016x}"


def read_window(ex, ws, passes: int) -> float:
    """GB/s of `passes` whole-buffer reads by the executor's pool: total bytes over total time. Placed on NUMA
    nodes: every group reads a buffer of ws's size on its own node, all at once."""
    if ex.numa == "off":
        return ex.read_bandwidth(ws, passes)
    bw = ex._x.node_read_bandwidth(ws.nbytes, passes, -1)
    return len(bw) / sum(1.0 / b for b in bw)


def numa_ceilings(threads, llc: int, repeats: int) -> dict:
    """The read ceilings per NUMA node (its workers alone, on a buffer on their node), of all nodes at once, and of
    every thread on one buffer the main thread wrote, with the workers a numa="replicate" executor picks (one group
    per node with workers; one group on a one-node host)."""
    spec = cf.get_format("bf16")
    banks = [spec.random_banks(1, 64, 64, np.random.default_rng(0))]
    size = max(4 * llc, 64 * MiB)
    with CpuMoeExecutor("bf16", banks, top_k=1, threads=threads, numa="replicate", repack=False) as ex:
        groups = ex.numa_plan.groups
        ws = cf.aligned_empty((size,), np.uint8)
        ws[:] = 1
        per, every, one = [[] for _ in groups], [], []
        for _ in range(repeats):  # interleaved, as the decode runs are
            for k in range(len(groups)):
                per[k] += ex._x.node_read_bandwidth(size, 1, k)
            every += ex._x.node_read_bandwidth(size, 1, -1)
            one.append(ex.read_bandwidth(ws, 1))
    return {"per_node": {str(g.node): {"cores": list(g.cores), "gbps": stats(v)} for g, v in zip(groups, per)},
            "all_nodes": stats(every), "one_buffer": stats(one), "bytes_per_group": size}


def compute_roof(ex, seconds: float = 0.05, reps: int = 5) -> dict | None:
    """The compute roof of the kernel that runs: every pool thread runs the tier's widest multiply-add instruction
    for its precision (cf.peak_loop: int8 for w4a8, bf16 otherwise) for ~`seconds`; the best of `reps` in
    G multiply-adds per second, or None where that tier has no such loop (scalar)."""
    tier, _, mode = ex.isa.partition("+")
    kind = "int8" if mode == "w4a8" else "bf16"
    if tier not in cf.TIERS:
        return None
    k, t = cf.PEAK_KINDS.index(kind), cf.TIERS.index(tier)
    t0 = time.perf_counter()
    if not ex._x.compute_peak(k, t, 20000, 1):
        return None
    iters = max(20000, int(20000 * seconds / max(time.perf_counter() - t0, 1e-6)))
    samples = ex._x.compute_peak(k, t, iters, reps)
    return {"kind": kind, "tier": tier, "gmacs": max(samples), "samples": samples}


def add_roofline(entry: dict, m: Model) -> None:
    """Per result: the step's multiply-adds, its memory floor (bytes at the ceiling), its compute floor (multiply-adds
    at the compute roof) and the roofline time (the larger), as % of the measured step; per routing, the largest
    batch's measured step over batch 1's (`<routing>_batch<N>_over_batch1`) and its compute floor over batch 1's
    step (`..._floor_over_batch1`): with batch 1 as fast as measured, no kernel of this tier brings that batch's
    ratio below it (the memory floor is no such bound: batch 1 reads above the read loop's ceiling on some hosts);
    and where the samples are there, the same ratio per repeat (`..._over_batch1_paired`: median, min, max; per
    result of a larger batch `over_batch1_paired`)."""
    roof = entry.get("compute_roof")
    for r in entry["results"].values():
        r["macs_per_step"] = r["batch"] * m.top_k * 3 * m.H * m.I
        r["memory_floor_us"] = r["bytes_per_step"] / (entry["ceiling_gbps"] * 1e3)
        r["compute_floor_us"] = r["macs_per_step"] / (roof["gmacs"] * 1e3) if roof else None
        r["roofline_us"] = max(r["memory_floor_us"], r["compute_floor_us"] or 0)
        r["roofline_pct"] = 100 * r["roofline_us"] / r["step_us"]["median"]
    for routing in ("random", "shared"):
        rs = sorted((r for r in entry["results"].values() if r["routing"] == routing), key=lambda r: r["batch"])
        if len(rs) > 1 and rs[0]["batch"] == 1:
            key, b1 = f"{routing}_batch{rs[-1]['batch']}", rs[0]["step_us"]["median"]
            entry[f"{key}_over_batch1"] = rs[-1]["step_us"]["median"] / b1
            entry[f"{key}_floor_over_batch1"] = (rs[-1]["compute_floor_us"] or 0) / b1
            for r in rs[1:]:  # every batch over batch 1 in the same repeat (interleaved), where samples are there
                if paired := [big / one for big, one in zip(r["step_us"].get("samples", ()),
                                                            rs[0]["step_us"].get("samples", ()))]:
                    r["over_batch1_paired"] = stats(paired)
            if "over_batch1_paired" in rs[-1]:
                entry[f"{key}_over_batch1_paired"] = rs[-1]["over_batch1_paired"]


def bench_one(fmt: str, m: Model, opts, rng, threads, llc: int, numas=("auto",)) -> dict:
    """One format at its model shape: an executor per --numa mode on the same banks, their runs interleaved
    repeat by repeat; numa mode -> the format's entry."""
    gname, dname = format_pair(fmt)
    spec, down = cf.get_format(gname), cf.get_format(dname)
    pair = spec is not down
    bpe = (spec.role_bytes_per_expert("gate_up", m.H, m.I) + down.role_bytes_per_expert("down", m.H, m.I) if pair
           else spec.bytes_per_expert(m.H, m.I))
    window = min(m.E, max(m.top_k * max(opts.batch), 1))  # experts one step can touch
    if opts.working_set == "dram":
        need = max(4 * llc, window * bpe * 2)
        n_win = max(2, math.ceil(need / (window * bpe)))
    else:
        n_win = 1
    E = window * n_win
    label = f"{fmt} ({E} experts, {E * bpe / MiB:.0f} MiB)"
    if pair:  # the gate_up format's gate_up banks and the down format's down banks
        banks = {k: v for k, v in build_banks(spec, E, m.H, m.I, rng, label).items() if k in spec.role_banks("gate_up")}
        banks.update((k, v) for k, v in build_banks(down, E, m.H, m.I, rng, label).items()
                     if k in down.role_banks("down"))
    else:
        banks = build_banks(spec, E, m.H, m.I, rng, label)
    mode = mode_for(gname, opts.mode)
    # a layout without the mode (ds_fp4_x16 has only w4a8) is never forced: ds_fp4 native stays ds_fp4
    has_layout = any(s.cpu_layout and (mode or s.default_mode) in cf.get_format(s.cpu_layout).modes
                     for s in (spec, down))
    exs = {}
    for numa in numas:
        exs[numa] = ex = CpuMoeExecutor([(gname, dname)] if pair else fmt, [banks], top_k=m.top_k,
                                        max_tokens=max(opts.batch), threads=threads,
                                        activation=m.activation, alpha=m.alpha, limit=m.limit, mode=mode,
                                        repack=REPACK[opts.repack] if has_layout else None,
                                        numa=None if numa == "auto" else numa)
        log(f"{fmt}: numa {numa}: {ex._numa_line()}")
    ex = exs[numas[0]]
    if run_name(ex) != (f"{gname}/{dname}" if pair else spec.name):
        log(f"{fmt}: running as {run_name(ex)} (the executor's repack; --repack off keeps {fmt}'s own layout)")
    roof = compute_roof(ex)
    if roof:
        log(f"{fmt}: compute roof {roof['gmacs']:.0f} G multiply-adds/s ({roof['kind']} at {roof['tier']}, "
            f"{ex.threads} threads)")
    ws = cf.aligned_empty((max(4 * llc, 64 * MiB),), np.uint8)
    ws[:] = 1
    T_max = max(opts.batch)
    x = rng.standard_normal((T_max, m.H)).astype(np.float32).astype(cf.numerics.BF16)
    ios = {}
    for numa, e in exs.items():
        ios[numa] = io = e.io_arrays()  # steps run on the IO block as a doorbell task would (no Python per step)
        io["x"][:T_max], io["w"][:T_max] = x, 1.0 / m.top_k
    runs = []  # one per (numa, routing, batch): its route plans (the same for every mode), the bytes each reads
    for routing in opts.routings:
        for T in opts.batch:
            # windows of what this step shape can touch, rotating through the whole bank (dram) or one window (cache)
            w = window if opts.working_set == "cache" else (m.top_k if routing == "shared" else min(E, m.top_k * T))
            plans = route_plans(opts.seed, E // w, w, T, m.top_k, routing == "shared")
            for numa in numas:
                runs.append({"numa": numa, "routing": routing, "T": T, "plans": plans, "window": w,
                             "bytes": [len(np.unique(p)) * bpe for p in plans], "gbps": [], "us": [], "ceiling": [],
                             "passes": 1})

    def steps(r, n):  # n steps of run r on the IO block (task = batch size, layer 0); weight bytes read
        e, io, nbytes = exs[r["numa"]], ios[r["numa"]], 0
        for s in range(n):
            j = s % len(r["plans"])
            io["ids"][:r["T"]] = r["plans"][j]
            if e._x.run_task(r["T"]):
                raise RuntimeError(e.health()["error_message"])
            nbytes += r["bytes"][j]
        return nbytes

    for r in runs:
        steps(r, 3)  # warm-up
    # Repeats interleave the runs (forward, then backward, so a drift in the host's speed hits every run alike):
    # each repeat of each run is timed next to its own ceiling window, and batch N / batch 1 (and each numa mode
    # over off) is also taken per repeat (`*_paired`), which a shared host's minute-to-minute swings move much less
    # than a ratio of medians.
    for rep in range(opts.repeats):
        for r in runs if rep % 2 == 0 else runs[::-1]:
            r["ceiling"].append(read_window(exs[r["numa"]], ws, r["passes"]))  # as long as this run's last repeat
            if opts.working_set == "cache":
                steps(r, 1)  # the window back into the cache the ceiling window evicted (untimed)
            t0 = time.perf_counter()
            nbytes = steps(r, opts.steps)
            dt = time.perf_counter() - t0
            r["passes"] = max(1, min(16, round(dt / (ws.nbytes / (r["ceiling"][-1] * 1e9)))))
            r["gbps"].append(nbytes / dt / 1e9)
            r["us"].append(dt / opts.steps * 1e6)
        log(f"{fmt}: repeat {rep + 1}/{opts.repeats}: " + ", ".join(
            f"{'' if len(numas) == 1 else r['numa'] + ' '}{r['routing'][0]}{r['T']} {r['us'][-1]:.0f} us"
            for r in runs))
    entries = {}
    for numa, e in exs.items():
        mine = [r for r in runs if r["numa"] == numa]
        results = {}
        for r in mine:
            routing, T = r["routing"], r["T"]
            results[f"{routing}/{T}"] = res = {
                "routing": routing, "batch": T, "gbps": stats(r["gbps"]),
                "bytes_per_step": sum(r["bytes"]) / len(r["bytes"]), "window": r["window"],
                "n_plans": len(r["plans"]), "routes_digest": routes_digest(r["plans"]),
                "step_us": stats(r["us"]), "steps_per_s": 1e6 / statistics.median(r["us"]),
                "pct_of_ceiling_paired": stats([100 * g / c for g, c in zip(r["gbps"], r["ceiling"])])}
            if opts.trace:  # extra steps after the timed ones, so the clock reads do not touch the figures
                e._x.set_trace(True)
                steps(r, opts.steps)
                e._x.set_trace(False)
                tr = res["trace"] = trace_summary(e._x.trace())
                log(f"{fmt} {routing} batch {T} trace: " + ", ".join(f"{k} {v:.0f}" for k, v in tr.items()
                                                                     if k != "threads"))
            log(f"{fmt} numa {e.numa} {routing} batch {T}: {res['gbps']['median']:.1f} GB/s, "
                f"{res['step_us']['median']:.0f} us/step, {res['pct_of_ceiling_paired']['median']:.0f}% of the "
                "ceiling (paired median)")
        ceil = stats([c for r in mine for c in r["ceiling"]])
        base = results.get(f"{opts.routings[0]}/{opts.batch[0]}")
        rep = e.numa_report()
        entries[numa] = entry = {
            "gbps": base["gbps"]["median"], "ceiling_gbps": ceil["median"],
            "ratio": base["gbps"]["median"] / ceil["median"], "batch": base["batch"], "threads": e.threads,
            "step_us": base["step_us"]["median"], "isa": e.isa, "layout": run_name(e), "format": fmt,
            "formats": [gname, dname], "mode": e.mode, "working_set": opts.working_set,
            "numa": e.numa, "numa_groups": rep["groups"], "numa_bounds": rep["bounds"], "shape": asdict(m),
            "bytes_per_expert": bpe, "bank_experts": E, "ceiling": ceil, "compute_roof": roof, "results": results}
        add_roofline(entry, m)
    for e in exs.values():
        e.close()
    return entries


def run_name(ex) -> str:
    """The format the executor's (one) layer runs as: 'q4_k_x16', or 'q4_k_x16/q6_k_x16' for a (gate_up, down) pair."""
    return "/".join(ex.layer_formats[0]) if ex.mixed else ex.spec.name


def add_numa(report: dict) -> None:
    """Per result: GB/s as % of the all-nodes ceiling; per format run with several modes: each mode's GB/s over
    numa off's in the same repeat, result by result (`over_off`: median, min, max, samples)."""
    every = report["numa_ceilings"]["all_nodes"]["median"]
    for e in report["formats"].values():
        for r in e["results"].values():
            r["pct_of_all_nodes"] = 100 * r["gbps"]["median"] / every
    for e in report["formats"].values():
        off = report["formats"].get(f"{e['format']}:off")
        if off is not None and e is not off:
            e["over_off"] = {k: stats([a / b for a, b in zip(r["gbps"]["samples"],
                                                              off["results"][k]["gbps"]["samples"])])
                             for k, r in e["results"].items() if k in off["results"]}


def table(report: dict) -> str:
    """One row per (format, batch, routing); a format the executor repacked shows as given>ran (mxfp4>mxfp4_panel)."""
    name = {}
    for f, e in report["formats"].items():
        fmt = e.get("format", f)
        name[f] = fmt if e.get("layout", fmt) == fmt else f"{fmt}>{e['layout']}"
    w = max([10, *map(len, name.values())])
    lines = [f"{'format':<{w}} {'isa':<16} {'numa':<9} {'thr':>3} {'batch':>5} {'routing':<7} {'us/step':>8} "
             f"{'GB/s':>7} {'ceiling':>8} {'%':>5} {'%all':>5} {'mem us':>7} {'mac us':>7} {'%roof':>6}"]
    for fmt, e in report["formats"].items():
        for r in e["results"].values():
            g, cu = r["gbps"]["median"], r.get("compute_floor_us")
            pct = r["pct_of_ceiling_paired"]["median"] if "pct_of_ceiling_paired" in r else 100 * g / e["ceiling_gbps"]
            alln = f"{r['pct_of_all_nodes']:.0f}%" if "pct_of_all_nodes" in r else "-"
            lines.append(f"{name[fmt]:<{w}} {e['isa']:<16} {e.get('numa', 'off'):<9} {e['threads']:>3} "
                         f"{r['batch']:>5} {r['routing']:<7} "
                         f"{r['step_us']['median']:>8.0f} {g:>7.1f} {e['ceiling_gbps']:>8.1f} "
                         f"{pct:>4.0f}% {alln:>5} {r['memory_floor_us']:>7.0f} "
                         f"{'-' if cu is None else f'{cu:.0f}':>7} {r['roofline_pct']:>5.0f}%")
    notes = []
    many = any(e.get("format", f) != f for f, e in report["formats"].items())  # several numa modes per format
    for fmt, e in report["formats"].items():
        label = f"{name[fmt]} numa {e['numa']}" if many else name[fmt]
        for k, v in e.items():
            if k.endswith("_floor_over_batch1"):
                measured = e.get(k.replace("_floor_", "_"))
                routing, batch = k.split("_")[:2]
                p = e.get(k.replace("_floor_", "_") + "_paired")
                paired = f" (per repeat {p['median']:.2f}x, {p['min']:.2f}-{p['max']:.2f})" if p else ""
                notes.append(f"{label}: {routing} batch {batch[5:]} / batch 1 measured {measured:.2f}x{paired}; "
                             f"its compute floor / batch 1 {v:.2f}x")
    for f, e in report["formats"].items():
        if "over_off" in e:
            notes.append(f"{name[f]} numa {e['numa']} over off, per repeat: " + ", ".join(
                f"{k} {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})" for k, v in e["over_off"].items()))
    pf = report.get("machine", {}).get("x16_prefetch")
    if pf and any(set(e.get("layout", f).split("/")) & set(cf.X16_PREFETCH_LAYOUTS) and "avx512vnni" in e["isa"]
                  for f, e in report["formats"].items()):
        notes.append(f"avx512vnni GGUF x16 software prefetch (CPUMOE_X16_PREFETCH): {pf['prefetch']} ({pf['why']})")
    nc = report.get("numa_ceilings")
    if nc:
        per = ", ".join(f"node {n} {v['gbps']['median']:.1f}" for n, v in nc["per_node"].items())
        notes.append(f"read ceilings GB/s: {per}; all nodes at once {nc['all_nodes']['median']:.1f}; one buffer "
                     f"(main thread's node) read by every thread {nc['one_buffer']['median']:.1f}")
    lines += ["", "%: GB/s over the ceiling window next to it, median over the repeats; %all: over the all-nodes "
                  "read ceiling (node-local buffers, every node at once); mem us: bytes at the read "
                  "ceiling; mac us: multiply-adds at the compute roof (compute_roof); %roof: the larger over the step",
              *notes] if notes else []
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: pip install 'cpumoe-executor[bench]' to draw plots")
        return
    fmts = list(report["formats"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    g = [report["formats"][f]["gbps"] for f in fmts]
    c = [report["formats"][f]["ceiling_gbps"] for f in fmts]
    a.bar(range(len(fmts)), g, color="#3a7", label="decode, batch 1")
    a.scatter(range(len(fmts)), c, marker="_", s=900, linewidths=2, color="k", label="read ceiling (same threads)")
    a.set_xticks(range(len(fmts)), fmts)
    a.set_ylabel("GB/s of expert weights")
    a.legend()
    for f in fmts:
        e = report["formats"][f]
        for routing, style in (("random", "-o"), ("shared", "--s")):
            pts = sorted(((r["batch"], r["step_us"]["median"], r["roofline_us"], r.get("over_batch1_paired"))
                          for r in e["results"].values() if r["routing"] == routing), key=lambda p: p[0])
            if pts:  # the per-repeat ratio's median where the repeats were paired, else the medians' ratio
                ys = [p[3]["median"] if p[3] else p[1] / pts[0][1] for p in pts]
                line, = b.plot([p[0] for p in pts], ys, style, label=f"{f} {routing}")
                if routing == "shared" and e.get("compute_roof"):  # the roofline (the larger floor) over batch 1
                    b.plot([p[0] for p in pts], [p[2] / pts[0][1] for p in pts], ":", color=line.get_color(), lw=1)
    b.axhline(1.6, color="#999", lw=0.8, ls="--")
    b.set_xlabel("batch")
    b.set_ylabel("step time / batch-1 step time, per repeat (dotted: shared roofline)")
    b.legend(fontsize=7)
    fig.suptitle(f"cpumoe-executor decode, {report['machine'].get('cpu', '')}, {report['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"plot written to {path}")


def size_arg(text: str) -> int:
    """--llc: bytes, or a number with K, M or G (powers of 1024)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        n = int(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes or a size like 96M") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive size")
    return n


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cpumoe_executor.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default=None,
                   help="comma list (default: every format with kernels); an entry may be a (gate_up, down) pair: "
                        f"{', '.join(PAIRS)} or 'gate_up/down'")
    p.add_argument("--model", choices=sorted(MODELS), help="model preset (default: each format's own model)")
    p.add_argument("--shape", help="H,I,E,TOPK instead of a preset")
    p.add_argument("--batch", default="1,4,8", help="comma list of batch sizes")
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: one per physical core)")
    p.add_argument("--mode", default=None,
                   help="precision mode: 'w4a8' for every format that has it, or per format "
                        "'nvfp4=w4a8,mxfp4=native' (default: each format's default mode; the isa column shows it)")
    p.add_argument("--working-set", choices=("dram", "cache"), default="dram")
    p.add_argument("--llc", type=size_arg, default=None,
                   help="the cache size the dram bank, the evicting reads and the ceiling buffer are sized by (bytes, "
                        "or with K/M/G: 96M; default: the level-3 cache sysfs reports, which a VM may understate)")
    p.add_argument("--repack", choices=tuple(REPACK), default="auto",
                   help="formats with a CPU layout (FormatSpec.cpu_layout: mxfp4, q4_0, fp8_block, bf16; nvfp4, "
                        "ds_fp4, q8_0 and q4_k in w4a8; q6_k; mxfp4 on to mxfp4_x16 in w4a8): auto repacks as the "
                        "executor does by default "
                        "(table: mxfp4>mxfp4_panel, or mxfp4>mxfp4_x16), "
                        "on forces it, off runs their own layout")
    p.add_argument("--routing", choices=("random", "shared", "both"), default="both")
    p.add_argument("--numa", default="auto",
                   help="comma list of auto, off, split, replicate: each format runs once per mode (CpuMoeExecutor's "
                        "numa=; auto: its default, split on 2+ nodes). The NUMA read ceilings are measured once")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", action="store_true",
                   help="after each timed run, trace --steps more steps: per-thread phase times (us per step)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    o = p.parse_args(argv)
    o.batch = [int(v) for v in o.batch.split(",")]
    try:
        o.mode = parse_modes(o.mode)
    except ValueError as e:
        p.error(str(e))
    o.routings = ["random", "shared"] if o.routing == "both" else [o.routing]
    o.numas = o.numa.split(",")
    if bad := [n for n in o.numas if n not in ("auto", "off", "split", "replicate")]:
        p.error(f"--numa {o.numa}: {bad} not in auto, off, split, replicate")
    if o.quick:
        o.repeats, o.steps = 2, 3
    return o


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--doorbell" in argv:
        from . import doorbell_bench

        return doorbell_bench.main([a for a in argv if a != "--doorbell"])
    opts = parse_args(argv)
    fmts = opts.format.split(",") if opts.format else [n for n, s in cf.FORMATS.items() if s.banks]
    llc = opts.llc or llc_bytes() or 32 * MiB
    if opts.quick:
        llc = 4 * MiB
    cores, why = resolve_cores(opts.threads)
    rng = np.random.default_rng(opts.seed)
    report = {"machine": machine_info(llc), "threads": len(cores), "cores": cores, "cores_why": why,
              "settings": {k: v for k, v in vars(opts).items() if k not in ("json", "plot")}, "formats": {}}
    log(f"{len(cores)} threads on cores {cores} ({why}); working set {opts.working_set}, LLC {llc / MiB:.0f} MiB")
    pf = report["machine"]["x16_prefetch"]
    log(f"avx512vnni GGUF x16 software prefetch (CPUMOE_X16_PREFETCH): {pf['prefetch']} ({pf['why']})")
    nc = report["numa_ceilings"] = numa_ceilings(opts.threads, llc, opts.repeats)
    log("read ceilings: " + ", ".join(f"node {n} ({len(v['cores'])} cores) {v['gbps']['median']:.1f} GB/s"
                                      for n, v in nc["per_node"].items()) +
        f"; all nodes {nc['all_nodes']['median']:.1f} GB/s; one buffer {nc['one_buffer']['median']:.1f} GB/s")
    for fmt in fmts:
        m = model_for(fmt, opts)
        if opts.quick:
            m = Model(max(m.H // 8 // 128 * 128, 256), max(m.I // 8 // 128 * 128, 256), min(m.E, 16),
                      min(m.top_k, 4), m.activation, m.alpha, m.limit)  # multiples of 128: every format's K
        for numa, entry in bench_one(fmt, m, opts, rng, opts.threads, llc, opts.numas).items():
            report["formats"][fmt if len(opts.numas) == 1 else f"{fmt}:{numa}"] = entry
    add_numa(report)
    print(table(report))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1)
        log(f"JSON written to {opts.json}")
    if opts.plot:
        plot(report, opts.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
