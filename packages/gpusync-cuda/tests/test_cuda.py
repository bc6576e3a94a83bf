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
            sync.decode(0, x, w, ids, None, out=out, path="kernel")
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
            y = sync.decode(layer, x.to(dev), w.to(dev), ids.to(dev), None if m is None else m.to(dev),
                            out=kw.get("out"), partial=kw.get("partial"), path=path)
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


# ---- the split: submit -> other GPU work on the same stream -> finish ---------------------------------------
def _mask(torch, g, E):
    m = torch.rand(E, generator=g) < 0.5
    m[0], m[1] = True, False  # at least one GPU-resident and one CPU expert
    return m


def _step(torch, g, ex, T, mask, cpu=True):
    """x, w, ids on the host; cpu=False: every route -1 or GPU-resident under `mask` (nothing for the CPU)."""
    x = torch.randn(T, ex.H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, ex.top_k, generator=g) + 0.05
    if cpu:
        ids = torch.randint(-1, ex.E, (T, ex.top_k), generator=g, dtype=torch.int32)
        ids[0, 0] = int((~mask).nonzero()[0, 0])  # at least one CPU route
    else:
        res = mask.nonzero().flatten().to(torch.int32)
        ids = res[torch.randint(0, len(res), (T, ex.top_k), generator=g)]
        ids[0, 0] = -1
    return x, w, ids


def _bf16(torch, g, ex, T):
    return torch.randn(T, ex.H, generator=g).to(torch.bfloat16)


def _split_path(sync, path, monkeypatch):
    _need_kernelio(path.split("/")[0])
    if path == "kernel/memop-wait":  # the variant the probe did not choose: a memop wait, then combine
        monkeypatch.setattr(sync, "kernel_wait", "memop")
        return "kernel"
    return path


@pytest.mark.parametrize("path", PATHS + ("kernel/memop-wait",))
@pytest.mark.parametrize("mode", ["new", "out", "partial"])
def test_split_matches_decode(sync, path, mode, monkeypatch):
    """submit -> a torch op on the same stream -> finish equals decode() of the same inputs bit for bit (and the
    executor's synchronous decode), with and without a residency mask, including a step with no CPU route."""
    import torch

    path = _split_path(sync, path, monkeypatch)
    ex, dev = sync.executor, torch.device("cuda", sync.ordinal)
    g = torch.Generator().manual_seed(zlib.crc32(f"split/{path}/{mode}".encode()))
    for layer, T, cpu, masked in ((0, 1, True, False), (3, 5, True, True), (1, 8, True, True), (2, 4, False, True)):
        mask = _mask(torch, g, ex.E)
        x, w, ids = _step(torch, g, ex, T, mask, cpu)
        p, q = _bf16(torch, g, ex, T), _bf16(torch, g, ex, T)
        xd, wd, idsd, pd, qd = (t.to(dev) for t in (x, w, ids, p, q))
        md = mask.to(dev) if masked else None
        ref_kw = {"out": torch.empty(T, ex.H, dtype=torch.bfloat16, device=dev)} if mode == "out" else \
            {"partial": pd + qd} if mode == "partial" else {}
        ref = sync.decode(layer, xd, wd, idsd, md, out=ref_kw.get("out"), partial=ref_kw.get("partial"),
                          path=path)
        sync.submit(layer, xd, wd, idsd, md, path=path)
        assert sync.pending_layer == layer
        if mode == "partial":
            target = pd + qd  # the GPU-resident experts' stand-in, computed between the halves
        elif mode == "out":
            target = torch.empty(T, ex.H, dtype=torch.bfloat16, device=dev)
            target.copy_(pd)  # other GPU work writes the output first; finish writes y over it
        else:
            target = None
            _ = pd.float() @ qd.float().T  # other GPU work on the stream, its result unused
        got = sync.finish(layer, out=target if mode == "out" else None,
                          partial=target if mode == "partial" else None)
        sync.synchronize()
        assert sync.pending_layer is None
        assert target is None or got is target
        exp = want(torch, ex, layer, x, w, ids, mask if masked else None, (pd + qd).cpu() if mode == "partial"
                   else None)
        where = (path, mode, layer, T, cpu, masked)
        assert torch.equal(bits(got), bits(ref)), where
        assert torch.equal(bits(got), bits(exp)), where
    assert not sync.pending()


def test_split_public_api(sync):
    """CudaSync.submit / finish on the chosen path, and the one-task-in-flight rules on the GPU."""
    import torch

    ex, dev = sync.executor, torch.device("cuda", sync.ordinal)
    g = torch.Generator().manual_seed(11)
    mask = _mask(torch, g, ex.E)
    md = mask.to(dev)
    x, w, ids = (t.to(dev) for t in _step(torch, g, ex, 3, mask))
    p = _bf16(torch, g, ex, 3).to(dev)
    ref = sync.decode(2, x, w, ids, md, partial=p.clone())
    sync.submit(2, x, w, ids, md)
    with pytest.raises(RuntimeError, match="layer 2's task is still pending"):
        sync.submit(1, x, w, ids, md)
    with pytest.raises(RuntimeError, match="layer 2's task is still pending"):
        sync.decode(1, x, w, ids, md)
    got = sync.finish(2, partial=p)
    sync.synchronize()
    assert got is p and torch.equal(bits(got), bits(ref))
    with pytest.raises(RuntimeError, match="no task is pending"):
        sync.finish(2)
    # finish for another layer: ValueError naming both, the task abandoned (drained), nothing pending
    sync.submit(0, x, w, ids, md)
    with pytest.raises(ValueError, match="finish\\(layer=3\\): layer 0 was submitted, not layer 3"):
        sync.finish(3)
    assert sync.pending_layer is None and not sync.pending()
    # a bad step is refused by submit before anything is enqueued; a bad out/partial by finish (then abandoned)
    with pytest.raises(ValueError, match="batch size 9"):
        sync.submit(0, torch.zeros(9, ex.H, dtype=torch.bfloat16, device=dev), torch.rand(9, ex.top_k, device=dev),
                    torch.zeros(9, ex.top_k, dtype=torch.int32, device=dev))
    assert sync.pending_layer is None
    sync.submit(0, x, w, ids, md)
    with pytest.raises(ValueError, match="expected \\(3, 256\\)"):
        sync.finish(0, partial=torch.zeros(2, ex.H, dtype=torch.bfloat16, device=dev))
    assert sync.pending_layer is None and not sync.pending()
    # finish on another stream than submit: refused, abandoned
    sync.submit(0, x, w, ids, md)
    other = torch.cuda.Stream(dev)
    with torch.cuda.stream(other):
        with pytest.raises(RuntimeError, match="is not the one the task was submitted on"):
            sync.finish(0)
    assert sync.pending_layer is None and not sync.pending()
    y = sync.decode(0, x, w, ids, md)  # still works, and right
    sync.synchronize()
    assert torch.equal(bits(y), bits(want(torch, ex, 0, x, w, ids, mask)))


@pytest.mark.parametrize("path", ("kernel", "kernel/memop-wait", "memop", "host-func"))
def test_split_under_graph_capture(sync, path, monkeypatch):
    """One torch.cuda graph: submit -> a torch add -> finish adding y into it; submit -> a torch write of the
    output -> finish(out=) over it; submit (no CPU route) -> finish into a partial; a plain decode. Captured once,
    replayed 24 times with fresh inputs and a fresh residency mask: every output equals eager decode() of the same
    inputs bit for bit, and the executor's synchronous decode."""
    import torch

    path = _split_path(sync, path, monkeypatch)
    ex, dev = sync.executor, torch.device("cuda", sync.ordinal)
    g = torch.Generator().manual_seed(zlib.crc32(f"split-graph/{path}".encode()))
    steps = ((0, 2, True), (1, 3, True), (2, 8, False), (3, 1, True))  # (layer, T, any CPU route)
    mask = _mask(torch, g, ex.E)
    md = mask.to(dev)
    st = [tuple(t.to(dev) for t in _step(torch, g, ex, T, mask, cpu) + (_bf16(torch, g, ex, T),
                                                                          _bf16(torch, g, ex, T)))
          for _layer, T, cpu in steps]
    o1 = torch.empty(steps[1][1], ex.H, dtype=torch.bfloat16, device=dev)

    def body():
        (x0, w0, i0, p0, q0), (x1, w1, i1, p1, _q1), (x2, w2, i2, p2, q2), (x3, w3, i3, p3, q3) = st
        sync.submit(0, x0, w0, i0, md, path=path)
        y0 = sync.finish(0, partial=p0 + q0)  # the partial computed between the halves
        sync.submit(1, x1, w1, i1, md, path=path)
        o1.copy_(p1)  # other GPU work writes the output first
        sync.finish(1, out=o1)
        sync.submit(2, x2, w2, i2, md, path=path)  # no CPU route
        y2 = sync.finish(2, partial=p2 + q2)
        y3 = sync.decode(3, x3, w3, i3, md, partial=p3 + q3, path=path)
        return y0, o1, y2, y3

    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        body()  # warm-up outside the capture
        sync.synchronize(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            outs = body()
        assert sync.pending_layer is None
        for r in range(24):
            mask.copy_(_mask(torch, g, ex.E))
            md.copy_(mask)
            for (_layer, T, cpu), tensors in zip(steps, st):
                fresh = _step(torch, g, ex, T, mask, cpu) + (_bf16(torch, g, ex, T), _bf16(torch, g, ex, T))
                for a, b in zip(tensors, fresh):
                    a.copy_(b)
            graph.replay()
            sync.synchronize(s)
            for i, ((layer, T, _cpu), (x, w, ids, p, q), got) in enumerate(zip(steps, st, outs)):
                if i == 1:
                    ref = sync.decode(layer, x, w, ids, md, out=torch.empty(T, ex.H, dtype=torch.bfloat16, device=dev),
                                      path=path)
                    exp = want(torch, ex, layer, x, w, ids, mask)
                else:
                    ref = sync.decode(layer, x, w, ids, md, partial=p + q, path=path)
                    exp = want(torch, ex, layer, x, w, ids, mask, (p + q).cpu())
                sync.synchronize(s)
                assert torch.equal(bits(got), bits(ref)), (path, r, i)
                assert torch.equal(bits(got), bits(exp)), (path, r, i)
        del graph
    torch.cuda.current_stream(dev).wait_stream(s)
    assert not sync.pending()


def test_split_graph_holds_both_halves_or_neither(sync):
    """A submit captured without its finish cannot be finished outside the graph (RuntimeError, nothing pending
    afterwards, the executor untouched: nothing ran)."""
    import torch

    ex, dev = sync.executor, torch.device("cuda", sync.ordinal)
    g = torch.Generator().manual_seed(5)
    x, w, ids = (t.to(dev) for t in _step(torch, g, ex, 2, _mask(torch, g, ex.E)))
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        sync.synchronize(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            sync.submit(0, x, w, ids)
        with pytest.raises(RuntimeError, match="a graph must hold both halves of a step or neither"):
            sync.finish(0)
        assert sync.pending_layer is None
        del graph  # never replayed
        y = sync.decode(0, x, w, ids)
        sync.synchronize(s)
    torch.cuda.current_stream(dev).wait_stream(s)
    assert torch.equal(bits(y), bits(want(torch, ex, 0, x, w, ids)))
    assert not sync.pending()


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_split_on_the_eager_path_refuses_capture(rng):
    """No replay-safe path: submit / finish still work eagerly (== decode); either half under capture raises
    CaptureRefusedError and leaves nothing pending."""
    import torch

    import gpusync_cuda as gs

    ex = make_executor(rng, layers=2)
    s = gs.CudaSync(ex, paths=("eager",))
    try:
        assert s.path == "eager"
        dev = torch.device("cuda", s.ordinal)
        g = torch.Generator().manual_seed(6)
        mask = _mask(torch, g, ex.E)
        x, w, ids = (t.to(dev) for t in _step(torch, g, ex, 2, mask))
        p0 = _bf16(torch, g, ex, 2).to(dev)
        ref = s.decode(1, x, w, ids, mask.to(dev), partial=p0.clone())
        s.submit(1, x, w, ids, mask.to(dev))
        p = p0.clone()
        got = s.finish(1, partial=p)
        assert got is p and torch.equal(bits(got), bits(ref))
        assert torch.equal(bits(got), bits(want(torch, ex, 1, x, w, ids, mask, p0)))
        with pytest.raises(gs.CaptureRefusedError, match="capture refused.*--cuda-graph-max-bs 0"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                s.submit(1, x, w, ids)
        assert s.pending_layer is None
        s.submit(1, x, w, ids)  # submitted eagerly, finished under capture: refused too
        with pytest.raises(gs.CaptureRefusedError, match="capture refused"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                s.finish(1)
        assert s.pending_layer is None
    finally:
        s.close()
        ex.close()
