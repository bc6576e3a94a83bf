"""Hit rate vs residency per placement policy on calibrated traces: raw JSON and a PNG for docs/placement.md.

    python -m moe_engine.placement.report --out docs/results/placement_trace   # .json and .png, ~2 min on 2 cores

Thread contract: a command-line tool."""
from __future__ import annotations

import argparse
import json
import sys

from .calibrate import CALIBRATED, HOT, measure
from .simulate import POLICIES, curve
from .trace import TraceModel

RESIDENCIES = (0.05, 0.1, 0.125, 0.2, 0.25, 0.3, 0.366, 0.5, 0.75, 0.9)
SHAPES = {"qwen3-30b-a3b": (128, 8), "qwen3.6-35b-a3b": (256, 8), "qwen3-next-80b-a3b": (512, 10)}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["curves"]), figsize=(5 * len(results["curves"]), 4), squeeze=False)
    for ax, (name, c) in zip(axes[0], results["curves"].items()):
        xs = [p["residency"] for p in c["points"]]
        for pol in POLICIES:
            ax.plot(xs, [p[pol]["hit_rate"] for p in c["points"]], marker="o", ms=3, label=pol)
        ax.set_title(f"{name} (E={c['model']['E']}, top-{c['model']['top_k']})")
        ax.set_xlabel("GPU-resident fraction of each layer's experts")
        ax.set_ylabel("routes hitting a resident expert")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_engine.placement.report", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="path stem: writes STEM.json and STEM.png")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    a = p.parse_args(argv)
    res = {"calibration": {"params": CALIBRATED, "hot": HOT, "measured": measure(CALIBRATED)}, "curves": {}}
    for name, (E, K) in SHAPES.items():
        m = TraceModel(E=E, top_k=K, layers=a.layers, **CALIBRATED)
        res["curves"][name] = curve(m, RESIDENCIES, steps=a.steps, batch=a.batch, **HOT)
        for pt in res["curves"][name]["points"]:
            print(name, f"{pt['residency']:.3f}", " ".join(f"{k}={pt[k]['hit_rate']:.3f}" for k in POLICIES),
                  flush=True)
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    plot(res, a.out + ".png")
    print(f"wrote {a.out}.json and {a.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
