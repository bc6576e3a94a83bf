"""Start-up qualification of a path: the real decode, eager and inside a CUDA
graph replayed with changed inputs, bit-identical to the executor's synchronous
decode of the same inputs (fail closed: docs/architecture.md). The step's two halves are
proven the same way: submit, other GPU work on the same stream (a torch add, as an
engine's GPU-resident experts would run there), then finish adding y into that
work's result or writing it out; eager and in the graph, with a step that has a
CPU route and one that has none. Raises on any difference."""
from __future__ import annotations

REPLAYS = 3


def qualify(sync, path: str, torch) -> None:
    """Raises on any difference; `sync` is a StepSync (gpusync_cuda.CudaSync, gpusync_hip.HipSync) proving `path`."""
    try:
        _qualify(sync, path, torch)
    finally:
        sync.abandon()  # a failure between the halves leaves nothing pending (its CPU work drained)


def _qualify(sync, path: str, torch) -> None:
    ex = sync.executor
    dev = torch.device("cuda", sync.ordinal)
    E, H, K, T = ex.E, ex.H, ex.top_k, min(3, ex.max_tokens)
    layer = ex.num_layers - 1
    gen = torch.Generator().manual_seed(20261129)
    mask = torch.zeros(E, dtype=torch.bool)
    if E > 1:
        mask[0::2] = True  # even experts "run on the GPU"

    def fresh(skip: bool = False):
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        w = torch.rand(T, K, generator=gen) + 0.05
        if skip:  # every route resident or -1: nothing for the CPU
            ids = torch.randint(0, (E + 1) // 2, (T, K), generator=gen, dtype=torch.int32) * 2
            ids[0, -1] = -1
            if E == 1:
                ids.fill_(-1)
        else:
            ids = torch.randint(-1, E, (T, K), generator=gen, dtype=torch.int32)
            ids[0, 0] = 1 if E > 1 else 0  # at least one CPU route
        return x, w, ids

    def bf16():
        return torch.randn(T, H, generator=gen).to(torch.bfloat16)

    def want(x, w, ids, partial=None):
        hit = mask[ids.clamp(0, E - 1).long()] & (ids >= 0)
        y = ex.decode(layer, x, w, ids.masked_fill(hit, -1))
        return y if partial is None else (partial.float() + y.float()).to(torch.bfloat16)

    def same(got, exp, what):
        if not torch.equal(got.cpu().view(torch.int16), exp.view(torch.int16)):
            raise AssertionError(f"{what}: differs from the synchronous CPU result")

    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    mask_d = mask.to(dev)
    with torch.cuda.stream(s):
        x, w, ids = fresh()
        p, q1, q2 = bf16(), bf16(), bf16()
        xd, wd, idsd = x.to(dev), w.to(dev), ids.to(dev)
        q1d, q2d = q1.to(dev), q2.to(dev)
        y1 = sync.decode(layer, xd, wd, idsd, mask_d, path=path)
        y2 = sync.decode(layer, xd, wd, idsd, mask_d, partial=p.to(dev), path=path)
        # The split: other GPU work on the same stream between the halves, its result the partial y is added to.
        sync.submit(layer, xd, wd, idsd, mask_d, path=path)
        part = q1d + q2d
        y3 = sync.finish(layer, partial=part)
        sync.synchronize(s)
        same(y1, want(x, w, ids), "eager")
        same(y2, want(x, w, ids, p), "eager, added into a partial")
        same(y3, want(x, w, ids, (q1d + q2d).cpu()), "eager submit / other GPU work / finish into its result")

        # One graph: a step for the CPU (out), a skipped step added into a partial, then the same two through
        # the halves: submit, a torch add, finish adding into its result; submit (no CPU route), other GPU work
        # writing the output first, finish writing y over it.
        xs, ws, ids_s = xd.clone(), wd.clone(), idsd.clone()
        xk, wk, idk = (t.to(dev) for t in fresh(skip=True))
        ps = torch.zeros(T, H, dtype=torch.bfloat16, device=dev)
        xt, wt, idt = xd.clone(), wd.clone(), idsd.clone()
        xu, wu, idu = xk.clone(), wk.clone(), idk.clone()
        a1, a2 = q1d.clone(), q2d.clone()
        ou = torch.zeros(T, H, dtype=torch.bfloat16, device=dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            o1 = sync.decode(layer, xs, ws, ids_s, mask_d, path=path)
            sync.decode(layer, xk, wk, idk, mask_d, partial=ps, path=path)
            sync.submit(layer, xt, wt, idt, mask_d, path=path)
            o3 = sync.finish(layer, partial=a1 + a2)
            sync.submit(layer, xu, wu, idu, mask_d, path=path)
            ou.copy_(a1)
            sync.finish(layer, out=ou)
        for r in range(REPLAYS):
            (x, w, ids), (x2, w2, ids2), (x3, w3, ids3), (x4, w4, ids4) = (
                fresh(), fresh(skip=True), fresh(), fresh(skip=True))
            p, b1, b2 = bf16(), bf16(), bf16()
            for dst, src in ((xs, x), (ws, w), (ids_s, ids), (xk, x2), (wk, w2), (idk, ids2), (ps, p),
                             (xt, x3), (wt, w3), (idt, ids3), (xu, x4), (wu, w4), (idu, ids4), (a1, b1), (a2, b2)):
                dst.copy_(src)
            graph.replay()
            sync.synchronize(s)
            same(o1, want(x, w, ids), f"graph replay {r}")
            same(ps, want(x2, w2, ids2, p), f"graph replay {r}, skipped step")
            same(o3, want(x3, w3, ids3, (a1 + a2).cpu()), f"graph replay {r}, submit / torch add / finish")
            same(ou, want(x4, w4, ids4), f"graph replay {r}, submit / other GPU work / finish, skipped step")
        del graph
    torch.cuda.current_stream(dev).wait_stream(s)
