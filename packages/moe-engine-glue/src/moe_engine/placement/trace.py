"""A routing-trace model: per-layer top-k expert ids per decode token, with skewed popularity and temporal locality,
for comparing placements where no real routing is at hand (docs/placement.md states the calibration).

Per layer, experts are ranked by a fixed random permutation (the model's identity, from `model_seed`) and token t
draws its top_k distinct experts as follows:
- each of the previous token's experts is kept with probability `sticky` (a route that repeats from one token to the
  next: the locality an LRU cache feeds on);
- the rest are drawn without replacement (Gumbel top-k) from a Zipf popularity p(rank) ~ (rank + 1) ** -zipf over
  the layer's current ranking, times `leak` past the first `active` fraction of the ranks (a phase's working set:
  a cache smaller than it thrashes, one larger holds nearly every route);
- the current ranking is the base ranking with a fraction `shift` of its positions shuffled afresh at each phase
  change (a topic change: one per `phase_tokens` tokens on average, shared by every layer of a sequence, never
  cumulative, so the long-run popularity stays anchored to the base ranking).
A batch is `batch` independent sequences of one model (same base ranking, their own phases).

Thread contract: TraceModel is an immutable value; generate() uses only its own generator, so calls may run in
parallel."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class TraceModel:
    E: int
    top_k: int
    layers: int = 8
    zipf: float = 1.0
    sticky: float = 0.5
    phase_tokens: float = 256.0
    shift: float = 0.5
    active: float = 1.0
    leak: float = 1.0
    model_seed: int = 0

    def __post_init__(self):
        for name in ("E", "top_k", "layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: expected a positive int")
        if self.top_k > self.E:
            raise ValueError(f"top_k={self.top_k}: expected at most E={self.E}")
        if not (self.zipf >= 0 and np.isfinite(self.zipf)):
            raise ValueError(f"zipf={self.zipf!r}: expected a finite exponent >= 0")
        for name in ("sticky", "shift", "active", "leak"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected a probability in [0, 1]")
        if not self.phase_tokens >= 1:
            raise ValueError(f"phase_tokens={self.phase_tokens!r}: expected a mean phase length >= 1 token")

    def params(self) -> dict:
        return asdict(self)

    def base_ranking(self) -> np.ndarray:
        """[layers, E]: the expert at each popularity rank (rank 0 the most routed), per layer."""
        rng = np.random.default_rng([self.model_seed, 0x7ace])
        return np.stack([rng.permutation(self.E) for _ in range(self.layers)])

    def generate(self, steps: int, *, batch: int = 1, seed: int = 1) -> np.ndarray:
        """ids [steps, batch, layers, top_k] int32: the routes of `steps` decode steps of `batch` sequences."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps={steps!r}: expected a positive int")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch={batch!r}: expected a positive int")
        E, K, L = self.E, self.top_k, self.layers
        rng = np.random.default_rng([self.model_seed, seed])
        base = np.tile(self.base_ranking(), (batch, 1))  # rows: sequence-major, then layer
        R = batch * L
        logp_rank = -self.zipf * np.log1p(np.arange(E, dtype=np.float64))
        logp_rank[int(np.ceil(self.active * E)):] += np.log(self.leak) if self.leak > 0 else -np.inf
        logp = np.empty((R, E))
        rows = np.arange(R)[:, None]
        n_shift = int(round(self.shift * E))

        def rerank(seq_rows):
            for r in seq_rows:
                ranking = base[r].copy()
                if n_shift > 1:
                    pos = rng.choice(E, n_shift, replace=False)
                    ranking[pos] = ranking[rng.permutation(pos)]
                logp[r, ranking] = logp_rank

        rerank(range(R))
        out = np.empty((steps, R, K), np.int32)
        prev = None
        p_phase = 1.0 / self.phase_tokens
        for t in range(steps):
            changed = np.flatnonzero(rng.random(batch) < p_phase) if t else np.empty(0, int)
            if changed.size:
                rerank((changed[:, None] * L + np.arange(L)).ravel())
            keys = logp + rng.gumbel(size=(R, E))
            if prev is not None:
                keep = rng.random((R, K)) < self.sticky
                kept = np.where(keep, prev, 0)
                np.put_along_axis(keys, kept, np.where(keep, np.inf, np.take_along_axis(keys, kept, 1)), 1)
            top = np.argpartition(-keys, K - 1, axis=1)[:, :K]
            out[t] = top[rows, np.argsort(-keys[rows, top], axis=1)]
            prev = out[t]
        return out.reshape(steps, batch, L, K)


def counts(ids: np.ndarray, E: int) -> np.ndarray:
    """ids [..., layers, top_k] (-1 = no route) -> [layers, E] int64 routes per expert."""
    L = ids.shape[-2]
    flat = np.moveaxis(ids, -2, 0).reshape(L, -1)
    out = np.zeros((L, E), np.int64)
    for li in range(L):
        v = flat[li]
        out[li] = np.bincount(v[v >= 0], minlength=E)
    return out
