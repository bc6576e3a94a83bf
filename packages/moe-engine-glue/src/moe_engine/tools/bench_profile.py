"""`moe-engine bench --profile`: the bandwidths strategy="auto" decides from (placement/profile.py), measured at a
model's expert shape: the CPU's read ceiling, the executor's weight GB/s per format (batch 1, a DRAM working set),
the pinned host-to-device copy, and under CUDA graphs (as the runner's decode runs them) the GPU experts' fixed
cost, their reads from HBM and zero-copy from page-locked host banks, and the executor and the zero-copy reads at
once. Writes the versioned profile (atomically, to the user cache dir unless --out) and a PNG. Without a GPU the GPU
parts are skipped with the reason, recorded in the profile's notes.

Thread contract: a command-line tool."""
from __future__ import annotations

import json
import threading
import time

import numpy as np

import cpumoe_formats as cf

MiB = 1 << 20


def _banks(fmt: str, E: int, H: int, I: int, seed: int = 0):  # noqa: E741
    from ..banks import random_layers

    return random_layers(fmt, E, H, I, 1, seed=seed, progress=False)


def _steps_ids(E: int, K: int, n: int, rng) -> list[np.ndarray]:
    """One token's K distinct experts per step, walking the whole bank so the working set is DRAM, not cache."""
    perm = rng.permutation(E)
    return [np.take(perm, np.arange(s * K, (s + 1) * K) % E).reshape(1, K).astype(np.int32) for s in range(n)]


def cpu_part(fmt: str, E: int, H: int, I: int, K: int, threads, steps: int, rng) -> dict:  # noqa: E741
    """The read ceiling and the executor's GB/s at batch 1 over E experts; the fixed cost of a step with no route."""
    import torch

    from cpumoe_executor import CpuMoeExecutor

    banks = _banks(fmt, E, H, I)
    bpe = cf.get_format(fmt).bytes_per_expert(H, I)
    with CpuMoeExecutor(fmt, banks, top_k=K, max_tokens=1, threads=threads) as ex:
        ws = cf.aligned_empty((max(256 * MiB, 2 * E * bpe),), np.uint8)
        ws[:] = 1
        ceiling = ex.read_bandwidth(ws, 5)
        x = torch.randn(1, H).to(torch.bfloat16)
        w = torch.full((1, K), 1.0 / K)
        ids = [torch.from_numpy(a) for a in _steps_ids(E, K, steps, rng)]
        ex.decode(0, x, w, ids[0])
        rounds = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            for s in range(steps):
                ex.decode(0, x, w, ids[s])
            rounds.append(time.perf_counter() - t0)
        dt = float(np.median(rounds))
        none = torch.full((1, K), -1, dtype=torch.int32)
        t1 = time.perf_counter()
        for _ in range(50):
            ex.decode(0, x, w, none)
        fixed_us = (time.perf_counter() - t1) / 50 * 1e6
    return {"cpu_read": ceiling, "executor": steps * K * bpe / dt / 1e9, "cpu_fixed_us": fixed_us}


def h2d_GBps(dev) -> float:
    """The link's host-to-device copy rate, GB/s: 256 MiB from page-locked memory, 5 copies after one warm-up."""
    import torch

    host = torch.empty(256 * MiB, dtype=torch.uint8, pin_memory=True)
    d = torch.empty_like(host, device=dev)
    d.copy_(host)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(5):
        d.copy_(host, non_blocking=True)
    torch.cuda.synchronize(dev)
    return 5 * host.numel() / (time.perf_counter() - t0) / 1e9


def _graph_us(steps, replays: int) -> tuple:
    """us per step of `steps` (callables) captured in one CUDA graph and replayed `replays` times: the runner's
    decode runs its GPU experts inside a captured step, where launches cost nothing on the host (eager, a forward
    with no route took 142 us on the H200, more than one reading 8 experts from HBM)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # Triton's compile and the first launches, outside the capture
        for f in steps:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in steps:
            f()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (replays * len(steps)) * 1e6, g


# the executor's figure is the median of 5 rounds of `steps` decodes (64 steps of fp8_block are ~27 ms): one round
# read fp8_block at 34.3 GB/s on an H100 host where the runner's CPU-only misses read 91 a minute later
ROUNDS = 5
GRAPH_STEPS = 16  # steps per captured graph, each with its own routes: 16 x 8 routes walk all 128 experts (600 MB
                  # of fp8_block), so the weights come from memory, not the GPU's L2 (50 MB on an H100)


def gpu_part(fmt: str, E: int, H: int, I: int, K: int, threads, steps: int, rng) -> dict:  # noqa: E741
    """H2D copy; under CUDA graphs, the GPU experts' fixed cost (a step with no route), their reads from HBM
    (resident) and zero-copy from page-locked host banks, each net of the fixed cost; the executor and the zero-copy
    reads at once (the graph replays leave the host free, as in the runner)."""
    import torch

    from ..gpu.experts import GpuExperts
    from ..placement.pinning import PinnedBanks
    from ..placement.zerocopy import ZeroCopyBank

    dev = torch.device("cuda")
    banks = _banks(fmt, E, H, I)
    bpe = cf.get_format(fmt).bytes_per_expert(H, I)
    h2d = h2d_GBps(dev)
    pinned = PinnedBanks(banks, dev, budget=1 << 40)
    banks = pinned.banks
    out = {"h2d": h2d}
    try:
        if not pinned.pinned[0]:
            return {**out, "notes": f"zero-copy skipped: {pinned.why}"}
        zc = ZeroCopyBank(fmt, banks, pinned.pinned, E=E, H=H, I=I, device=dev)
        cap = min(E, 64)
        ge = GpuExperts(fmt, num_layers=1, capacity=cap, E=E, H=H, I=I, top_k=K, max_tokens=1, device=dev)
        for s in range(cap):
            ge.load(0, s, banks[0], s)
        x = torch.randn(1, H, device=dev).to(torch.bfloat16)
        w = torch.full((1, K), 1.0 / K, device=dev)
        n = min(GRAPH_STEPS, max(1, E // K))
        ids = [torch.from_numpy(a).to(dev) for a in _steps_ids(E, K, n, rng)]
        slots = [(i % cap).int() for i in ids]
        none = torch.full((1, K), -1, dtype=torch.int32, device=dev)
        replays = max(2, steps // n)
        fixed, _ = _graph_us([lambda: ge.forward(0, x, w, none)] * n, replays)
        hbm_us, _ = _graph_us([lambda i=i: ge.forward(0, x, w, i) for i in slots], replays)
        zc_us, zc_graph = _graph_us([lambda i=i: ge.forward(0, x, w, i, bank=zc) for i in ids], replays)
        net = lambda us: K * bpe / max(us - fixed, 1e-3) / 1e3  # noqa: E731 - GB/s net of the fixed cost
        out.update(gpu_fixed_us=fixed, hbm=net(hbm_us), zero_copy=net(zc_us))
        # a window of >= 0.5 s, not a burst (3 replays were 36 ms). fp8_block's executor read 17-18 GB/s there at
        # either length on an H100 (bf16's 76-81), while the runner's split ran 10-24% faster than the CPU alone:
        # choose.py does not use these at-once rates
        both_replays = max(replays, int(0.5e6 / (n * zc_us)) + 1)
        out["both"] = _both(fmt, banks, K, bpe, threads, x, w, ids, zc_graph, n, both_replays, fixed)
    finally:
        torch.cuda.synchronize()
        pinned.close()
    return out


def _both(fmt, banks, K, bpe, threads, x, w, ids, zc_graph, n, replays, fixed) -> dict:
    """The executor decoding on a thread while the zero-copy graph replays: each side's GB/s over the same window
    (the decodes that finished inside it)."""
    import torch

    from cpumoe_executor import CpuMoeExecutor

    with CpuMoeExecutor(fmt, banks, top_k=K, max_tokens=1, threads=threads) as ex:
        xc, wc = x.cpu(), w.cpu()
        cids = [i.cpu() for i in ids]
        done, stop = [], threading.Event()

        def cpu_loop():
            s = 0
            while not stop.is_set():
                ex.decode(0, xc, wc, cids[(s + 7) % len(cids)])
                done.append(time.perf_counter())
                s += 1

        th = threading.Thread(target=cpu_loop)
        th.start()
        while len(done) < 2:  # the executor is running before the window opens
            time.sleep(1e-4)
        t0 = time.perf_counter()
        for _ in range(replays):
            zc_graph.replay()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        stop.set()
        th.join()
    inside = sum(t0 < t <= t1 for t in done)
    zc_us = (t1 - t0) / (replays * n) * 1e6
    return {"cpu": inside * K * bpe / (t1 - t0) / 1e9, "zero_copy": K * bpe / max(zc_us - fixed, 1e-3) / 1e3}


def plot(p: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, vals = ["cpu read"], [p["cpu_read"]]
    for f, v in p["executor"].items():
        labels.append(f"executor {f}")
        vals.append(v)
    if p.get("h2d"):
        labels.append("h2d pinned")
        vals.append(p["h2d"])
    for f, v in p.get("zero_copy", {}).items():
        labels.append(f"zero-copy {f}")
        vals.append(v)
    for f, b in p.get("both", {}).items():
        labels += [f"at once: cpu {f}", f"at once: zc {f}"]
        vals += [b["cpu"], b["zero_copy"]]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 4))
    ax.bar(range(len(vals)), vals)
    ax.set_xticks(range(len(vals)), labels, rotation=30, ha="right")
    ax.set_ylabel("GB/s")
    ax.set_title(f"bandwidth profile: {p['gpu']} (shape {p['shape']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def workers(threads: int | None, gpu: str) -> int | None:
    """The executor's workers for the profile: `threads` when given, else beside a GPU the runner's own count (one
    core left to the thread driving the GPU), else None (every core). With a worker on every core the thread driving
    the steps, and in the at-once window the one replaying the GPU's graphs, share a pinned worker's core; a profile
    taken so read fp8_block's executor at 73.5 GB/s (H100, batch 1) where the runner's CPU-only misses ran ~100, and
    auto's picks leaned to the split."""
    if threads is not None or gpu == "none":
        return threads
    from ..runner import threads_beside_gpu

    return threads_beside_gpu()


def run_bench_profile(a) -> int:
    from ..placement import profile as prof
    from .shapes import preset

    if a.shape:
        E, H, I, K = (int(v) for v in a.shape.split(","))  # noqa: E741
    else:
        s = preset(a.preset or "qwen3-30b-a3b")
        E, H, I, K = s.E, s.H, s.I, s.top_k
    fmts = a.formats.split(",") if a.formats else ["bf16", "fp8_block"]
    rng = np.random.default_rng(0)
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    a.threads = workers(a.threads, gpu)
    print(f"executor threads: {a.threads or 'every core'}"
          f"{' (one core left to the GPU-driving thread, as the runner)' if gpu != 'none' else ''}", flush=True)
    p = {"gpu": gpu, "shape": {"E": E, "H": H, "I": I, "top_k": K}, "executor": {}, "zero_copy": {}, "both": {},
         "notes": {}}
    for f in fmts:
        c = cpu_part(f, E, H, I, K, a.threads, a.steps, rng)
        p["cpu_read"], p["cpu_fixed_us"] = c["cpu_read"], c["cpu_fixed_us"]
        p["executor"][f] = c["executor"]
        print(f"{f}: cpu read {c['cpu_read']:.1f} GB/s, executor {c['executor']:.1f} GB/s, empty step "
              f"{c['cpu_fixed_us']:.0f} us", flush=True)
        if gpu == "none":
            p["notes"][f] = "GPU parts skipped: torch sees no CUDA device"
            continue
        g = gpu_part(f, E, H, I, K, a.threads, a.steps, rng)
        p["h2d"] = g["h2d"]
        for k in ("zero_copy", "both"):
            if k in g:
                p[k][f] = g[k]
        if "hbm" in g:
            p["hbm"], p["gpu_fixed_us"] = g["hbm"], g["gpu_fixed_us"]
        if "notes" in g:
            p["notes"][f] = g["notes"]
        print(f"{f}: {json.dumps(g)}", flush=True)
    for f, why in p["notes"].items():
        print(f"{f}: {why}")
    profile = prof.Profile.from_json(p)
    path = prof.save(profile, a.out)
    png = (a.png or path[:-5] + ".png") if path.endswith(".json") else path + ".png"
    plot(profile.to_json(), png)
    print(f"wrote {path} and {png}")
    return 0
