"""Per-layer formats: a model's experts as one format, or a (gate_up format, down format) pair per layer (a Q4_K_M
GGUF file: gate / up Q4_K everywhere, down Q6_K in some layers and Q4_K in the others).

The spec is the executor's (cpumoe_executor.CpuMoeExecutor's `format`): a format name for every layer and both
matrices, or a list with one entry per layer, each a name or a (gate_up, down) pair. A pair layer's banks are the
gate_up format's gate-up banks and the down format's down banks under their schema names.

Thread contract: plain functions over their arguments."""
from __future__ import annotations

import cpumoe_formats as cf

Pair = tuple  # (gate_up format name, down format name)


def normalize(spec, num_layers: int) -> list[Pair]:
    """[(gate_up, down)] per layer, canonical names; ValueError / TypeError naming the layer that is wrong.
    cpumoe_formats.layer_formats decides where it exists (it validates against the executor's rules)."""
    helper = getattr(cf, "layer_formats", None)
    if helper is not None:
        return [tuple(p) for p in helper(spec, num_layers)]
    if isinstance(spec, str):
        name = cf.get_format(spec).name
        return [(name, name)] * num_layers
    if isinstance(spec, (tuple, dict)) or not hasattr(spec, "__len__"):
        raise TypeError(f"format={spec!r}: expected a format name or a list with one entry per layer (a name or a "
                        "(gate_up, down) pair)")
    if len(spec) != num_layers:
        raise ValueError(f"format: {len(spec)} entries, expected one per layer ({num_layers})")
    out = []
    for i, entry in enumerate(spec):
        names = (entry, entry) if isinstance(entry, str) else tuple(entry) if isinstance(entry, (tuple, list)) else ()
        if len(names) != 2 or not all(isinstance(n, str) for n in names):
            raise ValueError(f"format[{i}]={entry!r}: expected a format name or a (gate_up, down) pair of names")
        out.append(tuple(cf.get_format(n).name for n in names))
    return out


def compact(pairs: list[Pair]):
    """The spec to hand on: one name when every layer runs one format for both matrices, else the per-layer list."""
    first = pairs[0]
    if first[0] == first[1] and all(p == first for p in pairs):
        return first[0]
    return [p[0] if p[0] == p[1] else p for p in pairs]


def is_uniform(pairs: list[Pair]) -> bool:
    return isinstance(compact(pairs), str)


def describe(pairs: list[Pair]) -> str:
    """One line for logs and plans: 'q4_k' for a uniform model, else each distinct pair with its layers, e.g.
    'q4_k/q6_k: layers 0-5,8,11; q4_k: layers 6-7,9-10'."""
    if is_uniform(pairs):
        return pairs[0][0]
    groups: dict[Pair, list[int]] = {}
    for i, p in enumerate(pairs):
        groups.setdefault(p, []).append(i)
    return "; ".join(f"{p[0] if p[0] == p[1] else '/'.join(p)}: layers {_ranges(ls)}" for p, ls in groups.items())


def _ranges(layers: list[int]) -> str:
    out, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def role_bytes(fmt: str, role: str, H: int, I: int) -> int:  # noqa: E741
    """Bytes one expert reads in one role ('gate_up' or 'down') of format `fmt`: the banks whose name starts with
    the role (gate_up, gate_up_scale, ...; the schema's naming in every format)."""
    spec = cf.get_format(fmt)
    total = 0
    for b in spec.banks:
        if b.name.startswith(role):
            total += int(_prod(b.expected(1, H, I))) * _itemsize(b.dtypes[0])
    return total


def bytes_per_expert(pair: Pair, H: int, I: int) -> int:  # noqa: E741
    """Bytes of weights one expert of a layer in `pair` reads (gate_up role of pair[0], down role of pair[1])."""
    if pair[0] == pair[1]:
        return cf.get_format(pair[0]).bytes_per_expert(H, I)
    return role_bytes(pair[0], "gate_up", H, I) + role_bytes(pair[1], "down", H, I)


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize
