"""Prefill: a batch above max_tokens (a prompt) runs eagerly, never under a graph. The routes the GPU does not hold
either run on the CPU in chunks of max_tokens, or, where a GPU is present and it is faster, the routed experts'
weights are copied to the GPU for this step (staged) and run there.

The choice compares two estimates measured on this machine as prefills run (no constant): chunks x the CPU's time for
one chunk of max_tokens, against the staged experts' bytes over the measured host-to-GPU copy rate plus the GPU
time. The first staged-capable prefill runs on the CPU (timing a chunk) and copies one expert (timing the copy)."""
from __future__ import annotations

import time

import numpy as np

from . import validate

POLICIES = ("auto", "cpu", "gpu")


def check_policy(policy) -> None:
    if policy not in POLICIES:
        raise ValueError(f"prefill={policy!r}: expected one of {list(POLICIES)}")


class PrefillPolicy:
    def __init__(self, runner, policy: str = "auto"):
        self.runner = runner
        self.can_stage = runner.device.type == "cuda" and runner.host_banks is not None and _has_gpu_kernel(runner)
        self.chunk_s: float | None = None  # measured: one chunk of max_tokens tokens on the CPU
        self.copy_bps: float | None = None  # measured: host -> GPU bytes per second of staged experts
        self._stage = None
        self.set(policy)

    def set(self, policy: str) -> None:
        """How later prefills run; the timings measured so far are kept."""
        check_policy(policy)
        if policy == "gpu" and not self.can_stage:
            raise ValueError("prefill='gpu' stages experts on a GPU: it needs a CUDA/HIP device and a format with GPU "
                             "experts kernels; expected prefill='cpu' or 'auto'")
        if policy == "cpu" and self.runner.executor is None:
            raise ValueError("prefill='cpu' needs the CPU executor; strategy 'gpu' has none")
        self.policy = policy

    def choose(self, T: int, n_experts: int) -> str:
        """'cpu' or 'gpu' for a prefill of T tokens whose CPU routes touch n_experts experts."""
        r = self.runner
        if self.policy != "auto":
            return self.policy
        if not self.can_stage or n_experts == 0:
            return "cpu"
        if r.executor is None:
            return "gpu"
        if self.copy_bps is None:
            self._stage_experts(0, np.arange(1))  # one expert's copy: the host -> GPU rate
        if self.chunk_s is None:
            return "cpu"  # measures a chunk now
        chunks = -(-T // r.max_tokens)
        return "gpu" if n_experts * r.bytes_per_expert / self.copy_bps < chunks * self.chunk_s else "cpu"

    def estimate(self, T: int, n_experts: int) -> dict:
        r = self.runner
        chunks = -(-T // r.max_tokens)
        return {"cpu_s": None if self.chunk_s is None else chunks * self.chunk_s,
                "gpu_copy_s": None if self.copy_bps is None else n_experts * r.bytes_per_expert / self.copy_bps}

    # ---- the two ways ---------------------------------------------------------------------------------
    def cpu_chunks(self, layer: int, x, w, ids, mask):
        """y [T, H] bf16 of the routes not resident on the GPU (mask), max_tokens tokens per executor task."""
        import torch

        r = self.runner
        out = torch.empty((x.shape[0], r.H), dtype=torch.bfloat16, device=x.device)
        for t0 in range(0, x.shape[0], r.max_tokens):
            sl = slice(t0, t0 + r.max_tokens)
            t = time.perf_counter()
            r.sync.decode(layer, x[sl], w[sl], ids[sl], mask, out=out[sl], check=False)
            if x.is_cuda:
                torch.cuda.current_stream(x.device).synchronize()
            if x[sl].shape[0] == r.max_tokens:
                dt = time.perf_counter() - t
                self.chunk_s = dt if self.chunk_s is None else 0.8 * self.chunk_s + 0.2 * dt
        return out

    def _stage_experts(self, layer: int, experts: np.ndarray) -> None:
        """Copy `experts` of `layer` into the staging slots 0.. (timed: the copy rate the choice uses)."""
        import torch

        r = self.runner
        if self._stage is None:
            from .gpu.experts import GpuExperts

            self._stage = GpuExperts(r.format, num_layers=1, capacity=r.E, E=r.E, H=r.H, I=r.I, top_k=r.top_k,
                                     **r.act.kwargs(), apply_router_weight_on_input=r.apply_router_weight_on_input,
                                     max_tokens=r.max_tokens, device=r.device)
        torch.cuda.current_stream(r.device).synchronize()
        t = time.perf_counter()
        for slot, e in enumerate(experts.tolist()):
            self._stage.load(0, slot, r.host_banks[layer], e)
        torch.cuda.current_stream(r.device).synchronize()
        if len(experts):
            bps = len(experts) * r.bytes_per_expert / (time.perf_counter() - t)
            self.copy_bps = bps if self.copy_bps is None else 0.8 * self.copy_bps + 0.2 * bps

    def gpu_staged(self, layer: int, x, w, ids, experts: np.ndarray, partial=None):
        """The routes of `experts` (ids not in them are skipped) on the GPU, their weights copied in for this step."""
        import torch

        r = self.runner
        self._stage_experts(layer, experts)
        table = torch.full((r.E,), -1, dtype=torch.int32)
        table[torch.from_numpy(experts.astype(np.int64))] = torch.arange(len(experts), dtype=torch.int32)
        table = table.to(r.device)
        ids64 = ids.long()
        slots = torch.where(ids64 >= 0, table[ids64.clamp(0, r.E - 1)], torch.full_like(ids64, -1, dtype=torch.int32))
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        y = self._stage.forward(0, xb, w.float(), slots.to(torch.int32))
        return y if partial is None else partial.add_(y)


def _has_gpu_kernel(r) -> bool:
    try:
        from .gpu.experts import GpuExperts
    except ImportError:
        return False
    return r.format in GpuExperts.FORMATS


def prefill(r, layer: int, x, w, ids):
    """forward() for T > max_tokens: eager, exact same math as decode steps (the same kernels, in chunks)."""
    import torch

    if r.check_ids:
        validate.ids_range(ids, r.E)
    pol = r.prefill_policy
    wf = w.float()
    if r.strategy == "gpu":
        y = r.gpu.forward(layer, x.to(torch.bfloat16), wf, r.residency.slots(layer, ids))
        return y.to(x.dtype)
    mask = r.residency.mask[layer] if r.residency is not None else None
    host_ids = ids.detach().to("cpu", torch.int64).numpy()
    resident = r.residency.host_mask(layer) if r.residency is not None else np.zeros(r.E, bool)
    cpu_experts = np.unique(host_ids[(host_ids >= 0)])
    cpu_experts = cpu_experts[~resident[cpu_experts]]
    how = pol.choose(x.shape[0], len(cpu_experts))
    est = pol.estimate(x.shape[0], len(cpu_experts))  # what the choice saw (the run below updates the timings)
    y = None
    if r.residency is not None:  # the GPU-resident routes, all tokens at once
        y = r.gpu.forward(layer, x.to(torch.bfloat16), wf, r.residency.slots(layer, ids))
    if how == "gpu":
        y = pol.gpu_staged(layer, x, wf, ids, cpu_experts, partial=y)
    else:
        c = pol.cpu_chunks(layer, x, wf, ids, mask)
        y = c if y is None else y.add_(c)
    r.last_prefill = {"tokens": int(x.shape[0]), "cpu_experts": int(len(cpu_experts)), "how": how, **est}
    return y.to(x.dtype)
