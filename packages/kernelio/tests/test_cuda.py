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
    assert kernelio.probe(gs.C_API_CAPSULE, dev.handle, wait=True) == ""  # the in-kernel wait's stages too
    forced = kernelio.wait_override()
    assert kernelio.probe_wait(gs.C_API_CAPSULE, dev.handle)[0] == (forced or "poll")


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


def test_in_kernel_wait_reads_y_stored_before_done_and_times_out_without_reading(dev):
    """combine(wait=True) through a real IO block: it spins until the host stores done = 1 (after y), a
    skipped step does not wait, and nobody answering ends in a counted timeout with out untouched."""
    import time

    import torch

    import cpumoe_executor as ce
    import cpumoe_formats as cf
    import gpusync_cuda as gs
    from cpumoe_executor import _native as xn
    from gpusync_cuda import _native

    E, H, K, T = 8, 256, 4, 3
    rng = np.random.default_rng(6)
    banks = [cf.get_format("bf16").random_banks(E, H, 32, rng)]
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=K, max_tokens=8, threads=1)  # no coordinator: we play the CPU
    b = _native.Iob(dev, ce.C_API_CAPSULE, ex.handle, ex)
    iob = ex.io_block()
    io = {k: b.dptr(iob[k]) for k in ("x", "ids", "w", "y", "ready", "done")}
    io.update(H=H, K=K, max_tokens=8)
    kio = kernelio.open_kernels(gs.C_API_CAPSULE, dev, io)
    cuda = torch.device("cuda", 0)
    st = torch.cuda.current_stream(cuda)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(cuda)
    ids = torch.full((T, K), 2, dtype=torch.int32, device=cuda)  # CPU routes: rings, skip flag 0
    w = torch.rand(T, K, generator=g).to(cuda)
    a = ex.io_arrays()
    a["y"][:T] = 0  # stale y: a combine that does not wait reads this
    out = torch.full((T, H), 7.0, dtype=torch.bfloat16, device=cuda)
    kio.publish(st.cuda_stream, T, x.data_ptr(), H, ids.data_ptr(), K, w.data_ptr(), K, 0, E, T)
    kio.combine(st.cuda_stream, T, out.data_ptr(), H, False, True)
    time.sleep(0.05)
    assert not st.query(), "combine(wait=True) finished before done = 1"
    assert xn.load_u64(iob["ready"]) == T and xn.load_u64(iob["done"]) == 0
    y = rng.standard_normal((T, H)).astype(np.float32).astype(cf.numerics.BF16)
    a["y"][:T] = y
    xn.store_u64(iob["ready"], 0)
    xn.store_u64(iob["done"], 1)  # release store after y
    assert b.sync(st.cuda_stream, 5.0)  # bounded: on expiry it releases the kernel (done := SHUTDOWN)
    assert torch.equal(bits(out), bits(torch.from_numpy(y.view(np.int16)).view(torch.bfloat16)))
    assert kio.poll_timeouts() == 0

    # Nobody answers: the kernel gives up after poll_timeout_s, counts it and writes nothing.
    kio.poll_timeout_s = 0.05
    out.fill_(7.0)
    kio.publish(st.cuda_stream, T, x.data_ptr(), H, ids.data_ptr(), K, w.data_ptr(), K, 0, E, T)
    kio.combine(st.cuda_stream, T, out.data_ptr(), H, True, True)
    assert b.sync(st.cuda_stream, 5.0), "the in-kernel timeout did not end the wait (released by the host)"
    assert kio.poll_timeouts() >= 1 and kio.poll_timeouts() == 0  # counted, then cleared
    assert (out.float() == 7.0).all()
    xn.store_u64(iob["ready"], 0)
    xn.store_u64(iob["done"], 1)
    del kio, b
    ex.close()
