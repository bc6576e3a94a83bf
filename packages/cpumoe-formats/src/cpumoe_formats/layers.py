"""A model's formats per layer and per role: a format name for every layer, or a list with one entry per layer, each
a name or a (gate_up format, down format) pair (GGUF Q4_K_M: ("q4_k", "q6_k") in some layers, "q4_k" in others).

Pure functions of their arguments: any thread may call them.
"""
from __future__ import annotations

from typing import Mapping

from .formats import get_format
from .roles import ROLES

MODES = ("native", "w4a8")  # cpumoe_mode order (abi.h)


def layer_formats(format, num_layers: int) -> list:  # noqa: A002
    """The per-layer (gate_up, down) canonical format names of a model: `format` is a name (every layer, both
    matrices) or a list with one entry per layer, each a name or a (gate_up_format, down_format) pair. ValueError /
    TypeError naming the layer and what was expected. Threads: any (a pure function)."""
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r} must be a positive int")
    if isinstance(format, str) or hasattr(format, "bank_names"):
        name = get_format(format).name
        return [(name, name)] * num_layers
    if not isinstance(format, list):
        raise TypeError(f"format must be a format name or a list with one entry per layer (a name or a (gate_up, "
                        f"down) pair each), got {type(format).__name__}; a pair for every layer is [pair] * num_layers")
    if len(format) != num_layers:
        raise ValueError(f"format lists {len(format)} layers, expected one entry per layer (num_layers={num_layers})")
    out = []
    for layer, entry in enumerate(format):
        if isinstance(entry, str) or hasattr(entry, "bank_names"):
            pair = (entry, entry)
        elif isinstance(entry, (tuple, list)) and len(entry) == 2:
            pair = tuple(entry)
        else:
            raise TypeError(f"format[{layer}] = {entry!r}: expected a format name or a (gate_up_format, "
                            "down_format) pair")
        names = []
        for role, name in zip(ROLES, pair):
            try:
                names.append(get_format(name).name)
            except (ValueError, TypeError) as e:
                raise type(e)(f"layer {layer} {role} format: {e}") from None
        out.append(tuple(names))
    return out


def is_uniform(pairs) -> bool:
    """Whether every layer runs one format for both matrices (the single-format model). Threads: any."""
    return len({p for p in pairs}) == 1 and pairs[0][0] == pairs[0][1]


def model_mode(pairs, mode: str | None = None) -> str:
    """The activation mode of a model of these (gate_up, down) pairs: `mode` checked against every format, or (None)
    the one mode every format supports, preferring the first layer's gate_up format's default (a uniform model's
    default), then the other formats' defaults in layer order. ValueError naming the layer, its two formats and
    their modes where they share none (or lack `mode`). Threads: any (a pure function)."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {list(MODES)} or None")
    common = set(MODES)
    for layer, (g, d) in enumerate(pairs):
        gs, ds = get_format(g), get_format(d)
        both = set(gs.modes) & set(ds.modes)
        what = (f"layer {layer}: gate_up format {gs.name!r} (modes {list(gs.modes)}) and down format {ds.name!r} "
                f"(modes {list(ds.modes)})")
        if not both:
            raise ValueError(f"{what} share no activation mode; a layer's two formats run in one mode")
        if mode is not None and mode not in both:
            raise ValueError(f"mode={mode!r}: {what}; expected a mode both support")
        if not both & common:
            raise ValueError(f"{what} share no activation mode with the layers before it (modes {sorted(common)}); "
                             "every layer of a model runs in one mode")
        common &= both
    if mode is not None:
        return mode
    for g, d in pairs:
        for name in (g, d):
            if get_format(name).default_mode in common:
                return get_format(name).default_mode
    return next(m for m in MODES if m in common)


def validate_layer(pair, banks: Mapping, E: int | None = None, H: int | None = None,
                   I: int | None = None) -> tuple:  # noqa: E741
    """One layer's banks for a (gate_up, down) pair: the gate_up format's gate_up banks and the down format's down
    banks, no others. Returns ((gate_up arrays, down arrays) in each format's role slot order, (E, H, I)). A uniform
    pair checks the whole format (FormatSpec.validate, its arrays split by role). Threads: any (reads the banks'
    metadata)."""
    gs, ds = get_format(pair[0]), get_format(pair[1])
    if not isinstance(banks, Mapping):
        raise TypeError(f"banks must be a mapping of bank name to array, got {type(banks).__name__}")
    if gs is ds:
        arrays, dims = gs.validate(banks, E, H, I)
        n = len(gs.role_banks("gate_up"))
        return (arrays[:n], arrays[n:]), dims
    want = gs.role_banks("gate_up") + ds.role_banks("down")
    extra = [n for n in banks if n not in want]
    if extra:
        raise ValueError(f"a ({gs.name}, {ds.name}) layer holds banks {list(want)} ({gs.name}'s gate_up banks, "
                         f"{ds.name}'s down banks); unexpected {extra}")
    gu, dims = gs.validate_role("gate_up", banks, E, H, I)
    try:
        dn, dims = ds.validate_role("down", banks, *dims)
    except ValueError as e:
        raise ValueError(f"{e} (the gate_up banks of {gs.name} give E, H, I = {dims}: a layer's two formats share "
                         "E, H and I)") from None
    return (gu, dn), dims
