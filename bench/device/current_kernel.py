# Run by hand (and by bench/device/device_x16.sh): one thread, one expert in cache, a format's kernels per call.
"""Times the package's kernels of one format per work-item call (one thread, one expert in cache), for comparison
with x16.cpp: gate_up over all 2I rows and down over all H rows, 1 and 8 tokens, best of 60 x 10 calls.

    PYTHONPATH=packages/cpumoe-formats/src python3 bench/device/current_kernel.py q4_0 2816 704 w4a8
prints ga1= ga8= do1= do8= in microseconds per call.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../packages/cpumoe-formats/tests"))
from fp4_helpers import prep, to_bf16_bits, views  # noqa: E402

import cpumoe_formats as cf  # noqa: E402


def calls(k, V, H, I, which, n, rng):  # noqa: E741
    if which == "gate_up":
        bufs = [prep(k, x) for x in to_bf16_bits(rng.standard_normal((n, H)))]
        g = cf.aligned_empty((n, I), np.uint16)
        args = (V, 0, 0, I, [b.ctypes.data for b in bufs], [1.0] * n, [g[j].ctypes.data for j in range(n)])
        return k._k.gate_up, args, bufs, g
    bufs = [prep(k, x) for x in to_bf16_bits(rng.standard_normal((n, I)))]
    acc = cf.aligned_empty((n, H), np.float32)
    acc[...] = 0
    routes = [(j, 0, 1.0, bufs[j].ctypes.data) for j in range(n)]
    return k._k.down, (V, 0, H, routes, acc.ctypes.data, H), bufs, acc


def main():
    fmt, H, I, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]  # noqa: E741
    rng = np.random.default_rng(0)
    banks = cf.get_format(fmt).random_banks(1, H, I, rng)
    k = cf.Kernel(fmt, 1, H, I, mode=None if mode == "native" else mode)
    V = views(fmt, banks)
    res = []
    for which in ("gate_up", "down"):
        for n in (1, 8):
            f, args, *_keep = calls(k, V, H, I, which, n, rng)
            best = 1e9
            for _ in range(60):
                t = time.perf_counter()
                for _ in range(10):
                    f(*args)
                best = min(best, (time.perf_counter() - t) / 10)
            res.append(f"{which[:2]}{n}={best * 1e6:.0f}")
    print(" ".join(res))


if __name__ == "__main__":
    main()
