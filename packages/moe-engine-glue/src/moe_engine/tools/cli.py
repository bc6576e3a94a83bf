"""The `moe-engine` command: `info` (what this machine offers), `demo` (a synthetic model decoded and verified),
`generate` and `bench` (a shipped checkpoint loaded with from_pretrained: a generation, or llama-bench's tests),
`profile` (routing counts over a calibration run, for residency="static")."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from .shapes import PRESETS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-engine", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log the components' start-up lines (INFO)")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", title="commands")
    i = sub.add_parser("info", help="CPU tiers per format, the GPU and runtime, which handshake paths probe OK")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")
    i.add_argument("--no-probe", action="store_true", help="skip the handshake probe on the GPU")
    d = sub.add_parser("demo", help="decode a synthetic model at a real expert shape and verify it")
    d.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS),
                   help="expert shape (default %(default)s)")
    d.add_argument("--shape", metavar="E,H,I,TOPK", help="a custom expert shape instead of the preset's")
    d.add_argument("--format", default="bf16", help="weight format (default %(default)s)")
    d.add_argument("--layers", type=int, default=4, help="MoE layers to build (default %(default)s)")
    d.add_argument("--steps", type=int, default=200, help="decode steps (default %(default)s)")
    d.add_argument("--batch", type=int, default=1, help="tokens per step (default %(default)s)")
    d.add_argument("--strategy", default="auto", choices=("auto", "cpu", "hybrid", "gpu"),
                   help="auto: hybrid with a GPU, cpu without (default)")
    d.add_argument("--residency", type=float, default=0.25, help="hybrid: fraction of experts on the GPU (0.25)")
    d.add_argument("--threads", type=int, default=None, help="CPU workers (default: one per physical core)")
    d.add_argument("--check-every", type=int, default=25, help="verify every N-th step (default %(default)s)")
    d.add_argument("--reshuffle-every", type=int, default=50, help="hybrid: new residency every N steps (50)")
    d.add_argument("--no-graphs", action="store_true", help="decode eagerly on a GPU too")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    from .generate import add_parsers, common_args
    from .profile import add_parser as add_profile_parser

    add_parsers(sub)
    add_profile_parser(sub, common_args)
    return p


def main(argv=None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    if a.cmd is None:  # bare `moe-engine`: the commands, not an argparse error
        parser.print_help(sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(name)s: %(message)s")
    logging.getLogger("moe_engine").setLevel(logging.INFO)  # its one start-up line names the choices and why
    if a.cmd == "profile":
        from .profile import run_profile

        return run_profile(a)
    if a.cmd == "bench" and a.profile:
        from .bench_profile import run_bench_profile

        return run_bench_profile(a)
    if a.cmd == "bench" and a.path is None:
        parser.error("bench: PATH is required (or --profile)")
    if a.cmd in ("generate", "bench"):
        from .generate import run_bench, run_generate

        return run_generate(a) if a.cmd == "generate" else run_bench(a)
    if a.cmd == "info":
        from .info import info, render

        d = info(probe=not a.no_probe)
        print(json.dumps(d, indent=1, default=str) if a.json else render(d))
        return 0
    from .demo import render, run_demo

    shape = None
    if a.shape:
        try:
            shape = tuple(int(v) for v in a.shape.split(","))
            assert len(shape) == 4 and min(shape) > 0
        except (ValueError, AssertionError):
            print(f"moe-engine demo: --shape {a.shape!r}: expected four positive ints E,H,I,TOPK", file=sys.stderr)
            return 2
    res = run_demo(a.preset, a.format, a.layers, a.steps, a.batch, a.strategy, a.residency, a.threads, a.seed,
                   a.check_every, a.reshuffle_every, not a.no_graphs, not a.quiet, shape)
    print(render(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
