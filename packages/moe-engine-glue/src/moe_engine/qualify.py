"""Start-up qualification, fail closed (docs/architecture.md, rule 4). Before a runner serves:
  every other layer: one step (one token routed to one expert of each side of a hybrid split, rotating with the
    layer) against the float64 reference of cpumoe_formats, so a layer whose banks or tables are wrong (a poisoned
    checkpoint's layer 0) stops start-up, not only the last layer. The reference's dequantization costs most of it:
    0.10-0.13 s a layer for a Qwen3-30B-A3B q4_0 expert on 2 cores (docs/transformers.md).
  the last layer, at every graph batch size:
    eager: steps with CPU and GPU routes, only CPU routes, only GPU routes (no CPU route), compared with the float64
      reference (tolerance in reference.py) and, for steps with only CPU routes, with the executor's synchronous
      decode bit for bit. A failure raises: the runner would compute wrong answers.
    graphs (a CUDA/HIP device): the step captured once, replayed with changed inputs, routes and residency, each
      replay equal bit for bit to the eager step on the same inputs. A failure refuses decode graphs (with a warning
      naming the reason) on every tensor-parallel rank, and eager decode stays correct.
Every compared step has finite inputs: a NaN / Inf in its output (or the reference's) fails, unless
allow_nonfinite (offload_experts' flag for checkpoints loaded with non-finite scales): then the output must be
NaN / Inf exactly where the reference is, and within tolerance elsewhere.
"""
from __future__ import annotations

import contextlib
import logging
import warnings

import numpy as np

from .layer_formats import describe
from .reference import TOLERANCE, reference

log = logging.getLogger("moe_engine")
SEED = 20261203
KINDS = ("mixed", "cpu-only", "gpu-only")


def _torch():
    import torch

    return torch


def _gpu_served(r, layer: int) -> np.ndarray:
    """bool [E]: the experts whose routes the GPU always serves (resident, or in the miss split's fixed set; its
    per-step share varies with the routes)."""
    m = r.residency.host_mask(layer) if r.residency is not None else np.zeros(r.E, bool)
    split = getattr(r, "split", None)
    return m | split.host_mask(layer) if split is not None else m


def step_inputs(r, gen, T: int, kind: str, layer: int):
    """x bf16 [T, H], w fp32 [T, K], ids int32 [T, K] on the runner's device. kind picks the experts routed to:
    mixed (any; -1 routes too), cpu-only (non-resident), gpu-only (resident: no CPU route)."""
    torch = _torch()
    K, E = r.top_k, r.E
    resident = _gpu_served(r, layer)
    if r.executor is None:  # gpu strategy: every route is resident
        resident = np.ones(E, bool)
    pool = {"mixed": np.arange(E), "cpu-only": np.flatnonzero(~resident), "gpu-only": np.flatnonzero(resident)}[kind]
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    ids = np.full((T, K), -1, np.int32)
    for t in range(T):
        n = min(K, len(pool))
        ids[t, :n] = rng.choice(pool, n, replace=False)
    if kind == "mixed" and K > 1:
        ids[0, -1] = -1  # a route to no expert
    x = torch.randn(T, r.H, generator=gen).to(torch.bfloat16)
    w = torch.rand(T, K, generator=gen) + 0.05
    d = r.device
    return x.to(d), w.to(d), torch.from_numpy(ids).to(d)


def compare(got, ref: np.ndarray, tol: float, allow_nonfinite: bool = False) -> str | None:
    """Why `got` (a step's output) fails against the float64 reference `ref`, or None: max |got - ref| / max |ref|
    below tol over the finite values; NaN / Inf in either fails unless allow_nonfinite, where they must coincide."""
    g = got.detach().float().cpu().numpy().astype(np.float64)
    fin_g, fin_r = np.isfinite(g), np.isfinite(ref)
    if not allow_nonfinite and not (fin_g.all() and fin_r.all()):
        return (f"{int((~fin_g).sum())} of {g.size} outputs are NaN/Inf (the float64 reference has "
                f"{int((~fin_r).sum())}) for finite inputs: the banks hold non-finite values (a checkpoint's scales?) "
                "or a kernel made them; offload_experts(allow_nonfinite=True) accepts them where the reference has "
                "them")
    if (fin_g != fin_r).any():
        return (f"NaN/Inf in {int((~fin_g).sum())} outputs, the float64 reference in {int((~fin_r).sum())}, at "
                "different places")
    both = fin_g & fin_r
    rel = float(np.abs(g - ref)[both].max(initial=0.0) / (np.abs(ref[both]).max(initial=0.0) + 1e-6))
    if not rel < tol:
        return f"max rel error {rel:.3g} against the float64 reference, expected < {tol}"
    return None


def _reference(r, layer: int, x, w, ids) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):  # poisoned banks: the NaN is the finding, not a warning
        return reference(r, layer, x, w, ids)


def tolerance(r) -> float:
    return max(TOLERANCE.get(r.executor.mode if r.executor else "native", 3e-2), TOLERANCE["native"])


def _sync(r, stream=None) -> None:
    torch = _torch()
    if r.device.type != "cuda":
        return
    if r.sync is not None and hasattr(r.sync, "synchronize"):
        r.sync.synchronize(stream)  # bounded: a step that never completes raises instead of hanging
    else:
        (stream or torch.cuda.current_stream(r.device)).synchronize()


def check_eager(r, layer: int, gen, allow_nonfinite: bool = False) -> list[str]:
    """Raises AssertionError on a wrong eager step; returns what was checked."""
    torch = _torch()
    tol = tolerance(r)
    done = []
    sizes = r.graph_batch_sizes
    for T in sizes:
        for kind in KINDS:
            if kind == "cpu-only" and r.executor is None:
                continue
            x, w, ids = step_inputs(r, gen, T, kind, layer)
            split = getattr(r, "split", None)
            with split.cpu_only(layer) if kind == "cpu-only" and split is not None else contextlib.nullcontext():
                y = r.step(layer, x, w, ids)  # the split's per-step share would send some misses to the GPU
                _sync(r)
            if T in (sizes[0], sizes[-1]) or kind == "mixed":
                why = compare(y, _reference(r, layer, x, w, ids), tol, allow_nonfinite)
                if why:
                    raise AssertionError(f"layer {layer}: eager {kind} step (T={T}): {why}")
            if kind == "cpu-only":
                want = r.executor.decode(layer, x.cpu(), w.cpu(), ids.cpu())
                if not torch.equal(y.cpu().view(torch.int16), want.view(torch.int16)):
                    raise AssertionError(f"eager cpu-only step (T={T}) differs from the executor's synchronous decode")
            done.append(f"{kind}@{T}")
    return done


def sample_ids(r, layer: int) -> np.ndarray:
    """ids [1, top_k]: one expert of `layer` from each side that holds some (the CPU's, the GPU's), the layer's index
    into that side's experts (so successive layers cover different experts); the rest -1."""
    resident = _gpu_served(r, layer)
    if r.executor is None:
        resident = np.ones(r.E, bool)
    pools = [p for p in (np.flatnonzero(~resident), np.flatnonzero(resident)) if len(p)]
    picks = [int(p[layer % len(p)]) for p in pools][:r.top_k]
    ids = np.full((1, r.top_k), -1, np.int32)
    ids[0, :len(picks)] = picks
    return ids


def check_every_layer(r, gen, allow_nonfinite: bool = False, skip: int | None = None) -> int:
    """One one-token step per layer (but `skip`) with sample_ids' experts against the float64 reference; raises
    AssertionError naming the layer. Returns the number of layers checked."""
    torch = _torch()
    tol, n = tolerance(r), 0
    for layer in range(r.num_layers):
        if layer == skip:
            continue
        ids = torch.from_numpy(sample_ids(r, layer)).to(r.device)
        x = torch.randn(1, r.H, generator=gen).to(torch.bfloat16).to(r.device)
        w = (torch.rand(1, r.top_k, generator=gen) + 0.05).to(r.device)
        y = r.step(layer, x, w, ids)
        _sync(r)
        why = compare(y, _reference(r, layer, x, w, ids), tol, allow_nonfinite)
        if why:
            experts = [int(e) for e in ids[0].tolist() if e >= 0]
            raise AssertionError(f"layer {layer}: one-token step with experts {experts}: {why}")
        n += 1
    return n


def check_graphs(r, layer: int, gen, replays: int = 4) -> None:
    """Capture one step per batch size, replay with changed inputs / routes / residency; == eager bit for bit."""
    torch = _torch()
    dev = r.device
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    saved = r.residency.host_mask(layer).copy() if r.residency is not None else None
    try:
        with torch.cuda.stream(s):
            for T in r.graph_batch_sizes:
                xs, ws, ids_s = step_inputs(r, gen, T, "mixed", layer)
                r.step(layer, xs, ws, ids_s)  # warm-up: kernels compiled and loaded outside the capture
                _sync(r, s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=s):
                    ys = r.step(layer, xs, ws, ids_s)
                for rep in range(replays):
                    kind = KINDS[rep % len(KINDS)] if r.executor is not None else "gpu-only"
                    if rep == replays - 1 and r.strategy == "hybrid" and 0 < saved.sum() < r.E:
                        r.set_residency(layer, np.roll(saved, 1 + T))  # another subset, same size: no recapture
                    x, w, ids = step_inputs(r, gen, T, kind, layer)
                    for dst, src in ((xs, x), (ws, w), (ids_s, ids)):
                        dst.copy_(src)
                    graph.replay()
                    _sync(r, s)
                    want = r.step(layer, x, w, ids)
                    _sync(r, s)
                    if not torch.equal(ys.view(torch.int16), want.view(torch.int16)):
                        raise AssertionError(f"graph replay {rep} ({kind} routes, T={T}) differs from the eager step")
                del graph
    finally:
        torch.cuda.current_stream(dev).wait_stream(s)
        if saved is not None:
            r.set_residency(layer, saved)


def consensus(eager_ok: bool, graphs_ok: bool, reason: str, group=None) -> tuple[bool, bool, str]:
    """Every tensor-parallel rank must agree: the runner starts only where every rank's eager steps passed, and
    graphs are used only where every rank proved them (torch.distributed when initialised; the verdicts travel as
    objects, so gloo and nccl groups both work). Returns (eager_ok, graphs_ok, reason) over all ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return eager_ok, graphs_ok, reason
    verdicts = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, (dist.get_rank(), eager_ok, graphs_ok, reason), group=group)
    bad_eager = [(rk, why) for rk, e, _g, why in verdicts if not e]
    bad_graph = [(rk, why) for rk, e, g, why in verdicts if e and not g]
    bad = bad_eager or bad_graph
    if not bad:
        return True, True, reason
    return not bad_eager, False, "; ".join(f"rank {rk}: {why}" for rk, why in bad)


def graph_layers(r) -> list[int]:
    """The layers whose captured steps qualification replays: the last, and the first of each other fixed path
    (residency="layers": a GPU layer's step has no CPU side, a CPU layer's no GPU experts)."""
    paths = getattr(r, "layer_path", None)
    last = r.num_layers - 1
    if paths is None:
        return [last]
    firsts = {}
    for li, p in enumerate(paths):
        firsts.setdefault(p, li)
    return [last] + [li for p, li in firsts.items() if p != paths[last]]


def qualify_runner(r, tp_group=None, *, allow_nonfinite: bool = False) -> None:
    """Sets r.graphs_ok / r.graphs_reason; raises RuntimeError when an eager step is wrong (on any rank).
    allow_nonfinite: NaN / Inf outputs pass where the float64 reference has them (module docstring)."""
    torch = _torch()
    gen = torch.Generator().manual_seed(SEED)
    layer = r.num_layers - 1
    gpu = r.device.type == "cuda"
    eager_ok, graphs_ok = True, gpu
    try:
        checked = check_eager(r, layer, gen, allow_nonfinite=allow_nonfinite)
        sampled = check_every_layer(r, gen, allow_nonfinite, skip=layer)
        why = f"eager {len(checked)} steps ok on layer {layer}, one step on each of {sampled} other layers"
    except Exception as e:  # noqa: BLE001 - reported below, after the ranks agree
        eager_ok, graphs_ok, why = False, False, f"{type(e).__name__}: {e}"
    if eager_ok and gpu:
        try:
            on = graph_layers(r)
            for li in on:
                check_graphs(r, li, gen)
            where = "" if on == [layer] else f" on layers {on}"
            why = f"{why}; graph replays ok at batch sizes {list(r.graph_batch_sizes)}{where}"
        except Exception as e:  # noqa: BLE001 - any failure refuses graphs; eager stays correct
            graphs_ok, why = False, f"graph replay failed: {type(e).__name__}: {e}"
    eager_ok, graphs_ok, why = consensus(eager_ok, graphs_ok, why, tp_group)
    if not eager_ok:
        raise RuntimeError(f"moe_engine: start-up qualification failed eagerly ({why}); the runner ({r.strategy}, "
                           f"{describe(r.layer_formats)}) would compute wrong results and is not started")
    r.graphs_ok, r.graphs_reason = graphs_ok and gpu, why
    if gpu and not graphs_ok:
        warnings.warn(f"moe_engine: decode graphs refused ({why}); decode eagerly (eager steps are correct)",
                      RuntimeWarning, stacklevel=3)
    log.info("qualification: %s", why)
