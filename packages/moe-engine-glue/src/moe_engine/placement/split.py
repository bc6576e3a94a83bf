"""The miss split: of each layer's non-resident experts, a set the GPU experts read zero-copy from pinned host memory
(zerocopy.py) while the CPU executor computes the rest, at once. The set is chosen per expert (an expert touched by
several tokens of a step is read once either way) so that it carries a fraction q of the expected miss bytes, and is
kept in device tables rewritten in place between steps, like the residency.

The step derives both sides from the live tables with fixed-shape ops, so no route is lost or counted twice whatever
order the tables were rewritten in: a route resident on the GPU goes to its slot; else, if its expert is in the
zero-copy set, to the zero-copy bank; else to the CPU (the CPU skips resident | zero-copy).

Thread contract: owned by its MoERunner; assign() between steps under the runner's lock, tensors read in the step."""
from __future__ import annotations

import numpy as np


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
        self.zc = torch.zeros((layers, E), dtype=torch.bool, device=device)  # True: read zero-copy by the GPU
        self.slot_of = torch.full((layers, E), -1, dtype=torch.int32, device=device)  # expert id, -1 = not
        self._zc = np.zeros((layers, E), bool)

    def host_mask(self, layer: int) -> np.ndarray:
        return self._zc[layer].copy()

    def set(self, layer: int, mask) -> None:
        """Make `mask` (bool [E]) layer `layer`'s zero-copy set (stream-ordered on the current stream)."""
        import torch

        m = np.asarray(mask, bool)
        if m.shape != (self.E,):
            raise ValueError(f"zero-copy set for layer {layer}: shape {m.shape}, expected [E={self.E}]")
        self._zc[layer] = m
        ids = np.where(m, np.arange(self.E), -1).astype(np.int32)
        self.slot_of[layer].copy_(torch.from_numpy(ids))
        self.zc[layer].copy_(torch.from_numpy(m.copy()))

    def routes(self, layer: int, ids, resident_slots, resident_mask):
        """(zero-copy slot per route [T, K], -1 where not; the CPU's skip mask [E]): capture-safe tensor ops."""
        import torch

        ids64 = ids.long()
        z = self.slot_of[layer][ids64.clamp(0, self.E - 1)]
        ok = (ids64 >= 0) & (ids64 < self.E) & (resident_slots < 0)
        return torch.where(ok, z, torch.full_like(z, -1)), resident_mask | self.zc[layer]
