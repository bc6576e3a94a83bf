"""strategy="auto" from measurements: a step-time model over the profile's bandwidths and the live miss rate picks
gpu, hybrid (misses on the CPU), hybrid+split (a fraction q of the miss bytes read by the GPU experts from pinned
host memory, the rest on the CPU, at once) or gpu-only misses (offload-like: q = 1, the CPU idle).

The model, per layer and step (docs/placement.md): U experts touched (distinct routes of the batch), a fraction m
of them missing the GPU's slots, b bytes each, so miss bytes M = m U b and resident bytes R = (1 - m) U b;
    t_cpu(q) = c_cpu + (1 - q) M / B_cpu            (the executor, fixed cost c_cpu: handshake, wake)
    t_gpu(q) = c_gpu + R / B_hbm + q M / B_zc       (the GPU experts, fixed cost c_gpu: launches)
    t(q) = max(t_cpu(q), t_gpu(q)), the CPU part dropped when q = 1 or M = 0.
The split's q makes the two sides finish together: q = (c_cpu + M/B_cpu - c_gpu - R/B_hbm) / (M/B_cpu + M/B_zc),
clipped to [0, 1]; with no fixed costs and nothing resident that is q = B_zc / (B_zc + B_cpu). While both paths run
they use the profile's both-at-once bandwidths. A mode whose offload-like miss rate differs (a cache that loads every
miss) is given its own rate.

Thread contract: pure functions."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .profile import Profile

MODES = ("gpu", "hybrid", "split", "gpu_misses")


@dataclass(frozen=True)
class Choice:
    mode: str  # one of MODES
    q: float  # fraction of the miss bytes the GPU reads zero-copy
    step_us: dict  # mode -> modelled us per layer step
    reason: str

    @property
    def strategy(self) -> str:
        return "gpu" if self.mode == "gpu" else "hybrid"


def touched(E: int, top_k: int, batch: int) -> float:
    """Expected distinct experts of a layer a batch of independent uniform top-k routes touches."""
    return E * (1.0 - (1.0 - top_k / E) ** batch)


def _pos(name: str, v, *, zero_ok=False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 if zero_ok else v > 0) or \
            not math.isfinite(v):
        raise ValueError(f"{name}={v!r}: expected a finite number {'>= 0' if zero_ok else '> 0'}")
    return float(v)


def step_us(M: float, R: float, q: float, *, b_cpu: float, b_zc: float, b_hbm: float, c_cpu: float,
            c_gpu: float) -> float:
    """The model's us for one layer step (bytes in, GB/s = 1e3 bytes/us)."""
    t_gpu = c_gpu + (R / (b_hbm * 1e3) if b_hbm > 0 else 0.0) + (q * M / (b_zc * 1e3) if q > 0 else 0.0)
    if q >= 1.0 or M == 0:
        return t_gpu
    return max(c_cpu + (1.0 - q) * M / (b_cpu * 1e3), t_gpu)


def choose(profile: Profile, format: str, *, bytes_per_expert: int, E: int, top_k: int, batch: int,
           miss_rate: float, residency: float, gpu_misses_miss_rate: float | None = None,
           modes=MODES) -> Choice:
    """The mode among `modes` (those the runner can run) with the smallest modelled step time (ties go to the simpler
    mode, in MODES order)."""
    modes = tuple(modes)
    if not modes or any(x not in MODES for x in modes):
        raise ValueError(f"modes={modes!r}: expected a non-empty subset of {list(MODES)}")
    b = _pos("bytes_per_expert", bytes_per_expert)
    m = _pos("miss_rate", miss_rate, zero_ok=True)
    if m > 1:
        raise ValueError(f"miss_rate={miss_rate!r}: expected a fraction in [0, 1]")
    if not 0.0 <= residency <= 1.0:
        raise ValueError(f"residency={residency!r}: expected a fraction in [0, 1]")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r}: expected a positive int")
    profile.check(gpu=None, format=format)
    U = touched(E, top_k, batch)
    b_cpu = profile.executor[format]
    b_zc = profile.zero_copy.get(format, 0.0)
    both = profile.both.get(format, {})
    kw = dict(b_hbm=profile.hbm, c_cpu=profile.cpu_fixed_us, c_gpu=profile.gpu_fixed_us)
    M, R = m * U * b, (1 - m) * U * b
    t = {}
    if residency >= 1.0 or m == 0:
        t["gpu"] = step_us(0.0, U * b, 0.0, b_cpu=b_cpu, b_zc=1.0, **kw)
    else:
        t["hybrid"] = step_us(M, R, 0.0, b_cpu=b_cpu, b_zc=1.0, **kw)
        q = 0.0
        if b_zc > 0:
            mo = m if gpu_misses_miss_rate is None else _pos("gpu_misses_miss_rate", gpu_misses_miss_rate, zero_ok=True)
            t["gpu_misses"] = step_us(mo * U * b, (1 - mo) * U * b, 1.0, b_cpu=b_cpu, b_zc=b_zc, **kw)
            bc, bz = both.get("cpu", b_cpu), both.get("zero_copy", b_zc)
            tc, tz = M / (bc * 1e3), M / (bz * 1e3)
            t_res = kw["c_gpu"] + (R / (kw["b_hbm"] * 1e3) if kw["b_hbm"] > 0 else 0.0)
            q = min(1.0, max(0.0, (kw["c_cpu"] + tc - t_res) / (tc + tz)))
            if 0.0 < q < 1.0:
                t["split"] = step_us(M, R, q, b_cpu=bc, b_zc=bz, **kw)
    t = {k: v for k, v in t.items() if k in modes} or {k: v for k, v in t.items() if k in ("gpu", "hybrid")}
    mode = min(t, key=lambda k: (t[k], MODES.index(k)))
    q_out = {"gpu": 0.0, "hybrid": 0.0, "gpu_misses": 1.0}.get(mode, q if mode == "split" else 0.0)
    others = ", ".join(f"{k} {v:.0f} us" for k, v in t.items() if k != mode)
    why = (f"auto: {mode}{f' q={q_out:.2f}' if mode == 'split' else ''}: model {t[mode]:.0f} us/layer"
           f"{f' vs {others}' if others else ''} (batch {batch}, miss {100 * m:.1f}% of {U:.1f} experts/layer = "
           f"{M / 1e6:.1f} MB; cpu {b_cpu:.1f} GB/s, zero-copy {b_zc:.1f} GB/s, profile from {profile.gpu})")
    return Choice(mode, q_out, t, why)


def slots_from_budget(budget_bytes: int, bytes_per_expert: int, layers: int, E: int) -> int:
    """GPU slots per layer an expert budget holds; ValueError when it holds less than one expert."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"expert budget={budget_bytes!r}: expected bytes (an int >= 0)")
    if budget_bytes < bytes_per_expert:
        raise ValueError(f"expert budget of {budget_bytes} bytes is smaller than one expert ({bytes_per_expert} "
                         "bytes): give the GPU more memory, or strategy='cpu'")
    return min(E, budget_bytes // (bytes_per_expert * layers))
