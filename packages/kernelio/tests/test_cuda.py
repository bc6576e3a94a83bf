"""On an NVIDIA GPU (marked cuda/gpu; skipped with the reason elsewhere): the
self-test passes, and publish/combine move the exact bits through a real
executor IO block (strided x, residency mask, skip, both combine modes)."""
import numpy as np
import pytest
from conftest import cuda, gpu_missing

import kernelio

MISSING = gpu_missing()
pytestmark = cuda + [pytest.mark.skipif(MISSING is not None, reason=f"no CUDA GPU: {MISSING}")]


@pytest.fixture(scope="module")
def dev():
    from gpusync_cuda import _native

    return _native.Device(0)


def test_probe_passes(dev):
    import gpusync_cuda as gs

    assert kernelio.probe(gs.C_API_CAPSULE, dev.handle) == ""


def bits(t):
    import torch

    return t.detach().cpu().contiguous().view(torch.int16)


def test_publish_and_combine_through_an_io_block(dev):
    import torch

    import cpumoe_executor as ce
    import cpumoe_formats as cf
    import gpusync_cuda as gs
    from cpumoe_executor import _native as xn
    from gpusync_cuda import _native

    E, H, K, T = 8, 256, 4, 5
    rng = np.random.default_rng(5)
    banks = [cf.get_format("bf16").random_banks(E, H, 32, rng) for _ in range(2)]
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=K, max_tokens=8, threads=1)  # no coordinator: we play the CPU
    b = _native.Iob(dev, ce.C_API_CAPSULE, ex.handle, ex)
    iob = ex.io_block()
    io = {k: b.dptr(iob[k]) for k in ("x", "ids", "w", "y", "ready", "done")}
    io.update(H=H, K=K, max_tokens=8)
    kio = kernelio.open_kernels(gs.C_API_CAPSULE, dev, io)
    cuda = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(9)
    xfull = torch.randn(T, H + 24, generator=g).to(torch.bfloat16).to(cuda)
    x = xfull[:, 8:H + 8]  # strided rows, 16-byte aligned
    ids = torch.randint(-1, E, (T, K), generator=g, dtype=torch.int32)
    ids[0, 0] = 2
    w = torch.rand(T, K, generator=g)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[1, 4, 7]] = True
    stream = torch.cuda.current_stream(cuda).cuda_stream
    task = (1 << 32) | T
    # Named device tensors: a temporary's memory could be reused before the kernel runs.
    ids_d, w_d, mask_d = ids.to(cuda), w.to(cuda), mask.to(cuda)
    kio.publish(stream, T, x.data_ptr(), x.stride(0), ids_d.data_ptr(), K, w_d.data_ptr(), K, mask_d.data_ptr(), E,
                task)
    torch.cuda.synchronize()
    a = ex.io_arrays()
    assert (a["x"][:T].view(np.int16) == bits(x).numpy()).all()
    want_ids = ids.masked_fill(mask[ids.clamp(0).long()] & (ids >= 0), -1).numpy()
    assert (a["ids"][:T] == want_ids).all() and (a["w"][:T] == w.numpy()).all()
    assert xn.load_u64(iob["ready"]) == task and xn.load_u64(iob["done"]) == 0

    # Play the coordinator: y, then ready := 0, done := 1.
    y = rng.standard_normal((T, H)).astype(np.float32).astype(cf.numerics.BF16)
    a["y"][:T] = y
    xn.store_u64(iob["ready"], 0)
    xn.store_u64(iob["done"], 1)
    p = torch.randn(T, H, generator=g).to(torch.bfloat16)
    out, part = torch.empty(T, H + 8, dtype=torch.bfloat16, device=cuda)[:, :H], p.to(cuda)
    kio.combine(stream, T, out.data_ptr(), out.stride(0), False)
    kio.combine(stream, T, part.data_ptr(), part.stride(0), True)
    torch.cuda.synchronize()
    yt = torch.from_numpy(y.view(np.int16)).view(torch.bfloat16)
    assert torch.equal(bits(out), bits(yt))
    assert torch.equal(bits(part), bits((p.float() + yt.float()).to(torch.bfloat16)))

    # No CPU route: done := 1, no doorbell, combine adds/writes zeros.
    skip = torch.tensor([[1, 4, -1, 7]] * 2, dtype=torch.int32)
    xn.store_u64(iob["done"], 5)
    skip_d = skip.to(cuda)
    kio.publish(stream, 2, x.data_ptr(), x.stride(0), skip_d.data_ptr(), K, w_d.data_ptr(), K, mask_d.data_ptr(), E,
                (0 << 32) | 2)
    part = p[:2].to(cuda)
    kio.combine(stream, 2, part.data_ptr(), part.stride(0), True)
    kio.combine(stream, 2, out.data_ptr(), out.stride(0), False)
    torch.cuda.synchronize()
    assert xn.load_u64(iob["ready"]) == 0 and xn.load_u64(iob["done"]) == 1
    assert torch.equal(bits(part), bits((p[:2].float() + 0.0).to(torch.bfloat16)))
    assert not bits(out[:2]).any()
    del kio, b
    ex.close()
