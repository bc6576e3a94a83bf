"""Single-thread bench of the format kernels: effective GB/s of weights read.

    python -m cpumoe_formats.bench [--formats bf16,nvfp4] [--tiers all|auto|avx2,...]
                                   [--json FILE] [--markdown FILE] [--plot PNG] [--quick]

Each format runs a decode step (T=1, top_k routes) of its model preset through
every kernel it has (mode x ISA tier) that this CPU can run. Expert ids rotate
through disjoint windows of a bank larger than the working set (default
max(4 x LLC, 256 MiB)), so every step reads top_k experts that are not in cache.
GB/s = top_k x bytes_per_expert x steps / time, per repeat; the median and the
spread over repeats are reported next to the single-thread read bandwidth of a
buffer of the same size, measured in the same run before the first format and
after each one. Machines are shared and noisy: compare the ratio, not GB/s.
Progress goes to stderr; the table to stdout. See docs/bench-formats.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import _native
from ._arrays import aligned_empty
from .formats import FORMATS, get_format
from .kernels import TIERS, Kernel, usable_tiers
from .machine import llc_bytes, machine_info, stats
from .numerics import BF16

MiB = 1 << 20


@dataclass(frozen=True)
class Preset:
    model: str
    H: int
    I: int  # noqa: E741 - the model's name for it
    top_k: int
    activation: str
    alpha: float | None = None
    limit: float | None = None


# One decode shape per format: the model that ships in it (spec §7).
PRESETS = {
    "bf16": Preset("Qwen3-30B-A3B", 2048, 768, 8, "silu"),
    "fp8_block": Preset("Qwen3.6-35B-A3B-FP8", 2048, 512, 8, "silu"),
    "nvfp4": Preset("Qwen3.6-35B-A3B-NVFP4", 2048, 512, 8, "silu"),
    "mxfp4": Preset("gpt-oss-120b", 2880, 2880, 4, "swigluoai", 1.702, 7.0),
    "mxfp4_panel": Preset("gpt-oss-120b", 2880, 2880, 4, "swigluoai", 1.702, 7.0),  # mxfp4 repacked for CPUs
    "mxfp4_x16": Preset("gpt-oss-120b", 2880, 2880, 4, "swigluoai", 1.702, 7.0),  # mxfp4 rows interleaved (w4a8)
    "ds_fp4": Preset("DeepSeek-V4-Flash", 4096, 2048, 6, "swiglu_clamp", 1.0, 10.0),
    "q4_0": Preset("gemma-4-26B-A4B", 2816, 704, 8, "gelu_tanh"),
    "q4_0_x16": Preset("gemma-4-26B-A4B", 2816, 704, 8, "gelu_tanh"),  # q4_0 with rows interleaved for CPUs
    "bf16_x16": Preset("Qwen3-30B-A3B", 2048, 768, 8, "silu"),  # bf16 with rows interleaved for CPUs
    "fp8_block_x16": Preset("Qwen3.6-35B-A3B-FP8", 2048, 512, 8, "silu"),  # fp8_block with rows interleaved for CPUs
    "nvfp4_x16": Preset("Qwen3.6-35B-A3B-NVFP4", 2048, 512, 8, "silu"),  # nvfp4 with rows interleaved for CPUs
    "ds_fp4_x16": Preset("DeepSeek-V4-Flash", 4096, 2048, 6, "swiglu_clamp", 1.0, 10.0),  # ds_fp4 rows interleaved
    "q8_0": Preset("Qwen3-30B-A3B", 2048, 768, 8, "silu"),  # GGUF Q8_0 files
    "q4_k": Preset("Qwen3-30B-A3B", 2048, 768, 8, "silu"),  # GGUF Q4_K_M files: gate/up, most down
    "q6_k": Preset("Qwen3-30B-A3B", 2048, 768, 8, "silu"),  # GGUF Q4_K_M files: some layers' down; Q6_K files
    "q5_k": Preset("Qwen3-30B-A3B", 2048, 768, 8, "silu"),  # GGUF Q5_K_M files: gate/up, most down
    "q4_k_x16": Preset("Qwen3-30B-A3B", 2048, 768, 8, "silu"),  # q4_k with rows interleaved for CPUs
    "q5_k_x16": Preset("Qwen3-30B-A3B", 2048, 768, 8, "silu"),  # q5_k with rows interleaved for CPUs
    "q6_k_x16": Preset("Qwen3-30B-A3B", 2048, 768, 8, "silu"),  # q6_k with rows interleaved for CPUs
    "q8_0_x16": Preset("Qwen3-30B-A3B", 2048, 768, 8, "silu"),  # q8_0 with rows interleaved for CPUs
}


class Skip(Exception):
    """A format (or kernel) that cannot be benched here; the message says why."""


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---- ceiling -------------------------------------------------------------------------------
class Ceiling:
    """Single-thread read bandwidth of a buffer the size of the working set."""

    def __init__(self, nbytes: int):
        self.buf = aligned_empty((nbytes,), np.uint8, 4096)
        self.buf[...] = 1  # first touch: page faults are not timed
        self.checkpoints: list[list[float]] = []

    def sample(self, n: int, warm: bool = True) -> list[float]:
        ptr, size = self.buf.ctypes.data, self.buf.nbytes
        if warm:
            _native.read_bandwidth(ptr, size, 1)  # warm-up pass
        got = [_native.read_bandwidth(ptr, size, 1) for _ in range(n)]
        self.checkpoints.append(got)
        return got


# ---- kernels and banks -----------------------------------------------------------------------
def kernel_plan(spec, tiers: str, usable: list[str]) -> list[tuple[str, str | None]]:
    """(mode, isa cap) pairs to try; isa None = the default tier (CPUMOE_ISA or the best)."""
    modes = [spec.default_mode] + [m for m in spec.modes if m != spec.default_mode]
    if tiers == "auto":
        return [(m, None) for m in modes]
    wanted = None if tiers == "all" else [t.strip() for t in tiers.split(",") if t.strip()]
    if wanted:
        bad = [t for t in wanted if t not in TIERS]
        if bad:
            raise SystemExit(f"--tiers: {bad} are not tiers; expected all, auto or a comma list of {list(TIERS)}")
    plan = []
    for m in modes:
        own = spec.kernel_tiers.get(m)
        if own is None:  # a mode without a tier list: its default kernel only
            plan.append((m, None))
            continue
        for t in (wanted or own):
            if t in usable and (wanted or t in own):
                plan.append((m, t))
    if tiers == "all":
        plan.append((spec.default_mode, None))  # the default kernel, even under a CPUMOE_ISA cap
    return plan


def make_kernels(spec, preset: Preset, E: int, plan) -> tuple[dict, dict, str | None]:
    """name -> (mode, isa, Kernel) for the plan (deduplicated by kernel name), failures, default name."""
    kernels, failed = {}, {}
    act = {"activation": preset.activation, "alpha": preset.alpha, "limit": preset.limit}
    for mode, isa in plan:
        try:
            k = Kernel(spec, E, preset.H, preset.I, mode=mode, isa=isa, **act)
        except (ValueError, TypeError, NotImplementedError) as e:
            failed[f"{mode}@{isa or 'default'}"] = str(e)
            continue
        kernels.setdefault(k.name, (mode, isa, k))
    try:
        default = Kernel(spec, E, preset.H, preset.I, **act).name
    except (ValueError, TypeError, NotImplementedError):
        default = None
    return kernels, failed, default


def build_banks(spec, E: int, H: int, I: int, rng, label: str) -> dict:  # noqa: E741
    """Random banks for E experts, built in chunks (progress on stderr) into 64-byte-aligned arrays."""
    bpe = spec.bytes_per_expert(H, I)
    chunk = max(1, min(E, (64 * MiB) // max(bpe, 1)))
    log(f"{label}: building {E} experts ({E * bpe / 1e9:.2f} GB)...")
    t0 = last = time.perf_counter()
    banks = None
    for e0 in range(0, E, chunk):
        n = min(chunk, E - e0)
        part = spec.random_banks(n, H, I, rng)
        if banks is None:
            banks = {k: aligned_empty((E,) + np.shape(v)[1:], np.asarray(v).dtype, 64) for k, v in part.items()}
        for k, v in part.items():
            banks[k][e0:e0 + n] = v
        now = time.perf_counter()
        if now - last > 2.0 and e0 + n < E:
            log(f"{label}: built {e0 + n}/{E} experts ({now - t0:.1f} s)")
            last = now
    log(f"{label}: banks built in {time.perf_counter() - t0:.1f} s")
    return banks


# ---- one format ------------------------------------------------------------------------------
def bench_format(name: str, preset: Preset, opts, rng, label: str, ceiling: Ceiling | None = None) -> dict:
    """Time every planned kernel of one format; raises Skip with the reason if none can run."""
    spec = get_format(name)
    bpe = spec.bytes_per_expert(preset.H, preset.I)  # > 0: a format has gate_up and down banks (schema.py)
    k = preset.top_k
    E = (math.ceil(opts.working_set / bpe) + k - 1) // k * k + k  # windows of top_k experts, > working set
    kernels, failed, default = make_kernels(spec, preset, E, kernel_plan(spec, opts.tiers, usable_tiers()))
    if not kernels:
        raise Skip("no kernel could be created: " + "; ".join(f"{m}: {r}" for m, r in failed.items()))
    try:
        t0 = time.perf_counter()
        banks = build_banks(spec, E, preset.H, preset.I, rng, label)
        build_s = time.perf_counter() - t0
    except NotImplementedError as e:
        raise Skip(f"format {name!r} cannot build random banks yet ({e or 'random_banks not implemented'})") from e
    try:
        steps = {n: kk.bind(banks) for n, (_, _, kk) in kernels.items()}  # validates the banks once per kernel
    except (ValueError, TypeError) as e:
        raise Skip(f"format {name!r}: its random banks fail validation: {e}") from e

    nw = E // k
    ids = np.arange(nw * k, dtype=np.int32).reshape(nw, 1, k)
    w = np.full((1, k), 1.0 / k, np.float32)
    x = (rng.standard_normal((1, preset.H), np.float32)).astype(BF16)
    out = aligned_empty((1, preset.H), BF16)
    step_bytes = k * bpe
    c = 0

    def run(step, n):
        nonlocal c
        t = time.perf_counter()
        for _ in range(n):
            step(x, w, ids[c % nw], out)
            c += 1
        return time.perf_counter() - t

    names = list(kernels)
    log(f"{label}: timing {len(names)} kernel(s) {', '.join(names)}: {opts.warmup} warm-up + "
        f"{opts.repeats} x {opts.steps} steps of {step_bytes / 1e6:.1f} MB each")
    for n in list(names):  # at least one untimed step each: a kernel that fails is reported, not timed
        try:
            run(steps[n], max(1, opts.warmup))
        except (ValueError, RuntimeError) as e:
            failed[n] = f"step failed: {e}"
            log(f"{label}: {n}: step failed: {e}")
            names.remove(n)
            del kernels[n]
    if not names:
        raise Skip("every kernel failed its first step: " + "; ".join(f"{m}: {r}" for m, r in failed.items()))
    samples = {n: [] for n in names}
    during = []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(opts.repeats):  # kernels interleaved per repeat: noise hits all of them alike
            if ceiling is not None:  # and one ceiling pass per repeat, between the kernels' runs
                during += ceiling.sample(1, warm=False)
            for n in names:
                samples[n].append(step_bytes * opts.steps / run(steps[n], opts.steps) / 1e9)
            cs = f"ceiling {during[-1]:.2f}, " if during else ""
            log(f"{label}: repeat {r + 1}/{opts.repeats}: {cs}"
                + ", ".join(f"{n} {samples[n][-1]:.2f}" for n in names) + " GB/s")
    finally:
        if gc_was:
            gc.enable()
    del steps, banks
    gc.collect()
    results = {n: {"mode": kernels[n][0], "isa_cap": kernels[n][1] or "default", "gbps": stats(samples[n])}
               for n in names}
    return {"model": preset.model, "bytes_per_expert": bpe, "working_set_bytes": E * bpe,
            "shape": {"H": preset.H, "I": preset.I, "E": E, "top_k": k, "activation": preset.activation,
                      "alpha": preset.alpha, "limit": preset.limit},
            "default_kernel": default, "results": results, "failed": failed, "build_seconds": round(build_s, 2),
            "ceiling_during": during}


def finish_format(entry: dict, ceiling_samples: list[float]) -> dict:
    """Fill in ceiling, ratios and the fastest kernel (`tier`, `gbps`) of a measured format."""
    ceil = stats(ceiling_samples + entry.pop("ceiling_during", []))
    cg = ceil["median"]
    for r in entry["results"].values():
        r["ratio"] = r["gbps"]["median"] / cg
    best = max(entry["results"], key=lambda n: entry["results"][n]["gbps"]["median"])
    b = entry["results"][best]
    head = {"gbps": b["gbps"]["median"], "ceiling_gbps": cg, "tier": best, "ratio": b["ratio"], "mode": b["mode"]}
    d = entry["results"].get(entry.get("default_kernel"))
    if d:
        head.update(default_gbps=d["gbps"]["median"], default_ratio=d["ratio"])
    return {**head, "ceiling": ceil, **entry}


# ---- driver ----------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cpumoe_formats.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="all", help="comma list of formats (default: all)")
    p.add_argument("--tiers", default="all",
                   help="all: every (mode, tier) the format has a kernel for and this CPU runs; auto: the default "
                        "kernel of each mode; or a comma list of tiers (default: all)")
    p.add_argument("--repeats", type=int, help="timed repeats per kernel (default 5; --quick 2)")
    p.add_argument("--steps", type=int, help="decode steps per repeat (default 20; --quick 3)")
    p.add_argument("--warmup", type=int, help="untimed steps per kernel first, at least 1 (default 3; --quick 1)")
    p.add_argument("--working-set-mb", type=float,
                   help="MiB of experts the routes rotate through (default max(4 x LLC, 256); --quick 16)")
    p.add_argument("--ceiling-samples", type=int, help="read-bandwidth passes per checkpoint (default 5; --quick 2)")
    p.add_argument("--quick", action="store_true", help="tiny working set and few steps (CI smoke test; the numbers "
                   "measure cache, not DRAM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--markdown", metavar="FILE", help="write the table as markdown (replaces the block between "
                   "the bench-table markers when FILE has them)")
    p.add_argument("--plot", metavar="PNG", help="bar chart of GB/s against the ceiling (needs matplotlib)")
    a = p.parse_args(argv)
    q = a.quick
    a.repeats = a.repeats or (2 if q else 5)
    a.steps = a.steps or (3 if q else 20)
    a.warmup = (1 if q else 3) if a.warmup is None else a.warmup
    a.ceiling_samples = a.ceiling_samples or (2 if q else 5)
    if min(a.repeats, a.steps, a.ceiling_samples) < 1 or a.warmup < 0:
        p.error("--repeats, --steps and --ceiling-samples must be >= 1, --warmup >= 0")
    a.llc = llc_bytes()
    if a.working_set_mb is None:
        a.working_set = 16 * MiB if q else max(4 * (a.llc or 32 * MiB), 256 * MiB)
    else:
        a.working_set = int(a.working_set_mb * MiB)
    if a.working_set <= 0:
        p.error("--working-set-mb must be > 0")
    if a.formats == "all":
        a.format_list = list(FORMATS)
    else:
        try:
            a.format_list = [get_format(f.strip()).name for f in a.formats.split(",") if f.strip()]
        except ValueError as e:
            p.error(str(e))
    return a


def run(opts) -> dict:
    llc = opts.llc
    if not opts.quick and opts.working_set < 4 * (llc or 32 * MiB):
        log(f"warning: working set {opts.working_set / MiB:.0f} MiB is under 4 x LLC "
            f"({4 * (llc or 32 * MiB) / MiB:.0f} MiB): the numbers include cache hits")
    settings = {"formats": opts.format_list, "tiers": opts.tiers, "repeats": opts.repeats, "steps": opts.steps,
                "warmup": opts.warmup, "working_set_bytes": opts.working_set,
                "ceiling_samples": opts.ceiling_samples, "quick": opts.quick, "seed": opts.seed, "tokens": 1}
    report = {"machine": machine_info(llc), "settings": settings, "formats": {}, "skipped": {}}
    log(f"{report['machine']['cpu']}, LLC {llc / MiB if llc else '?'} MiB, working set "
        f"{opts.working_set / MiB:.0f} MiB, tiers usable: {', '.join(usable_tiers())}; avx512vnni GGUF x16 "
        f"prefetch {report['machine']['x16_prefetch']['prefetch']} ({report['machine']['x16_prefetch']['why']})")
    ceiling = Ceiling(opts.working_set)
    log(f"ceiling: single-thread read of {opts.working_set / MiB:.0f} MiB...")
    before = ceiling.sample(opts.ceiling_samples)
    rng = np.random.default_rng(opts.seed)
    for i, name in enumerate(opts.format_list):
        label = f"{name} ({i + 1}/{len(opts.format_list)})"
        preset = PRESETS.get(name)
        try:
            if preset is None:
                raise Skip(f"no model preset for format {name!r} in cpumoe_formats.bench.PRESETS")
            entry = bench_format(name, preset, opts, rng, label, ceiling)
        except Skip as e:
            log(f"{label}: skipped: {e}")
            report["skipped"][name] = str(e)
            continue
        after = ceiling.sample(opts.ceiling_samples)
        report["formats"][name] = finish_format(entry, before + after)
        f = report["formats"][name]
        log(f"{label}: fastest {f['tier']} {f['gbps']:.2f} GB/s = {100 * f['ratio']:.0f}% of "
            f"{f['ceiling_gbps']:.2f} GB/s")
        before = after
    all_ceiling = [v for cp in ceiling.checkpoints for v in cp]
    report["ceiling"] = stats(all_ceiling)
    report["presets"] = {n: asdict(p) for n, p in PRESETS.items()}
    return report


def main(argv=None) -> int:
    from . import _bench_report

    opts = parse_args(argv)
    report = run(opts)
    print(_bench_report.text_table(report))
    if opts.json:
        Path(opts.json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {opts.json}")
    if opts.markdown:
        _bench_report.write_markdown(opts.markdown, report)
        log(f"wrote {opts.markdown}")
    if opts.plot:
        try:
            _bench_report.plot(report, opts.plot)
            log(f"wrote {opts.plot}")
        except ImportError:
            log("--plot needs matplotlib: pip install 'cpumoe-formats[bench]' (or matplotlib); no plot written")
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
