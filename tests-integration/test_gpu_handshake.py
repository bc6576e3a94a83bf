"""cpumoe-executor + gpusync-cuda + kernelio on one GPU, for each path (kernel,
memop, host-func): eager decode, and one CUDA graph of 4 layers mixing ringing
and skipped layers, captured once and replayed REPLAYS times with fresh x, ids
and weights written into the same GPU tensors before each replay. Every
output must be bit-identical to the executor's synchronous decode of the same
inputs, the doorbells served must equal the ringing layers, nothing may be
pending afterwards, and every wait is bounded (CudaSync.synchronize). The
kernel path runs with the wait the probe chose (the in-kernel wait on a GPU
that passes it) and, as "kernel/memop-wait", with the stream memop wait."""
import contextlib
import os
import zlib

import numpy as np
import pytest
from conftest import cuda, cuda_missing

MISSING = cuda_missing()
pytestmark = cuda + [pytest.mark.skipif(MISSING is not None, reason=f"no CUDA GPU: {MISSING}")]
REPLAYS = int(os.environ.get("GPUSYNC_TEST_REPLAYS", "1000"))
PATHS = ("kernel", "kernel/memop-wait", "memop", "host-func")
E, H, I, K, T, LAYERS = 16, 512, 64, 4, 5, 4  # noqa: E741


@pytest.fixture(scope="module")
def sync():
    import cpumoe_executor as ce
    import cpumoe_formats as cf
    import gpusync_cuda as gs

    rng = np.random.default_rng(11)
    banks = [cf.get_format("bf16").random_banks(E, H, I, rng) for _ in range(LAYERS)]
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=K, max_tokens=8, threads=4)
    s = gs.CudaSync(ex)
    assert s.path == "kernel", s.summary()
    print(f"kernel path: {s.kernel_wait} wait ({s.reasons['kernel']})")
    yield s
    s.close()
    ex.close()


@contextlib.contextmanager
def variant(sync, path):
    """The path name _decode takes; "kernel/memop-wait" is the kernel path with a stream memop wait."""
    if path != "kernel/memop-wait":
        yield path
        return
    was, sync.kernel_wait = sync.kernel_wait, "memop"
    try:
        yield "kernel"
    finally:
        sync.kernel_wait = was


def test_kernel_path_uses_the_in_kernel_wait(sync):
    import kernelio

    assert sync.kernel_wait == (kernelio.wait_override() or "poll"), sync.summary()


def bits(t):
    import torch

    return t.detach().cpu().contiguous().view(torch.int16)


def reference(torch, ex, layer, x, w, ids, mask, partial=None):
    hit = mask[ids.clamp(0, E - 1).long()] & (ids >= 0)
    y = ex.decode(layer, x, w, ids.masked_fill(hit, -1))
    return y if partial is None else (partial.float() + y.float()).to(torch.bfloat16)


def inputs(torch, g, ring: bool, mask):
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, K, generator=g) + 0.01
    if ring:
        ids = torch.randint(-1, E, (T, K), generator=g, dtype=torch.int32)
        ids[0, 0] = 3  # not resident: the CPU has work
    else:  # every route resident on the GPU or -1
        res = torch.nonzero(mask).flatten().to(torch.int32)
        ids = res[torch.randint(0, len(res), (T, K), generator=g)]
        ids[:, -1] = -1
    return x, w, ids


@pytest.mark.parametrize("path", PATHS)
def test_eager(sync, path):
    with variant(sync, path) as p:
        _eager(sync, p, path)


def _eager(sync, path, name):
    import torch

    ex, dev = sync.executor, torch.device("cuda", sync.ordinal)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    mask = torch.zeros(E, dtype=torch.bool)
    mask[::4] = True
    for layer in range(LAYERS):
        for ring in (True, False):
            x, w, ids = inputs(torch, g, ring, mask)
            p = torch.randn(T, H, generator=g).to(torch.bfloat16)
            served = ex.health()["served"]
            y = sync.decode(layer, x.to(dev), w.to(dev), ids.to(dev), mask.to(dev), path=path)
            pd = sync.decode(layer, x.to(dev), w.to(dev), ids.to(dev), mask.to(dev), partial=p.to(dev), path=path)
            sync.synchronize()
            assert torch.equal(bits(y), bits(reference(torch, ex, layer, x, w, ids, mask)))
            assert torch.equal(bits(pd), bits(reference(torch, ex, layer, x, w, ids, mask, p)))
            bells = 2 if (ring or path != "kernel") else 0  # kernel IO skips the CPU entirely
            assert ex.health()["served"] - served == bells
    assert not sync.pending()


@pytest.mark.parametrize("path", PATHS)
def test_graph_replay(sync, path):
    """Layers 0 and 2 ring, 1 and 3 are skipped; 0 and 3 write out, 1 and 2 add into a partial."""
    with variant(sync, path) as p:
        _graph_replay(sync, p, path)


def _graph_replay(sync, path, name):
    import torch

    ex, dev = sync.executor, torch.device("cuda", sync.ordinal)
    g = torch.Generator().manual_seed(1000 + zlib.crc32(name.encode()))
    mask = torch.zeros(E, dtype=torch.bool)
    mask[1::3] = True
    ring = (True, False, True, False)
    adds = (False, True, True, False)
    static = [[t.to(dev) for t in inputs(torch, g, r, mask)] for r in ring]
    parts = [torch.zeros(T, H, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
    mask_d = mask.to(dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            outs = [sync.decode(layer, *static[layer], mask_d, partial=parts[layer] if adds[layer] else None, path=path)
                    for layer in range(LAYERS)]
        mismatches, served0 = 0, ex.health()["served"]
        for _ in range(REPLAYS):
            fresh = [inputs(torch, g, ring[layer], mask) for layer in range(LAYERS)]
            p0 = [torch.randn(T, H, generator=g).to(torch.bfloat16) if adds[layer] else None for layer in range(LAYERS)]
            for layer in range(LAYERS):
                for dst, src in zip(static[layer], fresh[layer]):
                    dst.copy_(src, non_blocking=False)
                if adds[layer]:
                    parts[layer].copy_(p0[layer])
            graph.replay()
            sync.synchronize(s)  # bounded: raises TimeoutError instead of hanging
            for layer in range(LAYERS):
                want = reference(torch, ex, layer, *fresh[layer], mask, p0[layer])
                mismatches += not torch.equal(bits(outs[layer]), bits(want))
        served = ex.health()["served"] - served0
    torch.cuda.current_stream(dev).wait_stream(s)
    bells = sum(ring) if path == "kernel" else LAYERS
    wait = sync.kernel_wait if path == "kernel" else "-"
    print(f"path={name} wait={wait} replays={REPLAYS} layers/replay={LAYERS} mismatches={mismatches} "
          f"doorbells={served} (expected {bells * REPLAYS})")
    assert mismatches == 0
    assert served == bells * REPLAYS
    h = ex.health()
    assert not sync.pending() and h["error"] == 0, h
    del graph
