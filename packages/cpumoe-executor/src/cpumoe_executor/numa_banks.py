"""A layer's banks cut by intermediate rows (I) for numa="split": the part of every bank that an I-slice
[i0, i1) reads, as banks of the same format with I = i1 - i0, and back.

A slice runs the format's own kernel with I = i1 - i0: gate_up rows i0..i1 of the gate half and of the up half
(or the interleaved pairs), the down columns i0..i1, the activation blocks of those columns. The cut follows each
base format's bank layout (CUTS); a CPU layout (q4_0_x16, mxfp4_panel, ...) is cut through its source format
(unpack, cut, to_layout), so each slice is exactly the layout of the source's slice. Formats not in CUTS, and formats
that round each route's whole term (ds_fp4: a slice's term is not the term), cannot be cut: cut_unit says why.
The cut rules belong to each format (cpumoe-formats, design principle 6); they live here until FormatSpec has one.
Pure functions: any thread may call them.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

import cpumoe_formats as cf


@dataclass(frozen=True)
class Cut:
    """unit: a slice starts at a multiple of it (a block of the weights' or the activations' quantization);
    whole_i: I itself must be a multiple of unit (gate and up rows share blocks where it is not). banks: bank ->
    (kind, axis): "halves" (axis: gate rows then up rows, 2I), "along" (axis: I, or gate/up pairs interleaved),
    "whole" (no I: per output row, the same for every slice), "first" (an additive per-output-row bias: slice 0
    keeps it, the others get zeros, so their terms add up to one bias)."""

    unit: int
    whole_i: bool
    banks: dict


CUTS = {
    "bf16": Cut(1, False, {"gate_up": ("halves", 1), "down": ("along", 2)}),
    "q4_0": Cut(32, False, {"gate_up": ("halves", 1), "down": ("along", 2)}),
    "q8_0": Cut(32, False, {"gate_up": ("halves", 1), "down": ("along", 2)}),
    "q4_k": Cut(256, False, {"gate_up": ("halves", 1), "down": ("along", 2)}),  # GGUF K-quant super-blocks of 256
    "q5_k": Cut(256, False, {"gate_up": ("halves", 1), "down": ("along", 2)}),
    "q6_k": Cut(256, False, {"gate_up": ("halves", 1), "down": ("along", 2)}),
    "nvfp4": Cut(16, False, {"gate_up_packed": ("halves", 1), "gate_up_scale": ("halves", 1),
                             "gate_up_global": ("halves", 1), "down_packed": ("along", 2),
                             "down_scale": ("along", 2), "down_global": ("whole", 0)}),
    "fp8_block": Cut(128, True, {"gate_up": ("halves", 1), "gate_up_scale": ("halves", 1), "down": ("along", 2),
                                 "down_scale": ("along", 2)}),
    "mxfp4": Cut(32, False, {"gate_up_blocks": ("along", 2), "gate_up_scales": ("along", 2),
                             "gate_up_bias": ("along", 1), "down_blocks": ("along", 1), "down_scales": ("along", 1),
                             "down_bias": ("first", 0)}),
}


def _source(spec):
    """The format a CPU layout is made from (its `source`, else the format naming it as cpu_layout), or None."""
    src = getattr(spec, "source", None)
    if src is not None:
        return src
    return next((s for s in cf.FORMATS.values() if s.cpu_layout == spec.name and s.name != spec.name), None)


def _base(spec):
    """(base format with a CUTS entry, unpack function from spec to it or None), or (None, None)."""
    if spec.name in CUTS:
        return spec, None
    src = _source(spec)
    unpack = getattr(sys.modules[type(spec).__module__], "unpack", None)
    if src is None or src.name not in CUTS or unpack is None:
        return None, None
    return src, unpack


def cut_unit(spec, I: int) -> int | str:  # noqa: E741
    """The row multiple an I-slice of `spec` (a FormatSpec) starts at, or a sentence saying why its banks cannot be
    cut at this I."""
    if spec.round_route_term:
        return (f"format {spec.name!r} rounds each route's whole down term to bf16 (the sum of two slices' rounded "
                "terms is not it)")
    base, _ = _base(spec)
    if base is None:
        return f"format {spec.name!r} has no I-slice rule (cpumoe_executor.numa_banks.CUTS)"
    c = CUTS[base.name]
    unit = _lcm(_lcm(c.unit, base.k_multiple), spec.k_multiple)
    if c.whole_i and I % c.unit:
        return f"format {base.name!r} shares blocks of {c.unit} rows between gate and up where I={I} is not a multiple"
    return unit


def _lcm(a: int, b: int) -> int:
    x, y = a, b
    while y:
        x, y = y, x % y
    return a * b // x


def _length(bspec, E: int, H: int, i: int, axis: int) -> int:
    return bspec.expected(E, H, i)[axis]


def _cut_base(base, banks: dict, bounds) -> list:
    """Base-format banks -> one dict of banks per slice."""
    arrays, (E, H, I) = base.validate(banks)  # noqa: E741
    rules, specs = CUTS[base.name].banks, {b.name: b for b in base.banks}
    out = [{} for _ in bounds[:-1]]
    for name, a in zip(base.bank_names, arrays):
        kind, axis = rules[name]
        bs = specs[name]
        for p, (i0, i1) in enumerate(zip(bounds[:-1], bounds[1:])):
            ix = [slice(None)] * a.ndim
            if kind == "along":
                ix[axis] = slice(_length(bs, E, H, i0, axis), _length(bs, E, H, i1, axis))
                piece = a[tuple(ix)]
            elif kind == "halves":
                half = _length(bs, E, H, I, axis) // 2
                lo, hi = _length(bs, E, H, i0, axis) // 2, _length(bs, E, H, i1, axis) // 2
                piece = np.concatenate([a[(slice(None),) * axis + (slice(lo, hi),)],
                                        a[(slice(None),) * axis + (slice(half + lo, half + hi),)]], axis=axis)
            elif kind == "first" and p > 0:
                piece = np.zeros_like(a)
            else:  # "whole", and "first" of slice 0
                piece = a
            out[p][name] = cf.aligned_copy(piece)
    return out


def _join_base(base, parts: list) -> dict:
    """The inverse of _cut_base: one dict of base-format banks from the slices' (in I order)."""
    rules = CUTS[base.name].banks
    specs = {b.name: b for b in base.banks}
    dims = [base.validate(p)[1] for p in parts]
    E, H = dims[0][0], dims[0][1]
    out = {}
    for name in base.bank_names:
        kind, axis = rules[name]
        arrs = [np.asarray(p[name]) for p in parts]
        if kind == "along":
            out[name] = np.concatenate(arrs, axis=axis)
        elif kind == "halves":
            halves = [_length(specs[name], E, H, d[2], axis) // 2 for d in dims]
            gate = [a[(slice(None),) * axis + (slice(0, h),)] for a, h in zip(arrs, halves)]
            up = [a[(slice(None),) * axis + (slice(h, 2 * h),)] for a, h in zip(arrs, halves)]
            out[name] = np.concatenate(gate + up, axis=axis)
        else:
            out[name] = arrs[0]
        out[name] = cf.aligned_copy(out[name])
    return out


def cut(spec, banks: dict, bounds, threads: int | None = None) -> list:
    """One layer's banks of format `spec` -> a dict of banks of `spec` per slice [bounds[p], bounds[p + 1]), each
    valid for spec with I = bounds[p + 1] - bounds[p] (new arrays, 64-byte aligned). bounds: 0 < ... < I at
    multiples of cut_unit. threads: for a CPU layout's repack of each slice (FormatSpec.to_layout)."""
    base, unpack = _base(spec)
    if base is None:
        raise ValueError(cut_unit(spec, bounds[-1]))
    if unpack is None:
        return _cut_base(base, banks, bounds)
    return [base.to_layout(p, spec.name, threads=threads) for p in _cut_base(base, unpack(banks), bounds)]


def model_cut_unit(specs, I: int) -> int | str:  # noqa: E741
    """cut_unit over a model's formats (a slice boundary valid for every one: their lcm), or the first reason one
    of them cannot be cut."""
    unit = 1
    for spec in specs:
        u = cut_unit(spec, I)
        if isinstance(u, str):
            return u
        unit = _lcm(unit, u)
    return unit


def cut_role(spec, role: str, banks: dict, bounds, threads: int | None = None) -> list:
    """One role's banks of `spec` (a layer of two formats) -> that role's banks per slice (cut's, role by role:
    FormatSpec.map_role)."""
    if _base(spec)[0] is None:
        raise ValueError(cut_unit(spec, bounds[-1]))
    return spec.map_role(role, banks, lambda b: cut(spec, b, bounds), spec, threads)


def join_role(spec, role: str, parts: list) -> dict:
    """cut_role's inverse: one role's banks of `spec` from the slices' (the same bytes)."""
    full = []
    for p in parts:
        arrs, dims = spec.validate_role(role, p)
        full.append(spec._with_zeros(role, dict(zip(spec.role_banks(role), arrs)), dims))
    joined = join(spec, full)
    return {n: joined[n] for n in spec.role_banks(role)}


def join(spec, parts: list, threads: int | None = None) -> dict:
    """The layer's banks of `spec` from its slices' (cut's inverse: the same bytes)."""
    base, unpack = _base(spec)
    if base is None:
        raise ValueError(f"format {spec.name!r} has no I-slice rule (cpumoe_executor.numa_banks.CUTS)")
    if unpack is None:
        return _join_base(base, parts)
    return base.to_layout(_join_base(base, [unpack(p) for p in parts]), spec.name, threads=threads)
