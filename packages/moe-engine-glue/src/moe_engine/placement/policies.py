"""Which experts of each layer sit in the GPU's slots: static placements (random, uniform, top of a count profile)
and the hot placer (an exponential moving average of routed counts, re-placed every N steps with hysteresis). The
runner (residency="hot") and the trace simulator (simulate.py) share these; no second copy of the rule.

Thread contract: the functions are pure; a HotPlacer is owned by one thread (the runner calls it under its lock)."""
from __future__ import annotations

import numpy as np

STATIC = ("random", "uniform", "static")


def _check_int(name: str, v, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}={v!r}: expected an int {rng}")
    return int(v)


def static_masks(kind: str, layers: int, E: int, capacity: int, *, counts=None, seed: int = 0) -> np.ndarray:
    """bool [layers, E] with `capacity` resident experts per layer.
    random: a seeded random subset per layer; uniform: evenly spaced expert ids (the same in every layer);
    static: the `capacity` most-routed experts of each layer in `counts` [layers, E] (a saved profile)."""
    capacity = _check_int("capacity", capacity, 0, E)
    out = np.zeros((layers, E), bool)
    if kind == "random":
        rng = np.random.default_rng(seed)
        for li in range(layers):
            out[li, rng.permutation(E)[:capacity]] = True
    elif kind == "uniform":
        out[:, (np.arange(capacity) * E) // max(capacity, 1)] = capacity > 0
    elif kind == "static":
        c = np.asarray(counts, dtype=np.float64) if counts is not None else None
        if c is None or c.shape != (layers, E):
            raise ValueError(f"counts: shape {None if c is None else c.shape}, expected [layers={layers}, E={E}] "
                             "routed counts (a profile from `moe-engine profile`)")
        top = np.argsort(-c, axis=1, kind="stable")[:, :capacity]
        np.put_along_axis(out, top, True, axis=1)
    else:
        raise ValueError(f"placement {kind!r}: expected one of {list(STATIC)}")
    return out


class HotPlacer:
    """Per layer, the experts with the largest moving average of routed counts, within `capacity` slots.

    observe() adds a window's counts [layers, E]; place() folds them into the average (the old average weighs
    0.5 ** (window steps / half_life)) and returns the new masks [layers, E]. A non-resident expert displaces the
    weakest resident one only when its average exceeds that one's by the factor 1 + hysteresis, so near-ties do not
    trade places every window (each trade is an expert copy)."""

    def __init__(self, layers: int, E: int, capacity: int, *, every: int = 50, half_life: float = 200.0,
                 hysteresis: float = 0.25, initial=None):
        self.layers, self.E = _check_int("layers", layers, 1), _check_int("E", E, 1)
        self.capacity = _check_int("capacity", capacity, 0, E)
        self.every = _check_int("every", every, 1)
        if not (half_life > 0 and np.isfinite(half_life)):
            raise ValueError(f"half_life={half_life!r}: expected a positive number of steps")
        if not (hysteresis >= 0 and np.isfinite(hysteresis)):
            raise ValueError(f"hysteresis={hysteresis!r}: expected a factor >= 0")
        self.half_life, self.hysteresis = float(half_life), float(hysteresis)
        self.ema = np.zeros((layers, E))
        self.window = np.zeros((layers, E))
        self.window_steps = 0
        if initial is None:
            initial = static_masks("random", layers, E, capacity)
        self.mask = np.array(initial, dtype=bool, copy=True)
        if self.mask.shape != (layers, E) or (self.mask.sum(1) > capacity).any():
            raise ValueError(f"initial: expected bool masks [layers={layers}, E={E}] with at most capacity="
                             f"{capacity} resident experts per layer")

    def rate(self) -> np.ndarray:
        """[layers, E] routes per step the average stands for (in a steady state the average holds
        window / (1 - decay) routes, a window being `every` steps)."""
        decay = 0.5 ** (self.every / self.half_life)
        return self.ema * (1.0 - decay) / self.every

    def observe(self, counts, steps: int = 1) -> None:
        c = np.asarray(counts, dtype=np.float64)
        if c.shape != (self.layers, self.E):
            raise ValueError(f"counts: shape {c.shape}, expected [layers={self.layers}, E={self.E}]")
        self.window += c
        self.window_steps += steps

    def due(self) -> bool:
        return self.window_steps >= self.every

    def place(self) -> np.ndarray:
        """Fold the window into the average and return the masks [layers, E] (self.mask, updated in place)."""
        self.ema *= 0.5 ** (self.window_steps / self.half_life)
        self.ema += self.window
        self.window[:] = 0
        self.window_steps = 0
        for li in range(self.layers):
            self._place_layer(li)
        return self.mask

    def _place_layer(self, li: int) -> None:
        m, a = self.mask[li], self.ema[li]
        res, out = np.flatnonzero(m), np.flatnonzero(~m)
        free = self.capacity - res.size
        cand = out[np.argsort(-a[out], kind="stable")]
        if free > 0:  # empty slots take the best candidates with any count at all
            take = cand[:free][a[cand[:free]] > 0]
            m[take] = True
            cand = cand[take.size:]
        weak = res[np.argsort(a[res], kind="stable")]
        n = min(weak.size, cand.size)
        swap = a[cand[:n]] > (1.0 + self.hysteresis) * a[weak[:n]]
        k = int(np.argmin(swap)) if not swap.all() else n  # sorted both ways: the first failing pair ends the trades
        m[weak[:k]] = False
        m[cand[:k]] = True
