"""What goes on the GPU: the non-expert weights, the KV cache for the configured length, then as many experts as
the rest of `gpu_memory` holds. And on the host, beside a GPU (host_copy): whether hybrid's CPU executor may hold its
own repacked copy of the experts next to the banks the GPU loads from, within `host_memory`.

Rule: the same number of experts in every MoE layer, so every layer's CPU share is equal and the slowest layer is
no slower than the others; which experts fill those slots is residency="hot"'s job (each layer's most-routed, from
routing counts; docs/placement.md). With whole_layers (residency="layers"): as many whole layers' experts as fit, the
last layers, as llama.cpp's --n-cpu-moe places (each layer then runs on one side only). A reserve for activations,
the GPU experts' workspace and CUDA graphs is kept out of the budget (RESERVE).

Thread contract: plain functions."""
from __future__ import annotations

import re
from dataclasses import dataclass

GiB = 1 << 30
# held back for activations, Triton workspaces, graph pools and the allocator's slack at decode; a round margin, the
# measured peak is in docs/end-to-end.md
RESERVE = int(1.5 * GiB)
# kept free on the host beside the weights when deciding on a second copy of the experts: the OS, torch's own
# allocations, the page cache's working part (from_pretrained's bound: banks + host-side non-expert weights + a
# layer + 1 GB)
HOST_MARGIN = 1 * GiB
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
          "tib": 1 << 40}


def parse_bytes(value, name: str = "gpu_memory") -> int:
    """An int of bytes, or a string like '16GiB', '24 GB', '512MiB'."""
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: expected bytes (int) or a size such as '16GiB'")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name}={value!r}: expected a positive number of bytes")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS and float(m.group(1)) > 0:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"{name}={value!r}: expected bytes (int) or a size such as '16GiB', '24GB', '512MiB'")


def kv_cache_bytes(config, length: int, batch: int, dtype_bytes: int) -> int:
    """A full-length cache (keys and values) for every attention layer: the upper bound a static cache allocates."""
    c = config.get_text_config()
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * heads * head_dim * length * batch * dtype_bytes


@dataclass
class Plan:
    strategy: str
    experts_per_layer: int  # resident on the GPU in each MoE layer
    E: int
    non_expert_bytes: int
    kv_bytes: int
    expert_bytes: int  # one expert on the GPU
    budget: int | None
    why: str
    formats: str = ""  # the experts' formats, compactly (layer_formats.describe): one name, or the pairs' layers
    gpu_layers: int | None = None  # whole_layers: the layers whose every expert is on the GPU (the last ones)

    @property
    def residency(self) -> float:
        return self.experts_per_layer / self.E


def plan(strategy: str, device, budget: int | None, *, non_expert_bytes: int, kv_bytes: int, expert_bytes: int,
         E: int, layers: int, gpu_kernels: bool, whole_layers: bool = False) -> Plan:
    """The strategy and the experts per layer on the GPU; ValueError when the budget cannot hold what must be there."""
    gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    if device.type != "cuda":
        if strategy not in ("auto", "cpu"):
            raise ValueError(f"strategy={strategy!r} runs experts on a GPU, but device={device}; expected 'cpu' or "
                             "'auto'")
        return Plan("cpu", 0, E, non_expert_bytes, kv_bytes, expert_bytes, None,
                    f"no GPU: every expert on the CPU; non-expert weights {gib(non_expert_bytes)} on the host")
    need = non_expert_bytes + kv_bytes + RESERVE
    if budget < need:
        raise ValueError(f"gpu_memory={gib(budget)} is too small: the non-expert weights need {gib(non_expert_bytes)}, "
                         f"the KV cache {gib(kv_bytes)} and the reserve {gib(RESERVE)} ({gib(need)} in all); "
                         "give more, or device='cpu'")
    fit = min(E, (budget - need) // (expert_bytes * layers)) if gpu_kernels else 0
    n_layers = min(layers, (budget - need) // (expert_bytes * E)) if gpu_kernels else 0
    if whole_layers:
        fit = E if n_layers == layers else 0
    head = (f"gpu_memory {gib(budget)}: non-expert weights {gib(non_expert_bytes)} + KV cache {gib(kv_bytes)} + "
            f"reserve {gib(RESERVE)}")
    if strategy == "auto":
        strategy = "gpu" if fit == E else "hybrid"
        if not gpu_kernels:
            strategy = "hybrid"
    if strategy == "gpu" and fit < E:
        raise ValueError(f"strategy='gpu' keeps all {E * layers} experts on the GPU "
                         f"({gib(E * layers * expert_bytes)}), but {head} leaves room for {fit} per layer; use "
                         "strategy='hybrid' or 'auto'")
    if strategy == "cpu":
        fit = n_layers = 0
    if strategy == "gpu":
        where = "every expert on the GPU"
    elif whole_layers and strategy == "hybrid":
        where = (f"the experts of {n_layers} of {layers} layers on the GPU (whole layers, the last {n_layers}, as "
                 f"llama.cpp's --n-cpu-moe {layers - n_layers}; {gib(n_layers * E * expert_bytes)}), the rest on "
                 "the CPU")
        return Plan(strategy, int(n_layers * E // layers), E, non_expert_bytes, kv_bytes, expert_bytes, budget,
                    f"{head}; {where}", gpu_layers=int(n_layers))
    else:
        where = (f"{fit} of {E} experts per layer on the GPU ({100 * fit / E:.0f}%, "
                 f"{gib(fit * layers * expert_bytes)}), the rest on the CPU")
    return Plan(strategy, int(fit), E, non_expert_bytes, kv_bytes, expert_bytes, budget, f"{head}; {where}")


def host_copy(*, base_bytes: int, repacked_bytes: int, layer_bytes: int, host_bytes: int | None,
              limit_name: str, base: str, repacked: str) -> tuple[bool, str]:
    """Whether hybrid's CPU executor may repack the experts into its own layout (`repacked`) beside the host banks in
    the file's layout (`base`) that the GPU loads from: two copies of the experts on the host, the executor at its
    layout's speed, or one copy, the executor running the file's layout. Two copies need both, one layer's working
    set and HOST_MARGIN within host_bytes (host_memory=, or MemAvailable when the load starts; None: unknown, the
    copy is made). Returns (repack, why)."""
    gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    need = base_bytes + repacked_bytes + layer_bytes + HOST_MARGIN
    if host_bytes is None:
        return True, (f"the CPU executor repacks the experts to {repacked} beside the GPU's host banks ({base}): two "
                      f"copies, {gib(base_bytes + repacked_bytes)}; host memory unknown (no /proc/meminfo)")
    if need <= host_bytes:
        return True, (f"the CPU executor repacks the experts to {repacked} beside the GPU's host banks ({base}): two "
                      f"copies, {gib(base_bytes + repacked_bytes)} + a layer + {gib(HOST_MARGIN)} fit {limit_name} "
                      f"{gib(host_bytes)}")
    return False, (f"the CPU executor runs the GPU's host banks as they are ({base}, one copy, {gib(base_bytes)}): its "
                   f"own layout {repacked} would add {gib(repacked_bytes)}, and two copies + a layer + "
                   f"{gib(HOST_MARGIN)} ({gib(need)}) exceed {limit_name} {gib(host_bytes)}")
