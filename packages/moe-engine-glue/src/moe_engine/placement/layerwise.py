"""residency="layers": whole layers' experts on the GPU, every other layer's on the CPU (llama.cpp's `--n-cpu-moe N`
places the same way: the first N layers' experts on the CPU). At equal bytes, uniform routes hit the GPU as often as
a spread of slots over every layer would, but a GPU layer skips the CPU hand-over and a CPU layer skips the GPU
experts' kernels, so each layer runs one side only.

The runner fixes each layer's path at construction (a captured step bakes it in): "gpu" (every expert resident, no
CPU hand-over) or "cpu" (no slot, no GPU experts' kernels); other residencies split every layer by the tables.

Thread contract: pure functions."""
from __future__ import annotations

import numpy as np

from .policies import _check_int


def gpu_layer_set(gpu_layers, layers: int) -> list[int]:
    """The layers whose experts all live on the GPU: an int n (the last n layers, as llama.cpp's --n-cpu-moe
    layers - n) or a sequence of distinct layer indices."""
    if isinstance(gpu_layers, (int, np.integer)) and not isinstance(gpu_layers, bool):
        n = _check_int("gpu_layers", gpu_layers, 0, layers)
        return list(range(layers - n, layers))
    if gpu_layers is None or isinstance(gpu_layers, (str, bytes, bool)) or not hasattr(gpu_layers, "__iter__"):
        raise ValueError(f"gpu_layers={gpu_layers!r}: residency='layers' needs the number of layers whose experts "
                         f"live on the GPU (an int in [0, {layers}], the last ones) or a list of layer indices")
    out = [_check_int("gpu_layers[]", li, 0, layers - 1) for li in gpu_layers]
    if len(set(out)) != len(out):
        raise ValueError(f"gpu_layers={list(gpu_layers)!r}: a layer is named twice; expected distinct indices")
    return sorted(out)


def layer_masks(gpu_layers, layers: int, E: int) -> np.ndarray:
    """bool [layers, E]: every expert of the GPU layers resident, none of the others."""
    out = np.zeros((layers, E), bool)
    out[gpu_layer_set(gpu_layers, layers)] = True
    return out


def paths(masks, E: int) -> list[str]:
    """Each layer's fixed path from its whole-layer mask: "gpu" (all resident) or "cpu" (none)."""
    out = []
    for li, m in enumerate(masks):
        n = int(np.asarray(m).sum())
        if n not in (0, E):
            raise ValueError(f"residency='layers': layer {li} keeps {n} of {E} experts on the GPU; expected all or "
                             "none")
        out.append("gpu" if n == E else "cpu")
    return out


def capacities(path: list[str], E: int) -> list[int]:
    """GPU slots per layer: E for a GPU layer, none for a CPU layer."""
    return [E if p == "gpu" else 0 for p in path]


def describe(path: list[str]) -> str:
    on = [li for li, p in enumerate(path) if p == "gpu"]
    if not on:
        return f"layers 0/{len(path)} on the GPU"
    span = f"{on[0]}-{on[-1]}" if on == list(range(on[0], on[-1] + 1)) else ",".join(map(str, on))
    return f"layers {len(on)}/{len(path)} on the GPU ({span}, every expert)"
