"""The GPU experts of a model whose layers use different formats: one GpuExperts per distinct (gate_up, down) pair,
each holding the layers of that pair, behind GpuExperts' own load / forward by the model's layer index.

A uniform model gets its one GpuExperts as it is (no mapping in its path).

Thread contract: as GpuExperts (not shareable; the runner's lock orders every call)."""
from __future__ import annotations


def open_gpu_experts(pairs: list[tuple[str, str]], **kw):
    """GpuExperts for a model of these per-layer (gate_up, down) formats; `kw`: GpuExperts' keywords but format and
    num_layers. ValueError naming the pair when GpuExperts cannot run it."""
    from .experts import GpuExperts

    distinct = list(dict.fromkeys(pairs))
    if len(distinct) == 1 and distinct[0][0] == distinct[0][1]:
        return GpuExperts(distinct[0][0], num_layers=len(pairs), **kw)
    return LayerMappedGpuExperts(pairs, **kw)


class LayerMappedGpuExperts:
    """load / forward of model layer `layer` go to its pair's GpuExperts at that pair's local layer index."""

    def __init__(self, pairs: list[tuple[str, str]], **kw):
        from .experts import GpuExperts

        self.pairs = list(pairs)
        self.by_pair: dict[tuple[str, str], GpuExperts] = {}
        self.where: list[tuple[GpuExperts, int]] = []
        counts: dict[tuple[str, str], int] = {}
        for p in self.pairs:
            self.where.append((p, counts.get(p, 0)))
            counts[p] = counts.get(p, 0) + 1
        for p, n in counts.items():
            fmt = p[0] if p[0] == p[1] else p
            try:
                self.by_pair[p] = GpuExperts(fmt, num_layers=n, **kw)
            except (TypeError, ValueError) as e:
                raise ValueError(f"GpuExperts cannot run the (gate_up, down) pair {p} ({e}); use strategy='cpu' "
                                 "for this model") from e
        self.where = [(self.by_pair[p], local) for p, local in self.where]

    def load(self, layer: int, slot: int, banks: dict, expert: int, **kw) -> None:
        g, local = self.where[layer]
        g.load(local, slot, banks, expert, **kw)

    def forward(self, layer: int, x, topk_weights, slots, out=None):
        g, local = self.where[layer]
        return g.forward(local, x, topk_weights, slots, out=out)

    @property
    def bytes_per_expert(self) -> int:
        """The largest pair's (a slot of every layer holds at most this)."""
        return max(g.bytes_per_expert for g in self.by_pair.values())
