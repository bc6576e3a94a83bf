"""Placement and miss-split benchmarks for docs/moe-engine.md (issue 40), 8 Qwen3-30B-A3B layers by default, routes
from the calibrated trace model (placement/trace.py), each step under a CUDA graph with its routes gathered from a
pool on the device; the engine's end_step() runs between replays, as an engine would.

    python -m moe_engine.tools.bench_placement hot [--json F]
        hot vs random placement at equal slots: step us and hit rate
    python -m moe_engine.tools.bench_placement split [--json F]
        0% resident: CPU-only misses (q=0), GPU-only zero-copy (q=1) and split fractions between, per split rule
    python -m moe_engine.tools.bench_placement auto [--json F]
        a grid (residency x batch x format): each q's step time and what split='auto' picks from the profile
    python -m moe_engine.tools.bench_placement replay [--json F]
        1,000 replays, hot re-placement every 50 steps, split on: each replay bit for bit against the eager step

`--smoke` runs a tiny shape eagerly (no GPU: Triton's interpreter), to check the tool itself.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from ..banks import random_layers
from ..placement.calibrate import CALIBRATED
from ..placement.livecheck import LiveCheck
from ..placement.missplit import live_GBps
from ..placement.split import DEFAULT_RULE
from ..placement.trace import TraceModel
from .shapes import MoEShape, preset


def _say(msg: str) -> None:
    print(f"[bench_placement] {msg}", file=sys.stderr, flush=True)


class Driver:
    """Steps of every layer over a pool of routes: a captured graph on a GPU, eager calls otherwise."""

    def __init__(self, runner, L: int, T: int, pool_ids, seed: int = 0):
        import torch

        self.torch, self.r, self.L, self.T = torch, runner, L, T
        dev = runner.device
        self.n = pool_ids.shape[0]
        self.ids_np = pool_ids  # [n, L, T, K]
        self.pool_ids = torch.from_numpy(pool_ids).to(dev)
        g = torch.Generator().manual_seed(seed)
        self.pool_w = (torch.rand(pool_ids.shape, generator=g) + 0.05).to(dev)
        self.x = torch.randn(T, runner.H, generator=g).to(torch.bfloat16).to(dev)
        self.i = 0
        self.end_s = 0.0  # host seconds in end_step() (re-placement, the split's re-choice)
        self.stats = {}  # the last timed(): end_step's host us per step, experts loaded by hot
        self.graph = None
        if dev.type == "cuda":
            from .bench import Step

            self.graph = Step(torch, runner.step, L, self.x, self.pool_w, self.pool_ids)
            self.graph.i.zero_()

    def step(self):
        """One step of every layer, then end_step(); returns the outputs (the graph's buffers on a GPU)."""
        if self.graph is not None:
            self.graph.graph.replay()
            out = self.graph.out
        else:
            out = [self.r.step(li, self.x, self.pool_w[self.i, li], self.pool_ids[self.i, li]) for li in range(self.L)]
        self.i = (self.i + 1) % self.n
        t0 = time.perf_counter()
        self.r.end_step()
        self.end_s += time.perf_counter() - t0
        return out

    def rewind(self, i: int) -> None:
        """The next step takes the pool's routes `i` (the graph's own counter too)."""
        self.i = i % self.n
        if self.graph is not None:
            self.graph.i.fill_(self.i)

    def sync(self):
        if self.graph is not None:
            self.torch.cuda.synchronize()

    def timed(self, steps: int) -> tuple[float, float]:
        """(us per layer, hit rate of the routes against the residency in force at each step). Each step is timed
        to its completion, end_step() included, as a decode loop that samples every token sees it; the hit count
        stays outside the timer."""
        hits = total = 0
        dt = 0.0
        self.sync()
        self.end_s, loads = 0.0, self._loads()
        for _ in range(steps):
            ids = self.ids_np[self.i]
            for li in range(self.L):
                m = self.r.residency.host_mask(li)
                v = ids[li][ids[li] >= 0]
                hits, total = hits + int(m[v].sum()), total + v.size
            t0 = time.perf_counter()
            self.step()
            self.sync()
            dt += time.perf_counter() - t0
        self.stats = {"end_step_us": 1e6 * self.end_s / steps, "loads": self._loads() - loads}
        return 1e6 * dt / (steps * self.L), hits / max(total, 1)

    def _loads(self) -> int:
        """Experts hot residency has loaded so far (0 without it)."""
        return self.r.hot.loads if self.r.hot is not None else 0


def _shape(a) -> MoEShape:
    if a.smoke:
        return MoEShape("smoke", 16, 128, 64, 4, 2)
    return preset(a.preset)


def _pool(s: MoEShape, L: int, T: int, n: int, seed: int) -> np.ndarray:
    m = TraceModel(E=s.E, top_k=s.top_k, layers=L, **CALIBRATED)
    return np.ascontiguousarray(m.generate(n, batch=T, seed=seed).transpose(0, 2, 1, 3))  # [n, L, T, K]


def _runner(fmt, banks, s, T, a, **kw):
    from ..runner import MoERunner

    # start-up qualification only where correctness is the measurement (replay); timing runs skip its seconds.
    # Host banks page-locked, as from_pretrained has them beside a GPU: hot's moves from pageable banks block the
    # host for each expert's copy (4-6 GB/s), inside the timed steps
    if not a.smoke:
        kw.setdefault("pin_memory", True)
    return MoERunner(fmt, banks, top_k=s.top_k, strategy="hybrid", graph_batch_sizes=(T,), threads=a.threads,
                     progress=False, device="cuda" if not a.smoke else None, qualify=a.what == "replay", **kw)


def _stats(v) -> dict:
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "samples": list(v)}


def bench_hot(a, fmt, T, banks, s, emit=lambda row: None) -> list[dict]:
    rows = []
    pool = _pool(s, a.layers, T, a.warmup + a.steps, seed=1)
    for res in (r for r in a.residencies if r > 0):  # no slot at 0%: nothing to place
        cap = max(1, round(res * s.E))
        row = {"format": fmt, "batch": T, "residency": res}
        for name, kw in (("hot", dict(residency="hot", capacity=cap, replace_every=a.every)),
                         ("random", dict(residency=cap / s.E, capacity=cap))):
            with _runner(fmt, banks, s, T, a, **kw) as r:
                d = Driver(r, a.layers, T, pool)
                for _ in range(a.warmup):
                    d.step()
                us, hit = d.timed(a.steps)
                row[name] = {"layer_us": us, "hit_rate": hit}
        rows.append(row)
        emit(row)  # main() saves each row as it comes
        _say(f"hot {fmt} T={T} {res:.0%}: hot {row['hot']['layer_us']:.0f} us hit {row['hot']['hit_rate']:.3f}; "
             f"random {row['random']['layer_us']:.0f} us hit {row['random']['hit_rate']:.3f}")
    return rows


def _modes(a, fmt, T, banks, s, res, qs, pool, pick=None) -> dict:
    """(median us per layer, hit rate, each round's us, the executor's median GB/s over the timed steps or None, each
    round's Driver.stats) of each split fraction q (0: CPU-only misses, 1: GPU-only zero-copy) at residency `res`; a
    q given as (q, rule) runs under that split rule (split.py), a plain q under the default one.

    One runner per residency: its banks page-locked and hot's placement warmed once (--warmup steps), then --repeats
    rounds; each round times every q in turn (set_split between blocks: the tables in place, no recapture), rotated
    one place a round so no q always follows the same one, and every block replays the same stretch of routes
    (--settle steps, then --steps timed). A runner per q and run cost ~10 s of set-up each, and two runs of one q
    minutes apart differed by 8% at the median and up to 71% on an H100 host (2026-12-07): more than the 5% the grid
    must resolve. pick(us, hit, GB/s) -> q, after the first q = 0 block: one more q, timed with the others from then
    on (auto's pick, as split="auto" makes it after its first window)."""
    cap = max(1, round(res * s.E))
    place = dict(residency="hot", capacity=cap, replace_every=a.every) if res > 0 else dict(residency=0.0, capacity=1)
    qs = list(qs)
    runs, rates, stats = {q: [] for q in qs}, {q: [] for q in qs}, {q: [] for q in qs}
    with _runner(fmt, banks, s, T, a, split=0.0, **place) as r:
        d = Driver(r, a.layers, T, pool)
        for _ in range(a.warmup):
            d.step()
        for rep in range(a.repeats):
            order = qs if rep == 0 else qs[rep % len(qs):] + qs[:rep % len(qs)]
            i = 0
            while i < len(order):  # qs (order, in round 0) grows by pick's q
                q = order[i]
                i += 1
                rule, qv = (q[1], q[0]) if isinstance(q, tuple) else (DEFAULT_RULE, q)
                if getattr(getattr(r, "split", None), "rule", DEFAULT_RULE) != rule:
                    r.split.set_rule(rule)
                r.set_split(qv)
                d.rewind(a.warmup)
                for _ in range(a.settle):
                    d.step()
                w0 = r.executor.work()
                runs[q].append(d.timed(a.steps))
                stats[q].append(d.stats)
                rate = live_GBps(w0, r.executor.work(), r.bytes_per_expert)
                if rate is not None:
                    rates[q].append(rate)
                if pick is not None and rep == 0 and q == 0.0:
                    extra = pick(*runs[q][0], rates[q][0] if rates[q] else None)
                    if extra not in runs:
                        qs.append(extra)
                        runs[extra], rates[extra], stats[extra] = [], [], []
    return {q: (statistics.median(u for u, _ in rs), rs[0][1], [u for u, _ in rs],
                statistics.median(rates[q]) if rates[q] else None, stats[q]) for q, rs in runs.items()}


def _key(q) -> str:
    return f"{q[0]}/{q[1]}" if isinstance(q, tuple) else str(q)


def bench_split(a, fmt, T, banks, s) -> dict:
    """0% resident: q = 0 and 1, and each split fraction under each of --rules; the best split of each rule against
    the better single path."""
    pool = _pool(s, a.layers, T, a.warmup + a.settle + a.steps, seed=2)
    rules = a.rules.split(",")
    mid = [q for q in a.qs if 0 < q < 1]
    qs = [0.0, 1.0] + [q if rule == DEFAULT_RULE else (q, rule) for rule in rules for q in mid]
    t = _modes(a, fmt, T, banks, s, 0.0, qs, pool)
    single = min(t[0.0][0], t[1.0][0])
    row = {"format": fmt, "batch": T, "us": {_key(q): v[0] for q, v in t.items()},
           "us_runs": {_key(q): v[2] for q, v in t.items()}, "best_q": {}, "speedup_vs_better_single": {}}
    for rule in rules:
        cands = [q for q in qs[2:] if (q if isinstance(q, tuple) else (q, DEFAULT_RULE))[1] == rule]
        best = min(cands, key=lambda q: t[q][0])
        row["best_q"][rule] = best[0] if isinstance(best, tuple) else best
        row["speedup_vs_better_single"][rule] = single / t[best][0]
        _say(f"split {fmt} T={T} by {rule}: cpu-only {t[0.0][0]:.0f} us, gpu-only {t[1.0][0]:.0f} us, best q="
             f"{row['best_q'][rule]} {t[best][0]:.0f} us: {single / t[best][0]:.2f}x")
    return row


def bench_auto(a, fmt, T, banks, s, profile, emit=lambda row: None) -> list[dict]:
    from ..placement.choose import choose

    rows = []
    pool = _pool(s, a.layers, T, a.warmup + a.settle + a.steps, seed=3)
    for res in a.residencies:
        qs = [0.0, 1.0] + [q for q in a.qs if 0 < q < 1]
        picked = []

        def pick(us, hit, cpu_GBps, picked=picked, res=res):
            # as split="auto" in the runner after its first window (q = 0): the hit rate and the CPU's lone rate of
            # that window (MissSplit), else the profile's rate
            picked.append(choose(profile, fmt, bytes_per_expert=banks_bpe(fmt, s), E=s.E, top_k=s.top_k, batch=T,
                                 miss_rate=1 - hit, residency=res, modes=("hybrid", "split", "gpu_misses"),
                                 cpu_GBps=cpu_GBps))
            return picked[0].q

        t = _modes(a, fmt, T, banks, s, res, qs, pool, pick=pick)
        hit, c = t[0.0][1], picked[0]
        # the runner's live check on round 0's blocks: the model's split stands only if its block ran faster than
        # q = 0's (the runner compares its re-placement windows the same way)
        check = LiveCheck(trial=1)
        check.ended(0.0, 1e-6 * t[0.0][2][0], T)
        check.next_q(c.q)
        if c.q > 0:
            check.ended(c.q, 1e-6 * t[c.q][2][0], T)
        q_auto = check.next_q(c.q)
        best = min(t, key=lambda q: t[q][0])
        row = {"format": fmt, "batch": T, "residency": res, "hit_rate": hit, "us": {str(q): v[0] for q, v in t.items()},
               "us_runs": {str(q): v[2] for q, v in t.items()},
               "cpu_GBps": {str(q): v[3] for q, v in t.items()},
               "step_stats": {str(q): v[4] for q, v in t.items()},  # per run: end_step's host us, hot's loads
               "auto": {"mode": c.mode if q_auto == c.q else "hybrid", "q": q_auto, "model_q": c.q,
                        "reason": c.reason, "checked": check.kept}, "best_q": best,
               "auto_over_best": t[q_auto][0] / t[best][0]}
        rows.append(row)
        emit(row)  # main() saves each row as it comes
        _say(f"auto {fmt} T={T} {res:.0%}: model q={c.q:.2f}, auto q={q_auto:.2f} {t[q_auto][0]:.0f} us, best q={best} "
             f"{t[best][0]:.0f} us ({100 * (row['auto_over_best'] - 1):+.1f}%)")
    return rows


def _machine() -> dict:
    import torch

    from cpumoe_formats.machine import machine_info

    m = machine_info(None)
    if torch.cuda.is_available():
        m["gpu"] = torch.cuda.get_device_name(0)
    return m


def banks_bpe(fmt, s) -> int:
    import cpumoe_formats as cf

    return cf.get_format(fmt).bytes_per_expert(s.H, s.I)


def bench_replay(a, fmt, T, banks, s) -> dict:
    """Each replay's outputs against the eager step on the same routes and tables, bit for bit; hot re-places every
    `every` steps between replays, the split is on."""
    import torch

    pool = _pool(s, a.layers, T, a.replays, seed=4)
    cap = max(1, round(0.25 * s.E))
    mismatches = moves = 0
    with _runner(fmt, banks, s, T, a, residency="hot", capacity=cap, replace_every=a.every, split=0.3,
                 split_rule=a.rule) as r:
        d = Driver(r, a.layers, T, pool)
        for _ in range(a.replays):
            idx = d.i
            if d.graph is not None:
                d.graph.graph.replay()  # its in-graph counter moves to the next routes by itself
                got = [o.clone() for o in d.graph.out]
            else:  # --smoke without a GPU: a second eager step stands in for the replay
                got = [r.step(li, d.x, d.pool_w[idx, li], d.pool_ids[idx, li]) for li in range(a.layers)]
            want = [r.step(li, d.x, d.pool_w[idx, li], d.pool_ids[idx, li]) for li in range(a.layers)]
            d.sync()
            mismatches += sum(not torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(got, want))
            d.i = (idx + 1) % d.n
            moves += r.end_step() > 0
        out = {"format": fmt, "batch": T, "replays": a.replays, "layers": a.layers, "mismatches": int(mismatches),
               "replacements_with_loads": int(moves), "split_q": r.split.q, "split_rule": r.split.rule,
               "runner": r.describe()}
    _say(f"replay {fmt} T={T}: {out}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_engine.tools.bench_placement", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("hot", "split", "auto", "replay"))
    p.add_argument("--formats", default="bf16,fp8_block")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--residencies", default="0,0.1,0.25,0.5,0.9")
    p.add_argument("--qs", default="0.2,0.3,0.4,0.5,0.6", help="split fractions to try besides 0 and 1")
    p.add_argument("--rules", default="expert,step", help="split: the split rules to time (placement/split.py)")
    p.add_argument("--rule", default=None, help="replay: the split rule (default: the runner's)")
    p.add_argument("--every", type=int, default=50, help="hot: re-placement period in steps")
    p.add_argument("--warmup", type=int, default=500, help="steps before timing (hot converges)")
    p.add_argument("--steps", type=int, default=300, help="timed steps")
    p.add_argument("--settle", type=int, default=25, help="split / auto: steps after each change of q, untimed")
    p.add_argument("--replays", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=1, help="split / auto: rounds over every q in turn; the median")
    p.add_argument("--profile", default=None, help="auto: a bandwidth profile (default: this GPU's cached one)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="a tiny shape, eager, any machine")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    a.residencies = [float(v) for v in a.residencies.split(",")]
    a.qs = [float(v) for v in a.qs.split(",")]
    if a.smoke:
        a.layers = min(a.layers, 2)
    s = _shape(a)
    out = {"what": a.what, "shape": s.name, "layers": a.layers, "trace": CALIBRATED, "rows": []}
    out["machine"] = _machine()

    def save():
        if a.json:
            with open(a.json + ".tmp", "w") as f:
                json.dump(out, f, indent=1)
            os.replace(a.json + ".tmp", a.json)

    def emit(row):  # the JSON is rewritten after every row, so a run cut off by its time limit keeps what it measured
        out["rows"].append(row)
        save()

    for fmt in a.formats.split(","):
        if a.what == "auto":
            import torch

            from ..placement import profile as prof

            gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"  # as bench --profile names it
            profile = prof.resolve(a.profile, gpu=gpu, format=fmt)
            if profile is None:
                raise SystemExit("bench_placement auto: no bandwidth profile; run `moe-engine bench --profile` first")
        banks = random_layers(fmt, s.E, s.H, s.I, a.layers, progress=False)
        for T in (int(b) for b in a.batch.split(",")):
            if a.what == "hot":
                bench_hot(a, fmt, T, banks, s, emit)
            elif a.what == "split":
                emit(bench_split(a, fmt, T, banks, s))
            elif a.what == "auto":
                bench_auto(a, fmt, T, banks, s, profile, emit)
            else:
                emit(bench_replay(a, fmt, T, banks, s))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
