"""python -m moe_engine.tools.synth --kind KIND --out PATH [--small] [--layers N] [--seed S] [--check]"""
from __future__ import annotations

import argparse
import json
import sys

from . import KINDS, check, write


def _bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib").rstrip("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_engine.tools.synth", description=__doc__)
    ap.add_argument("--kind", required=True, choices=sorted(KINDS),
                    help="gguf-q4_0 / gguf-q8_0 / gguf-q4_k_m / gguf-q5_k_m / gguf-q4_k / gguf-q5_k / gguf-q6_k / "
                         "bf16 / fp8: qwen3moe shape; "
                         "mxfp4: gpt-oss shape")
    ap.add_argument("--out", required=True, help="a .gguf file (gguf-*) or a directory")
    ap.add_argument("--small", action="store_true", help="the small variant (CI size)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-size", type=_bytes, default=1 << 30, help="safetensors shard bytes (1GiB)")
    ap.add_argument("--check", action="store_true", help="read the file back and check it (check.py)")
    ap.add_argument("--quiet", action="store_true", help="no per-layer progress lines")
    ap.add_argument("--random-codes", action="store_true",
                    help="GGUF Q4_0 / Q8_0 experts and FP8 block weights: draw the codes directly instead of "
                         "quantizing float weights "
                         "(a full-size file in minutes; the checker then tests their magnitude, not their values)")
    a = ap.parse_args(argv)
    r = write(a.kind, a.out, small=a.small, layers=a.layers, seed=a.seed, shard_bytes=a.shard_size,
              progress=not a.quiet, random_codes=a.random_codes)
    r["shape"] = r["shape"].__dict__
    if a.check:
        r["check"] = check(a.kind, a.out, small=a.small, layers=a.layers)
    print(json.dumps(r, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
