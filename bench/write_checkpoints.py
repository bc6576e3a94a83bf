"""Write the synthetic test checkpoints (moe_engine.tools.synth): real formats and shapes, random weights, streamed.

    python bench/write_checkpoints.py --out /work/models --kinds gguf-q4_0            # Qwen3-30B-A3B shape, 19.4 GB
    python bench/write_checkpoints.py --out /tmp/ckpt --small                          # every kind, small (~200 MB)

Full-size kinds and sizes: gguf-q4_0 19.4 GB, gguf-q4_k_m ~18 GB, gguf-q8_0 ~32 GB, fp8 ~31 GB (qwen3moe);
mxfp4 ~13 GB (gpt-oss-20b); bf16 is meant for --small (the full one is ~61 GB). Names: OUT/<kind>[-small][.gguf].
One JSON line per checkpoint (path, bytes, seconds, peak RSS of this process so far); --check reads each back.
Needs numpy, ml_dtypes, gguf, safetensors (not torch); runs from a checkout without installing the glue."""
from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

try:
    from moe_engine.tools import synth
except ImportError:  # a checkout: the glue's sources, without importing the package's torch-using modules
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "moe-engine-glue" / "src"))
    from moe_engine.tools import synth


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="folder the checkpoints are written in")
    ap.add_argument("--kinds", default=",".join(synth.KINDS), help=f"comma-separated, of {list(synth.KINDS)}")
    ap.add_argument("--small", action="store_true", help="the small variants (CI size)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="read each checkpoint back (synth.check)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for kind in a.kinds.split(","):
        path = a.out / (kind + ("-small" if a.small else "") + (".gguf" if kind.startswith("gguf") else ""))
        r = synth.write(kind, path, small=a.small, layers=a.layers, seed=a.seed)
        row = {"kind": kind, "path": str(path), "bytes": r["bytes"], "gb": round(r["bytes"] / 1e9, 2),
               "seconds": round(r["seconds"], 1), "tensors": r["tensors"], "layers": r["shape"].layers,
               "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}
        if a.check:
            row["check"] = synth.check(kind, path, small=a.small, layers=a.layers)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
