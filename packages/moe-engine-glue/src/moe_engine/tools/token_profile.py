"""Whose time a decode token is: the routed experts (moe_engine), attention, the routers, the LM head and the rest
(norms, residuals, embeddings, the framework: generate()'s Python, the cache), measured with forward hooks on
transformers' own modules over a run of decode steps of a model from from_pretrained.

    python -m moe_engine.tools.token_profile PATH [--gguf-file F] [-n 32] [-t THREADS] [--static] [--json F]

Hooks stamp time.perf_counter() before and after each module; on a GPU every stamp synchronizes first, so the parts
are true but the total is slower than a graph-replayed step. Thread contract: a command-line tool."""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict


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


def profile(model, steps: int = 32, static: bool = False) -> dict:
    """Seconds per decode token by part, over `steps` tokens after a one-token prompt (the prompt excluded)."""
    import torch

    dev = model.moe_engine.runner.device
    experts = set(model.moe_engine.modules)
    spent, depth, t0 = defaultdict(float), {"n": 0}, {}
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    hooks = []
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

    kw = dict(cache_implementation="static") if static else {}
    ids = torch.tensor([[1]], device=dev)
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False, streamer=Clock(),
                           **kw)
    finally:
        for h in hooks:
            h.remove()
    total = stamps[-1] - stamps[1]
    parts = {k: v / steps for k, v in spent.items()}
    parts["rest"] = total / steps - sum(parts.values())
    return {"token_s": total / steps, "tok_s": steps / total, "parts_s": parts, "steps": steps, "static_cache": static}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_engine.tools.token_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("-n", type=int, default=32, help="decode steps (default 32)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--static", action="store_true", help="transformers' static cache")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)
    from ..integrations.transformers import from_pretrained

    model = from_pretrained(a.path, a.gguf_file, threads=a.threads, progress=False)
    profile(model, 4, a.static)  # warm-up
    res = {"path": a.path, **profile(model, a.n, a.static), "runner": model.moe_engine.runner.describe()}
    for k, v in sorted(res["parts_s"].items(), key=lambda kv: -kv[1]):
        print(f"{k:10s} {1e3 * v:8.2f} ms/token ({100 * v / res['token_s']:.0f}%)")
    print(f"{'total':10s} {1e3 * res['token_s']:8.2f} ms/token ({res['tok_s']:.2f} tok/s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    model.moe_engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
