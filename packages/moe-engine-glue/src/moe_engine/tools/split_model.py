"""The miss split at 0% residency as the step-time model (placement/choose.py) sees it from a bandwidth profile, per
format, batch and split rule: the best q and its speed-up over the CPU alone, with the profile's lone rates (what
split="auto" uses) and with its both-at-once rates (the CPU beside the zero-copy reads). No GPU needed.
With --grid, auto's grid files (bench_placement auto) replayed offline: in each cell, the q the model picks from
the cell's hit rate and live CPU rate with the split's rates lone (as choose() does) or at once (the CPU's live
rate scaled by the profile's at-once / lone ratio), and how that q ran in the cell where it was timed.

    python -m moe_engine.tools.split_model --profile docs/results/profile_h100.json [--grid F ...] [--json F]
"""
from __future__ import annotations

import argparse
import json
import sys

from ..placement import profile as prof
from ..placement.choose import SPLIT_QS, choose, step_us, touched
from ..placement.split import RULES
from .shapes import preset


def rows(p, formats, batches, s) -> list[dict]:
    import cpumoe_formats as cf

    out = []
    for fmt in formats:
        b = cf.get_format(fmt).bytes_per_expert(s.H, s.I)
        kw = dict(b_hbm=p.hbm, c_cpu=p.cpu_fixed_us, c_gpu=p.gpu_fixed_us)
        for T in batches:
            n = max(1, round(touched(s.E, s.top_k, T)))
            alone = step_us(n, 1.0, 0.0, b, b_cpu=p.executor[fmt], b_zc=p.zero_copy[fmt], **kw)
            for rule in RULES:
                row = {"format": fmt, "batch": T, "rule": rule, "cpu_alone_us": alone}
                for name, cpu, zc in (("lone", p.executor[fmt], p.zero_copy[fmt]),
                                      ("at_once", p.both[fmt]["cpu"], p.both[fmt]["zero_copy"])):
                    ts = {q: step_us(n, 1.0, q, b, b_cpu=cpu, b_zc=zc, rule=rule, **kw) for q in SPLIT_QS}
                    q = min(ts, key=ts.get)
                    row[name] = {"q": q, "us": ts[q], "speedup": alone / ts[q]}
                out.append(row)
    return out


def replay_grid(p, files) -> list[dict]:
    """Each grid cell: choose()'s pick with either split_rates, from the cell's hit rate and live CPU rate, and how
    that q ran in the cell over its best (None where the q was not timed)."""
    import cpumoe_formats as cf

    out = []
    for path in files:
        with open(path) as f:
            g = json.load(f)
        s = preset(g.get("shape", "qwen3-30b-a3b"))
        for r in g["rows"]:
            if r["hit_rate"] >= 1.0:
                continue  # no misses to place
            fmt = r["format"]
            us = {float(k): v for k, v in r["us"].items()}
            row = {"format": fmt, "batch": r["batch"], "residency": r["residency"], "best_q": r["best_q"]}
            for rates in ("lone", "at_once"):
                q = choose(p, fmt, bytes_per_expert=cf.get_format(fmt).bytes_per_expert(s.H, s.I), E=s.E,
                           top_k=s.top_k, batch=r["batch"], miss_rate=1.0 - r["hit_rate"], residency=r["residency"],
                           modes=("hybrid", "split", "gpu_misses"), cpu_GBps=r["cpu_GBps"].get("0.0"),
                           rule="expert", split_rates=rates).q
                row[rates] = {"q": q, "over_best": us[q] / min(us.values()) - 1 if q in us else None}
            out.append(row)
    return out


def _rounded(v):
    """Floats to 3 decimals (us and ratios: the model's own precision is far coarser)."""
    if isinstance(v, float):
        return round(v, 3)
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_engine.tools.split_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="a bandwidth profile (moe-engine bench --profile)")
    ap.add_argument("--formats", default="bf16,fp8_block")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--grid", nargs="*", default=[], help="auto's grid files (bench_placement auto --json) to replay")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    p = prof.load(a.profile)
    formats = a.formats.split(",")
    missing = [f for f in formats if f not in p.executor or f not in p.zero_copy or f not in p.both]
    if missing:
        raise SystemExit(f"split_model: the profile {a.profile} lacks executor, zero-copy or both-at-once figures for "
                         f"{missing}; rerun `moe-engine bench --profile --formats {','.join(formats)}` on a GPU host")
    out = {"profile": a.profile, "gpu": p.gpu, "shape": a.preset,
           "rows": rows(p, formats, [int(x) for x in a.batch.split(",")], preset(a.preset))}
    for r in out["rows"]:
        lone, both = r["lone"], r["at_once"]
        print(f"{r['format']:>9} batch {r['batch']} by {r['rule']:>6}: CPU alone {r['cpu_alone_us']:.0f} us; lone "
              f"rates q {lone['q']} {lone['speedup']:.2f}x; at-once rates q {both['q']} {both['speedup']:.2f}x")
    if a.grid:
        out["grid"] = replay_grid(p, a.grid)
        for r in out["grid"]:
            say = {k: f"q {r[k]['q']}" + (f" {100 * r[k]['over_best']:+.1f}%" if r[k]["over_best"] is not None
                                          else " (not timed)") for k in ("lone", "at_once")}
            print(f"grid {r['format']:>9} batch {r['batch']} {r['residency']:.0%}: best q {r['best_q']}; lone rates "
                  f"{say['lone']}, at-once rates {say['at_once']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(_rounded(out), f, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
