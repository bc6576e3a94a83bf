"""Per-layer formats: a model's experts as one format, or a (gate_up format, down format) pair per layer (a Q4_K_M
GGUF file: gate / up Q4_K everywhere, down Q6_K in some layers and Q4_K in the others).

The spec is the executor's (cpumoe_executor.CpuMoeExecutor's `format`): a format name for every layer and both
matrices, or a list with one entry per layer, each a name or a (gate_up, down) pair. A pair layer's banks are the
gate_up format's gate-up banks and the down format's down banks under their schema names.

Thread contract: plain functions over their arguments."""
from __future__ import annotations

import cpumoe_formats as cf

Pair = tuple  # (gate_up format name, down format name)
# the K-quant mixes GGUF files ship: (gate_up and most downs, the downs of the use_more_bits layers)
MIXES = {"q4_k_m": ("q4_k", "q6_k"), "q5_k_m": ("q5_k", "q6_k")}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose ffn_down gets more bits in Q4_K_M / Q5_K_M files (src/llama-quant.cpp,
    llama_tensor_get_type): the first eighth, the last eighth, and every third layer in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def mix_pairs(name: str, num_layers: int) -> list[Pair]:
    """The per-layer pairs of a Q4_K_M / Q5_K_M file of num_layers layers (llama.cpp's use_more_bits rule)."""
    if name not in MIXES:
        raise ValueError(f"mix {name!r}: expected one of {sorted(MIXES)}")
    base, more = MIXES[name]
    return [(base, more if use_more_bits(i, num_layers) else base) for i in range(num_layers)]


def normalize(spec, num_layers: int) -> list[Pair]:
    """[(gate_up, down)] per layer, canonical names (cpumoe_formats.layer_formats: ValueError / TypeError naming the
    layer that is wrong)."""
    if isinstance(spec, str):
        name = cf.get_format(spec).name
        return [(name, name)] * num_layers
    return [tuple(p) for p in cf.layer_formats(spec, num_layers)]


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


def validate_layer(pair: Pair, banks, E=None, H=None, I=None):  # noqa: E741
    """(arrays, (E, H, I)) of one layer's banks in `pair` (cpumoe_formats.validate_layer: a pair layer role by role)."""
    if pair[0] == pair[1]:
        return cf.get_format(pair[0]).validate(banks, E, H, I)
    return cf.validate_layer(pair, banks, E, H, I)


def bytes_per_expert(pair: Pair, H: int, I: int) -> int:  # noqa: E741
    """Bytes of weights one expert of a layer in `pair` reads (gate_up role of pair[0], down role of pair[1])."""
    if pair[0] == pair[1]:
        return cf.get_format(pair[0]).bytes_per_expert(H, I)
    return (cf.get_format(pair[0]).role_bytes_per_expert("gate_up", H, I) +
            cf.get_format(pair[1]).role_bytes_per_expert("down", H, I))


def to_layout(banks, pair: Pair, run: Pair, threads=None) -> dict:
    """One layer's banks in formats `pair` -> `run` (CPU layouts: cpumoe_executor.cpu_layout of each). A layer in one
    format moves as a whole (FormatSpec.to_layout); a pair layer moves role by role (to_layout_role), so a Q5_K_M
    layer's q5_k gate_up becomes q5_k_x16 and its q6_k down q6_k_x16, each from its own format."""
    if run == pair:
        return banks
    if pair[0] == pair[1] and run[0] == run[1]:
        return cf.get_format(pair[0]).to_layout(banks, run[0], threads)
    out = {}
    for role, src, dst in (("gate_up", pair[0], run[0]), ("down", pair[1], run[1])):
        out.update(cf.get_format(src).to_layout_role(role, banks, dst, threads))
    return out


def executor_formats(ex) -> list[Pair]:
    """The (gate_up, down) formats a CpuMoeExecutor runs per layer (after its repacks)."""
    return [tuple(p) for p in ex.layer_formats]
