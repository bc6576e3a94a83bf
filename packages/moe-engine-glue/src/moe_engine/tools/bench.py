"""Benchmarks of the runner (numbers for docs/moe-engine.md; timed side by side in one run, medians over repeats).

    python -m moe_engine.tools.bench overhead [--json F]
        runner.forward (strategy cpu) against CpuMoeExecutor.decode, batch 1, CPU tensors, interleaved
    python -m moe_engine.tools.bench step [--json F]
        on a GPU, under CUDA graphs, per layer: gpu, cpu and hybrid at several residencies, hybrid's CPU part alone
        and GPU part alone, then replays with changing inputs and residency against eager
    python -m moe_engine.tools.bench prefill [--json F]
        on a GPU, eager: a prompt of T tokens through one layer (strategy cpu) as CPU chunks, as experts staged on
        the GPU, and as `auto` picks, for T = 16 .. 1024

Routes are fresh every step: each graph gathers the next routes from a pool on the device (a counter in the graph),
so the CPU reads experts from DRAM as in decode, not the same experts from its cache.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from .. import layer_formats
from ..banks import random_layers, random_pair_layers
from .demo import routes
from .shapes import preset


def _stats(v) -> dict:
    v = [float(x) for x in v]
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "samples": v}


def _say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---- overhead --------------------------------------------------------------------------------------------------
def overhead(fmt: str = "bf16", layers: int = 2, calls: int = 200, repeats: int = 7, threads=None) -> dict:
    """us per call of runner.forward and of executor.decode on the same executor and routes, interleaved."""
    import torch

    from ..runner import MoERunner

    s = preset("qwen3-30b-a3b")
    banks = random_layers(fmt, s.E, s.H, s.I, layers, progress=False)
    rng = np.random.default_rng(1)
    ids, w = routes(rng, calls, layers, 1, s.top_k, s.E)
    ids_t, w_t = torch.from_numpy(ids), torch.from_numpy(w)
    x = torch.randn(1, s.H).to(torch.bfloat16)
    with MoERunner(fmt, banks, top_k=s.top_k, strategy="cpu", device="cpu", threads=threads, progress=False) as r:
        ex = r.executor
        fns = {"executor": lambda i, li: ex.decode(li, x, w_t[i, li], ids_t[i, li]),
               "runner": lambda i, li: r.forward(li, x, w_t[i, li], ids_t[i, li])}
        us = {k: [] for k in fns}
        for rep in range(repeats):
            for k in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
                t0 = time.perf_counter()
                for i in range(calls):
                    for li in range(layers):
                        fns[k](i, li)
                us[k].append(1e6 * (time.perf_counter() - t0) / (calls * layers))
        diff = [a - b for a, b in zip(us["runner"], us["executor"])]
        out = {"format": fmt, "shape": s.name, "batch": 1, "threads": ex.threads, "isa": ex.isa,
               "executor_us": _stats(us["executor"]), "runner_us": _stats(us["runner"]), "overhead_us": _stats(diff),
               "overhead_pct": _stats([100 * d / b for d, b in zip(diff, us["executor"])])}
    _say(f"overhead {fmt}: executor {out['executor_us']['median']:.1f} us, runner {out['runner_us']['median']:.1f} us "
         f"(+{out['overhead_us']['median']:.1f} us, {out['overhead_pct']['median']:.1f}%)")
    return out


# ---- decode step on a GPU ------------------------------------------------------------------------------------------
class Step:
    """One captured graph of `fn(layer, x, w, ids)` over every layer, its routes gathered from a pool in the graph."""

    def __init__(self, torch, fn, L: int, x, pool_w, pool_ids):
        self.torch, self.n = torch, pool_ids.shape[0]
        dev = x.device
        self.i = torch.zeros(1, dtype=torch.long, device=dev)
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))

        def body():
            w, ids = pool_w.index_select(0, self.i)[0], pool_ids.index_select(0, self.i)[0]  # no host read
            out = [fn(layer, x, w[layer], ids[layer]) for layer in range(L)]
            self.i.add_(1).remainder_(self.n)
            return out

        with torch.cuda.stream(s):
            body()  # warm-up outside the capture
            torch.cuda.synchronize(dev)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=s):
                self.out = body()
        torch.cuda.current_stream(dev).wait_stream(s)

    def time_us(self, replays: int) -> float:
        torch = self.torch
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(replays):
            self.graph.replay()
        torch.cuda.synchronize()
        return 1e6 * (time.perf_counter() - t0) / replays


def step_bench(fmt: str, L: int, batches, residencies, replays: int, repeats: int, check_replays: int,
               threads=None) -> dict:
    import torch

    from ..runner import MoERunner

    s = preset("qwen3-30b-a3b")
    dev = torch.device("cuda", torch.cuda.current_device())
    _say(f"{fmt}: building {L} layers of {s.name} experts")
    if fmt in layer_formats.MIXES:  # a K-quant mix: a (gate_up, down) pair per layer, as a Q4_K_M file has them
        pairs = layer_formats.mix_pairs(fmt, L)
        banks, fmt = random_pair_layers(pairs, s.E, s.H, s.I, progress=False), layer_formats.compact(pairs)
    else:
        banks = random_layers(fmt, s.E, s.H, s.I, L, progress=False)
    cap = max(1, round(max(residencies) * s.E))
    gbs = tuple(sorted(set(batches)))
    hy = MoERunner(fmt, banks, top_k=s.top_k, strategy="hybrid", residency=0.0, capacity=cap, graph_batch_sizes=gbs,
                   threads=threads, progress=False)
    gp = MoERunner(fmt, banks, top_k=s.top_k, strategy="gpu", graph_batch_sizes=gbs, progress=False)
    _say(f"hybrid: {hy.describe()}")
    rng = np.random.default_rng(7)
    name = fmt if isinstance(fmt, str) else layer_formats.describe(layer_formats.normalize(fmt, L))
    res = {"format": name, "shape": s.name, "layers": L, "hybrid_runner": hy.describe(), "rows": []}
    for T in gbs:
        ids, w = routes(rng, 64, L, T, s.top_k, s.E)
        pid, pw = torch.from_numpy(ids).to(dev), torch.from_numpy(w).to(dev)
        x = torch.randn(T, s.H, device=dev).to(torch.bfloat16)
        for f in residencies:
            for layer in range(L):
                hy.set_residency(layer, (np.random.default_rng(layer).permutation(s.E) < round(f * s.E)))
            fns = {"hybrid": hy.step,
                   "cpu_part": lambda li, x, w, ids: hy.sync.decode(li, x, w, ids, hy.residency.mask[li]),
                   "gpu_part": lambda li, x, w, ids: hy.gpu.forward(li, x, w, hy.residency.slots(li, ids))}
            if f == residencies[0]:
                fns["cpu"] = hy.sync.decode  # strategy cpu's step: every route
                fns["gpu"] = gp.step
            steps = {k: Step(torch, fn, L, x, pw, pid) for k, fn in fns.items()}
            us = {k: [] for k in steps}
            for rep in range(repeats):
                for k in (list(steps) if rep % 2 == 0 else list(steps)[::-1]):
                    us[k].append(steps[k].time_us(replays) / L)
            for k, v in us.items():
                row = {"batch": T, "variant": k, "residency": None if k in ("cpu", "gpu") else f, "layer_us": _stats(v)}
                res["rows"].append(row)
            a, b, c = (statistics.median(us[k]) for k in ("hybrid", "cpu_part", "gpu_part"))
            _say(f"{name} T={T} residency {f:.0%}: hybrid {a:.1f} us/layer, CPU part {b:.1f}, GPU part {c:.1f} "
                 f"(hybrid - max = {a - max(b, c):+.1f} us)")
            del steps
    res["replay_check"] = replay_check(torch, hy, L, gbs[0], check_replays, rng, s) if check_replays else None
    hy.close()
    gp.close()
    return res


def replay_check(torch, hy, L, T, n, rng, s) -> dict:
    """n replays of one captured step with fresh inputs every replay and a new residency every 100, each compared bit
    for bit with the eager step on the same inputs."""
    dev = hy.device
    xs = torch.zeros(T, s.H, device=dev, dtype=torch.bfloat16)
    ids_s = torch.zeros(L, T, s.top_k, device=dev, dtype=torch.int32)
    w_s = torch.zeros(L, T, s.top_k, device=dev)
    st = torch.cuda.Stream(dev)
    st.wait_stream(torch.cuda.current_stream(dev))
    mismatches, no_cpu, only_cpu = 0, 0, 0
    with torch.cuda.stream(st):
        g = torch.cuda.CUDAGraph()
        hy.step(0, xs, w_s[0], ids_s[0])
        torch.cuda.synchronize(dev)
        with torch.cuda.graph(g, stream=st):
            outs = [hy.step(li, xs, w_s[li], ids_s[li]) for li in range(L)]
        base = [hy.residency.host_mask(li).copy() for li in range(L)]
        for i in range(n):
            if i % 100 == 99:
                for li in range(L):
                    hy.set_residency(li, np.roll(base[li], i // 100))
            ids, w = routes(rng, 1, L, T, s.top_k, s.E)
            ids, w = ids[0], w[0]
            kind = i % 10
            for li in range(L):
                res = hy.residency.host_mask(li)
                if kind == 3:  # no CPU route: every route resident (or none)
                    pool = np.flatnonzero(res)
                    ids[li] = rng.choice(pool, ids[li].shape) if len(pool) else -1
                elif kind == 7:  # only CPU routes
                    pool = np.flatnonzero(~res)
                    ids[li] = rng.choice(pool, ids[li].shape) if len(pool) else -1
            no_cpu += kind == 3
            only_cpu += kind == 7
            x = torch.randn(T, s.H, device=dev).to(torch.bfloat16)
            xs.copy_(x)
            ids_s.copy_(torch.from_numpy(ids))
            w_s.copy_(torch.from_numpy(w))
            g.replay()
            got = [o.clone() for o in outs]
            want = [hy.step(li, x, w_s[li].clone(), ids_s[li].clone()) for li in range(L)]
            hy.sync.synchronize(st)
            mismatches += sum(not torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, want))
    torch.cuda.current_stream(dev).wait_stream(st)
    out = {"replays": n, "layers": L, "batch": T, "mismatches": int(mismatches), "steps_without_cpu_route": no_cpu,
           "steps_with_only_cpu_routes": only_cpu, "residency_changes": n // 100}
    _say(f"replay check: {out}")
    return out


# ---- prefill ---------------------------------------------------------------------------------------------------
def prefill_bench(fmt: str, tokens, repeats: int, threads=None, pin_memory=False) -> dict:
    """ms per layer of a T-token prompt (uniform random routes) as CPU chunks of max_tokens and as staged experts,
    each forced in turn (interleaved), then the `auto` policy's choice with the estimates it saw."""
    import torch

    from ..runner import MoERunner

    s = preset("qwen3-30b-a3b")
    dev = torch.device("cuda", torch.cuda.current_device())
    banks = random_layers(fmt, s.E, s.H, s.I, 1, progress=False)
    r = MoERunner(fmt, banks, top_k=s.top_k, strategy="cpu", device=dev, threads=threads, progress=False,
                  pin_memory=pin_memory)
    _say(f"prefill {fmt}: {r.describe()}")
    rng = np.random.default_rng(3)
    res = {"format": fmt, "shape": s.name, "max_tokens": r.max_tokens, "runner": r.describe(), "rows": []}

    def run(policy, x, w, ids):
        r.prefill_policy.set(policy)
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        y = r.forward(0, x, w, ids)
        torch.cuda.synchronize(dev)
        return 1e3 * (time.perf_counter() - t), y

    for T in tokens:
        ids, w = routes(rng, 1, 1, T, s.top_k, s.E)
        ids, w = torch.from_numpy(ids[0, 0]).to(dev), torch.from_numpy(w[0, 0]).to(dev)
        x = torch.randn(T, s.H, device=dev).to(torch.bfloat16)
        r.forward(0, x, w, ids)  # the policy measures a chunk and one expert's copy
        ms = {"cpu": [], "gpu": []}
        for rep in range(repeats):
            for pol in (("cpu", "gpu") if rep % 2 == 0 else ("gpu", "cpu")):
                ms[pol].append(run(pol, x, w, ids)[0])
        _, yc = run("cpu", x, w, ids)
        _, yg = run("gpu", x, w, ids)
        rel = float((yc.float() - yg.float()).norm() / yc.float().norm())
        r.prefill_policy.set("auto")
        r.forward(0, x, w, ids)
        lp = dict(r.last_prefill)
        best = min(("cpu", "gpu"), key=lambda k: statistics.median(ms[k]))
        row = {"tokens": T, "cpu_experts": lp["cpu_experts"], "cpu_chunks_ms": _stats(ms["cpu"]),
               "gpu_staged_ms": _stats(ms["gpu"]), "auto": lp["how"], "auto_estimates_s": {k: lp[k] for k in (
                   "cpu_s", "gpu_copy_s")}, "faster": best, "cpu_vs_gpu_rel_diff": rel}
        res["rows"].append(row)
        _say(f"prefill {fmt} T={T}: CPU chunks {statistics.median(ms['cpu']):.1f} ms, staged "
             f"{statistics.median(ms['gpu']):.1f} ms, auto -> {lp['how']} (faster: {best}), rel diff {rel:.1e}")
    bps = r.prefill_policy.copy_bps
    res["copy_GBps"] = bps / 1e9 if bps else None
    from .bench_profile import h2d_GBps

    res["h2d_GBps"] = h2d_GBps(dev)  # the link's copy rate on the same machine, as bench --profile measures it
    if bps:
        _say(f"prefill {fmt}: staging {bps / 1e9:.1f} GB/s = {100 * bps / 1e9 / res['h2d_GBps']:.0f}% of the "
             f"link's host-to-device copy ({res['h2d_GBps']:.1f} GB/s)")
    r.close()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_engine.tools.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("overhead", "step", "prefill"))
    p.add_argument("--formats", default="bf16,fp8_block", help="comma list of formats; step also takes the K-quant "
                   "mixes q4_k_m and q5_k_m (a (gate_up, down) pair per layer by llama.cpp's use_more_bits rule)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--residency", default="0,0.25,0.5,0.9")
    p.add_argument("--replays", type=int, default=50, help="graph replays per timing")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check-replays", type=int, default=1000)
    p.add_argument("--tokens", default="16,32,64,128,256,512,1024", help="prefill: prompt lengths")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--pin-memory", action="store_true", help="prefill: page-lock the host banks first (the staged "
                   "copies then run at link speed)")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    fmts = a.formats.split(",")
    if a.what == "overhead":
        out = {"overhead": [overhead(f, threads=a.threads) for f in fmts]}
    elif a.what == "prefill":
        out = {"prefill": [prefill_bench(f, [int(t) for t in a.tokens.split(",")], a.repeats, a.threads,
                                         a.pin_memory) for f in fmts]}
    else:
        out = {"step": [step_bench(f, a.layers, [int(b) for b in a.batch.split(",")],
                                   [float(r) for r in a.residency.split(",")], a.replays, a.repeats,
                                   a.check_replays if i == 0 else 0, a.threads) for i, f in enumerate(fmts)]}
    from cpumoe_formats.machine import machine_info

    out["machine"] = machine_info(None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
