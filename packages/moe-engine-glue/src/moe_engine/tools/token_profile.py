"""Whose time a decode token is: the routed experts (moe_engine), attention, the routers, the LM head and the rest
(norms, residuals, embeddings, the framework: generate()'s Python, the cache), measured with forward hooks on
transformers' own modules over a run of decode steps of a model from from_pretrained, on the decode path it chose
(from_pretrained's decode=; under `compile` the hooks would break the graph, so only the experts, timed inside the
runner's call, are split from the rest). With --ggml BIN (bench/llamacpp's moe_ggml_bench) the same run also times
ggml's MUL_MAT_ID experts step at the file's shape and threads, one layer's decode step (its DRAM working-set rule)
times the layer count: the experts' share of llama.cpp's token, against ours.

    python -m moe_engine.tools.token_profile PATH [--gguf-file F] [-n 32] [-t THREADS] [--decode auto]
        [--device cuda --strategy cpu|hybrid|gpu --gpu-memory 16GiB] [--team pool|openmp]
        [--ggml .ggml/build/moe_ggml_bench] [--rounds 2] [--json F]

Hooks stamp time.perf_counter() before and after each module; on a GPU every stamp synchronizes first, so the parts
are true but the total is slower than a graph-replayed step. Each round also times the same tokens through GraphLoop
(`loop`: the greedy step on a static cache, one CUDA graph replay a token on a GPU, eager on the CPU) and through
generate() without hooks (`generate`): their difference is what generate()'s own loop costs a token. With the experts
on the CPU the profile also splits our experts' time: the executor's native step inside the model (its step trace: the
step and how late its workers entered it) and, in each round, the same runner alone on the same banks
(`experts_alone`: random top-k routes, fresh per layer, every layer in turn, back to back, through runner.forward as
transformers calls it). Hooked minus alone is what the model around the call costs our experts: the glue's Python on
cold caches, workers woken beside torch's threads. Rounds alternate ours and ggml's on the same minutes of the
machine; the figures are medians over rounds. Thread contract: a command-line tool."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

# the ggml harness's entry for the end-to-end file's experts (bench/llamacpp/moe_ggml.h): format -> (name, H, I, E, k)
GGML_ENTRIES = {"q4_0": ("q4_0-qwen3", 2048, 768, 128, 8)}


def _kind(name: str, module, experts: set) -> str | None:
    if name in experts:
        return "experts"
    cls = type(module).__name__
    if name.endswith("self_attn") or cls.endswith("Attention"):
        return "attention"
    if name.endswith("mlp.gate") or name.endswith("mlp.router") or cls.endswith("Router"):
        return "router"
    if name.endswith("lm_head"):
        return "head"
    return None


def profile(model, steps: int = 32) -> dict:
    """Seconds per decode token by part, over `steps` tokens after a one-token prompt (the prompt excluded), on the
    model's generation_config (from_pretrained's decode path)."""
    import torch

    off = model.moe_engine
    dev = off.runner.device
    path = off.decode[0] if off.decode else "eager"
    experts = set(off.modules)
    spent, depth, t0 = defaultdict(float), {"n": 0}, {}
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    hooks = []
    runner, inner = off.runner, off.runner.forward
    if path == "compile":  # the custom op calls runner.forward outside the compiled graph: time it there
        def timed(*a, **k):
            t = time.perf_counter()
            y = inner(*a, **k)
            sync()
            if depth["n"]:
                spent["experts"] += time.perf_counter() - t
            return y

        runner.forward = timed
    else:
        for name, m in model.named_modules():
            kind = _kind(name, m, experts)
            if kind is None:
                continue

            def pre(mod, args, kind=kind, key=name):
                sync()
                t0[key] = time.perf_counter()

            def post(mod, args, out, kind=kind, key=name):
                sync()
                if depth["n"]:
                    spent[kind] += time.perf_counter() - t0[key]

            hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    stamps = []

    class Clock:
        def put(self, value):
            sync()
            stamps.append(time.perf_counter())
            depth["n"] = len(stamps) >= 2  # parts count from the first decode step on

        def end(self):
            pass

    ids = torch.tensor([[1]], device=dev)
    ex = runner.executor if runner.strategy == "cpu" else None
    if ex is not None:
        ex.start_trace()
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False, streamer=Clock())
    finally:
        for h in hooks:
            h.remove()
        if path == "compile":
            del runner.forward  # back to the class's method
        trace = ex.stop_trace() if ex is not None else None
    total = stamps[-1] - stamps[1]
    parts = {k: v / steps for k, v in spent.items()}
    parts["rest" if path != "compile" else "non-expert (compiled)"] = total / steps - sum(parts.values())
    out = {"token_s": total / steps, "tok_s": steps / total, "parts_s": parts, "steps": steps, "decode": path}
    if trace and trace["steps"]:
        out["executor_in_model"] = _trace_part(trace, runner.num_layers)
    return out


def loop_tok(loop, steps: int) -> float:
    """Seconds per decode token through GraphLoop (steps tokens after a one-token prompt)."""
    loop.generate([1], steps + 1)
    return loop.last["decode_s"] / steps


def generate_tok(model, steps: int) -> float:
    """Seconds per decode token through generate() on the model's generation_config, no hooks; on a GPU the step
    captured through the cudagraphs backend as moe-engine bench --loop generate does."""
    import torch

    from .generate import _Clock

    dev = model.moe_engine.runner.device
    kw = {}
    if dev.type == "cuda" and model.moe_engine.runner.graphs_ok:
        from transformers import CompileConfig

        kw = dict(cache_implementation="static", compile_config=CompileConfig(backend="cudagraphs", mode=None))
    clock = _Clock()
    with torch.no_grad():
        model.generate(torch.tensor([[1]], device=dev), max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                       do_sample=False, streamer=clock, **kw)
    return (clock.stamps[-1] - clock.stamps[1]) / steps


def _trace_part(trace: dict, layers: int) -> dict:
    """The executor's step trace as the experts' share of a token: the native step per token and per layer, and how
    long after a step began its threads entered it (the pool's wake), on average and for the latest thread."""
    enters = [t["enter_ns"] / t["steps"] / 1e3 for t in trace["raw"]["threads"] if t["steps"]]
    return {"step_s": trace["step_us"] * layers / 1e6, "layer_step_us": trace["step_us"], "steps": trace["steps"],
            "enter_us": trace["enter_us"], "enter_latest_us": max(enters)}


def experts_alone(runner, tokens: int = 16, seed: int = 0) -> dict:
    """The runner's experts alone on its own banks: `tokens` tokens of every layer in turn, back to back, each step
    on random top_k routes of E (fresh per layer, so the working set is every layer's banks: DRAM, not cache), x and
    weights bf16 and ids int64 as a router leaves them, through runner.forward. Seconds per token and microseconds per
    layer, with the executor's step trace over the same steps (CPU strategy)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    L, E, K = runner.num_layers, runner.E, runner.top_k
    dev = runner.device
    x = torch.from_numpy(rng.standard_normal((1, runner.H), dtype=np.float32)).to(torch.bfloat16).to(dev)
    ids = [[torch.from_numpy(rng.choice(E, K, replace=False).astype(np.int64)).view(1, K).to(dev)
            for _ in range(L)] for _ in range(tokens + 1)]
    w = torch.softmax(torch.from_numpy(rng.standard_normal((1, K), dtype=np.float32)), -1).to(torch.bfloat16).to(dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    for layer in range(L):  # one token untimed: the pool's first wake, first touches
        runner.forward(layer, x, w, ids[0][layer])
    ex = runner.executor if runner.strategy == "cpu" else None
    if ex is not None:
        ex.start_trace()
    sync()
    t = time.perf_counter()
    with torch.no_grad():
        for tok in range(1, tokens + 1):
            for layer in range(L):
                runner.forward(layer, x, w, ids[tok][layer])
    sync()
    total = time.perf_counter() - t
    out = {"token_s": total / tokens, "layer_us": 1e6 * total / (tokens * L), "tokens": tokens}
    if ex is not None:
        out["executor"] = _trace_part(ex.stop_trace(), L)
    return out


def ggml_entry(runner) -> str | None:
    """The ggml harness's entry for this runner's experts, or None where it has none at this shape."""
    fmt = runner.format.removesuffix("_x16")
    e = GGML_ENTRIES.get(fmt)
    if e is None or (runner.H, runner.I, runner.E, runner.top_k) != e[1:]:
        return None
    return e[0]


def ggml_layer_s(binary: str, entry: str, threads: int, repeats: int = 5, steps: int = 20) -> dict:
    """One run of moe_ggml_bench: ggml's experts decode step (batch 1, random routes, cache evicted) in seconds."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "g.json")
        subprocess.run([binary, "--format", entry, "--batch", "1", "--routing", "random", "--threads", str(threads),
                        "--repeats", str(repeats), "--steps", str(steps), "--json", out], check=True,
                       stdout=subprocess.DEVNULL)
        with open(out) as f:
            res = json.load(f)
    r = res["formats"][entry]
    return {"step_s": r["results"]["random/1"]["step_us"]["median"] / 1e6, "buffer_types": r["buffer_types"],
            "check_ok": r["check"]["ok"], "ggml": res["ggml"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_engine.tools.token_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("-n", type=int, default=32, help="decode steps (default 32)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--decode", default="auto", help="from_pretrained's decode path (auto, eager, packed, static, "
                    "compile, gemv)")
    ap.add_argument("--team", default=None, choices=("pool", "openmp"), help="who runs the executor's steps "
                    "(MoERunner's team=; default: openmp with the activations on the CPU)")
    ap.add_argument("--ggml", default=None, metavar="BIN", help="moe_ggml_bench (bench/llamacpp/build.sh): also time "
                    "ggml's experts at this shape")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of ours then ggml's (default 2)")
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (from_pretrained's device=)")
    ap.add_argument("--strategy", default="auto", choices=("auto", "cpu", "hybrid", "gpu"))
    ap.add_argument("--gpu-memory", default=None, help="from_pretrained's gpu_memory= (e.g. 16GiB)")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)
    from ..integrations.transformers import from_pretrained

    if a.ggml and not os.access(a.ggml, os.X_OK):
        raise SystemExit(f"--ggml {a.ggml}: not an executable (build it with bench/llamacpp/build.sh)")
    kw = {k: v for k, v in (("device", a.device), ("gpu_memory", a.gpu_memory), ("team", a.team)) if v is not None}
    model = from_pretrained(a.path, a.gguf_file, threads=a.threads, progress=False, decode=a.decode,
                            strategy=a.strategy, **kw)
    runner = model.moe_engine.runner
    entry = ggml_entry(runner) if a.ggml else None
    if a.ggml and entry is None:
        print(f"--ggml: the harness has no entry for {runner.format} at H={runner.H} I={runner.I} E={runner.E} "
              f"top_k={runner.top_k}; ggml's side skipped", file=sys.stderr)
    threads = runner.executor.threads if runner.executor else (a.threads or 1)
    profile(model, 4)  # warm-up (compiles under decode=compile)
    from ..integrations.transformers.graph_loop import GraphLoop

    loop = GraphLoop(model, max_len=a.n + 4)
    loop_tok(loop, 4)  # warm-up (captures on a GPU)
    runs, gg, alone, loops, gens = [], [], [], [], []
    for _ in range(max(1, a.rounds)):
        runs.append(profile(model, a.n))
        loops.append(loop_tok(loop, a.n))
        gens.append(generate_tok(model, a.n))
        alone.append(experts_alone(runner, a.n))
        if entry:
            gg.append(ggml_layer_s(a.ggml, entry, threads))
    keys = sorted({k for r in runs for k in r["parts_s"]})
    parts = {k: statistics.median(r["parts_s"].get(k, 0.0) for r in runs) for k in keys}
    token = statistics.median(r["token_s"] for r in runs)
    res = {"path": a.path, "decode": model.moe_engine.decode, "token_s": token, "tok_s": 1 / token, "parts_s": parts,
           "rounds": runs, "layers": runner.num_layers, "threads": threads, "runner": runner.describe(),
           "loadavg": os.getloadavg(), "loop": {"captured": loop.capture, "token_s": statistics.median(loops),
                                                "rounds": loops},
           "generate": {"token_s": statistics.median(gens), "rounds": gens},
           "experts_alone": {"token_s": statistics.median(x["token_s"] for x in alone), "rounds": alone}}
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"{k:22s} {1e3 * v:8.2f} ms/token ({100 * v / token:.0f}%)")
    print(f"{'total':22s} {1e3 * token:8.2f} ms/token ({1 / token:.2f} tok/s; decode path {res['decode'][0]})")
    L = runner.num_layers
    native = [r["executor_in_model"] for r in runs if "executor_in_model" in r]
    if native:
        med = {k: statistics.median(n[k] for n in native) for k in ("step_s", "enter_us", "enter_latest_us")}
        res["executor_in_model"] = med
        print(f"{'  executor step':22s} {1e3 * med['step_s']:8.2f} ms/token ({1e6 * med['step_s'] / L:.0f} us/layer; "
              f"workers entered {med['enter_us']:.0f} us after it began, the latest {med['enter_latest_us']:.0f})")
    lp, gn = res["loop"]["token_s"], res["generate"]["token_s"]
    print(f"{'generate(), no hooks':22s} {1e3 * gn:8.2f} ms/token ({1 / gn:.2f} tok/s)")
    print(f"{'GraphLoop':22s} {1e3 * lp:8.2f} ms/token ({1 / lp:.2f} tok/s; "
          f"{'one CUDA graph replay a token' if loop.capture else 'eager steps'}): generate() costs "
          f"{1e3 * (gn - lp):.2f} ms a token more")
    loop.close()
    al = res["experts_alone"]["token_s"]
    print(f"{'experts alone':22s} {1e3 * al:8.2f} ms/token ({1e6 * al / L:.0f} us/layer: same banks, random routes, "
          f"back to back); in the model {parts.get('experts', 0.0) / al:.2f}x that")
    if gg:
        step = statistics.median(g["step_s"] for g in gg)
        ggml_tok = step * runner.num_layers
        ours = parts.get("experts", 0.0)
        res["ggml_experts"] = {"entry": entry, "layer_step_s": step, "token_s": ggml_tok, "rounds": gg,
                               "ours_over_ggml_speed": ggml_tok / ours if ours else None}
        print(f"{'ggml experts (MUL_MAT_ID)':22s} {1e3 * ggml_tok:8.2f} ms/token ({1e3 * step:.2f} ms/layer x "
              f"{runner.num_layers}); ours {ggml_tok / ours:.2f}x faster" if ours else "")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    model.moe_engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
