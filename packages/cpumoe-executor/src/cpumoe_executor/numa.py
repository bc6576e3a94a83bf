"""NUMA topology (sysfs) and the executor's plan for it: one worker group per node, the I-slices each runs.

A dual-socket host reads a single pool's banks half across the socket link. CpuMoeExecutor(numa=...) runs one
worker group per node instead (docs/numa.md):
- "split" (the default on 2+ nodes): each layer's experts are cut by intermediate rows (I) into one slice per
  node, each node's slice placed on that node and run by its workers; the down terms of every slice are summed in
  a fixed order (slices in I order, routes in route order), so the result does not depend on nodes or threads.
- "replicate": a full copy of the banks on every node, each worker reading its own node's copy (more memory, the
  single pool's exact bits).
- "off": the single pool (the default on one node, and where a format cannot be cut: numa_banks.cut_unit).

Topology is read under a sysfs root ("/sys", or CPUMOE_SYSFS_ROOT, or the `root` argument), so tests describe
any machine: nodes/node<N>/cpulist and meminfo, cpu/online, cpu<N>/topology/thread_siblings_list, fs/cgroup.
Everything here is a pure function of its arguments and that tree: any thread may call it.
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass

from . import _native

SYSFS_ENV = "CPUMOE_SYSFS_ROOT"
MODES = ("split", "replicate", "off")
MAX_PARTS = _native.MAX_PARTS
# Slices start at multiples of 32 rows where every node still gets one (a bf16 row slice then starts on a
# 64-byte line), else at the format's own cut unit.
ALIGN = 32


@dataclass(frozen=True)
class Node:
    """A NUMA node: its online CPUs (none for a memory-only node) and memory in bytes (-1: meminfo says nothing)."""

    id: int
    cpus: tuple
    mem_total: int
    mem_free: int


@dataclass(frozen=True)
class Topology:
    root: str
    nodes: tuple  # Node, by id (memory-only nodes included)
    online: tuple  # online CPUs

    def node_of(self, cpu: int) -> int | None:
        return next((n.id for n in self.nodes if cpu in n.cpus), None)


def sysfs_root(root: str | None = None) -> str:
    """`root`, else CPUMOE_SYSFS_ROOT, else /sys."""
    return root or os.environ.get(SYSFS_ENV) or "/sys"


def topology(root: str | None = None) -> Topology:
    """The nodes under the sysfs root, their CPUs restricted to the online ones. A kernel without node directories
    (no NUMA) is one node 0 holding every online CPU."""
    root = sysfs_root(root)
    online = tuple(_cpulist(_read(os.path.join(root, "devices/system/cpu/online"))))
    nodes = []
    for nid, cpus, total, free in _numa_nodes(root):
        nodes.append(Node(nid, tuple(c for c in cpus if not online or c in online), total, free))
    if not nodes:
        nodes = [Node(0, online or tuple(_native.allowed_cpus()), -1, -1)]
    return Topology(root, tuple(nodes), online)


def _read(path: str) -> str:
    """A sysfs file's text, "" where it is missing or unreadable (a kernel or container without it)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _cpulist(text: str) -> list:
    """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11] (the executor's own parser, as for thread_siblings_list)."""
    return list(_native.parse_cpulist(text.strip()))


def _numa_nodes(root: str) -> list:
    """(id, cpus, MemTotal bytes, MemFree bytes) of each devices/system/node/node<id> under root, by id; -1 where
    meminfo does not say. Python reads it: the text is small, and a reader here has no native failure mode (a
    C++ reader segfaulted on the GPU host's sysfs in a GCC 13 build)."""
    d = os.path.join(root, "devices/system/node")
    try:
        names = os.listdir(d)
    except OSError:
        return []
    out = []
    for name in names:
        if not re.fullmatch(r"node[0-9]+", name):
            continue
        mem = {}
        for line in _read(os.path.join(d, name, "meminfo")).splitlines():
            f = line.split()  # "Node 0 MemTotal:       24683784 kB"
            if len(f) >= 4 and f[2] in ("MemTotal:", "MemFree:") and f[3].isdigit():
                mem[f[2]] = int(f[3]) * 1024
        out.append((int(name[4:]), _cpulist(_read(os.path.join(d, name, "cpulist"))), mem.get("MemTotal:", -1),
                    mem.get("MemFree:", -1)))
    return sorted(out)


@dataclass(frozen=True)
class Group:
    """One worker group: the node its banks are placed on, its cores (the first group's first core is the caller's,
    where the coordinator runs) and the parts (I-slices) it runs, in order."""

    node: int
    cores: tuple
    parts: tuple


@dataclass(frozen=True)
class NumaPlan:
    """Worker groups and the I-slices they run: part p is rows [bounds[p], bounds[p + 1]) of every expert's I.
    mode "off" is one group on the given arrays; "split" and "replicate" place each group's banks on its node."""

    mode: str
    groups: tuple
    bounds: tuple
    why: str = ""

    @property
    def parts(self) -> list:
        return list(zip(self.bounds[:-1], self.bounds[1:]))

    @property
    def cores(self) -> list:
        return [c for g in self.groups for c in g.cores]

    def on_one_group(self) -> NumaPlan:
        """This plan's parts, in order, on one group holding every core: the single pool summing split's terms in
        split's order (its bits equal this plan's, whatever the groups: tests and docs/numa.md)."""
        g = Group(self.groups[0].node, tuple(self.cores), tuple(range(len(self.bounds) - 1)))
        return NumaPlan(self.mode, (g,), self.bounds, self.why + "; every part on one group")


def _node_order(topo: Topology, cores) -> dict:
    """cores by node, nodes in the order their first core appears (the caller's node first)."""
    by = {}
    for c in cores:
        n = topo.node_of(c)
        if n is None:
            raise ValueError(f"core {c} is on no NUMA node of {topo.root} (nodes: "
                             f"{ {n.id: list(n.cpus) for n in topo.nodes} })")
        by.setdefault(n, []).append(c)
    return by


def select_cores(topo: Topology, threads: int | None = None, core_ids=None, *, allowed=None,
                 limit: int | None = None) -> tuple[dict, str]:
    """The worker cores by node, and why. core_ids: as given (repeats allowed), grouped by node. Else one per
    physical core (thread siblings under the root), or `threads` of them, taken from the nodes in turn so each node
    gets its share; then the other logical CPUs the same way. allowed: the CPUs this process may use (default: its
    affinity mask, restricted to the online CPUs); limit: the cgroup CPU limit (default: the root's fs/cgroup,
    0 = none). `threads` past min(allowed, limit) is clamped with a RuntimeWarning, as resolve_cores does."""
    if core_ids is not None:
        cores = [int(c) for c in core_ids]
        return _node_order(topo, cores), "core_ids given"
    if allowed is None:
        allowed = [c for c in _native.allowed_cpus() if not topo.online or c in topo.online]
    allowed = sorted(set(allowed))
    limit = _native.cgroup_cpu_limit(topo.root) if limit is None else limit
    phys = _native.physical_cores_in(topo.root, allowed) or allowed
    per_node = {n.id: [c for c in phys if c in n.cpus] for n in topo.nodes}
    rest = {n.id: [c for c in allowed if c in n.cpus and c not in phys] for n in topo.nodes}
    order = _interleave(per_node) + _interleave(rest)
    usable = min(len(order), limit) if limit > 0 else len(order)
    nodes = sum(1 for v in per_node.values() if v)
    if threads is None:
        n, why = min(len(_interleave(per_node)), usable), f"{len(phys)} physical cores on {nodes} nodes"
        if n < len(phys):
            why += f", capped to {n} by the cgroup CPU limit"
    else:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"threads={threads!r} must be a positive int or None")
        n, why = threads, f"threads={threads} requested ({len(phys)} physical cores on {nodes} nodes)"
        if threads > usable:
            warnings.warn(f"threads={threads} is more than the {usable} CPUs this process may use (affinity mask, "
                          f"cgroup CPU limit): using threads={usable}. Pass core_ids to place several workers on one "
                          "core on purpose", RuntimeWarning, stacklevel=6)  # CpuMoeExecutor's caller
            n, why = usable, f"threads clamped to {usable} usable CPUs ({len(phys)} physical cores)"
    if not order:
        raise ValueError(f"no usable CPU: affinity {allowed}, nodes {[list(x.cpus) for x in topo.nodes]}")
    return _node_order(topo, order[:max(1, n)]), why


def _interleave(per_node: dict) -> list:
    """Node 0's first, node 1's first, ..., node 0's second, ...: a prefix of any length spreads over the nodes."""
    lists = [v for _, v in sorted(per_node.items()) if v]
    return [lst[i] for i in range(max(map(len, lists), default=0)) for lst in lists if i < len(lst)]


def cut_bounds(I: int, unit: int, weights) -> tuple:  # noqa: E741
    """Slice boundaries of [0, I) into len(weights) parts sized by weight (each group's worker count), at multiples
    of `unit` (of lcm(unit, 32) where every part still gets one); the last part ends at I. ValueError where I has
    fewer units than parts."""
    n, w = len(weights), [max(1, int(x)) for x in weights]
    big = unit * ALIGN // _gcd(unit, ALIGN)
    unit = big if -(-I // big) >= n else unit
    units = -(-I // unit)
    if units < n:
        raise ValueError(f"I={I} has {units} slices of {unit} rows, fewer than the {n} worker groups")
    cuts, prev, total = [], 0, sum(w)
    for k in range(1, n):
        c = round(units * sum(w[:k]) / total)
        c = min(max(c, prev + 1), units - (n - k))
        cuts.append(c)
        prev = c
    return (0, *(c * unit for c in cuts), I)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def plan(mode: str | None, I: int, unit, *, topo: Topology | None = None, threads: int | None = None,  # noqa: E741
         core_ids=None, allowed=None, limit: int | None = None) -> NumaPlan:
    """The plan for `mode` (None: "split" where two or more nodes get workers and the banks can be cut, else
    "off"). unit: numa_banks.cut_unit's answer for the format and I (an int, or why it cannot be cut). A node
    without usable CPUs (memory-only, offline, outside the affinity mask) gets no group. "off" here is one group
    of the same cores; the executor then runs today's single pool."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"numa={mode!r}: expected one of {list(MODES)} or None (auto)")
    topo = topo or topology()
    by_node, why = select_cores(topo, threads, core_ids, allowed=allowed, limit=limit)
    nodes = list(by_node)
    cut_why = unit if isinstance(unit, str) else None
    if cut_why is None and len(nodes) > 1 and -(-I // unit) < len(nodes):
        cut_why = f"I={I} has fewer than {len(nodes)} slices of {unit} rows"
    if mode is None:
        if len(nodes) < 2:
            mode, why = "off", why + "; one NUMA node has workers"
        elif cut_why:
            mode, why = "off", why + f"; numa split unavailable ({cut_why})"
            warnings.warn(f"{len(nodes)} NUMA nodes, but the banks cannot be cut by I ({cut_why}): running one "
                          "pool (numa='off'); numa='replicate' places a full copy on every node", RuntimeWarning,
                          stacklevel=5)  # CpuMoeExecutor's caller
        else:
            mode = "split"
    if len(nodes) > MAX_PARTS and mode == "split":
        raise ValueError(f"numa='split': {len(nodes)} nodes, at most {MAX_PARTS} slices")
    if mode == "off":
        return NumaPlan("off", (Group(-1, tuple(c for n in nodes for c in by_node[n]), (0,)),), (0, I), why)
    if mode == "replicate":
        return NumaPlan(mode, tuple(Group(n, tuple(by_node[n]), (0,)) for n in nodes), (0, I), why)
    if cut_why:
        raise ValueError(f"numa='split': {cut_why}; expected numa='replicate' (a copy per node) or 'off'")
    bounds = cut_bounds(I, unit, [len(by_node[n]) for n in nodes])
    return NumaPlan(mode, tuple(Group(n, tuple(by_node[n]), (k,)) for k, n in enumerate(nodes)), bounds, why)


def check_plan(p: NumaPlan, I: int, unit, allowed) -> None:  # noqa: E741
    """ValueError naming what is wrong with a plan given as numa=NumaPlan(...)."""
    if not isinstance(p, NumaPlan) or p.mode not in MODES:
        raise ValueError(f"numa={p!r}: expected a NumaPlan with mode in {list(MODES)}")
    b = tuple(int(x) for x in p.bounds)
    if len(b) < 2 or b[0] != 0 or b[-1] != I or any(x >= y for x, y in zip(b, b[1:])) or len(b) - 1 > MAX_PARTS:
        raise ValueError(f"numa plan bounds {list(b)}: expected 0 < ... < I={I} rising, at most {MAX_PARTS} parts")
    if len(b) > 2:
        if isinstance(unit, str):
            raise ValueError(f"numa plan cuts I into {len(b) - 1} parts but {unit}")
        if any(x % unit for x in b[1:-1]):
            raise ValueError(f"numa plan bounds {list(b)}: cuts must be multiples of {unit} rows for this format")
    if not p.groups:
        raise ValueError("numa plan: expected at least one group")
    ran = set()
    for k, g in enumerate(p.groups):
        bad = [c for c in g.cores if c not in allowed]
        if not g.cores or bad:
            raise ValueError(f"numa plan group {k}: cores {list(g.cores)} must be non-empty and in the affinity mask "
                             f"{sorted(allowed)}")
        if not g.parts or any(not 0 <= q < len(b) - 1 for q in g.parts):
            raise ValueError(f"numa plan group {k}: parts {list(g.parts)} must name parts in [0, {len(b) - 1})")
        ran.update(g.parts)
    if ran != set(range(len(b) - 1)):
        raise ValueError(f"numa plan: parts {sorted(set(range(len(b) - 1)) - ran)} are run by no group")


def resolve(numa, I: int, unit, *, root: str | None = None, threads: int | None = None,  # noqa: E741
            core_ids=None) -> tuple:
    """CpuMoeExecutor's numa= -> (plan, topology): plan None for the single pool ("off"; auto where fewer than two
    nodes have usable CPUs, or, with a RuntimeWarning, where the format cannot be cut); topology None for "off"."""
    if numa == "off":
        return None, None
    if not (numa is None or isinstance(numa, NumaPlan) or numa in ("split", "replicate")):
        raise ValueError(f"numa={numa!r}: expected None (auto), 'split', 'replicate', 'off' or a NumaPlan")
    topo = topology(root)
    if isinstance(numa, NumaPlan):
        if numa.mode == "off":
            raise ValueError("numa=NumaPlan(mode='off'): expected numa='off' for the single pool")
        check_plan(numa, I, unit, set(_native.allowed_cpus()))
        return numa, topo
    if numa is None:
        cand = core_ids if core_ids is not None else [c for c in _native.allowed_cpus()
                                                        if not topo.online or c in topo.online]
        if len({topo.node_of(int(c)) for c in cand} - {None}) < 2:
            return None, topo  # one node with workers: the single pool, untouched
        if isinstance(unit, str):
            warnings.warn(f"{len(topo.nodes)} NUMA nodes, but numa='split' is unavailable ({unit}): running one pool "
                          "(numa='off'); numa='replicate' places a full copy on every node", RuntimeWarning,
                          stacklevel=4)
            return None, topo
    p = plan(numa, I, unit, topo=topo, threads=threads, core_ids=core_ids)
    return (None if p.mode == "off" else p), topo


def check_memory(p: NumaPlan, topo: Topology, total_bytes: float) -> None:
    """A node that cannot hold its share of total_bytes (by MemFree): replicate raises (a copy per node: the OOM its
    peers hit), split warns (mbind's preferred policy places the rest on other nodes)."""
    I = p.bounds[-1]  # noqa: E741
    free = {n.id: n.mem_free for n in topo.nodes}
    need = {}
    for g in p.groups:
        need[g.node] = need.get(g.node, 0) + total_bytes * sum(p.bounds[q + 1] - p.bounds[q] for q in g.parts) / I
    for node, b in need.items():
        if free.get(node, -1) < 0 or b <= free[node]:
            continue
        msg = f"numa={p.mode!r}: node {node} needs {_size(b)} for its banks and has {_size(free[node])} free"
        if p.mode == "replicate":
            raise ValueError(msg + "; expected numa='split' (one copy, cut across the nodes) or 'off'")
        warnings.warn(msg + ": the kernel places the rest on other nodes", RuntimeWarning, stacklevel=4)


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
