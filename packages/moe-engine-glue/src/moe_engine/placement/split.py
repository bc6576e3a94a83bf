"""The miss split: of each step's non-resident experts, a share the GPU experts read zero-copy from pinned host memory
(zerocopy.py) while the CPU executor computes the rest, at once. It goes by expert (an expert touched by several
tokens of a step is read once either way) and follows one of two rules, both kept in device tables rewritten in
place between steps, like the residency:
  "expert" (the default): a fixed zero-copy set per layer carrying a fraction q of the expected miss bytes
    (zero_copy_set), so a step's share is what its routes happen to draw;
  "step": each step, round(q * n) of the n distinct experts it misses (gpu/split_routes.py), so a batch-1 step's
    ~8 misses divide as evenly as whole experts allow.

The step derives both sides from the live tables in one kernel, so no route is lost or counted twice whatever order
the tables were rewritten in: a route resident on the GPU goes to its slot; else, if the GPU takes its expert this
step, to the zero-copy bank; else to the CPU (the CPU skips resident | taken).

Thread contract: owned by its MoERunner; assign() between steps under the runner's lock, tensors read in the step."""
from __future__ import annotations

import numpy as np

# "expert" is the rule measured on a GPU (docs/moe-engine.md); "step" is tested against numpy in Triton's interpreter
# and waits for its device run (bench/device/placement_h200.sh STAGE="split replay" RULE=step) before it replaces it
DEFAULT_RULE = "expert"
RULES = ("expert", "step")
SHIFT = 20  # q in fixed point, 2^20 for 1: round(q n) exact on the GPU and here alike (q 0.35, n 10: 3.5 in float64,
Q_ONE = 1 << SHIFT  # 3.4999 in float32)


def q_fixed(q: float) -> int:
    """q in [0, 1] as the device table holds it."""
    return int(round(float(q) * Q_ONE))


def take_count(q: float, n):
    """round(q n), halves up, as gpu/split_routes.py computes it (n: an int or an int array)."""
    return (q_fixed(q) * n + (Q_ONE >> 1)) >> SHIFT


def zero_copy_set(resident, load, q: float, eligible: bool = True) -> np.ndarray:
    """bool [E]: the non-resident experts the GPU reads zero-copy, hottest first, until they carry a fraction q of
    the expected miss bytes. load [E]: routes per step (an average; None = equal); an expert with rate l is touched in
    a step with probability 1 - exp(-l) (Poisson), so that is its expected share of the miss bytes."""
    if not (isinstance(q, (int, float)) and not isinstance(q, bool) and 0.0 <= q <= 1.0):
        raise ValueError(f"split={q!r}: expected the fraction of the miss bytes the GPU reads, in [0, 1]")
    resident = np.asarray(resident, bool)
    out = np.zeros(resident.shape, bool)
    miss = np.flatnonzero(~resident)
    if not eligible or q == 0.0 or miss.size == 0:
        return out
    if q == 1.0:
        out[miss] = True
        return out
    lam = np.ones(resident.shape) if load is None else np.asarray(load, np.float64)
    p = 1.0 - np.exp(-np.maximum(lam[miss], 0.0))
    if p.sum() <= 0:
        p = np.ones_like(p)
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order]) / p.sum()
    n = int(np.argmin(np.abs(np.concatenate([[0.0], cum]) - q)))  # the prefix whose share is nearest q
    out[miss[order[:n]]] = True
    return out


class SplitTable:
    def __init__(self, layers: int, E: int, device):
        import torch

        self.layers, self.E = layers, E
        self.zc = torch.zeros((layers, E), dtype=torch.bool, device=device)  # rule "expert": the fixed set
        self.q = torch.zeros((layers, 1), dtype=torch.int32, device=device)  # rule "step": each step's share (q_fixed)
        self._zc = np.zeros((layers, E), bool)

    def host_mask(self, layer: int) -> np.ndarray:
        """bool [E]: the layer's fixed zero-copy set (none under the "step" rule)."""
        return self._zc[layer].copy()

    def set(self, layer: int, mask, q: float = 0.0) -> None:
        """Make `mask` (bool [E]) layer `layer`'s fixed zero-copy set and q its per-step share (stream-ordered on the
        current stream)."""
        import torch

        m = np.asarray(mask, bool)
        if m.shape != (self.E,):
            raise ValueError(f"zero-copy set for layer {layer}: shape {m.shape}, expected [E={self.E}]")
        self._zc[layer] = m
        self.zc[layer].copy_(torch.from_numpy(m.copy()))
        self.q[layer].fill_(q_fixed(q))

    def routes(self, layer: int, ids, resident_mask):
        """(zero-copy expert per route [T, K], -1 where not; the CPU's skip mask [E]): one capture-safe kernel."""
        from ..gpu.split_routes import split_routes

        skip, zc = split_routes(ids, resident_mask, self.zc[layer], self.q[layer], SHIFT)
        return zc, skip
