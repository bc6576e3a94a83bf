"""`moe-engine demo`: a synthetic model at a real model's expert shape (random codes, a few MoE layers) decoded for a
few hundred steps through a MoERunner: hybrid under CUDA/HIP graphs where a GPU is present, cpu without. Every
`check_every` steps each layer's output is checked against the float64 reference and a graph replay against the
eager step; prints steps/s and the CPU side's effective GB/s against this machine's read ceiling, measured in the
same run by the executor's own threads."""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace

import numpy as np

import cpumoe_formats as cf

from ..banks import random_layers
from ..progress import bar
from ..reference import TOLERANCE, reference
from ..runner import MoERunner
from .shapes import preset

log = logging.getLogger("moe_engine")
MiB = 1 << 20


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_ceiling(executor, repeats: int = 3) -> dict:
    """Multi-thread read GB/s of a buffer of 4x the LLC (at least 256 MiB) by the executor's pool: DRAM's rate for
    these threads. Experts that come from the LLC read faster than it (render() says when that can happen)."""
    from cpumoe_formats.machine import llc_bytes, stats

    llc = llc_bytes() or 0
    buf = cf.aligned_empty((max(4 * llc, 256 * MiB),), np.uint8)
    buf[:] = 1
    executor.read_bandwidth(buf, 1)  # warm-up
    return {**stats([executor.read_bandwidth(buf, 2) for _ in range(repeats)]), "llc_bytes": llc}


def routes(rng, steps: int, L: int, T: int, K: int, E: int) -> tuple[np.ndarray, np.ndarray]:
    """ids [steps, L, T, K] (distinct experts per token) and router weights (softmax-like, sum 1 per token)."""
    ids = np.argsort(rng.random((steps, L, T, E)), axis=-1)[..., :K].astype(np.int32)
    w = rng.random((steps, L, T, K)).astype(np.float32) + 0.1
    return ids, w / w.sum(-1, keepdims=True)


def _mix(torch, h, y):
    """The next layer's input: a residual add and an RMS normalisation, as a transformer block would."""
    s = h.float() + y.float()
    return (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)


def run_demo(preset_name: str = "qwen3-30b-a3b", fmt: str = "bf16", layers: int = 4, steps: int = 200,
             batch: int = 1, strategy: str = "auto", residency: float = 0.25, threads: int | None = None,
             seed: int = 0, check_every: int = 25, reshuffle_every: int = 50, graphs: bool = True,
             progress: bool = True, custom: tuple | None = None) -> dict:
    import torch

    shape = preset(preset_name).with_layers(layers)
    if custom is not None:  # E, H, I, top_k of a shape no preset names
        shape = replace(shape, name=f"custom {'x'.join(map(str, custom))}", E=custom[0], H=custom[1], I=custom[2],
                        top_k=custom[3])
    spec = cf.get_format(fmt)
    L, T, K, E = layers, batch, shape.top_k, shape.E
    _say(f"demo: {shape.name} experts (E={E}, H={shape.H}, I={shape.I}, top_k={K}), {L} layers in {spec.name} "
         f"({L * E * spec.bytes_per_expert(shape.H, shape.I) / 1e9:.2f} GB), batch {T}, {steps} steps")
    banks = random_layers(spec.name, E, shape.H, shape.I, L, seed=seed, progress=progress)
    r = MoERunner(spec.name, banks, top_k=K, activation=shape.activation, alpha=shape.alpha, limit=shape.limit,
                  strategy=strategy, residency=residency if strategy in ("auto", "hybrid") else None,
                  graph_batch_sizes=(T,), threads=threads, progress=progress)
    _say(f"demo: {r.describe()}")
    dev = r.device
    use_graphs = graphs and dev.type == "cuda" and r.graphs_ok
    ceiling = read_ceiling(r.executor) if r.executor is not None else None
    rng = np.random.default_rng(seed + 1)
    ids_all, w_all = routes(rng, steps, L, T, K, E)
    ids_d, w_d = torch.from_numpy(ids_all).to(dev), torch.from_numpy(w_all).to(dev)
    x0 = torch.from_numpy(rng.standard_normal((T, shape.H)).astype(np.float32)).to(torch.bfloat16).to(dev)

    def eager_step(s: int, keep: list | None = None):
        h = x0
        for layer in range(L):
            y = r.forward(layer, h, w_d[s, layer], ids_d[s, layer])
            if keep is not None:
                keep.append((h, y))
            h = _mix(torch, h, y)
        return h

    step, graph, static = eager_step, None, None
    if use_graphs:
        st_ids, st_w = ids_d[0].clone(), w_d[0].clone()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            eager_step(0)  # warm-up outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                h = x0
                for layer in range(L):
                    h = _mix(torch, h, r.forward(layer, h, st_w[layer], st_ids[layer]))
                static = h
        torch.cuda.current_stream(dev).wait_stream(side)

        def step(s: int, keep=None):
            st_ids.copy_(ids_d[s])
            st_w.copy_(w_d[s])
            graph.replay()
            return static

    # Timed first, checked after: the checks' float64 references and eager steps run CPU threads (numpy, torch)
    # that keep spinning after they finish and would slow the steps timed next to them. The replayed outputs of the
    # checked steps are kept with the residency they ran under, and each is compared after the loop with the eager
    # step under that same residency (bit for bit) and with the float64 reference.
    tol = max(TOLERANCE.get(r.executor.mode if r.executor else "native", 3e-2), TOLERANCE["native"])
    bpe = spec.bytes_per_expert(shape.H, shape.I)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    masks = (lambda: [r.residency.host_mask(li).copy() for li in range(L)]) if r.residency is not None else list
    kept, cpu_bytes, elapsed = [], 0, 0.0
    cpu_set = bpe * sum(E - int(m.sum()) for m in (masks() or [np.zeros(E, bool)] * L)) if r.executor else 0
    sync()
    with bar(steps, "decoding", "step", disable=not progress) as pb:
        for s in range(steps):
            if r.strategy == "hybrid" and reshuffle_every and s and s % reshuffle_every == 0:
                for layer in range(L):  # a new residency of the same size: the captured graph needs no recapture
                    r.set_residency(layer, np.roll(r.residency.host_mask(layer), 1 + s // reshuffle_every))
            if r.executor is not None:
                res = masks() or [np.zeros(E, bool)] * L
                cpu_bytes += bpe * sum(len(set(ids_all[s, li].ravel().tolist()) - set(np.flatnonzero(m).tolist()))
                                       for li, m in enumerate(res))
            t0 = time.perf_counter()
            out = step(s)
            sync()
            elapsed += time.perf_counter() - t0
            if check_every and (s % check_every == 0 or s == steps - 1):
                kept.append((s, out.clone(), masks()))
            pb.update(1)
    worst, mismatches = 0.0, 0
    with bar(len(kept), "verifying", "step", disable=not progress) as pb:
        for s, got, res in kept:
            for layer, m in enumerate(res):
                r.set_residency(layer, m)
            keep: list = []
            want = eager_step(s, keep)
            sync()
            if graph is not None and not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                mismatches += 1
            for layer, (h, y) in enumerate(keep):
                ref = reference(r, layer, h, w_d[s, layer], ids_d[s, layer])
                worst = max(worst, float(np.abs(y.float().cpu().numpy() - ref).max() / (np.abs(ref).max() + 1e-6)))
            pb.update(1)
    checks = len(kept)
    ok = mismatches == 0 and worst < tol
    res = {"preset": shape.name, "format": spec.name, "layers": L, "batch": T, "steps": steps,
           "strategy": r.strategy, "graphs": graph is not None, "runner": r.describe(),
           "step_us": 1e6 * elapsed / steps, "steps_per_s": steps / elapsed, "layer_us": 1e6 * elapsed / steps / L,
           "cpu_gbps": cpu_bytes / elapsed / 1e9 if r.executor is not None else None,
           "ceiling_gbps": ceiling["median"] if ceiling else None,
           "llc_bytes": ceiling["llc_bytes"] if ceiling else None, "cpu_experts_bytes": cpu_set,
           "checks": checks, "max_rel_err": worst,
           "tolerance": tol, "graph_mismatches": mismatches if graph is not None else None, "verified": ok}
    r.close()
    return res


def render(res: dict) -> str:
    lines = [f"{res['preset']} x {res['layers']} layers, {res['format']}, batch {res['batch']}: {res['strategy']}"
             f"{' under graphs' if res['graphs'] else ' (eager)'}",
             f"  {res['steps_per_s']:.1f} steps/s ({res['step_us']:.0f} us/step, {res['layer_us']:.0f} us/layer)"]
    if res["cpu_gbps"] is not None and res["ceiling_gbps"]:
        pct = 100 * res["cpu_gbps"] / res["ceiling_gbps"]
        lines.append(f"  CPU experts read at {res['cpu_gbps']:.1f} GB/s = {pct:.0f}% of the DRAM read rate of the same "
                     f"threads ({res['ceiling_gbps']:.1f} GB/s over a buffer 4x the LLC, same run)")
        if pct > 100:  # not a ceiling the kernels beat: part of the experts' bytes came from the cache
            lines.append(f"  (above 100%: the CPU's experts total {res['cpu_experts_bytes'] / 1e9:.2f} GB against a "
                         f"{(res['llc_bytes'] or 0) / MiB:.0f} MiB LLC, so an expert routed again within a few steps "
                         "is read from cache; more layers (--layers) make the working set DRAM's)")
    verdict = "verification passed" if res["verified"] else "verification FAILED"
    extra = f", {res['graph_mismatches']} graph/eager mismatches" if res["graph_mismatches"] is not None else ""
    lines.append(f"  {verdict}: {res['checks']} checked steps, max rel error {res['max_rel_err']:.2e} against the "
                 f"float64 reference (tolerance {res['tolerance']}){extra}")
    return "\n".join(lines)
