# Run by hand on a CUDA GPU (the H200 figures in docs/moe-engine.md came from it).
"""GPU experts bench: moe_engine.gpu.GpuExperts under a CUDA graph against transformers' batched_mm and grouped_mm
experts (eager, the same bf16 weights) and the device's copy bandwidth, per format and batch size.

    PYTHONPATH=packages/cpumoe-formats/src:packages/moe-engine-glue/src \
        python bench/gpu_experts.py --json out.json

Shape: Qwen3-30B-A3B's experts (E=128, H=2048, I=768, top_k=8) by default, every expert resident, `--layers`
layers of distinct weights in one graph (so each replay reads more than the L2 holds), random routes (top_k
distinct experts per token). Weights are random codes filled on the device (the kernels' tensors directly; load()
from cpumoe_formats banks is the tests' business). Per (format, batch):

  * a config sweep (coordinate descent: gate_up candidates with the default down, then down candidates with the
    best gate_up), every candidate checked against a float64 torch reference of the same routes first; the
    candidates are compiled beforehand by --procs worker processes into Triton's cache
  * the best config: median / min / max microseconds per layer over --repeats runs of --replays graph replays,
    eager too
  * weight bytes read per layer (distinct routed experts x bytes_per_expert) / time, against the copy bandwidth:
    torch device-to-device copy of a 1 GiB buffer, GB/s = 2 * bytes / t (read + write)

transformers: transformers.models.qwen3_moe's Qwen3MoeExperts (use_experts_implementation-decorated) with
config._experts_implementation = 'batched_mm' / 'grouped_mm', its parameters the bf16 weights of the same layers,
called eagerly as the model calls it: experts(hidden_states, top_k_index, top_k_weights).

--deadline EPOCH stops the sweep in time to measure and write the JSON anyway. --device cpu (with
TRITON_INTERPRET=1) smoke-tests the code paths on a tiny shape (no graphs, no timing worth reading).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict

import torch
from gpu_experts_ref import fill_random, matrix_format, reference, rel_err, routes  # bench/, beside this

FMT_ORDER = ("bf16", "fp8_block", "mxfp4", "nvfp4")


def fmt_arg(name):
    """'q4_k/q6_k' -> ('q4_k', 'q6_k') (GpuExperts' pair), a single name as it is."""
    return tuple(name.split("/")) if "/" in name else name


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def stats(v):
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


# ---- ceilings ------------------------------------------------------------------------------------------------
def copy_bandwidth(device, nbytes=1 << 30, iters=10, repeats=7):
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    gbs = []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            dst.copy_(src)
        e1.record()
        e1.synchronize()
        gbs.append(2 * nbytes * iters / (e0.elapsed_time(e1) * 1e-3) / 1e9)
    del src, dst
    return stats(gbs)


# ---- timing ---------------------------------------------------------------------------------------------
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ours(ge, xs, sl, wl, outs, replays, repeats, graph=True):
    """us per layer: all layers in one graph, `replays` replays per run."""
    L = len(sl)
    dev = xs.device

    def step():
        for layer in range(L):
            ge.forward(layer, xs, wl[layer], sl[layer], out=outs[layer])

    if dev.type != "cuda":
        t0 = time.perf_counter()
        step()
        return [(time.perf_counter() - t0) * 1e6 / L]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = None
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        run = g.replay
    else:
        run = step
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(replays):
            run()
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1) * 1e3 / (replays * L))
    del g
    return out


def measure_config(ge, T, cfg, xs, ids, ws, outs, ref, replays, reps):
    """(us per layer list, error vs the reference) of one config; (None, err) if it is not right."""
    ge.set_config(T, cfg)
    y = ge.forward(0, xs, ws[0], ids[0])
    sync(xs.device)
    err = rel_err(y, ref)
    if not err < 1e-2:
        return None, err
    return time_ours(ge, xs, ids, ws, outs, replays, reps), err


def kernel_times(ge, xs, ids, ws, outs):
    """Device time per kernel name (us per layer) of eager forwards of every layer, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    L = len(ids)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            for layer in range(L):
                ge.forward(layer, xs, ws[layer], ids[layer], out=outs[layer])
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0)
        if t and ("kernel" in ev.key or "_kernel" in ev.key):
            out[ev.key] = t / (5 * L)
    return out


def hf_modules(ge, L):
    """One transformers Qwen3MoeExperts per layer over ge's bf16 weights (no copies)."""
    import transformers

    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        cfg = Qwen3MoeConfig(hidden_size=ge.H, moe_intermediate_size=ge.I, num_experts=ge.E,
                             num_experts_per_tok=ge.top_k, hidden_act="silu")
        mods = []
        for layer in range(L):
            with torch.device("meta"):
                m = Qwen3MoeExperts(cfg)
            m.gate_up_proj = torch.nn.Parameter(ge.parts["gu_w"][layer], requires_grad=False)
            m.down_proj = torch.nn.Parameter(ge.parts["dn_w"][layer], requires_grad=False)
            mods.append(m)
        return mods, cfg, f"transformers {transformers.__version__} Qwen3MoeExperts"
    except Exception as e:  # noqa: BLE001 - report and fall back to calling the functions directly
        log(f"transformers Qwen3MoeExperts unavailable ({e!r}); calling integrations.moe's functions directly")
        return None, None, repr(e)


def time_hf(ge, impl, xs, ids, ws, iters, repeats, mods, cfg):
    from transformers.integrations import moe

    L = len(ids)
    if mods is not None:
        cfg._experts_implementation = impl
        calls = [lambda layer, m=m: m(xs, ids[layer], ws[layer]) for m in mods]
    else:
        fn = {"batched_mm": moe.batched_mm_experts_forward, "grouped_mm": moe.grouped_mm_experts_forward}[impl]

        class _Mod(torch.nn.Module):
            pass

        calls = []
        for layer in range(L):
            m = _Mod()
            m.num_experts, m.hidden_dim, m.intermediate_dim = ge.E, ge.H, ge.I
            m.gate_up_proj, m.down_proj = ge.parts["gu_w"][layer], ge.parts["dn_w"][layer]
            m.act_fn = torch.nn.SiLU()
            m.has_gate, m.has_bias, m.is_transposed, m.is_concatenated = True, False, False, True
            m.has_post_expert_norm, m._is_expert_parallel = False, False
            m._apply_gate = lambda gu, m=m: m.act_fn(gu.chunk(2, dim=-1)[0]) * gu.chunk(2, dim=-1)[1]
            calls.append(lambda layer, m=m: fn(m, xs, ids[layer], ws[layer]))
    with torch.no_grad():
        for _ in range(2):
            for layer in range(L):
                y = calls[layer](layer)
        sync(xs.device)
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if xs.device.type == "cuda":
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            for _ in range(iters):
                for layer in range(L):
                    y = calls[layer](layer)
            if xs.device.type == "cuda":
                e1.record()
                e1.synchronize()
                out.append(e0.elapsed_time(e1) * 1e3 / (iters * L))
            else:
                out.append((time.perf_counter() - t0) * 1e6 / (iters * L))
    return out, y


# ---- sweep candidates -----------------------------------------------------------------------------------
MAX_CANDIDATES = 0


def candidates(fmt, T, stage):
    """StageConfig / Config field sets to try (dicts: 'st' StageConfig args + Config-level keys); fmt: a format or a
    (gate_up, down) pair (each stage's blocks from its matrix's format)."""
    from moe_engine.gpu import StageConfig

    fmt = matrix_format(fmt, stage)
    byte = fmt in ("bf16", "fp8_block", "q8_0", "q4_k", "q6_k")
    bks = {"bf16": (128, 256, 512), "fp8_block": (64, 128), "mxfp4": (32, 64, 128, 256),
           "nvfp4": (32, 64, 128, 256), "q4_0": (64, 128, 256), "q8_0": (64, 128, 256), "q4_k": (256,),
           "q6_k": (256,)}[fmt]
    dbks = {"bf16": (64, 128, 256), "fp8_block": (64, 128), "mxfp4": (32, 64, 128), "nvfp4": (32, 64, 128),
            "q4_0": (32, 64, 128), "q8_0": (32, 64, 128), "q4_k": (256,), "q6_k": (256,)}[fmt]
    full = fmt == "bf16"
    out = []
    if stage == "gate_up":
        bns = (8, 16, 32) if full else (8, 16)
        for bn in bns:
            for bk in bks:
                for w in ((4, 8) if full else (4,)):
                    out.append({"st": StageConfig(bn, bk, w, 2), "grouped": T > 1})
        for bn in ((8, 16, 32) if T > 1 else (8, 16)):
            for bk in dbks:
                for ns in ((3, 4) if full else (3,)):
                    out.append({"st": StageConfig(bn, bk, 4, ns, dot=True), "grouped": T > 1})
        if T > 1:
            out.append({"st": StageConfig(16, bks[min(1, len(bks) - 1)], 4, 2), "grouped": False})
    else:
        bns = (8, 16, 32) if full else (16, 32)
        for bn in bns:
            for bk in bks:
                for w in ((4, 8) if full else (4,)):
                    out.append({"st": StageConfig(bn, bk, w, 2), "down_mode": "group"})
        for bn in ((4, 8, 16) if full else (8,)):
            for bk in (bks if byte else bks[-2:]) + ((1024,) if fmt == "bf16" else ()):
                for w in ((4, 8) if full else (4,)):
                    out.append({"st": StageConfig(bn, bk, w, 2), "down_mode": "token"})
        if T > 1 or fmt != "bf16":
            for bn in (16, 32, 64) if full else (32,):
                for bk in dbks:
                    for ns in ((3, 4) if full else (3,)):
                        out.append({"st": StageConfig(bn, bk, 4, ns, dot=True), "down_mode": "group"})
    return out[:MAX_CANDIDATES] if MAX_CANDIDATES else out


def apply(base, stage, cand):
    kw = {k: v for k, v in cand.items() if k != "st"}
    kw[stage] = cand["st"]
    return base.replace(**kw)


def cfg_dict(cfg):
    d = asdict(cfg)
    return d


# ---- precompile workers ------------------------------------------------------------------------------------
def _precompile_worker(job):
    fmt, T, shape, cfgs, device = job
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import torch as _t

    from moe_engine.gpu import GpuExperts

    E, H, I, K = shape  # noqa: E741
    ge = GpuExperts(fmt_arg(fmt) if isinstance(fmt, str) else fmt, num_layers=1, capacity=E, E=E, H=H, I=I,
                    top_k=K, max_tokens=max(T, 1), device=device)
    x = _t.zeros((T, H), dtype=_t.bfloat16, device=device)
    s = _t.zeros((T, K), dtype=_t.int32, device=device)
    w = _t.zeros((T, K), dtype=_t.float32, device=device)
    out = _t.empty((T, H), dtype=_t.bfloat16, device=device)
    errs = []
    for c in cfgs:
        try:
            ge.set_config(T, c)
            ge.forward(0, x, w, s, out=out)
            if device != "cpu":
                _t.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            errs.append((repr(c), repr(e)[:400]))
    return errs


def precompile(jobs, procs, device, timeout):
    if procs <= 1 or not jobs:
        return []
    import multiprocessing as mp

    per = max(1, math.ceil(sum(len(j[3]) for j in jobs) / (2 * procs)))  # ~2 chunks per worker, balanced
    chunks = []
    for fmt, T, shape, cfgs in jobs:
        for i in range(0, len(cfgs), per):
            chunks.append((fmt, T, shape, cfgs[i:i + per], device))
    t0 = time.time()
    try:
        with mp.get_context("spawn").Pool(min(procs, len(chunks))) as pool:
            errs = [e for r in pool.map_async(_precompile_worker, chunks).get(timeout) for e in r]
    except Exception as e:  # noqa: BLE001 - the sweep compiles what is missing itself
        log(f"precompile stopped: {e!r}")
        return [("precompile", repr(e)[:400])]
    log(f"precompiled {sum(len(c[3]) for c in chunks)} configs in {len(chunks)} chunks, {time.time() - t0:.1f}s, "
        f"{len(errs)} errors")
    return errs


# ---- main ---------------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--formats", default=",".join(FMT_ORDER))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--shape", default="128,2048,768,8", help="E,H,I,top_k (default Qwen3-30B-A3B)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--sweep-repeats", type=int, default=5)
    ap.add_argument("--sweep", choices=("full", "none"), default="full")
    ap.add_argument("--procs", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--deadline", type=float, default=0.0, help="unix time by which to have written the JSON")
    ap.add_argument("--wait", help="wait for this file to exist before importing cpumoe_formats (a parallel build)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--max-candidates", type=int, default=0, help="try only the first N candidates per stage")
    a = ap.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    global MAX_CANDIDATES
    MAX_CANDIDATES = a.max_candidates
    dev = torch.device(a.device)
    E, H, I, K = (int(v) for v in a.shape.split(","))  # noqa: E741
    L = a.layers
    batches = [int(b) for b in a.batches.split(",")]
    formats = [f for f in a.formats.split(",") if f]
    t_start = time.time()
    deadline = a.deadline or (t_start + 1e9)
    res = {"shape": {"E": E, "H": H, "I": I, "top_k": K}, "layers": L, "replays": a.replays, "repeats": a.repeats,
           "torch": torch.__version__, "notes": [], "results": [], "transformers": [], "sweep": [],
           "precompile_errors": []}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        pass
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        res["device"] = {"name": p.name, "sms": p.multi_processor_count, "memory_GiB": p.total_memory / 2**30}
        res["copy_GBps"] = copy_bandwidth(dev)
        log(f"{p.name}: copy {res['copy_GBps']['median']:.0f} GB/s (2 x bytes / t)")
    else:
        res["device"] = {"name": "cpu (Triton interpreter smoke run)"}
        res["copy_GBps"] = {"median": float("nan")}

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1, default=str)

    if a.wait:
        while not os.path.exists(a.wait) and time.time() < deadline - 60:
            time.sleep(1)
        log(f"waited for {a.wait}: {time.time() - t_start:.0f}s")
    from moe_engine.gpu import GpuExperts
    from moe_engine.gpu import config as gcfg

    shape = (E, H, I, K)
    if a.sweep == "full":
        jobs = []
        for fmt in formats:
            for T in batches:
                base = gcfg.default(fmt_arg(fmt), T, H, I)
                cs = [base] + [apply(base, st, c) for st in ("gate_up", "down")
                               for c in candidates(fmt_arg(fmt), T, st)]
                jobs.append((fmt, T, shape, cs))
        res["precompile_errors"] = precompile(jobs, a.procs, a.device, max(30.0, 0.35 * (deadline - time.time())))
        save()

    copy_bw = res["copy_GBps"]["median"]
    # the sweep's time, shared among the (format, batch) pairs by their number of candidates
    done = set()
    weights = {(f, T): 1 + len(candidates(fmt_arg(f), T, "gate_up")) + len(candidates(fmt_arg(f), T, "down"))
               for f in formats for T in batches}
    for fmt in formats:
        ge = GpuExperts(fmt_arg(fmt), num_layers=L, capacity=E, E=E, H=H, I=I, top_k=K, max_tokens=max(batches),
                        device=dev)
        fill_random(ge, seed=1)
        mods = hfcfg = None
        if fmt == "bf16" and not a.no_hf:
            mods, hfcfg, res["transformers_impl"] = hf_modules(ge, L)
        for T in batches:
            ids, ws = routes(T, E, K, L, dev, seed=100 + T)
            xs = (torch.randn(T, H, device=dev) * 1.0).to(torch.bfloat16)
            outs = [torch.empty((T, H), dtype=torch.bfloat16, device=dev) for _ in range(L)]
            uniq = statistics.mean(len(set(i.reshape(-1).tolist())) for i in ids)
            nbytes = uniq * ge.bytes_per_expert
            ref = reference(ge, 0, xs, ids[0].cpu(), ws[0].cpu())
            base = gcfg.default(fmt_arg(fmt), T, H, I)

            replays = a.replays if dev.type == "cuda" else 1

            def measure(cfg, reps, ge=ge, T=T, xs=xs, ids=ids, ws=ws, outs=outs, ref=ref, replays=replays):
                return measure_config(ge, T, cfg, xs, ids, ws, outs, ref, replays, reps)

            best, best_t = base, None
            left = sum(v for k, v in weights.items() if k not in done)
            share = weights[(fmt, T)] / left
            # 20 s per pair left for the final measurement, transformers and the JSON
            slice_end = time.time() + share * max(0.0, deadline - time.time() - 20 * len(
                [k for k in weights if k not in done]))
            done.add((fmt, T))
            try:
                tb, eb = measure(base, a.sweep_repeats)
                best_t = statistics.median(tb) if tb else None
                res["sweep"].append({"format": fmt, "batch": T, "stage": "default", "config": cfg_dict(base),
                                     "us": best_t, "err": eb})
            except Exception as e:  # noqa: BLE001
                res["sweep"].append({"format": fmt, "batch": T, "stage": "default", "config": cfg_dict(base),
                                     "error": repr(e)[:400]})
                best_t = None
            if a.sweep == "full":
                for stage in ("gate_up", "down"):
                    for c in candidates(fmt_arg(fmt), T, stage):
                        if time.time() > slice_end:
                            res["notes"].append(f"sweep cut short by the deadline at {fmt} batch {T} {stage}")
                            break
                        cfg = apply(best, stage, c)
                        entry = {"format": fmt, "batch": T, "stage": stage, "config": cfg_dict(cfg)}
                        try:
                            tt, err = measure(cfg, a.sweep_repeats)
                            entry["err"] = err
                            if tt:
                                entry["us"] = statistics.median(tt)
                                if best_t is None or entry["us"] < best_t:
                                    best, best_t = cfg, entry["us"]
                        except Exception as e:  # noqa: BLE001
                            entry["error"] = repr(e)[:400]
                        res["sweep"].append(entry)
                    save()
            row = {"format": fmt, "batch": T, "config": cfg_dict(best), "distinct_experts": uniq,
                   "weight_bytes": nbytes, "bytes_per_expert": ge.bytes_per_expert}
            try:
                tg, err = measure(best, a.repeats)
                row["err"] = err
                if tg:
                    row["graph_us"] = stats(tg)
                    row["GBps"] = nbytes / (row["graph_us"]["median"] * 1e-6) / 1e9
                    row["pct_of_copy"] = 100.0 * row["GBps"] / copy_bw if copy_bw == copy_bw else None
                    row["eager_us"] = stats(time_ours(ge, xs, ids, ws, outs, replays, max(3, a.repeats // 3),
                                                      graph=False))
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:400]
            if dev.type == "cuda":
                try:
                    ge.set_config(T, best)
                    row["kernel_us"] = kernel_times(ge, xs, ids, ws, outs)
                except Exception as e:  # noqa: BLE001
                    row["kernel_us_error"] = repr(e)[:400]
            res["results"].append(row)
            log(f"{fmt} b{T}: {row.get('graph_us', {}).get('median', float('nan')):.1f} us  "
                f"{row.get('GBps', float('nan')):.0f} GB/s  {row.get('pct_of_copy') or float('nan'):.1f}% of copy  "
                f"err {row.get('err', float('nan')):.2e}")
            if mods is not None or (fmt == "bf16" and not a.no_hf):
                ids64 = [i.long() for i in ids]
                wsb = [w.to(torch.bfloat16) for w in ws]
                for impl in ("batched_mm", "grouped_mm"):
                    entry = {"impl": impl, "batch": T}
                    hf_args = (ge, impl, xs, ids64, wsb, 10 if dev.type == "cuda" else 1,
                               max(5, a.repeats // 2) if dev.type == "cuda" else 1)
                    try:
                        try:
                            th, yh = time_hf(*hf_args, mods, hfcfg)
                            entry["how"] = "Qwen3MoeExperts module" if mods is not None else "functions"
                        except Exception as e:  # noqa: BLE001 - the module path failed: the functions directly
                            if mods is None:
                                raise
                            log(f"transformers {impl} through the module failed ({e!r}); calling the function")
                            th, yh = time_hf(*hf_args, None, None)
                            entry["how"] = f"functions (module failed: {e!r})"[:300]
                        entry["us"] = stats(th)
                        # the last layer's output against our kernel's on the same routes (same bf16 weights)
                        entry["rel_diff_vs_ours"] = rel_err(yh.float(), outs[-1].double())
                    except Exception as e:  # noqa: BLE001
                        entry["error"] = repr(e)[:400]
                    res["transformers"].append(entry)
                    log(f"transformers {impl} b{T}: {entry.get('us', {}).get('median', float('nan')):.1f} us")
            save()
        ge = mods = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    res["wall_s"] = time.time() - t_start
    save()
    # table
    print(f"\n{res['device']['name']}  copy {copy_bw:.0f} GB/s (2 x bytes / t)  shape E={E} H={H} I={I} "
          f"top_k={K}, {L} layers per graph")
    print(f"{'format':10s} {'b':>3s} {'graph us':>9s} {'min':>7s} {'max':>7s} {'eager':>7s} {'GB/s':>6s} "
          f"{'%copy':>6s} {'err':>8s}  config")
    for r in res["results"]:
        gu = r.get("graph_us", {})
        c = r["config"]
        cs = (f"gu {c['gate_up']['block_n']}x{c['gate_up']['block_k']} w{c['gate_up']['num_warps']} "
              f"{'dot' if c['gate_up']['dot'] else 'fma'} {'grp' if c['grouped'] else 'dir'} | dn "
              f"{c['down']['block_n']}x{c['down']['block_k']} w{c['down']['num_warps']} "
              f"{'dot' if c['down']['dot'] else 'fma'} {c['down_mode']}")
        print(f"{r['format']:10s} {r['batch']:3d} {gu.get('median', float('nan')):9.1f} "
              f"{gu.get('min', float('nan')):7.1f} {gu.get('max', float('nan')):7.1f} "
              f"{r.get('eager_us', {}).get('median', float('nan')):7.1f} {r.get('GBps', float('nan')):6.0f} "
              f"{r.get('pct_of_copy') or float('nan'):6.1f} {r.get('err', float('nan')):8.1e}  {cs}"
              + (f"  ERROR {r['error']}" if "error" in r else ""))
    for h in res["transformers"]:
        u = h.get("us", {})
        print(f"transformers {h['impl']:10s} b{h['batch']}: {u.get('median', float('nan')):8.1f} us "
              f"(min {u.get('min', float('nan')):.1f}, max {u.get('max', float('nan')):.1f})"
              + (f"  ERROR {h['error']}" if "error" in h else ""))


if __name__ == "__main__":
    main()
