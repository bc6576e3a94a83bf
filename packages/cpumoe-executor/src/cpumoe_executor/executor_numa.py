"""CpuMoeExecutor's NUMA placement (numa.py plans it, numa_banks.py cuts the banks; docs/numa.md): the plan, each
layer's banks copied onto the nodes of the groups that run them, and the report of where they went.

Thread contract: CpuMoeExecutor's (placement runs in its constructor; numa_report() from any thread)."""
from __future__ import annotations

from . import numa as numa_mod
from . import numa_banks
from .cores import _resolve_cores


def _span(a) -> int:
    """Bytes from an array's first element to the end of its last (its strides are positive: validated banks)."""
    return sum((n - 1) * st for n, st in zip(a.shape, a.strides)) + a.itemsize if a.size else 0


class NumaPlacement:
    """Mixin of CpuMoeExecutor: needs its _formats, H, I, E, core_ids, numa_plan, _x, _layers_as and _check."""

    def _plan_numa(self, numa, root, threads, core_ids, layers):
        """The worker groups and slices, or None for the single pool (numa.resolve). The slices start at a multiple
        of every run format's cut unit (their lcm)."""
        if core_ids is not None and numa != "off":
            _resolve_cores(threads, core_ids)  # the single pool's checks first (affinity mask, threads)
        f = self._formats
        plan, self._topology = numa_mod.resolve(numa, self.I, numa_banks.model_cut_unit(f.kernel_formats, self.I),
                                                root=root, threads=threads, core_ids=core_ids)
        if plan is not None:
            per_layer = [g.bytes_per_expert(self.H, self.I) if g is d else
                         g.role_bytes_per_expert("gate_up", self.H, self.I) +
                         d.role_bytes_per_expert("down", self.H, self.I) for g, d in f.run]
            numa_mod.check_memory(plan, self._topology, sum(per_layer) * self.E)
        return plan

    def _place(self, banks) -> None:
        """Each layer (repacked one at a time where the executor repacks), cut into the plan's slices where it
        splits (a two-format layer role by role), copied onto the node of every group that runs each slice."""
        plan, f = self.numa_plan, self._formats
        threads = len(self.core_ids)
        self._placed = [{} for _ in banks]
        for layer, arrays in self._layers_as(banks):
            (g, d), names = f.run[layer], f.names(layer)
            if len(plan.bounds) <= 2:
                pieces = [arrays]
            elif g is d:
                pieces = [g.validate(p)[0] for p in numa_banks.cut(g, dict(zip(names, arrays)), plan.bounds, threads)]
            else:
                cuts = [numa_banks.cut_role(s, role, dict(zip(names, arrays)), plan.bounds, threads)
                        for s, role in ((g, "gate_up"), (d, "down"))]
                pieces = [[gu[n] for n in g.role_banks("gate_up")] + [dn[n] for n in d.role_banks("down")]
                          for gu, dn in zip(*cuts)]
            for gi, grp in enumerate(plan.groups):
                for q in grp.parts:
                    arrs = pieces[q]
                    mem, rec = self._x.place_banks(layer, gi, q, [(a.ctypes.data, _span(a), a.strides[0],
                                                                   a.strides[1] if a.ndim == 3 else a.strides[-1])
                                                                  for a in arrs], *f.bank_maps(layer))
                    self._placed[layer][(gi, q)] = (mem, [(a.shape, a.dtype, a.strides, off)
                                                          for a, off in zip(arrs, rec["offsets"])])
            self._arrays[layer] = None  # the executor holds the placed copies only
        self._arrays, self._banks_ref = None, None

    def _numa_line(self) -> str:
        p = self.numa_plan
        if p is None:
            return "off"
        groups = "; ".join(f"node {g.node}: {len(g.cores)} cores, part {list(g.parts)}" for g in p.groups)
        return f"{p.mode} ({groups}; I cut at {list(p.bounds)})"

    @property
    def numa(self) -> str:
        """"off" (the single pool), "split" or "replicate": what runs (numa_report() for the groups and placement)."""
        return "off" if self.numa_plan is None else self.numa_plan.mode

    def numa_report(self) -> dict:
        """The plan and where every placed bank went: mode, why, the topology read (root, nodes), the groups (node,
        cores, parts), the slices' I bounds, and per (layer, group, part) the placement record: node, bytes, mbind's
        answer ("ok", "EINVAL" for a node the kernel does not have, "ENOSYS" without NUMA, "not asked"), how many
        threads wrote the pages first and how many of those were pinned, and of `pages_checked` sampled pages how
        many sit on the node (move_pages)."""
        self._check()
        p = self.numa_plan
        topo = self._topology
        groups = ([{"node": g.node, "cores": list(g.cores), "parts": list(g.parts)} for g in p.groups] if p else
                  [{"node": -1, "cores": list(self.core_ids), "parts": [0]}])
        return {"mode": self.numa, "why": p.why if p else "numa off, one NUMA node, or a format auto cannot cut",
                "root": topo.root if topo else None,
                "nodes": [{"id": n.id, "cpus": list(n.cpus), "mem_total": n.mem_total, "mem_free": n.mem_free}
                          for n in topo.nodes] if topo else None,
                "groups": groups, "bounds": list(p.bounds) if p else [0, self.I],
                "placements": [{k: v for k, v in r.items() if k != "offsets"} for r in self._x.placements()]}
