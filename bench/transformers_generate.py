#!/usr/bin/env python3
"""generate() of a Qwen3-MoE-shaped transformers model (Qwen3-30B-A3B's hidden and expert sizes: H 2048, I 768,
128 experts, top-8; 32 query / 4 KV heads of 128; a few layers; random weights) with its experts run three ways, in
one process, the configurations interleaved within each repeat (docs/transformers.md):

  --mode cpu   everything on the CPU: transformers' built-in experts implementations that run there (grouped_mm,
               batched_mm, eager; bf16 experts: transformers loads FP8 and GGUF checkpoints dequantized to bf16 on a
               CPU) against moe_engine's (strategy cpu) with bf16, fp8_block and q4_0 banks.
  --mode h200  the model on the GPU: transformers with every expert on the GPU (the reference when they fit),
               accelerate's CPU offload of the experts (dispatch_model: expert weights copied to the GPU on every
               forward), moe_engine cpu and hybrid (a quarter of each layer's experts on the GPU), eager and under
               transformers' static cache with CUDA graphs (torch.compile backend "cudagraphs").

Tokens/s = new tokens x batch / wall time of generate() (prompt of --prompt tokens, --new-tokens greedy tokens),
median of --repeats; decode tokens/s takes off a 1-token generate's time. Writes --json."""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in ("cpumoe-formats", "cpumoe-executor", "gpusync-cuda", "gpusync-hip", "kernelio", "moe-engine-glue"):
    sys.path.insert(0, str(ROOT / "packages" / p / "src"))


def build_model(layers: int, vocab: int, seed: int = 0):
    """Qwen3-30B-A3B-shaped model with `layers` layers and random N(0, 0.02) weights, bf16, on the CPU (a pool of 16 Mi
    random values copied into every tensor at shifting offsets: timings do not depend on the values)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(1 << 24, generator=g) * 0.02).to(torch.bfloat16)  # 16 Mi values, copied around (fast)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
                continue
            flat, n = p.view(-1), p.numel()
            at = int(torch.randint(0, pool.numel(), (1,), generator=g))
            for i in range(0, n, pool.numel()):
                k = min(pool.numel(), n - i)
                src = torch.roll(pool, -at)[:k] if k < pool.numel() or at else pool
                flat[i:i + k].copy_(src)
                at = (at + 7919) % pool.numel()
    model.model.rotary_emb = Qwen3MoeRotaryEmbedding(cfg)  # to_empty left its buffers uninitialised
    return model


def others_busy(window_s: float = 0.3) -> float:
    """CPU cores kept busy by other processes over a short window while this one sleeps (from /proc/stat)."""
    def total():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[0] + v[1] + v[2] + v[5] + v[6] + v[7], sum(v)  # user nice system irq softirq steal, all

    b0, t0 = total()
    time.sleep(window_s)
    b1, t1 = total()
    return (b1 - b0) / max(t1 - t0, 1) * (os.cpu_count() or 1)


class Quiet:
    """Waits (up to max_wait_s) before each timed run until other processes use under `limit` cores: this machine
    is shared, and a busy core slows both thread pools (torch's, the executor's) far more than its share."""

    def __init__(self, limit: float, max_wait_s: float):
        self.limit, self.max_wait_s, self.waited_s, self.busy_runs = limit, max_wait_s, 0.0, 0

    def __call__(self) -> float:
        if self.limit <= 0 or not os.path.exists("/proc/stat"):
            return 0.0
        t = time.time()
        while (busy := others_busy()) > self.limit and time.time() - t < self.max_wait_s:
            time.sleep(1.0)
        self.waited_s += time.time() - t
        self.busy_runs += busy > self.limit
        return busy


QUIET = Quiet(0.0, 0.0)


def timed_generate(model, ids, new_tokens: int, sync, **kw) -> float:
    QUIET()
    sync()
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, **kw)
    sync()
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - t


class Runs:
    """Interleaved repeats of named configurations; each entry: (prepare() -> (model, generate kwargs))."""

    def __init__(self, args, sync):
        self.args, self.sync, self.rows = args, sync, {}

    def measure(self, configs: dict, ids, repeats: int, label: str):
        for prep in configs.values():  # warm-up (and compile, for the timed cache length) once each, untimed
            model, kw = prep()
            timed_generate(model, ids, self.args.new_tokens, self.sync, **kw)
        for rep in range(repeats):
            for name, prep in configs.items():
                model, kw = prep()
                t1 = timed_generate(model, ids, 1, self.sync, **kw)
                tn = timed_generate(model, ids, self.args.new_tokens, self.sync, **kw)
                row = self.rows.setdefault(f"{label} {name}", {"generate_s": [], "first_token_s": []})
                row["generate_s"].append(tn)
                row["first_token_s"].append(t1)
                print(f"  rep {rep} {label} {name}: {self.args.new_tokens * ids.shape[0] / tn:7.2f} tok/s", flush=True)
        for key in (f"{label} {name}" for name in configs):  # this call's rows (new_tokens can differ per call)
            row = self.rows[key]
            g, f = statistics.median(row["generate_s"]), statistics.median(row["first_token_s"])
            n, b = self.args.new_tokens, ids.shape[0]
            row.update(batch=b, new_tokens=n, generate_tok_s=round(n * b / g, 3),
                       decode_tok_s=round((n - 1) * b / max(g - f, 1e-9), 3))


def _floor(self, hidden_states, top_k_index, top_k_weights):
    """An experts 'implementation' that costs nothing (returns its input): the tokens/s no experts implementation can
    beat, the bound on any speedup over transformers' own (the rest of each layer is transformers')."""
    return hidden_states


def shared_copy(model, experts_only: bool = False):
    """A second model object over the same tensors (all of them, or only the experts' weights; the rest copied, so
    that moving it to a GPU leaves `model` where it is): offload_experts on it replaces its own experts' Parameter
    objects and leaves `model`'s."""
    if experts_only:
        tensors = [p for n, p in model.named_parameters() if ".experts." in n]
    else:
        tensors = list(model.parameters()) + list(model.buffers())
    return copy.deepcopy(model, {id(t): t for t in tensors})


def cpu_mode(args) -> dict:
    """One phase per format (the model's bf16 experts plus one format's banks in memory at a time): in each,
    transformers' grouped_mm and eager, moe_engine in that format and the floor, interleaved; batched_mm (far
    slower) in the first phase, with fewer repeats."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    from moe_engine.integrations.transformers import offload_experts

    t0 = time.time()
    base = build_model(args.layers, args.vocab)
    print(f"model: {args.layers} layers, built in {time.time() - t0:.0f} s", flush=True)
    ExpertsInterface.register("bench_floor", _floor)
    hf_impls = [i for i in ("grouped_mm", "eager") if i == "eager" or i in ALL_EXPERTS_FUNCTIONS]

    def hf(impl):
        def prep():
            base.set_experts_implementation(impl)
            return base, {}
        return prep

    runs, convert_s, described, table, floor = Runs(args, lambda: None), {}, {}, [], {}
    for phase, fmt in enumerate(args.formats):
        t = time.time()
        m = shared_copy(base)
        off = offload_experts(m, format=fmt, strategy="cpu", threads=args.threads, max_tokens=args.max_tokens,
                              progress=not args.quiet)
        convert_s[fmt], described[fmt] = round(time.time() - t, 1), off.runner.describe()
        print(f"moe_engine {fmt}: {described[fmt]} ({convert_s[fmt]} s)", flush=True)
        configs = {f"transformers {i}": hf(i) for i in hf_impls}
        configs[f"moe_engine {fmt}"] = lambda m=m: (m, {})
        if phase == 0:
            configs["floor: experts cost nothing"] = hf("bench_floor")
        for b in args.batch:
            ids = torch.randint(0, args.vocab, (b, args.prompt), generator=torch.Generator().manual_seed(b))
            label = f"batch {b} [{fmt} phase]"
            runs.measure(configs, ids, args.repeats, label)
            if phase == 0 and "batched_mm" in ALL_EXPERTS_FUNCTIONS:
                runs.measure({"transformers batched_mm": hf("batched_mm")}, ids, max(1, args.repeats // 3), label)
            best = max((runs.rows[f"{label} transformers {i}"]["generate_tok_s"], i) for i in hf_impls)
            r = runs.rows[f"{label} moe_engine {fmt}"]["generate_tok_s"]
            table.append({"batch": b, "format": fmt, "tok_s": r, "best_transformers": best[1],
                          "best_transformers_tok_s": best[0], "speedup": round(r / best[0], 2)})
            if phase == 0:
                floor[b] = round(runs.rows[f"{label} floor: experts cost nothing"]["generate_tok_s"] / best[0], 2)
        off.close()
        del m, off, configs
        gc.collect()
    return {"rows": runs.rows, "convert_s": convert_s, "moe_engine": described, "vs_best_transformers": table,
            "floor_vs_best_transformers": floor}


def h200_mode(args) -> dict:
    from accelerate import dispatch_model
    from transformers import CompileConfig

    from moe_engine.integrations.transformers import offload_experts

    dev = torch.device(args.device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    t0 = time.time()
    base = build_model(args.layers, args.vocab)
    print(f"model: {args.layers} layers, built in {time.time() - t0:.0f} s", flush=True)
    models, configs, notes = {}, {}, {}
    gpu_all = copy.deepcopy(base).to(dev)  # its own copy: moved to the GPU
    gpu_all.set_experts_implementation("grouped_mm")
    configs["transformers grouped_mm, experts on the GPU"] = lambda: (gpu_all, {})
    offl = shared_copy(base, experts_only=True)  # accelerate keeps the experts on the CPU, streams them
    main = 0 if dev.type == "cuda" else "cpu"
    dm = {"model.embed_tokens": main, "model.norm": main, "model.rotary_emb": main, "lm_head": main}
    for i in range(args.layers):
        p = f"model.layers.{i}"
        dm.update({f"{p}.self_attn": main, f"{p}.input_layernorm": main, f"{p}.post_attention_layernorm": main,
                   f"{p}.mlp.gate": main, f"{p}.mlp.experts": "cpu"})
    offl = dispatch_model(offl, device_map=dm, main_device=main)
    offl.set_experts_implementation("grouped_mm")
    configs["accelerate cpu offload of the experts"] = lambda: (offl, {})
    for strategy in args.strategies:
        t = time.time()
        m = shared_copy(base, experts_only=True)
        off = offload_experts(m, format="bf16", strategy=strategy, device=dev, threads=args.threads,
                              residency=args.residency if strategy == "hybrid" else None,
                              max_tokens=args.max_tokens or 64, progress=not args.quiet)
        m.to(dev)
        notes[strategy] = {"describe": off.runner.describe(), "convert_s": round(time.time() - t, 1)}
        models[strategy] = m
        print(f"moe_engine {strategy}: {off.runner.describe()}", flush=True)
        configs[f"moe_engine {strategy}, eager"] = lambda m=m: (m, {"cache_implementation": "static",
                                                                     "disable_compile": True})
        configs[f"moe_engine {strategy}, static cache + CUDA graphs"] = lambda m=m: (
            m, {"cache_implementation": "static", "compile_config": CompileConfig(backend="cudagraphs", mode=None)})
    runs = Runs(args, sync)
    for b in args.batch:
        ids = torch.randint(0, args.vocab, (b, args.prompt), generator=torch.Generator().manual_seed(b)).to(dev)
        slow = {k: v for k, v in configs.items() if k.startswith("accelerate")}
        fast = {k: v for k, v in configs.items() if k not in slow}
        runs.measure(fast, ids, args.repeats, f"batch {b}")
        saved = args.new_tokens
        args.new_tokens = min(args.new_tokens, args.offload_tokens)  # weights over PCIe every step: short runs
        runs.measure(slow, ids, max(1, args.repeats // 2), f"batch {b}")
        args.new_tokens = saved
    # the same tokens eagerly and under graphs (greedy, same prompt)
    same = {}
    ids = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(dev)
    for strategy, m in models.items():
        kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, cache_implementation="static")
        with torch.no_grad():
            a = m.generate(ids, disable_compile=True, **kw)
            g = m.generate(ids, compile_config=CompileConfig(backend="cudagraphs", mode=None), **kw)
        same[strategy] = bool(torch.equal(a, g))
    return {"rows": runs.rows, "moe_engine": notes, "graphs_equal_eager_tokens": same,
            "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("cpu", "h200"), default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--offload-tokens", type=int, default=8, help="h200: new tokens per accelerate-offload run")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8_block", "q4_0"])
    ap.add_argument("--strategies", nargs="+", default=["hybrid", "cpu"])
    ap.add_argument("--residency", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=None, help="CPU executor workers (default: the physical cores)")
    ap.add_argument("--max-tokens", type=int, default=None, help="the runner's decode batch bound (cpu mode)")
    ap.add_argument("--device", default="cuda", help="h200: where the model runs (cpu: a dry run of the script)")
    ap.add_argument("--quiet-cores", type=float, default=0.2,
                    help="cpu: before each timed run, wait until other processes use fewer cores than this (0: off)")
    ap.add_argument("--quiet-wait", type=float, default=300.0, help="cpu: the longest such wait per run, seconds")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    import transformers

    if args.mode == "cpu":
        QUIET.limit, QUIET.max_wait_s = args.quiet_cores, args.quiet_wait
    t0, load0 = time.time(), os.getloadavg()
    res = cpu_mode(args) if args.mode == "cpu" else h200_mode(args)
    res.update(mode=args.mode, args=vars(args), wall_s=round(time.time() - t0, 1), torch=torch.__version__,
               loadavg_start_end=[round(load0[0], 2), round(os.getloadavg()[0], 2)],
               quiet={"cores": QUIET.limit, "waited_s": round(QUIET.waited_s, 1), "runs_still_busy": QUIET.busy_runs},
               transformers=transformers.__version__, torch_threads=torch.get_num_threads(),
               cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
               cpu_model=next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                               if ln.startswith("model name")), None) if os.path.exists("/proc/cpuinfo") else None,
               shape={"H": 2048, "I": 768, "E": 128, "top_k": 8, "layers": args.layers, "vocab": args.vocab,
                      "heads": 32, "kv_heads": 4, "head_dim": 128})
    for key, row in res["rows"].items():
        print(f"{key:60s} {row['generate_tok_s']:8.2f} tok/s (decode {row['decode_tok_s']:.2f})")
    for t in res.get("vs_best_transformers", []):
        print(f"batch {t['batch']} moe_engine {t['format']}: {t['speedup']}x transformers {t['best_transformers']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
