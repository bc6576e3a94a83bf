"""The GPU experts of a model whose layers differ, in format or in slots: one GpuExperts per distinct ((gate_up, down)
pair, slots) group, each holding the layers of that group, behind GpuExperts' own load / forward by the model's layer
index. A layer with no slots (residency="layers"' CPU layers) holds nothing on the GPU; its forward adds nothing.

A uniform model with one slot count gets its one GpuExperts as it is (no mapping in its path).

Thread contract: as GpuExperts (not shareable; the runner's lock orders every call)."""
from __future__ import annotations


def open_gpu_experts(pairs: list[tuple[str, str]], *, capacity: int, layer_capacity=None, host_pairs=None, **kw):
    """GpuExperts for a model of these per-layer (gate_up, down) formats, `capacity` slots per layer or
    `layer_capacity` (one count per layer); host_pairs: the per-layer formats of the banks the loads read, where they
    differ (a CPU layout of the pair's format: GpuExperts' host_format); `kw`: GpuExperts' keywords but format,
    num_layers and capacity. ValueError naming the pair when GpuExperts cannot run it."""
    from .experts import GpuExperts

    caps = [capacity] * len(pairs) if layer_capacity is None else [int(c) for c in layer_capacity]
    host_pairs = list(pairs) if host_pairs is None else [tuple(p) for p in host_pairs]
    distinct = list(dict.fromkeys(zip(pairs, host_pairs)))
    if len(distinct) == 1 and distinct[0][0][0] == distinct[0][0][1] and len(set(caps)) == 1:
        (p, h), = distinct
        return GpuExperts(p[0], num_layers=len(pairs), capacity=caps[0], host_format=_host(p, h), **kw)
    return LayerMappedGpuExperts(pairs, caps, host_pairs, **kw)


def _host(pair, host):
    """GpuExperts' host_format for a layer of `pair` whose banks are in `host`: None where they are the same."""
    if tuple(host) == tuple(pair):
        return None
    return host[0] if host[0] == host[1] else tuple(host)


class LayerMappedGpuExperts:
    """load / forward of model layer `layer` go to its group's GpuExperts at that group's local layer index; a layer
    without slots has none (forward returns zeros: no route of it is resident)."""

    def __init__(self, pairs: list[tuple[str, str]], caps: list[int], host_pairs=None, **kw):
        from .experts import GpuExperts

        self.pairs, self.caps = list(pairs), list(caps)
        hosts = self.pairs if host_pairs is None else list(host_pairs)
        self.groups: dict[tuple, GpuExperts] = {}
        where, counts = [], {}
        for p, c, h in zip(self.pairs, self.caps, hosts):
            key = (p, c, h)
            where.append((key, counts.get(key, 0)) if c > 0 else (None, 0))
            if c > 0:
                counts[key] = counts.get(key, 0) + 1
        for (p, c, h), n in counts.items():
            fmt = p[0] if p[0] == p[1] else p
            try:
                self.groups[(p, c, h)] = GpuExperts(fmt, num_layers=n, capacity=c, host_format=_host(p, h), **kw)
            except (TypeError, ValueError) as e:
                raise ValueError(f"GpuExperts cannot run the (gate_up, down) pair {p} ({e}); use strategy='cpu' "
                                 "for this model") from e
        self.where = [(self.groups[k] if k is not None else None, local) for k, local in where]

    def load(self, layer: int, slot: int, banks: dict, expert: int, **kw) -> None:
        g, local = self.where[layer]
        if g is None:
            raise ValueError(f"layer {layer} keeps no experts on the GPU (no slots); expected a layer with slots")
        g.load(local, slot, banks, expert, **kw)

    def forward(self, layer: int, x, topk_weights, slots, out=None):
        import torch

        g, local = self.where[layer]
        if g is None:  # no slots: no resident route
            return torch.zeros((x.shape[0], x.shape[1]), dtype=torch.bfloat16, device=x.device) if out is None \
                else out.zero_()
        return g.forward(local, x, topk_weights, slots, out=out)

    @property
    def bytes_per_expert(self) -> int:
        """The largest group's (a slot of every layer holds at most this)."""
        return max((g.bytes_per_expert for g in self.groups.values()), default=0)
