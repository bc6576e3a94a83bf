"""`moe-engine profile`: a calibration run that records the routing counts of every MoE layer (on the device, in the
decode steps) and writes them as a routing profile for residency="static" (placement/counts.py's file).

Thread contract: a command-line tool."""
from __future__ import annotations

import json
import os


def default_out(path: str) -> str:
    from ..placement.profile import cache_dir

    name = os.path.basename(os.path.normpath(str(path))) or "model"
    return os.path.join(cache_dir(), f"routing-{name}.json")


def run_profile(a) -> int:
    import torch

    from ..placement.counts import save_routing_profile
    from .generate import _prompt_ids, load

    model, _ = load(a, count_routes=True)
    runner = model.moe_engine.runner
    try:
        ids, _ = _prompt_ids(a, model)
        with torch.no_grad():
            model.generate(ids.to(runner.device), max_new_tokens=a.max_new_tokens, do_sample=False)
        counts = runner.route_counts.total()
        out = save_routing_profile(a.out or default_out(a.path), counts, steps=a.max_new_tokens, format=runner.format)
    finally:
        model.moe_engine.close()
    res = {"out": out, "layers": int(counts.shape[0]), "E": int(counts.shape[1]), "routes": int(counts.sum())}
    print(json.dumps(res) if a.json else f"wrote {out}: {res['routes']} decode routes over {res['layers']} layers")
    return 0


def add_parser(sub, common) -> None:
    p = sub.add_parser("profile", help="record routing counts over a calibration run (for residency='static')")
    common(p)
    w = p.add_mutually_exclusive_group(required=True)
    w.add_argument("--prompt", help="text (needs the checkpoint's tokenizer)")
    w.add_argument("--ids", help="token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=256, help="decoded tokens to count (default %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU workers (default: one per physical core)")
    p.add_argument("--out", default=None, help="the profile's path (default: the user cache dir, "
                   "routing-<model>.json)")

