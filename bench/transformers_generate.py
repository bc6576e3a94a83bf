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
    """Qwen3-30B-A3B-shaped model with `layers` layers and random N(0, 0.02) weights, bf16, on the CPU."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.model.rotary_emb = Qwen3MoeRotaryEmbedding(cfg)  # to_empty left its buffers uninitialised
    return model


def timed_generate(model, ids, new_tokens: int, sync, **kw) -> float:
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
        for name, prep in configs.items():  # warm-up (and compile) once each, untimed
            model, kw = prep()
            timed_generate(model, ids, 2, self.sync, **kw)
        for rep in range(repeats):
            for name, prep in configs.items():
                model, kw = prep()
                t1 = timed_generate(model, ids, 1, self.sync, **kw)
                tn = timed_generate(model, ids, self.args.new_tokens, self.sync, **kw)
                row = self.rows.setdefault(f"{label} {name}", {"generate_s": [], "first_token_s": []})
                row["generate_s"].append(tn)
                row["first_token_s"].append(t1)
                print(f"  rep {rep} {label} {name}: {self.args.new_tokens * ids.shape[0] / tn:7.2f} tok/s", flush=True)
        for key, row in self.rows.items():
            if not key.startswith(label + " "):
                continue
            g, f = statistics.median(row["generate_s"]), statistics.median(row["first_token_s"])
            n, b = self.args.new_tokens, ids.shape[0]
            row.update(batch=b, new_tokens=n, generate_tok_s=round(n * b / g, 3),
                       decode_tok_s=round((n - 1) * b / max(g - f, 1e-9), 3))


def _floor(self, hidden_states, top_k_index, top_k_weights):
    """An experts 'implementation' that costs nothing (returns its input): the tokens/s no experts implementation can
    beat, the bound on any speedup over transformers' own (the rest of each layer is transformers')."""
    return hidden_states


def cpu_mode(args) -> dict:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    from moe_engine.integrations.transformers import offload_experts

    t0 = time.time()
    base = build_model(args.layers, args.vocab)
    print(f"model: {args.layers} layers, built in {time.time() - t0:.0f} s", flush=True)
    hf_impls = [i for i in ("grouped_mm", "batched_mm", "eager") if i == "eager" or i in ALL_EXPERTS_FUNCTIONS]
    ours, convert_s = {}, {}
    for fmt in args.formats:
        t = time.time()
        m = copy.deepcopy(base)
        off = offload_experts(m, format=fmt, strategy="cpu", threads=args.threads, max_tokens=args.max_tokens,
                              progress=not args.quiet)
        convert_s[fmt] = round(time.time() - t, 1)
        ours[fmt] = (m, off)
        print(f"moe_engine {fmt}: {off.runner.describe()} ({convert_s[fmt]} s)", flush=True)
        gc.collect()

    def hf(impl):
        def prep():
            base.set_experts_implementation(impl)
            return base, {}
        return prep

    ExpertsInterface.register("bench_floor", _floor)
    configs = {f"transformers {i}": hf(i) for i in hf_impls}
    configs.update({f"moe_engine {f}": (lambda f=f: (ours[f][0], {})) for f in args.formats})
    configs["floor: experts cost nothing"] = hf("bench_floor")
    runs = Runs(args, lambda: None)
    for b in args.batch:
        ids = torch.randint(0, args.vocab, (b, args.prompt), generator=torch.Generator().manual_seed(b))
        runs.measure(configs, ids, args.repeats, f"batch {b}")
    res = {"rows": runs.rows, "convert_s": convert_s,
           "moe_engine": {f: o.runner.describe() for f, (_, o) in ours.items()}}
    table = []
    for b in args.batch:
        hf_best = max((runs.rows[f"batch {b} transformers {i}"]["generate_tok_s"], i) for i in hf_impls)
        for f in args.formats:
            r = runs.rows[f"batch {b} moe_engine {f}"]
            table.append({"batch": b, "format": f, "tok_s": r["generate_tok_s"], "best_transformers": hf_best[1],
                          "best_transformers_tok_s": hf_best[0], "speedup": round(r["generate_tok_s"] / hf_best[0], 2)})
    res["vs_best_transformers"] = table
    res["floor_vs_best_transformers"] = {
        b: round(runs.rows[f"batch {b} floor: experts cost nothing"]["generate_tok_s"]
                 / max(runs.rows[f"batch {b} transformers {i}"]["generate_tok_s"] for i in hf_impls), 2)
        for b in args.batch}
    return res


def h200_mode(args) -> dict:
    from accelerate import dispatch_model
    from transformers import CompileConfig

    from moe_engine.integrations.transformers import offload_experts

    dev = torch.device("cuda")

    def sync():
        torch.cuda.synchronize()

    t0 = time.time()
    base = build_model(args.layers, args.vocab)
    print(f"model: {args.layers} layers, built in {time.time() - t0:.0f} s", flush=True)
    models, configs, notes = {}, {}, {}
    gpu_all = copy.deepcopy(base).to(dev)
    gpu_all.set_experts_implementation("grouped_mm")
    configs["transformers grouped_mm, experts on the GPU"] = lambda: (gpu_all, {})
    offl = copy.deepcopy(base)
    dm = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}
    for i in range(args.layers):
        p = f"model.layers.{i}"
        dm.update({f"{p}.self_attn": 0, f"{p}.input_layernorm": 0, f"{p}.post_attention_layernorm": 0,
                   f"{p}.mlp.gate": 0, f"{p}.mlp.experts": "cpu"})
    offl = dispatch_model(offl, device_map=dm, main_device=0)
    offl.set_experts_implementation("grouped_mm")
    configs["accelerate cpu offload of the experts"] = lambda: (offl, {})
    for strategy in args.strategies:
        t = time.time()
        m = copy.deepcopy(base)
        off = offload_experts(m, format="bf16", strategy=strategy, device=dev, threads=args.threads,
                              residency=args.residency if strategy == "hybrid" else None, progress=not args.quiet)
        m.to(dev)
        notes[strategy] = {"describe": off.runner.describe(), "convert_s": round(time.time() - t, 1)}
        models[strategy] = m
        print(f"moe_engine {strategy}: {off.runner.describe()}", flush=True)
        configs[f"moe_engine {strategy}, eager"] = lambda m=m: (m, {"cache_implementation": "static",
                                                                     "disable_compile": True})
        configs[f"moe_engine {strategy}, static cache + CUDA graphs"] = lambda m=m: (
            m, {"cache_implementation": "static", "compile_config": CompileConfig(backend="cudagraphs")})
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
            g = m.generate(ids, compile_config=CompileConfig(backend="cudagraphs"), **kw)
        same[strategy] = bool(torch.equal(a, g))
    return {"rows": runs.rows, "moe_engine": notes, "graphs_equal_eager_tokens": same,
            "gpu": torch.cuda.get_device_name(0)}


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
    ap.add_argument("--json", default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    import transformers

    t0 = time.time()
    res = cpu_mode(args) if args.mode == "cpu" else h200_mode(args)
    res.update(mode=args.mode, args=vars(args), wall_s=round(time.time() - t0, 1), torch=torch.__version__,
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
