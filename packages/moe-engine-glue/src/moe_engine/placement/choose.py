"""strategy="auto" from measurements: a step-time model over the profile's bandwidths and the live miss rate picks
gpu, hybrid (misses on the CPU), hybrid+split (a fraction q of the misses read by the GPU experts from pinned host
memory, the rest on the CPU, at once) or gpu-only misses (offload-like: q = 1, the CPU idle).

The model, per layer and step (docs/placement.md): n experts touched (distinct routes of the batch), each missing
the GPU's slots with probability m, b bytes each; of the k that miss, the GPU reads k_gpu zero-copy and the CPU the
rest: k_gpu ~ Binomial(k, q) under the split's default rule, "expert" (each miss's expert in a fixed zero-copy set
with probability q), k_gpu = round(q k) under rule "step":
    t_cpu = c_cpu + (k - k_gpu) b / B_cpu                       (the executor, fixed cost c_cpu: handshake, wake)
    t_gpu = c_gpu + (n - k) b / B_hbm + k_gpu b / B_zc          (the GPU experts, fixed cost c_gpu)
    t = E[max(t_cpu, t_gpu)] over k ~ Binomial(n, m) and k_gpu; the CPU part is 0 where it has nothing.
The expectation, not the two sides' mean rates balanced, is what a step pays: at batch 1 a layer misses a handful of
experts and under rule "expert" the split of so few is rarely even (measured on an H100, fp8_block, batch 1, no resident
experts: q 0.2 ran 345 us, q 0.35 374 and q 0 356, where balanced mean rates gave q 0.33 at 250 us). q is the best of
0.05-0.95 in steps of 0.05. The lone bandwidths are used: the profile's at-once rates did not predict the runner's split
(on that H100 fp8_block's executor read 17.3 GB/s beside the zero-copy reads in the profile; at 0% residency the
runner's split ran 1.01-1.14x this model's step from the lone rates). A mode whose offload-like miss rate differs (a
cache that loads every miss) is given its own rate.

Thread contract: pure functions."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .profile import Profile, ProfileError
from .split import DEFAULT_RULE, take_count

MODES = ("gpu", "hybrid", "split", "gpu_misses")
TIES = ("gpu", "hybrid", "gpu_misses", "split")  # the simpler first


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


@functools.lru_cache(maxsize=8)
def _log_factorials(n: int) -> np.ndarray:
    return np.array([math.lgamma(i + 1) for i in range(n + 1)])


def _pmf(n: int, p: float) -> np.ndarray:
    """Binomial(n, p) probabilities of 0..n."""
    if p <= 0.0 or p >= 1.0:
        out = np.zeros(n + 1)
        out[0 if p <= 0.0 else n] = 1.0
        return out
    k = np.arange(n + 1)
    lg = _log_factorials(n)
    return np.exp(lg[n] - lg - lg[::-1] + k * math.log(p) + (n - k) * math.log1p(-p))


def _split_weights(n: int, m: float, q: float, k: np.ndarray, g: np.ndarray, rule: str = DEFAULT_RULE) -> np.ndarray:
    """P[k, g] over the grids k, g of 0..n: k of n touched experts miss (probability m each), g of those are read by
    the GPU (round(q k) under rule "step", as split_routes rounds; q each under "expert")."""
    pk = _pmf(n, m)
    if rule == "step":
        return np.where(g == take_count(q, k), pk[:, None], 0.0)
    if q <= 0.0 or q >= 1.0:
        return np.where(g == (0 if q <= 0.0 else k), pk[:, None], 0.0)
    lg = _log_factorials(n)
    inside = g <= k
    kg = np.where(inside, k - g, 0)
    logp = lg[k] - lg[g] - lg[kg] + g * math.log(q) + kg * math.log1p(-q)
    return np.where(inside, pk[:, None] * np.exp(np.where(inside, logp, 0.0)), 0.0)


def step_us(n: int, m: float, q: float, b: float, *, b_cpu: float, b_zc: float, b_hbm: float, c_cpu: float,
            c_gpu: float, rule: str = DEFAULT_RULE) -> float:
    """The model's expected us for one layer step (bytes in, GB/s = 1e3 bytes/us)."""
    k, g = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    res = (n - k) * b / (b_hbm * 1e3) if b_hbm > 0 else 0.0 * k
    t_gpu = c_gpu + res + (g * b / (b_zc * 1e3) if b_zc > 0 else 0.0)
    t_cpu = np.where(k > g, c_cpu + (k - g) * b / (b_cpu * 1e3), 0.0)
    return float((_split_weights(n, m, q, k, g, rule) * np.maximum(t_gpu, t_cpu)).sum())


SPLIT_QS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # the split's q tried: 0.05-0.95


def choose(profile: Profile, format: str, *, bytes_per_expert: int, E: int, top_k: int, batch: int,
           miss_rate: float, residency: float, gpu_misses_miss_rate: float | None = None,
           modes=MODES, cpu_GBps: float | None = None, rule: str = DEFAULT_RULE,
           split_rates: str = "lone") -> Choice:
    """The mode among `modes` (those the runner can run) with the smallest modelled step time (ties go to the simpler
    mode, in TIES order). cpu_GBps: the executor's lone rate measured live (MissSplit), in place of the profile's.
    rule: the split's ("step" or "expert", placement/split.py). split_rates: the split mode's two rates, "lone" (as
    the other modes) or "at_once" (the CPU's rate scaled by the profile's both-at-once / lone ratio, the link's
    both-at-once rate; tools/split_model replays a measured grid with either)."""
    if split_rates not in ("lone", "at_once"):
        raise ValueError(f"split_rates={split_rates!r}: expected 'lone' or 'at_once'")
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
    n = max(1, round(U))
    b_cpu = profile.executor[format] if cpu_GBps is None else _pos("cpu_GBps", cpu_GBps)
    b_zc = profile.zero_copy.get(format, 0.0)
    kw = dict(b_cpu=b_cpu, b_hbm=profile.hbm, c_cpu=profile.cpu_fixed_us, c_gpu=profile.gpu_fixed_us)
    t, q = {}, 0.0
    if residency >= 1.0 or m == 0:
        t["gpu"] = step_us(n, 0.0, 0.0, b, b_zc=b_zc, **kw)
    else:
        t["hybrid"] = step_us(n, m, 0.0, b, b_zc=b_zc, **kw)
        if b_zc > 0:
            mo = m if gpu_misses_miss_rate is None else _pos("gpu_misses_miss_rate", gpu_misses_miss_rate, zero_ok=True)
            t["gpu_misses"] = step_us(n, mo, 1.0, b, b_zc=b_zc, **kw)
            if "split" in modes:
                sk = dict(kw, b_zc=b_zc)
                if split_rates == "at_once":
                    both = profile.both.get(format)
                    if not both:
                        raise ProfileError(f"split_rates='at_once': the profile has no both-at-once figures for "
                                           f"{format!r}; rerun `moe-engine bench --profile --formats {format}`")
                    sk.update(b_cpu=b_cpu * both["cpu"] / profile.executor[format], b_zc=both["zero_copy"])
                ts = {x: step_us(n, m, x, b, rule=rule, **sk) for x in SPLIT_QS}
                q = min(ts, key=ts.get)
                t["split"] = ts[q]
    t = {k: v for k, v in t.items() if k in modes} or {k: v for k, v in t.items() if k in ("gpu", "hybrid")}
    low = min(t.values())  # ties (a q whose rounded counts are all or none of the misses) go to the simpler mode
    mode = min((k for k in t if t[k] <= low * (1 + 1e-9)), key=TIES.index)
    q_out = {"gpu": 0.0, "hybrid": 0.0, "gpu_misses": 1.0}.get(mode, q if mode == "split" else 0.0)
    others = ", ".join(f"{k} {v:.0f} us" for k, v in t.items() if k != mode)
    M = m * U * b
    why = (f"auto: {mode}{f' q={q_out:.2f}' if mode == 'split' else ''}: model {t[mode]:.0f} us/layer"
           f"{f' vs {others}' if others else ''} (batch {batch}, miss {100 * m:.1f}% of {U:.1f} experts/layer = "
           f"{M / 1e6:.1f} MB; cpu {b_cpu:.1f} GB/s{' live' if cpu_GBps is not None else ''}, zero-copy "
           f"{b_zc:.1f} GB/s, profile from {profile.gpu})")
    return Choice(mode, q_out, t, why)


def slots_from_budget(budget_bytes: int, bytes_per_expert: int, layers: int, E: int) -> int:
    """GPU slots per layer an expert budget holds; ValueError when it holds less than one expert."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"expert budget={budget_bytes!r}: expected bytes (an int >= 0)")
    if budget_bytes < bytes_per_expert:
        raise ValueError(f"expert budget of {budget_bytes} bytes is smaller than one expert ({bytes_per_expert} "
                         "bytes): give the GPU more memory, or strategy='cpu'")
    return min(E, budget_bytes // (bytes_per_expert * layers))
