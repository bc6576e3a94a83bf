"""The formats a CpuMoeExecutor runs, per layer and per role: the given (gate_up, down) pairs, the CPU layout each
format runs as (the repack rule per format, as for a single-format model), the native kernels' format list and each
layer's bank arrays for its two kernels.

Threads: a ModelFormats is built once by the executor and read afterwards (any thread); its functions read their
arguments and return new objects.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import cpumoe_formats as cf


@dataclass(frozen=True)
class ModelFormats:
    """A model's (gate_up, down) FormatSpecs per layer, as given and as they run. Threads: shareable (frozen; its
    methods read it)."""

    given: list  # per layer (gate_up, down) FormatSpec as given
    run: list  # per layer (gate_up, down) FormatSpec as it runs (after repack)

    @property
    def uniform(self) -> bool:
        """One format for every layer and both matrices, as given (a single-format model)."""
        return cf.is_uniform([(g.name, d.name) for g, d in self.given])

    @property
    def kernel_formats(self) -> list:
        """The distinct run formats in first-use order (layer by layer, gate_up then down): the native kernels."""
        out = {}
        for pair in self.run:
            for s in pair:
                out.setdefault(s.name, s)
        return list(out.values())

    def layer_kernels(self) -> list:
        """Per layer, the indices in kernel_formats of its gate_up and down formats."""
        ks = [s.name for s in self.kernel_formats]
        return [(ks.index(g.name), ks.index(d.name)) for g, d in self.run]

    def names(self, layer: int) -> tuple:
        """The run bank names of `layer`: its gate_up format's gate_up banks, then its down format's down banks
        (a single-format layer: the format's slot order)."""
        g, d = self.run[layer]
        return g.role_banks("gate_up") + d.role_banks("down")

    def bank_maps(self, layer: int) -> tuple:
        """(gu_map, dn_map) of the native set_banks / place_banks for `layer`'s names(): per slot of the gate_up
        (down) format's bank array, the index of its bank in names(), -1 for the other role's slots; ([], []) for a
        single-format layer (its arrays are both kernels' arrays as they are)."""
        g, d = self.run[layer]
        if g is d:
            return [], []
        ngu = len(g.role_banks("gate_up"))
        gu = [g.role_slots("gate_up").index(s) if s in g.role_slots("gate_up") else -1 for s in range(len(g.banks))]
        dn = [ngu + d.role_slots("down").index(s) if s in d.role_slots("down") else -1 for s in range(len(d.banks))]
        return gu, dn

    def summary(self, which: str = "run") -> str:
        """Per-layer formats compactly: "q4_k_x16/q6_k_x16 x 12 layers, q4_k_x16/q4_k_x16 x 36" (pairs in order of
        first use)."""
        pairs = [f"{g.name}/{d.name}" for g, d in getattr(self, which)]
        counts = Counter(pairs)
        return ", ".join(f"{p} x {n} layer{'s' if n > 1 else ''}" for p, n in
                         sorted(counts.items(), key=lambda kv: pairs.index(kv[0])))


def resolve(pairs, H: int, I: int, mode: str, isa, repack, target_of) -> ModelFormats:  # noqa: E741
    """ModelFormats of the given (gate_up, down) name pairs; target_of(spec, H, I, mode, isa, repack) -> the layout
    a format runs as, or None (the executor's repack rule, per format: q4_k -> q4_k_x16, q5_k -> q5_k_x16,
    q6_k -> q6_k_x16)."""
    given = [(cf.get_format(g), cf.get_format(d)) for g, d in pairs]
    run_of = {}
    for pair in given:
        for s in pair:
            if s.name not in run_of:
                run_of[s.name] = target_of(s, H, I, mode, isa, repack if s.cpu_layout else None) or s
    return ModelFormats(given, [(run_of[g.name], run_of[d.name]) for g, d in given])


def repack_layer(given_pair, run_pair, banks, dims, threads: int) -> list:
    """One layer's validated banks (a mapping) -> its run arrays in ModelFormats.names() order, each role repacked
    into its run format where that differs (FormatSpec.to_layout_role), else the given arrays."""
    (gg, gd), (rg, rd) = given_pair, run_pair
    if gg is gd and rg is rd:
        return rg.validate(gg.to_layout(banks, rg.name, threads=threads), *dims)[0]
    gu = gg.to_layout_role("gate_up", banks, rg.name, threads) if rg is not gg else banks
    dn = gd.to_layout_role("down", banks, rd.name, threads) if rd is not gd else banks
    return (rg.validate_role("gate_up", gu, *dims)[0] + rd.validate_role("down", dn, *dims)[0])
