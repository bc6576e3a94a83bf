"""`moe-engine generate` and `moe-engine bench`: a shipped checkpoint loaded with from_pretrained, then a generation
(text or ids, with prefill and decode tokens/s apart) or llama-bench's tests (pp: a prompt of p tokens in one
forward; tg: n tokens decoded one at a time after a one-token prompt), printed in llama-bench's table shape so the
two sit side by side, or as JSON.

Thread contract: command-line entry points; one model, one thread."""
from __future__ import annotations

import json
import statistics
import sys
import time


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Clock:
    """A transformers streamer that stamps the prompt and every new token."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_kwargs(a) -> dict:
    """from_pretrained's keywords from common_args' options that were given (generate, bench and profile alike)."""
    names = ("gpu_memory", "host_memory", "strategy", "device", "decode", "attention", "residency")
    return {n: getattr(a, n) for n in names if getattr(a, n, None) is not None}


def load(a, **extra):
    import torch

    from ..integrations.transformers import from_pretrained

    t = time.perf_counter()
    model = from_pretrained(a.path, a.gguf_file, threads=a.threads, progress=not a.quiet, dtype=torch.bfloat16,
                            **load_kwargs(a), **extra)
    return model, time.perf_counter() - t


def _prompt_ids(a, model):
    import torch

    tok = model.moe_engine.tokenizer
    if a.ids:
        ids = [int(v) for v in a.ids.replace(",", " ").split()]
        return torch.tensor([ids]), tok
    if tok is None:
        raise SystemExit("moe-engine generate: this checkpoint has no tokenizer; pass --ids 1,2,3 instead of --prompt")
    return tok(a.prompt, return_tensors="pt").input_ids, tok


def run_generate(a) -> int:
    import torch

    model, load_s = load(a)
    dev = model.moe_engine.runner.device
    ids, tok = _prompt_ids(a, model)
    ids = ids.to(dev)
    loop = _loop(a, model, ids.shape[1] + a.max_new_tokens)
    graphs = None
    if loop is not None:
        new = loop.generate(ids, a.max_new_tokens)[0].tolist()
        prefill_s, decode_s = loop.last["prompt_s"], loop.last["decode_s"]
        graphs = loop.capture
        loop.close()
    else:
        clock = _Clock()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=a.max_new_tokens, do_sample=False, streamer=clock)
        new = out[0, ids.shape[1]:].tolist()
        first = clock.stamps[1] if len(clock.stamps) > 1 else time.perf_counter()
        prefill_s = first - t0
        decode_s = clock.stamps[-1] - first if len(clock.stamps) > 2 else 0.0
    res = {"path": str(a.path), "load_s": load_s, "prompt_tokens": int(ids.shape[1]), "new_tokens": len(new),
           "prefill_tok_s": ids.shape[1] / prefill_s if prefill_s > 0 else None,
           "decode_tok_s": (len(new) - 1) / decode_s if decode_s > 0 else None, "ids": new,
           "text": tok.decode(new) if tok is not None and not a.ids else None,
           "loop": "graph" if loop is not None else "generate", "graphs": graphs,
           "runner": model.moe_engine.runner.describe()}
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print(res["text"] if res["text"] is not None else " ".join(map(str, new)))
        pf = f"{res['prefill_tok_s']:.2f}" if res["prefill_tok_s"] else "-"
        dc = f"{res['decode_tok_s']:.2f}" if res["decode_tok_s"] else "-"
        print(f"prefill {res['prompt_tokens']} tokens: {pf} tok/s; decode {len(new)} tokens: {dc} tok/s; "
              f"load {load_s:.1f} s", file=sys.stderr)
    model.moe_engine.close()
    return 0


def _pp(model, p: int, vocab: int, dev, depth: int = 0) -> float:
    """p prompt tokens in one forward, timed; after `depth` tokens already in the cache (untimed), as llama-bench's
    `-d`."""
    import torch

    from ..integrations.transformers.graph_loop import cache_kwarg

    ids = torch.randint(0, vocab, (1, p), device=dev)
    with torch.no_grad():
        kw = {}
        if depth:
            ctx = torch.randint(0, vocab, (1, depth), device=dev)
            kw[cache_kwarg(model)] = model(ctx, use_cache=True).past_key_values
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        model(ids, use_cache=True, **kw)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return p / (time.perf_counter() - t)


def _tg(model, n: int, vocab: int, dev, graphs: bool = False, loop=None, depth: int = 0) -> float:
    """n tokens decoded one at a time after a prompt of `depth` tokens (one at depth 0; llama-bench's `-d`).
    loop (a GraphLoop): its greedy step, on a GPU one CUDA graph replay a token (what llama-bench's tg times: tokens
    evaluated, no sampling, no Python between them).
    Otherwise generate(); graphs (a GPU): transformers' static cache with the step captured through torch.compile's
    cudagraphs backend (the eager kernels, our experts op inside; the first call at a cache length compiles)."""
    import torch

    ids = torch.randint(0, vocab, (1, max(1, depth)), device=dev)
    if loop is not None:
        loop.generate(ids, n + 1)
        return n / loop.last["decode_s"]
    clock = _Clock()
    kw = {}
    if graphs:
        from transformers import CompileConfig

        kw = dict(cache_implementation="static", compile_config=CompileConfig(backend="cudagraphs", mode=None))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=n + 1, min_new_tokens=n + 1, do_sample=False, streamer=clock, **kw)
    return n / (clock.stamps[-1] - clock.stamps[1])  # after the first new token: n decode steps


def _loop(a, model, length: int):
    """bench's and generate's GraphLoop, or None for transformers' generate() (--loop generate). Under decode=compile
    the loop compiles its step's forward (inductor) before capturing it."""
    if getattr(a, "loop", "generate") != "graph":
        return None
    from ..integrations.transformers.graph_loop import GraphLoop

    return GraphLoop(model, max_len=length, capture=None if not getattr(a, "no_graphs", False) else False)


def run_bench(a) -> int:
    if any(d < 0 for d in a.d):
        raise ValueError(f"-d {','.join(map(str, a.d))}: expected depths >= 0 (tokens already in the cache)")
    model, load_s = load(a)
    off = model.moe_engine
    dev = off.runner.device
    vocab = model.config.get_text_config().vocab_size
    depths = a.d
    tests = [(d, "pp", p) for d in depths for p in a.p if p > 0] + [(d, "tg", n) for d in depths for n in a.n if n > 0]
    rows = []
    graphs = dev.type == "cuda" and not a.no_graphs and off.runner.graphs_ok
    loop = _loop(a, model, max(a.n) + max(depths) + 2) if any(n > 0 for n in a.n) else None
    fn = {"pp": _pp, "tg": lambda m, k, v, dv, d: _tg(m, k, v, dv, graphs, loop, d)}
    for depth, kind, k in tests:
        # warm-up as llama-bench's: the same test once (pp: the staged prefill's kernels and its first choice's
        # timings; tg: the capture), on a CPU decode tg only 8 tokens
        fn[kind](model, k if kind == "pp" or graphs else min(k, 8), vocab, dev, depth)
        rates = []
        for _ in range(a.r):
            rates.append(fn[kind](model, k, vocab, dev, depth))
        rows.append({"test": f"{kind}{k}" + (f" @ d{depth}" if depth else ""), "n_prompt": k if kind == "pp" else 0,
                     "n_gen": k if kind == "tg" else 0, "n_depth": depth,
                     "avg_ts": statistics.fmean(rates), "stddev_ts": statistics.stdev(rates) if len(rates) > 1 else 0.0,
                     "samples_ts": rates})
    cfg = model.config.get_text_config()
    from ..integrations.transformers.decode import PackedLinear
    from ..layer_formats import describe

    params = sum(p.numel() for p in model.parameters()) + sum(  # a packed weight is no parameter
        m.in_features * m.out_features for m in model.modules() if isinstance(m, PackedLinear))
    info = {"model": f"{cfg.model_type} {describe(off.runner.layer_formats)}", "file": str(a.path), "load_s": load_s,
            "graphs": loop.capture if loop is not None else graphs,
            "loop": "graph" if loop is not None else "generate", "strategy": off.runner.strategy,
            "decode": off.decode,
            "threads": off.runner.executor.threads if off.runner.executor else 0,
            "non_expert_params": params, "plan": off.plan.why if off.plan else None, "runner": off.runner.describe()}
    if a.json:
        print(json.dumps({**info, "results": rows}, indent=1))
    else:
        backend = f"moe_engine {off.runner.strategy}" + (" (CUDA)" if dev.type == "cuda" else "")
        print("| model | backend | threads | test | t/s |")
        print("| ------ | ------- | ------: | ---: | ---: |")
        for r in rows:
            print(f"| {info['model']} | {backend} | {info['threads']} | {r['test']} | "
                  f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} |")
        _say(f"load {load_s:.1f} s; {off.plan.why if off.plan else ''}")
    if loop is not None:
        loop.close()
    off.close()
    return 0


def common_args(p, path_nargs=None) -> None:
    """The checkpoint arguments generate, bench and profile share."""
    p.add_argument("path", nargs=path_nargs,
                   help="a Hugging Face directory or a .gguf file (or its directory, with --gguf-file)")
    p.add_argument("--gguf-file", default=None, help="the GGUF file's name inside PATH")
    p.add_argument("--gpu-memory", default=None, help="GPU budget, e.g. 16GiB (default: the free memory)")
    p.add_argument("--host-memory", default=None,
                   help="host bytes the experts may take, e.g. 48GiB (default: MemAvailable); beside a GPU it decides "
                        "whether hybrid's CPU executor holds its own repacked copy of the experts")
    p.add_argument("--strategy", default=None, choices=("auto", "cpu", "hybrid", "gpu"))
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--decode", default=None, choices=("auto", "eager", "packed", "static", "compile", "gemv"),
                   help="the non-expert decode path (from_pretrained's decode=; default auto)")
    p.add_argument("--attention", default=None, choices=("auto", "sdpa"),
                   help="attention at decode on the CPU paths: auto = cpumoe_formats' decode attention, sdpa = "
                   "transformers' own (from_pretrained's attention=; default auto)")
    p.add_argument("--residency", default=None, choices=("hot", "random", "uniform", "layers"),
                   help="which experts hybrid's GPU share holds: the budget's slots in every layer (hot, random, "
                        "uniform; default hot) or whole layers, the last ones (layers, as llama.cpp's --n-cpu-moe)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_parsers(sub) -> None:
    g = sub.add_parser("generate", help="load a checkpoint (from_pretrained) and generate greedily")
    b = sub.add_parser("bench", help="llama-bench's tests on a checkpoint: pp (prompt) and tg (decode) tokens/s")
    common_args(g)
    common_args(b, "?")
    w = g.add_mutually_exclusive_group(required=True)
    w.add_argument("--prompt", help="text (needs the checkpoint's tokenizer)")
    w.add_argument("--ids", help="token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--loop", default="generate", choices=("generate", "graph"), help="generate: transformers' "
                   "generate(); graph: GraphLoop, the greedy step captured as one CUDA graph on a GPU (default "
                   "generate)")
    g.add_argument("-t", "--threads", type=int, default=None, help="CPU workers (default: one per physical core)")
    b.add_argument("-p", type=_ints, default=[512], help="prompt lengths (default 512; comma list)")
    b.add_argument("-n", type=_ints, default=[128], help="decoded tokens (default 128; comma list)")
    b.add_argument("-d", type=_ints, default=[0], help="depth: tokens already in the cache before each test, as "
                   "llama-bench's -d (default 0; comma list)")
    b.add_argument("-r", type=int, default=5, help="repetitions (default 5)")
    b.add_argument("-t", "--threads", type=int, default=None, help="CPU workers (default: one per physical core)")
    b.add_argument("--no-graphs", action="store_true", help="on a GPU, decode eagerly (default: CUDA graphs)")
    b.add_argument("--loop", default="graph", choices=("graph", "generate"), help="tg's decode loop: graph "
                   "(default): GraphLoop, the greedy step on a static cache, one CUDA graph replay a token on a GPU, "
                   "as llama-bench's tg evaluates tokens without sampling; generate: transformers' generate() (static "
                   "cache + the cudagraphs backend on a GPU)")
    b.add_argument("--profile", action="store_true", help="measure the bandwidths strategy='auto' decides from and "
                   "write the profile (no PATH: at --preset / --shape)")
    b.add_argument("--preset", default=None, help="--profile: expert shape preset (default qwen3-30b-a3b)")
    b.add_argument("--shape", default=None, metavar="E,H,I,TOPK", help="--profile: a custom expert shape")
    b.add_argument("--formats", default=None, help="--profile: comma list (default bf16,fp8_block)")
    b.add_argument("--steps", type=int, default=64, help="--profile: timed steps per measurement (default 64)")
    b.add_argument("--out", default=None, help="--profile: the profile's path (default: the user cache dir)")
    b.add_argument("--png", default=None, help="--profile: the plot's path (default: beside the profile)")


def _ints(v: str) -> list[int]:
    return [int(x) for x in v.split(",") if x.strip()]
