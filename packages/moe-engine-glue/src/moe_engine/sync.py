"""The handshake between the activations' device and the CPU executor: CudaSync (gpusync-cuda) or HipSync
(gpusync-hip) picked from torch's device and build, or HostSync for activations already on the CPU. All three
speak submit(layer, x, w, ids, residency_mask) -> finish(layer, out=/partial=) and decode() = both."""
from __future__ import annotations

from cpumoe_executor.sync_torch import StepSync

CUDA_PATHS = ("kernel", "memop", "host-func", "eager")
HIP_PATHS = ("copy-native", "copy-splice", "host-func", "eager")


class HostSync(StepSync):
    """Activations on the CPU: the executor's synchronous decode behind StepSync's submit/finish (the CPU work happens
    in submit; finish writes or adds y). Thread contract: StepSync's (one thread's step at a time)."""

    path = "host"
    PATHS = ("host",)

    def __init__(self, executor):
        super().__init__(executor, "cpu")
        self.reasons = {"host": "the executor's synchronous decode"}

    def summary(self) -> str:
        return self.reasons["host"]


def open_sync(executor, device, handshake: str | None = None, timeout_s: float = 10.0):
    """The sync backend for activations on `device` (a torch.device); handshake forces one path (else the best
    that its start-up probe and qualification proved). Returns (sync, why)."""
    import torch

    if device.type == "cpu":
        if handshake not in (None, "host"):
            raise ValueError(f"handshake={handshake!r}: activations on the CPU use 'host' (no GPU handshake)")
        return HostSync(executor), "activations on the CPU"
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    if torch.version.hip:
        from gpusync_hip import HipSync

        if handshake is not None and handshake not in HIP_PATHS:
            raise ValueError(f"handshake={handshake!r} is not a HIP path; expected one of {list(HIP_PATHS)}")
        sync = HipSync(executor, ordinal, path=handshake, timeout_s=timeout_s)
        return sync, f"torch {torch.__version__} is a ROCm build"
    from gpusync_cuda import CudaSync

    if handshake is not None and handshake not in CUDA_PATHS:
        raise ValueError(f"handshake={handshake!r} is not a CUDA path; expected one of {list(CUDA_PATHS)}")
    paths = CUDA_PATHS if handshake is None else (handshake,)
    return CudaSync(executor, ordinal, paths=paths, timeout_s=timeout_s), f"torch {torch.__version__} is a CUDA build"
