"""The float64 reference of a runner's step, as the runner splits it: CPU routes in the executor's precision mode,
GPU-resident routes in native mode, each through cpumoe_formats.reference. Start-up qualification, the demo and the
tests compare with it."""
from __future__ import annotations

import numpy as np

import cpumoe_formats as cf

from .banks import expert_slice
from .layer_formats import executor_formats

# max |y - ref| / max |ref|: bf16 output rounding (2^-9 relative) and a bf16 intermediate that rounds one ulp apart
# when the fp32 sums run in another order measured under 0.6% for bf16 and fp8_block weights; w4a8 adds the int8
# activation quantisation of that intermediate (a code one apart: 1/127 of its block's range).
TOLERANCE = {"native": 2e-2, "w4a8": 3e-2}


def layer_banks(r, layer: int, cpu: bool) -> tuple:
    """(format, banks, moved) the float64 reference reads: the given banks where the runner keeps them, else the
    executor's. The format is a name, or the layer's (gate_up, down) pair where the two differ. moved: for the GPU's
    routes from banks in a CPU layout, that layout's pair (each slice of the banks is put in the format's order,
    gpu/moved.py), else None."""

    given = _spec(r.layer_formats[layer])
    ran = _spec(executor_formats(r.executor)[layer]) if r.executor is not None else given
    on_gpu = r.gpu_layer_formats[layer]
    if not cpu and tuple(on_gpu) != tuple(r.layer_formats[layer]):  # the GPU's format, moved from the host's layout
        return _spec(on_gpu), r.host_banks[layer], tuple(r.layer_formats[layer])
    if r.host_banks is not None and not (cpu and ran != given):
        return given, r.host_banks[layer], None
    return ran, r.executor.layer_banks(layer), None


def _spec(pair):
    return pair[0] if pair[0] == pair[1] else tuple(pair)


# experts dequantized to float64 at once: 2 experts of Qwen3-30B-A3B's shape are 75 MB (64 at once were 2.4 GB, and
# a 48-layer model's qualification ran a 24 GB machine out of memory beside its 16 GB of banks; with 4, qualification
# was the peak of the full-size Q4_K_M load on 2 cores, ~0.4 GB above the loaded model)
EXPERTS_PER_CALL = 2


def reference(r, layer: int, x, w, ids) -> np.ndarray:
    """float64 y [T, H]: CPU routes in the executor's mode, GPU-resident routes in native mode. The routed experts are
    dequantized a few at a time (EXPERTS_PER_CALL): y is a sum over routes, so the parts add up exactly."""
    ids_np = ids.detach().cpu().numpy().astype(np.int64)
    resident = r.residency.host_mask(layer) if r.residency is not None else np.zeros(r.E, bool)
    if r.executor is None:
        resident = np.ones(r.E, bool)
    xs, ws = x.detach().float().cpu().numpy(), w.detach().float().cpu().numpy()
    y = np.zeros((ids_np.shape[0], r.H))
    for on_gpu in (False, True):
        part = np.where((ids_np >= 0) & (resident[ids_np.clip(0)] == on_gpu), ids_np, -1)
        routed = np.unique(part[part >= 0])
        if not len(routed):
            continue
        fmt, banks, moved = layer_banks(r, layer, cpu=not on_gpu)
        mode = "native" if on_gpu else r.executor.mode
        for c in range(0, len(routed), EXPERTS_PER_CALL):
            experts = routed[c:c + EXPERTS_PER_CALL]
            mine = np.isin(part, experts)
            local = np.searchsorted(experts, part.clip(0)).astype(np.int32)
            eb = expert_slice(banks, experts)
            if moved is not None:
                from .gpu.moved import source_banks

                eb = source_banks(moved, eb, r.H, r.I)
            y += cf.reference.moe(fmt, eb, xs, ws, np.where(mine, local, -1),
                                  **r.act.kwargs(), apply_router_weight_on_input=r.apply_router_weight_on_input,
                                  mode=mode)
    return y
