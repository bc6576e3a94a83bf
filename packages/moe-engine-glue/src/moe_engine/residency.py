"""Which experts of each layer live in GPU memory: a bool mask per layer, and the device tables a captured graph
reads (mask [L, E] for the CPU side, slot_of [L, E] for the GPU experts), rewritten in place so a change of
residency between steps needs no new capture. One table lookup decides each route: resident -> its GPU slot,
else the CPU; no route is counted twice or dropped."""
from __future__ import annotations

import numpy as np


class Residency:
    """capacity: GPU slots per layer, or one count per layer (residency="layers": E or 0); `.capacity` is the most of
    any layer, `.caps` each layer's."""

    def __init__(self, num_layers: int, E: int, capacity, device):
        import torch

        caps = [capacity] * num_layers if isinstance(capacity, int) else list(capacity)
        if len(caps) != num_layers or not all(isinstance(c, int) and 0 <= c <= E for c in caps):
            raise ValueError(f"capacity={capacity!r}: expected an int in [0, E={E}] (GPU slots per layer) or one "
                             f"per layer ({num_layers})")
        self.num_layers, self.E, self.caps = num_layers, E, caps
        self.capacity = max(caps)
        self.mask = torch.zeros((num_layers, E), dtype=torch.bool, device=device)  # True: the expert runs on the GPU
        self.slot_of = torch.full((num_layers, E), -1, dtype=torch.int32, device=device)  # its slot, -1 = CPU
        self._slot = np.full((num_layers, E), -1, np.int32)  # host mirror of slot_of

    def host_mask(self, layer: int) -> np.ndarray:
        return self._slot[layer] >= 0

    def fraction(self) -> float:
        return float((self._slot >= 0).mean())

    def plan(self, layer: int, mask) -> list[tuple[int, int]]:
        """Make `mask` (bool [E]) layer `layer`'s residency on the host mirror; returns the (expert, slot) pairs
        whose weights must be loaded. Experts that stay keep their slots; new ones take the freed slots."""
        m = np.asarray(mask.detach().cpu() if hasattr(mask, "detach") else mask)
        if m.shape != (self.E,) or m.dtype.kind not in "bui":
            raise ValueError(f"residency mask for layer {layer}: shape {m.shape} dtype {m.dtype}, expected a bool "
                             f"array of length E={self.E}")
        m = m.astype(bool)
        cap = self.caps[layer]
        if int(m.sum()) > cap:
            raise ValueError(f"residency mask for layer {layer}: {int(m.sum())} resident experts, expected at most "
                             f"capacity={cap} (the layer's GPU slots, set at construction)")
        row = self._slot[layer]
        row[~m] = -1
        free = sorted(set(range(cap)) - set(row[row >= 0].tolist()))
        loads = []
        for e in np.flatnonzero(m & (row < 0)).tolist():
            row[e] = free.pop(0)
            loads.append((e, int(row[e])))
        return loads

    def commit(self, layer: int) -> None:
        """Copy layer `layer`'s host tables to the device (stream-ordered on the current stream)."""
        import torch

        row = torch.from_numpy(self._slot[layer].copy())
        self.slot_of[layer].copy_(row)
        self.mask[layer].copy_(row >= 0)

    def slots(self, layer: int, ids):
        """ids [T, K] (any int dtype, -1 = no route) -> GPU slot per route, -1 where the route is not on the GPU.
        Fixed-shape tensor ops only: capture-safe, reads the live tables."""
        import torch

        table = self.slot_of[layer]
        ids64 = ids.long()
        s = table[ids64.clamp(0, self.E - 1)]
        # ids >= E never reach a slot; the CPU side rejects them (the executor's error word)
        return torch.where((ids64 >= 0) & (ids64 < self.E), s, torch.full_like(s, -1))
