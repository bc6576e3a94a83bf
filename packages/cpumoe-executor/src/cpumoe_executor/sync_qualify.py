"""Start-up qualification of a path: the real decode, eager and inside a CUDA
graph replayed with changed inputs, bit-identical to the executor's synchronous
decode of the same inputs (design.md principle 4). Raises on any difference."""
from __future__ import annotations

REPLAYS = 3


def qualify(sync, path: str, torch) -> None:
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
        p = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        xd, wd, idsd = x.to(dev), w.to(dev), ids.to(dev)
        y1 = sync._decode(path, layer, xd, wd, idsd, mask_d, None, None)
        y2 = sync._decode(path, layer, xd, wd, idsd, mask_d, None, p.to(dev))
        sync.synchronize(s)
        same(y1, want(x, w, ids), "eager")
        same(y2, want(x, w, ids, p), "eager, added into a partial")

        # One graph: a step for the CPU (out) then a skipped step added into a partial.
        xs, ws, ids_s = xd.clone(), wd.clone(), idsd.clone()
        xk, wk, idk = (t.to(dev) for t in fresh(skip=True))
        ps = torch.zeros(T, H, dtype=torch.bfloat16, device=dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            o1 = sync._decode(path, layer, xs, ws, ids_s, mask_d, None, None)
            sync._decode(path, layer, xk, wk, idk, mask_d, None, ps)
        for r in range(REPLAYS):
            (x, w, ids), (x2, w2, ids2) = fresh(), fresh(skip=True)
            p = torch.randn(T, H, generator=gen).to(torch.bfloat16)
            for dst, src in ((xs, x), (ws, w), (ids_s, ids), (xk, x2), (wk, w2), (idk, ids2), (ps, p)):
                dst.copy_(src)
            graph.replay()
            sync.synchronize(s)
            same(o1, want(x, w, ids), f"graph replay {r}")
            same(ps, want(x2, w2, ids2, p), f"graph replay {r}, skipped step")
        del graph
    torch.cuda.current_stream(dev).wait_stream(s)
