"""On an NVIDIA GPU (marked cuda/gpu; skipped with the reason elsewhere): the
driver resolves through cuGetProcAddress_v2, the probes pass, every path's
decode equals the executor's synchronous decode bit for bit, memops become
graph nodes, capture is refused where no replay-safe path exists, and waits
stay bounded."""
import zlib

import numpy as np
import pytest
from conftest import cuda, gpu_missing, make_executor

MISSING = gpu_missing()
pytestmark = cuda + [pytest.mark.skipif(MISSING is not None, reason=f"no CUDA GPU: {MISSING}")]
PATHS = ("kernel", "memop", "host-func", "eager")


@pytest.fixture(scope="module")
def sync():
    import gpusync_cuda as gs

    ex = make_executor(np.random.default_rng(3), E=8, H=256, I=64, layers=4, top_k=4, threads=4)
    s = gs.CudaSync(ex)
    yield s
    s.close()
    ex.close()


def want(torch, ex, layer, x, w, ids, mask=None, partial=None):
    ids = ids.cpu()
    if mask is not None:
        hit = mask.cpu()[ids.clamp(0, ex.E - 1).long()] & (ids >= 0)
        ids = ids.masked_fill(hit, -1)
    xc = x.cpu()
    y = ex.decode(layer, xc if xc.dtype == torch.bfloat16 else xc.float(), w.cpu().float(), ids)
    return y if partial is None else (partial.cpu().float() + y.float()).to(torch.bfloat16)


def bits(t):
    import torch

    return t.detach().cpu().contiguous().view(torch.int16)


def test_driver_resolution():
    import gpusync_cuda as gs

    st = gs.driver_status()
    assert st["resolver"].startswith("cuGetProcAddress_v2(cudaVersion=12000)"), st
    assert st["memops"] and st["graphs"] and st["modules"] and st["host_func"] and not st["missing"]


def _need_kernelio(path="kernel"):
    import importlib.util

    if path == "kernel" and importlib.util.find_spec("kernelio") is None:
        pytest.skip("the kernel path needs kernelio (pip install gpusync-cuda[kernels]); tests-integration runs it")


def test_probes_pass_and_kernel_path_is_chosen(sync):
    _need_kernelio()
    assert sync.path == "kernel", sync.summary()
    for p in ("memop", "host-func"):
        assert "bit-identical" in sync.reasons[p], sync.reasons[p]
    assert sync.kernel_image.endswith("SASS"), sync.kernel_image


def test_kernel_path_waits_in_kernel(sync):
    """The probe passed the in-kernel wait, so decode's graph holds no memop wait (unless KERNELIO_WAIT forces it)."""
    _need_kernelio()
    import kernelio

    want_wait = kernelio.wait_override() or "poll"
    assert sync.kernel_wait == want_wait, sync.summary()
    if want_wait == "poll":
        assert "waits in-kernel" in sync.reasons["kernel"], sync.reasons["kernel"]


def test_in_kernel_wait_puts_only_kernels_in_the_graph(sync):
    import torch

    _need_kernelio()
    if sync.kernel_wait != "poll":
        pytest.skip("the in-kernel wait is not in use (KERNELIO_WAIT=memop)")
    d, ex, dev = sync._dev, sync.executor, torch.device("cuda", sync.ordinal)
    x = torch.zeros(2, ex.H, dtype=torch.bfloat16, device=dev)
    ids = torch.full((2, ex.top_k), -1, dtype=torch.int32, device=dev)
    w, out = torch.zeros(2, ex.top_k, device=dev), torch.empty(2, ex.H, dtype=torch.bfloat16, device=dev)
    torch.cuda.synchronize()
    s = d._stream_create()
    try:
        d._capture_begin(s)
        with torch.cuda.stream(torch.cuda.ExternalStream(s)):
            sync._decode("kernel", 0, x, w, ids, None, out, None)
        types = d._capture_end(s)
    finally:
        d._stream_destroy(s)
    assert types == {0: 2}  # CU_GRAPH_NODE_TYPE_KERNEL: publish, combine; no BATCH_MEM_OP (12)


def test_in_kernel_wait_timeout_surfaces_in_synchronize(sync):
    """A combine that gives up waiting (nobody stored done) leaves its output alone and synchronize raises."""
    import torch

    from cpumoe_executor import _native as xn

    _need_kernelio()
    if sync.kernel_wait != "poll":
        pytest.skip("the in-kernel wait is not in use (KERNELIO_WAIT=memop)")
    ex, dev = sync.executor, torch.device("cuda", sync.ordinal)
    g = torch.Generator().manual_seed(77)
    x = torch.randn(2, ex.H, generator=g).to(torch.bfloat16).to(dev)
    w = torch.rand(2, ex.top_k, generator=g).to(dev)
    ids = torch.zeros(2, ex.top_k, dtype=torch.int32, device=dev)  # CPU routes: the step rings
    sync.decode(0, x, w, ids)
    sync.synchronize()  # the skip flag is now 0: a combine after this one waits for done
    iob, keep = ex.io_block(), sync._kio.poll_timeout_s
    out = torch.full((2, ex.H), 3.0, dtype=torch.bfloat16, device=dev)
    xn.store_u64(iob["done"], 0)  # a step nobody will answer (ready stays 0: the coordinator idles)
    try:
        sync._kio.poll_timeout_s = 0.05
        sync._kio.combine(torch.cuda.current_stream(dev).cuda_stream, 2, out.data_ptr(), out.stride(0), False, True)
        with pytest.raises(TimeoutError, match="gave up waiting for done after 0.05 s"):
            sync.synchronize(timeout_s=5.0)
        assert (out.float() == 3.0).all()
    finally:
        sync._kio.poll_timeout_s = keep
        xn.store_u64(iob["done"], 1)
    sync.synchronize()  # the count was cleared
    assert not sync.pending()


@pytest.mark.parametrize("path", PATHS + ("kernel/memop-wait",))
@pytest.mark.parametrize("mode", ["new", "out", "partial"])
def test_decode_matches_the_executor(sync, path, mode, monkeypatch):
    import torch

    _need_kernelio(path.split("/")[0])
    if path == "kernel/memop-wait":  # the variant the probe did not choose: a memop wait, then combine
        monkeypatch.setattr(sync, "kernel_wait", "memop")
        path = "kernel"

    ex, dev = sync.executor, torch.device("cuda", sync.ordinal)
    g = torch.Generator().manual_seed(zlib.crc32(f"{path}/{mode}".encode()))
    mask = torch.zeros(ex.E, dtype=torch.bool)
    mask[1::3] = True
    for layer, T in ((0, 1), (3, 5), (1, 8)):
        x = torch.randn(T, ex.H, generator=g).to(torch.bfloat16)
        w = torch.rand(T, ex.top_k, generator=g)
        ids = torch.randint(-1, ex.E, (T, ex.top_k), generator=g, dtype=torch.int32)
        p = torch.randn(T, ex.H, generator=g).to(torch.bfloat16)
        for m in (None, mask):
            target = {"new": None, "out": torch.empty(T, ex.H, dtype=torch.bfloat16, device=dev),
                      "partial": p.to(dev)}[mode]
            kw = {"out": target} if mode == "out" else {"partial": target} if mode == "partial" else {}
            y = sync._decode(path, layer, x.to(dev), w.to(dev), ids.to(dev), None if m is None else m.to(dev),
                             kw.get("out"), kw.get("partial"))
            sync.synchronize()
            assert target is None or y is target
            exp = want(torch, ex, layer, x, w, ids, m, p if mode == "partial" else None)
            assert torch.equal(bits(y), bits(exp)), (path, mode, layer, T, m is not None)
    assert not sync.pending()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_non_bf16_x_takes_the_copy_path(sync, dtype):
    import torch

    ex, dev = sync.executor, torch.device("cuda", sync.ordinal)
    x = torch.randn(3, ex.H, dtype=getattr(torch, dtype))
    w = torch.rand(3, ex.top_k)
    ids = torch.randint(0, ex.E, (3, ex.top_k), dtype=torch.int64)  # int64 ids are converted too
    y = sync.decode(2, x.to(dev), w.to(dev), ids.to(dev))
    sync.synchronize()
    assert torch.equal(bits(y), bits(want(torch, ex, 2, x.to(torch.bfloat16), w, ids.to(torch.int32))))


def test_memops_are_graph_nodes(sync):
    from gpusync_cuda import _native

    d, b = sync._dev, sync._iob
    s = d._stream_create()
    try:
        d._capture_begin(s)
        b.submit(_native.PATHS["memop"], s, 0, 1)
        b.wait(_native.PATHS["memop"], s)
        types = d._capture_end(s)
    finally:
        d._stream_destroy(s)
    assert types == {12: 3}  # CU_GRAPH_NODE_TYPE_BATCH_MEM_OP: write done, write ready, wait


@pytest.mark.parametrize("fork", ["0", "1"])
def test_copy_fork_passes_the_probes_with_the_same_nodes(sync, fork, monkeypatch):
    """GPUSYNC_COPY_FORK is read when a block is registered: a second registration of the executor's block with
    each value passes both copy paths' probes (eager, capture, 3 replays with changed inputs, bit-identical to
    the CPU), and the fork adds no graph node (under capture its events are edges, not nodes)."""
    import cpumoe_executor as ce
    from gpusync_cuda import _native

    monkeypatch.setenv("GPUSYNC_COPY_FORK", fork)
    b = _native.Iob(sync._dev, ce.C_API_CAPSULE, sync.executor.handle, sync.executor)
    try:
        for path, shape in (
            ("memop", "14 nodes (6 memop, 0 host, 8 memcpy, 0 other)"),
            ("host-func", "12 nodes (0 memop, 4 host, 8 memcpy, 0 other)"),
        ):
            safe, report = b.probe(_native.PATHS[path], 10.0)
            print(f"GPUSYNC_COPY_FORK={fork} {report}")
            assert safe and shape in report, report
            assert ("copies forked" if fork == "1" else "copies serial") in report, report
    finally:
        del b
    assert not sync.pending()


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_capture_is_refused_without_a_replay_safe_path(rng):
    import torch

    import gpusync_cuda as gs

    ex = make_executor(rng, layers=1)
    s = gs.CudaSync(ex, paths=("eager",))
    assert s.path == "eager"
    dev = torch.device("cuda", s.ordinal)
    x = torch.randn(2, ex.H, device=dev).to(torch.bfloat16)
    w, ids = torch.rand(2, ex.top_k, device=dev), torch.zeros(2, ex.top_k, dtype=torch.int32, device=dev)
    y = s.decode(0, x, w, ids)  # eager decode stays correct
    assert torch.equal(bits(y), bits(want(torch, ex, 0, x, w, ids)))
    g = torch.cuda.CUDAGraph()
    with pytest.raises(gs.CaptureRefusedError, match="capture refused.*--cuda-graph-max-bs 0"):
        with torch.cuda.graph(g):
            s.decode(0, x, w, ids)
    s.close()
    ex.close()


def test_waits_are_bounded(rng):
    import cpumoe_executor as ce
    from gpusync_cuda import _native

    ex = make_executor(rng, layers=1)  # coordinator not started: nobody answers
    d = _native.Device(0)
    b = _native.Iob(d, ce.C_API_CAPSULE, ex.handle, ex)
    s = d._stream_create()
    try:
        b.submit(_native.PATHS["memop"], s, 0, 1)
        b.wait(_native.PATHS["memop"], s)
        assert b.sync(s, 0.3) is False  # expired, and released the stream
        assert ex.health()["done"] == 0x7FFFFFFFFFFFFFFF
        assert d.sync(s, 5.0)
    finally:
        d._stream_destroy(s)
        del b
        ex.close()
