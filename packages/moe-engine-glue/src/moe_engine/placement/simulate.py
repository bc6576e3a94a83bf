"""Hit rates of placements on routing traces (trace.py): the fraction of routes whose expert is resident on the GPU
when the step runs. Policies: random, uniform, static (top of a profile from another trace of the same model), hot
(HotPlacer), lru (a per-layer cache that loads every miss, evicting the least recently used) and oracle (the best
static placement in hindsight: each layer's most-routed experts of the trace itself).

Thread contract: pure functions."""
from __future__ import annotations

import numpy as np

from .policies import HotPlacer, static_masks
from .trace import TraceModel, counts

POLICIES = ("random", "uniform", "static", "hot", "lru", "oracle")


def _static_hits(ids: np.ndarray, masks: np.ndarray) -> tuple[int, int]:
    valid = ids >= 0
    li = np.arange(ids.shape[-2])[:, None]
    hit = masks[li, np.where(valid, ids, 0)] & valid
    return int(hit.sum()), int(valid.sum())


def _lru_hits(ids: np.ndarray, E: int, capacity: int) -> tuple[int, int, int]:
    steps, _, L, _ = ids.shape
    last = np.full((L, E), -1, np.int64)  # step of last use, -1 = not cached
    hits = routes = loads = 0
    for t in range(steps):
        for li in range(L):
            v = ids[t, :, li].ravel()
            v = v[v >= 0]
            routes += v.size
            row = last[li]
            hits += int((row[v] >= 0).sum())
            new = np.unique(v[row[v] < 0])
            if capacity == 0:
                continue
            row[np.unique(v)] = t  # touched this step
            over = int((row >= 0).sum()) - capacity
            if over > 0:  # evict the least recently used, never one of this step's
                cached = np.flatnonzero((row >= 0) & (row < t))
                row[cached[np.argsort(row[cached], kind="stable")[:over]]] = -1
            loads += new.size
    return hits, routes, loads


def simulate(policy: str, ids: np.ndarray, E: int, capacity: int, *, profile=None, every: int = 50,
             half_life: float = 200.0, hysteresis: float = 0.25, seed: int = 0) -> dict:
    """ids [steps, batch, layers, top_k] -> {hit_rate, loads (expert copies after the first placement)}."""
    steps, _, L, _ = ids.shape
    if policy in ("random", "uniform", "static", "oracle"):
        kind = "static" if policy == "oracle" else policy
        c = counts(ids, E) if policy == "oracle" else profile
        h, n = _static_hits(ids, static_masks(kind, L, E, capacity, counts=c, seed=seed))
        return {"hit_rate": h / max(n, 1), "loads": 0}
    if policy == "lru":
        h, n, loads = _lru_hits(ids, E, capacity)
        return {"hit_rate": h / max(n, 1), "loads": loads}
    if policy == "hot":
        placer = HotPlacer(L, E, capacity, every=every, half_life=half_life, hysteresis=hysteresis,
                           initial=static_masks("random", L, E, capacity, seed=seed))
        h = n = loads = 0
        for t0 in range(0, steps, every):
            w = ids[t0:t0 + every]
            hh, nn = _static_hits(w, placer.mask)
            h, n = h + hh, n + nn
            placer.observe(counts(w, E), steps=w.shape[0])
            before = placer.mask.copy()
            loads += int((placer.place() & ~before).sum())
        return {"hit_rate": h / max(n, 1), "loads": loads}
    raise ValueError(f"policy={policy!r}: expected one of {list(POLICIES)}")


def curve(model: TraceModel, residencies, *, steps: int = 4000, batch: int = 1, seed: int = 1,
          policies=POLICIES, **hot) -> dict:
    """Hit rate per policy per residency fraction on one trace; `static` profiles a second trace (seed + 1000)."""
    ids = model.generate(steps, batch=batch, seed=seed)
    profile = counts(model.generate(steps, batch=batch, seed=seed + 1000), model.E)
    out = {"model": model.params(), "steps": steps, "batch": batch, "seed": seed, "hot": hot, "points": []}
    for r in residencies:
        cap = int(round(r * model.E))
        row = {"residency": r, "capacity": cap}
        for p in policies:
            row[p] = simulate(p, ids, model.E, cap, profile=profile, **hot)
        out["points"].append(row)
    return out
