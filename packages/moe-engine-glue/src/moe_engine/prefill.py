"""Prefill: a batch above max_tokens (a prompt) runs eagerly, never under a graph. The routes the GPU does not hold
either run on the CPU in chunks of max_tokens, or, where a GPU is present and it is faster, the routed experts'
weights are copied to the GPU for this step (staged) and run there: a layer's whole bank in one copy per bank where
the prompt touches half of its experts or more (a 512-token prompt touches nearly all of a 128-expert layer), else
each of them.

The choice compares two estimates measured on this machine as prefills run (no constant): chunks x the CPU's time for
one chunk of max_tokens, against the staged experts' bytes over the measured host-to-GPU copy rate plus the GPU
time. The first staged-capable prefill times one chunk of its own tokens on the CPU (the output dropped if staging
wins) and the copy it would stage (one expert, or the layer's bank), then chooses."""
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

    def choose(self, T: int, n_experts: int, probe=None) -> str:
        """'cpu' or 'gpu' for a prefill of T tokens whose CPU routes touch n_experts experts. probe(): runs one
        chunk of max_tokens of this prefill's tokens on the CPU (cpu_chunks: timed), when no chunk is timed yet;
        without one the prefill runs on the CPU and times its chunks."""
        r = self.runner
        if self.policy != "auto":
            return self.policy
        if not self.can_stage or n_experts == 0:
            return "cpu"
        if r.executor is None:
            return "gpu"
        if self.copy_bps is None:  # the copy staging would make: the host -> GPU rate
            self._stage_experts(0, np.arange(self.staged_experts(n_experts)))
        if self.chunk_s is None and probe is not None and T >= r.max_tokens:
            probe()
        if self.chunk_s is None:
            return "cpu"  # measures a chunk now
        chunks = -(-T // r.max_tokens)
        copy_s = self.staged_experts(n_experts) * r.bytes_per_expert / self.copy_bps
        return "gpu" if copy_s < chunks * self.chunk_s else "cpu"

    def estimate(self, T: int, n_experts: int) -> dict:
        r = self.runner
        chunks = -(-T // r.max_tokens)
        return {"cpu_s": None if self.chunk_s is None else chunks * self.chunk_s,
                "gpu_copy_s": None if self.copy_bps is None else
                self.staged_experts(n_experts) * r.bytes_per_expert / self.copy_bps}

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

    def staged_experts(self, n_experts: int) -> int:
        """How many experts staging n_experts copies: a layer's whole bank (one copy per bank) once they are half
        of it or more (a prompt's layer touches most experts), else each of them."""
        return self.runner.E if 2 * n_experts >= self.runner.E else n_experts

    def _stage_experts(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Copy `experts` of `layer` into staging slots (timed: the copy rate the choice uses); returns the slot of
        each expert id ([E] int32, -1 where not staged)."""
        import torch

        r = self.runner
        if self._stage is None:
            from .gpu.experts import GpuExperts

            self._stage = GpuExperts(r.gpu_format, num_layers=1, capacity=r.E, E=r.E, H=r.H, I=r.I, top_k=r.top_k,
                                     **r.act.kwargs(), apply_router_weight_on_input=r.apply_router_weight_on_input,
                                     max_tokens=r.max_tokens, device=r.device,
                                     host_format=None if r.format == r.gpu_format else r.format)
        slot = np.full(r.E, -1, np.int32)
        n = self.staged_experts(len(experts))
        torch.cuda.current_stream(r.device).synchronize()
        t = time.perf_counter()
        if n == r.E:  # slot = expert id
            self._stage.load_range(0, 0, r.host_banks[layer], 0, r.E)
            slot[experts] = experts
        else:
            for s, e in enumerate(experts.tolist()):
                self._stage.load(0, s, r.host_banks[layer], e)
            slot[experts] = np.arange(len(experts), dtype=np.int32)
        torch.cuda.current_stream(r.device).synchronize()
        if n:
            bps = n * r.bytes_per_expert / (time.perf_counter() - t)
            self.copy_bps = bps if self.copy_bps is None else 0.8 * self.copy_bps + 0.2 * bps
        return slot

    def gpu_staged(self, layer: int, x, w, ids, experts: np.ndarray, partial=None):
        """The routes of `experts` (ids not in them are skipped) on the GPU, their weights copied in for this step."""
        import torch

        r = self.runner
        table = torch.from_numpy(self._stage_experts(layer, experts)).to(r.device)
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
    return r.gpu_format in GpuExperts.FORMATS


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
    k = r.max_tokens
    how = pol.choose(x.shape[0], len(cpu_experts), probe=lambda: pol.cpu_chunks(layer, x[:k], wf[:k], ids[:k], mask))
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
