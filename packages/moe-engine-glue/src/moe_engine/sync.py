"""The handshake between the activations' device and the CPU executor: CudaSync (gpusync-cuda) or HipSync
(gpusync-hip) picked from torch's device and build, or HostSync for activations already on the CPU. All three
speak submit(layer, x, w, ids, residency_mask) -> finish(layer, out=/partial=) and decode() = both."""
from __future__ import annotations

from cpumoe_executor.sync_torch import mask_ids

CUDA_PATHS = ("kernel", "memop", "host-func", "eager")
HIP_PATHS = ("copy-native", "copy-splice", "host-func", "eager")


class HostSync:
    """Activations on the CPU: the executor's synchronous decode, with the same submit/finish shape (the CPU work
    happens in submit; finish writes or adds y)."""

    path = "host"
    reasons = {"host": "the executor's synchronous decode"}

    def __init__(self, executor):
        self.executor = executor
        self._pending = None  # (layer, y)

    def summary(self) -> str:
        return self.reasons["host"]

    def submit(self, layer, x, topk_weights, topk_ids, residency_mask=None) -> None:
        import torch

        if self._pending is not None:
            raise RuntimeError(f"submit: layer {self._pending[0]}'s task is still pending (call finish first)")
        ids = topk_ids
        if residency_mask is not None:
            ids = mask_ids(torch, ids.to(torch.int32), residency_mask, self.executor.E)
        self._pending = (int(layer), self.executor.decode(int(layer), x, topk_weights, ids))

    def finish(self, layer, *, out=None, partial=None):
        if self._pending is None:
            raise RuntimeError("finish: no task was submitted")
        got, y = self._pending
        if got != int(layer):
            raise ValueError(f"finish: layer={layer} but layer {got} was submitted")
        self._pending = None
        if partial is not None:
            return partial.add_(y)
        if out is not None:
            return out.copy_(y)
        return y

    def decode(self, layer, x, topk_weights, topk_ids, residency_mask=None, *, out=None, partial=None):
        self.submit(layer, x, topk_weights, topk_ids, residency_mask)
        return self.finish(layer, out=out, partial=partial)

    def close(self) -> None:
        self._pending = None


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
