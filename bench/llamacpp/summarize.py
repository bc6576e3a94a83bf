#!/usr/bin/env python3
"""Summarize a compare.sh folder: ours-<fmt>[-<mode>][-l3]-r<R>.json (python -m cpumoe_executor.bench) against
ggml-<fmt>[-l3]-r<R>.json (moe_ggml_bench), one row per (working set, format, our mode, batch, routing); -l3 is
the cache working set (`--working-set cache` on both sides), no suffix the DRAM one.

    python3 bench/llamacpp/summarize.py OUT        # prints the table, writes OUT/summary.md and OUT/summary.json

Per round each side reports the median step time of its repeats; a row gives the median over rounds of those
medians and their range (min-max over rounds), the ratio ggml/ours of the medians (> 1: ours faster) and the
range of the per-round ratios (each round's pair ran minutes apart at most), the GB/s of expert weights each
side read (unique experts a step touches x bytes per expert, over the step time), the experts a step touched
on each side (the routes are drawn by each side's own RNG under the same rule), and the read ceiling our bench
measured with the same threads (median over rounds). Where OUT/logs/quiet.csv is there (compare.sh's quiet
checks), each row gives the machine's busy % before its runs (median and max over both sides' runs), and where
OUT/logs/during.csv is, the % of the CPUs other processes kept busy during them (the kept attempt of each run;
max); the summary's meta gives both over every run. With both working sets, summary.md adds a table of the
ratios side by side.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

GGML_SCHEME = {"q4_k_m": "q4_K gate/up, q6_K down x q8_K", "q5_k_m": "q5_K gate/up, q6_K down x q8_K",
               "q4_0": "q4_0 x q8_0", "mxfp4": "mxfp4 x q8_0", "bf16": "bf16 x bf16", "q8_0": "q8_0 x q8_0",
               "q4_k": "q4_K x q8_K", "q5_k": "q5_K x q8_K", "q6_k": "q6_K x q8_K"}
# our mode with ggml's precision scheme
MATCHED = {"q4_k_m": "w4a8", "q5_k_m": "w4a8", "q4_0": "w4a8", "mxfp4": "w4a8", "bf16": "native", "q8_0": "w4a8",
           "q4_k": "w4a8", "q5_k": "w4a8", "q6_k": "w4a8"}


def med(v):
    return statistics.median(v) if v else float("nan")


WSETS = ("dram", "l3")  # compare.sh's WSET names: --working-set dram / cache on both sides


def busy_log(out: Path, name: str = "quiet.csv", col: int = 1) -> dict:
    """compare.sh's logs/quiet.csv (busy % before each run) or logs/during.csv (col 2: the % other processes kept
    busy during it): run label (ours-<tag>-r<R>, ggml-<tag>-r<R>) -> %, the last attempt's where a run was repeated."""
    p = out / "logs" / name
    if not p.exists():
        return {}
    lines = p.read_text().splitlines()[1:]
    return {f[0]: float(f[col]) for f in (ln.split(",") for ln in lines) if len(f) > col}


def load(out: Path):
    ours = defaultdict(dict)  # (fmt, tag, wset) -> round -> report entry
    ggml = defaultdict(dict)  # (fmt, wset) -> round -> format entry
    meta = {"ours_machine": None, "ggml_machine": None, "ggml": None, "threads": set(), "settings": None}
    for p in sorted(out.glob("ours-*-r*.json")):
        m = re.fullmatch(r"ours-(.+?)(?:-(w4a8|native))?(-l3)?-r(\d+)\.json", p.name)
        if not m:
            continue
        fmt, mode, wset, r = m.group(1), m.group(2) or "default", "l3" if m.group(3) else "dram", int(m.group(4))
        rep = json.loads(p.read_text())
        ours[(fmt, mode, wset)][r] = rep["formats"][fmt]
        meta["ours_machine"] = rep["machine"]
        meta["threads"].add(rep["threads"])
        meta["settings"] = {k: rep["settings"].get(k) for k in ("repeats", "steps", "batch", "working_set")}
    for p in sorted(out.glob("ggml-*-r*.json")):
        m = re.fullmatch(r"ggml-(.+?)(-l3)?-r(\d+)\.json", p.name)
        if not m:
            continue
        fmt, wset, r = m.group(1), "l3" if m.group(2) else "dram", int(m.group(3))
        rep = json.loads(p.read_text())
        ggml[(fmt, wset)][r] = rep["formats"][fmt]
        meta["ggml_machine"] = rep["machine"]
        meta["ggml"] = rep["ggml"]
        meta["threads"].add(rep["threads"])
    meta["threads"] = sorted(meta["threads"])
    return ours, ggml, meta


def rows(ours, ggml, busy=None, during=None):
    out = []
    busy, during = busy or {}, during or {}
    order = {f: i for i, f in enumerate(MATCHED)}
    for (fmt, tag, wset), by_round in sorted(ours.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1:])):
        g_rounds = ggml.get((fmt, wset), {})
        any_entry = next(iter(by_round.values()))
        isa = any_entry["isa"]
        mode_ran = any_entry.get("mode") or isa.partition("+")[2] or "native"
        suffix = "-l3" if wset == "l3" else ""
        labels = [f"ours-{fmt}{'' if tag == 'default' else '-' + tag}{suffix}-r{r}" for r in by_round]
        labels += [f"ggml-{fmt}{suffix}-r{r}" for r in g_rounds]
        b = [busy[x] for x in labels if x in busy]
        d = [during[x] for x in labels if x in during]
        keys = list(any_entry["results"])
        for key in keys:
            o_us, g_us, o_gb, g_gb, ratios, ceil, o_exp, g_exp = [], [], [], [], [], [], [], []
            same = []  # per round: both sides' route digests equal (the same experts in the same steps)
            for r, e in sorted(by_round.items()):
                res = e["results"].get(key)
                if not res:
                    continue
                o_us.append(res["step_us"]["median"])
                o_gb.append(res["gbps"]["median"])
                ceil.append(e["ceiling_gbps"])
                o_exp.append(res["bytes_per_step"] / e["bytes_per_expert"])
                g = g_rounds.get(r, {}).get("results", {}).get(key)
                if g:
                    ratios.append(g["step_us"]["median"] / res["step_us"]["median"])
                    if "routes_digest" in res and "routes_digest" in g:
                        same.append(res["routes_digest"] == g["routes_digest"])
            for _r, e in sorted(g_rounds.items()):
                g = e["results"].get(key)
                if g:
                    g_us.append(g["step_us"]["median"])
                    g_gb.append(g["gbps"]["median"])
                    g_exp.append(g["unique_experts_per_step"])
            routing, batch = key.split("/")
            gm = med(g_us)
            om = med(o_us)
            out.append({
                "working_set": wset, "format": fmt, "ours_mode": mode_ran, "ours_isa": isa,
                "ours_layout": any_entry.get("layout", fmt),
                "matched_precision": mode_ran == MATCHED.get(fmt), "ggml_scheme": GGML_SCHEME.get(fmt, "?"),
                "batch": int(batch), "routing": routing, "rounds_ours": len(o_us), "rounds_ggml": len(g_us),
                "ours_us": om, "ours_us_range": [min(o_us), max(o_us)] if o_us else None,
                "ggml_us": gm, "ggml_us_range": [min(g_us), max(g_us)] if g_us else None,
                "ratio_ggml_over_ours": gm / om if g_us and o_us else None,
                "ratio_range": [min(ratios), max(ratios)] if ratios else None,
                "ours_gbps": med(o_gb), "ggml_gbps": med(g_gb), "ceiling_gbps": med(ceil),
                "ours_experts_per_step": med(o_exp), "ggml_experts_per_step": med(g_exp),
                "step_mb": med(o_exp) * any_entry["bytes_per_expert"] / 1e6,
                "same_routes": all(same) if same else None,
                "busy_pct_median": med(b) if b else None, "busy_pct_max": max(b) if b else None,
                "others_pct_during_max": max(d) if d else None,
            })
    out.sort(key=lambda x: (WSETS.index(x["working_set"]),
                            list(MATCHED).index(x["format"]) if x["format"] in MATCHED else 9,
                            not x["matched_precision"], x["ours_mode"], x["routing"], x["batch"]))
    return out


def fmt_range(r, nd=0):
    return "-" if not r else f"{r[0]:.{nd}f}-{r[1]:.{nd}f}"


def table(rs) -> str:
    head = ("| wset | format | ours (layout, isa) | batch | routing | MB/step | ours us (range) | ggml us (range) "
            "| ggml/ours (per-round range) | ours GB/s | ggml GB/s | ceiling GB/s | experts/step ours, ggml "
            "| busy % before (max); others during, max |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for x in rs:
        r = x["ratio_ggml_over_ours"]
        ratio = "-" if r is None else f"**{r:.2f}x** ({fmt_range(x['ratio_range'], 2)})"
        isa = f"{x['ours_layout']}, {x['ours_isa']}" + ("" if x["matched_precision"] else " (not ggml's scheme)")
        busy = "-" if x.get("busy_pct_max") is None else f"{x['busy_pct_median']:.0f} ({x['busy_pct_max']:.0f})"
        if x.get("others_pct_during_max") is not None:
            busy += f"; {x['others_pct_during_max']:.0f}"
        lines.append(
            f"| {x['working_set']} | {x['format']} | {isa} | {x['batch']} | {x['routing']} | {x['step_mb']:.1f} "
            f"| {x['ours_us']:.0f} ({fmt_range(x['ours_us_range'])}) "
            f"| {x['ggml_us']:.0f} ({fmt_range(x['ggml_us_range'])}) "
            f"| {ratio} | {x['ours_gbps']:.1f} | {x['ggml_gbps']:.1f} | {x['ceiling_gbps']:.1f} "
            f"| {x['ours_experts_per_step']:.1f}, {x['ggml_experts_per_step']:.1f}{SAME[x.get('same_routes')]} "
            f"| {busy} |")
    return "\n".join(lines)


SAME = {True: " (same routes)", False: " (ROUTES DIFFER)", None: ""}


def side_by_side(rs) -> str:
    """ggml/ours per (format, our mode, batch, routing), the working sets side by side ('' where only one ran)."""
    cells, keys = {}, []
    for x in rs:
        k = (x["format"], x["ours_mode"], x["batch"], x["routing"])
        if k not in cells:
            keys.append(k)
        cells.setdefault(k, {})[x["working_set"]] = x
    sets = [w for w in WSETS if any(w in c for c in cells.values())]
    if len(sets) < 2:
        return ""
    head = ("| format | ours mode | batch | routing | "
            + " | ".join(f"{w}: ours us, ggml us, ggml/ours" for w in sets) + " |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for k in keys:
        row = []
        for w in sets:
            x = cells[k].get(w)
            r = x and x["ratio_ggml_over_ours"]
            row.append("-" if not r else f"{x['ours_us']:.0f}, {x['ggml_us']:.0f}, **{r:.2f}x**")
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    ours, ggml, meta = load(out)
    if not ours or not ggml:
        print(f"summarize: no ours-*.json or ggml-*.json in {out}", file=sys.stderr)
        return 1
    busy = busy_log(out)
    if busy:
        v = list(busy.values())
        meta["busy_pct"] = {"runs": len(v), "median": med(v), "max": max(v), "min": min(v),
                            "source": "logs/quiet.csv (busy % over 1 s before each run)"}
    during = busy_log(out, "during.csv", 2)
    if during:
        v = list(during.values())
        meta["others_pct_during"] = {"runs": len(v), "median": med(v), "max": max(v), "min": min(v),
                                     "source": "logs/during.csv (% of the CPUs processes other than the run kept "
                                               "busy during it; the kept attempt)"}
    rs = rows(ours, ggml, busy, during)
    om, gm, g = meta["ours_machine"] or {}, meta["ggml_machine"] or {}, meta["ggml"] or {}
    rounds = max(max(len(v) for v in ours.values()), max(len(v) for v in ggml.values()))
    hdr = [
        "# ours vs llama.cpp ggml CPU backend: MoE decode step",
        "",
        f"- machine: {gm.get('cpu') or om.get('cpu')}, {om.get('logical_cpus')} logical CPUs, LLC as the benches "
        f"sized by it {(om.get('llc_bytes') or 0) / 2**20:.0f} MiB (ggml "
        f"{(gm.get('llc_bytes') or 0) / 2**20:.0f}); threads {', '.join(map(str, meta['threads']))}",
        f"- ggml {g.get('version')} (llama.cpp {g.get('commit')}), built {g.get('build')}, OpenMP {g.get('openmp')}, "
        f"extra buffer types (repack) {g.get('extra_bufts')}; features: {gm.get('ggml_features')}",
        f"- ours: cpumoe-formats {om.get('cpumoe_formats')}, usable tiers {om.get('usable_tiers')}",
        f"- {rounds} interleaved rounds; per round and side {meta['settings'] and meta['settings'].get('repeats')} "
        f"repeats x {meta['settings'] and meta['settings'].get('steps')} steps, median step of the repeats; "
        "working set: dram = bank >= 4 x LLC, windows rotated per step; l3 = one window of top_k x max batch "
        "experts, the same route plan every step, loaded back by an untimed step after each evicting read "
        "(MB/step: the experts a step reads; above the LLC they come partly from DRAM)",
        "- ggml/ours > 1: ours faster. Ranges are min-max over rounds. GB/s: unique experts per step x bytes per "
        "expert / step time. ceiling: our bench's all-thread read loop, same threads.",
    ]
    if "busy_pct" in meta:
        b = meta["busy_pct"]
        hdr.append(f"- machine busy before each run (1 s, all CPUs): median {b['median']:.0f} %, max {b['max']:.0f} % "
                   f"over {b['runs']} runs")
    if "others_pct_during" in meta:
        b = meta["others_pct_during"]
        hdr.append(f"- CPUs other processes kept busy during each run: median {b['median']:.0f} %, "
                   f"max {b['max']:.0f} %")
    hdr.append("")
    text = "\n".join(hdr) + "\n" + table(rs) + "\n"
    if sbs := side_by_side(rs):
        text += "\nggml/ours by working set (median over rounds):\n\n" + sbs + "\n"
    print(text)
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps({"meta": meta, "rows": rs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
