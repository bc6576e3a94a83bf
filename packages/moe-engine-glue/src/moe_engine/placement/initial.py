"""Which experts a hybrid runner starts with on the GPU, from MoERunner's `residency=` (a fraction, a placement's
name, or per-layer masks) and the placement's own arguments; every malformed value is refused here, naming it.

Thread contract: pure functions."""
from __future__ import annotations

import numpy as np

DEFAULT_HYBRID_RESIDENCY = 0.25  # a quarter of each layer's experts on the GPU unless told otherwise
NAMED_RESIDENCY = ("hot", "static", "random", "uniform", "layers")


def fraction_masks(E: int, num_layers: int, fraction: float, seed: int = 0) -> list[np.ndarray]:
    """Per-layer bool masks with round(fraction * E) resident experts, a seeded random subset per layer (the
    "random" placement's)."""
    from .policies import static_masks

    return list(static_masks("random", num_layers, E, round(fraction * E), seed=seed))


def initial_masks(residency, num_layers: int, E: int, *, replace_every=50, routing_profile=None, capacity=None,
                  gpu_layers=None) -> list[np.ndarray]:
    """bool [E] per layer: the experts resident at start. residency None: a seeded random quarter (the runner makes
    it "hot" beside a GPU before it gets here)."""
    if residency is None:
        residency = DEFAULT_HYBRID_RESIDENCY
    if isinstance(residency, str):
        return named_masks(residency, num_layers, E, replace_every=replace_every, routing_profile=routing_profile,
                           capacity=capacity, gpu_layers=gpu_layers)
    if isinstance(residency, (int, float)) and not isinstance(residency, bool):
        f = float(residency)
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"residency={residency!r}: expected a fraction in [0, 1] or per-layer masks")
        return fraction_masks(E, num_layers, f)
    masks = [np.asarray(m.detach().cpu() if hasattr(m, "detach") else m) for m in residency]
    if len(masks) != num_layers:
        raise ValueError(f"residency: {len(masks)} masks, expected one per layer ({num_layers})")
    for li, m in enumerate(masks):
        if m.shape != (E,):
            raise ValueError(f"residency[{li}]: shape {m.shape}, expected a bool mask of length E={E}")
    return [m.astype(bool) for m in masks]


def named_masks(name: str, num_layers: int, E: int, *, replace_every, routing_profile, capacity,
                gpu_layers) -> list[np.ndarray]:
    from .counts import load_routing_profile
    from .policies import _check_int, static_masks

    if name not in NAMED_RESIDENCY:
        raise ValueError(f"residency={name!r}: expected one of {list(NAMED_RESIDENCY)}, a fraction in [0, 1] or "
                         "per-layer masks")
    if name == "layers":
        from .layerwise import layer_masks

        if capacity is not None:
            raise ValueError(f"capacity={capacity!r}: residency='layers' places whole layers (E slots on each GPU "
                             "layer, none elsewhere); pass gpu_layers= instead")
        return list(layer_masks(gpu_layers, num_layers, E))
    if gpu_layers is not None:
        raise ValueError(f"gpu_layers={gpu_layers!r} goes with residency='layers', not residency={name!r}")
    cap = round(DEFAULT_HYBRID_RESIDENCY * E) if capacity is None else capacity
    if not isinstance(cap, int) or not 0 <= cap <= E:
        raise ValueError(f"capacity={capacity!r}: expected an int in [0, E={E}] (GPU slots per layer)")
    if name == "hot":
        _check_int("replace_every", replace_every, 1)  # the re-placement period in steps
        if cap < 1:
            raise ValueError(f"residency='hot' needs at least one GPU slot per layer, but capacity={cap}: a "
                             "budget smaller than one expert; give more GPU memory, or residency=0")
    counts = None
    if name == "static":
        if routing_profile is None:
            raise ValueError("residency='static' places from a routing profile: pass routing_profile= (a file "
                             "from `moe-engine profile`)")
        counts = load_routing_profile(routing_profile, layers=num_layers, E=E)
    kind = "random" if name == "hot" else name  # hot starts from a random placement until counts arrive
    return list(static_masks(kind, num_layers, E, cap, counts=counts))
