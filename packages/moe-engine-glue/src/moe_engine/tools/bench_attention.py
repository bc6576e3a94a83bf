"""Decode attention, one layer at Qwen3-30B-A3B's heads (32 query heads, 4 kv heads of 128), one query token: ours
(moe_engine.attention on a CpuMoeExecutor's threads, as from_pretrained's gemv path runs it) against transformers'
sdpa (torch's CPU scaled_dot_product_attention, on torch's threads) on the same tensors, interleaved, median and
spread over repeats. Cases: a static
cache of L positions with `filled` of them written (generate()'s static cache is its maximum length; bench's is the
test's). Also the read floor: the filled positions' keys and values at the read ceiling (the executor's threads
reading a 128 MB buffer, measured in the same run; --ceiling GB/s overrides it).

    python -m moe_engine.tools.bench_attention [-t 2] [--cases 34:34,512:512,4096:40,4096:4096] [--json F]

Thread contract: a command-line tool."""
from __future__ import annotations

import argparse
import json
import statistics
import time


def _time(fn, steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t) / steps


def run_case(L: int, filled: int, repeats: int, steps: int, executor=None, seed: int = 0) -> dict:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from .. import attention

    g = torch.Generator().manual_seed(seed)
    Hq, Hkv, D = 32, 4, 128
    q = torch.randn(1, 1, Hq, D, generator=g).to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, Hkv, L, D, generator=g).to(torch.bfloat16)
    v = torch.randn(1, Hkv, L, D, generator=g).to(torch.bfloat16)
    mask = torch.zeros(1, 1, 1, L, dtype=torch.bool)
    mask[..., :filled] = True
    mod = torch.nn.Module()
    mod.num_key_value_groups, mod.is_causal = Hq // Hkv, True
    mod._moe_engine_executor = executor
    sides = {"ours": lambda: attention.decode_attention(mod, q, k, v, mask, scaling=D ** -0.5),
             "sdpa": lambda: sdpa_attention_forward(mod, q, k, v, mask, scaling=D ** -0.5)}
    a, b = sides["ours"]()[0].float(), sides["sdpa"]()[0].float()
    rel = float((a - b).abs().max() / b.abs().max())
    runs = {s: [] for s in sides}
    with torch.no_grad():
        for f in sides.values():
            _time(f, max(2, steps // 10))
        for r in range(repeats):
            for s in (("ours", "sdpa") if r % 2 == 0 else ("sdpa", "ours")):
                runs[s].append(1e6 * _time(sides[s], steps))
    med = {s: statistics.median(x) for s, x in runs.items()}
    return {"L": L, "filled": filled, "us": med, "us_runs": runs, "sdpa_over_ours": med["sdpa"] / med["ours"],
            "kv_bytes": 2 * Hkv * filled * D * 2, "max_rel_diff": rel}


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python -m moe_engine.tools.bench_attention",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads: torch's (sdpa) and the executor's (ours)")
    ap.add_argument("--cases", default="34:34,512:512,4096:40,4096:4096", help="L:filled,... (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=50, help="calls per timed repeat")
    ap.add_argument("--ceiling", type=float, default=None, help="read ceiling in GB/s (default: measured here)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import numpy as np

    import cpumoe_executor as ce
    import cpumoe_formats as cf

    # an executor of two tiny bf16 experts: only its threads and its attention are used
    ex = ce.CpuMoeExecutor("bf16", [cf.get_format("bf16").random_banks(2, 64, 32, np.random.default_rng(0))],
                           top_k=2, threads=a.threads, team="openmp")
    if a.ceiling is None:  # 128 MB: 4x the dev VM's 32 MB L3, read by the executor's threads
        buf = np.ones(128 << 20, np.uint8)
        a.ceiling = statistics.median(ex.read_bandwidth(buf) for _ in range(5))
    rows = []
    print(f"read ceiling {a.ceiling:.1f} GB/s; decode attention, 32 q / 4 kv heads of 128, one token; ours: "
          f"{ex.attention_isa} on the executor's "
          f"{a.threads} threads, sdpa on torch's {a.threads}")
    print("| L | filled | ours us | sdpa us | sdpa / ours | read floor us |")
    print("|---:|---:|---:|---:|---:|---:|")
    for c in a.cases.split(","):
        L, filled = (int(x) for x in c.split(":"))
        r = run_case(L, filled, a.repeats, a.steps, ex)
        floor = r["kv_bytes"] / (a.ceiling * 1e3) if a.ceiling else None
        r["read_floor_us"] = floor
        rows.append(r)
        print(f"| {L} | {filled} | {r['us']['ours']:.1f} | {r['us']['sdpa']:.1f} | {r['sdpa_over_ours']:.1f}x | "
              f"{'-' if floor is None else f'{floor:.1f}'} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": a.threads, "tier": ex.attention_isa, "torch": torch.__version__,
                       "read_ceiling_gbps": a.ceiling, "cases": rows}, f, indent=1)
    ex.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
