"""`moe-engine info`: what this machine offers: CPU kernel tiers per format, the GPU and its runtime, and which
handshake paths probe OK (a tiny executor is opened on the GPU for that)."""
from __future__ import annotations

import platform

import numpy as np

import cpumoe_formats as cf


def cpu_info() -> dict:
    from cpumoe_executor import resolve_cores
    from cpumoe_formats.machine import cpu_model, llc_bytes

    cores, why = resolve_cores()
    kernels = {}
    for fmt in cf.formats.WEIGHT_FORMATS:  # every weight format this cpumoe-formats has (layouts apart)
        spec = cf.get_format(fmt)
        kernels[fmt] = {m: cf.selected_tier(fmt, m) for m in spec.modes}
        kernels[fmt]["cpu_layout"] = spec.cpu_layout or None
    return {"model": cpu_model(), "machine": platform.machine(), "usable_tiers": cf.usable_tiers(),
            "detected_tier": cf.detected_tier(), "llc_bytes": llc_bytes(), "workers": len(cores),
            "workers_why": why, "kernels": kernels}


def gpu_info(probe: bool = True) -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "hip_build": torch.version.hip,
           "available": torch.cuda.is_available()}
    import gpusync_cuda
    import gpusync_hip

    out["gpusync_cuda_driver"] = _status(gpusync_cuda.driver_status())
    out["gpusync_hip_runtime"] = _status(gpusync_hip.driver_status())
    try:
        from ..gpu.experts import GpuExperts

        out["gpu_experts_formats"] = list(GpuExperts.FORMATS)
    except ImportError as e:
        out["gpu_experts_formats"] = f"unavailable: {e}"
    if not out["available"]:
        out["handshake"] = "no GPU: activations stay on the CPU (strategy cpu, synchronous decode)"
        return out
    dev = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(dev)
    out["device"] = {"index": dev, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                     "capability": f"{p.major}.{p.minor}"}
    out["handshake"] = probe_paths(torch.device("cuda", dev)) if probe else "not probed (--no-probe)"
    return out


def _status(st: dict) -> dict:
    return {k: v for k, v in st.items() if not isinstance(v, (bytes, bytearray))}


def probe_paths(device) -> dict:
    """Each handshake path's verdict from a real start-up probe on a tiny executor (bf16, E=4, H=I=128)."""
    from cpumoe_executor import CpuMoeExecutor

    from ..sync import open_sync

    rng = np.random.default_rng(0)
    banks = [cf.get_format("bf16").random_banks(4, 128, 128, rng)]
    ex = CpuMoeExecutor("bf16", banks, top_k=2, max_tokens=4, threads=1)
    try:
        sync, why = open_sync(ex, device)
        try:
            return {"chosen": sync.path, "why": why, "paths": dict(sync.reasons)}
        finally:
            sync.close()
    finally:
        ex.close()


def info(probe: bool = True) -> dict:
    import cpumoe_executor

    from .. import __version__

    return {"moe_engine": __version__, "cpumoe_formats": cf.__version__, "cpumoe_executor": cpumoe_executor.__version__,
            "python": platform.python_version(), "cpu": cpu_info(), "gpu": gpu_info(probe)}


def render(d: dict) -> str:
    c, g = d["cpu"], d["gpu"]
    lines = [f"moe_engine {d['moe_engine']} (cpumoe-formats {d['cpumoe_formats']}, cpumoe-executor "
             f"{d['cpumoe_executor']}, torch {g['torch']}, Python {d['python']})",
             f"CPU: {c['model']}, {c['workers']} workers ({c['workers_why']}), tiers {', '.join(c['usable_tiers'])}",
             "  format      kernel per mode (tier+precision)            CPU layout"]
    for fmt, k in c["kernels"].items():
        modes = ", ".join(f"{m}: {t}" for m, t in k.items() if m != "cpu_layout")
        lines.append(f"  {fmt:<11} {modes:<44} {k['cpu_layout'] or '-'}")
    if g["available"]:
        dv = g["device"]
        rt = f"HIP {g['hip_build']}" if g["hip_build"] else f"CUDA {g['cuda_build']}"
        lines.append(f"GPU: {dv['name']} ({dv['memory_gib']} GiB, capability {dv['capability']}), torch {rt}")
        hs = g.get("handshake", {})
        if isinstance(hs, dict):
            lines.append(f"  handshake: {hs['chosen']} ({hs['why']})")
            lines += [f"    {p}: {why}" for p, why in hs["paths"].items()]
        lines.append(f"  GPU experts (Triton): {g['gpu_experts_formats']}")
    else:
        lines.append(f"GPU: none ({g['handshake']})")
    return "\n".join(lines)
