"""One process of the HIP-on-CUDA split test (tests/test_hip_on_cuda.py::test_split_on_cuda), run as

    GPUSYNC_HIP_LIBRARY=libhip_on_cuda.so HIPSHIM_MODE=<native|eager-capture> \\
        python split_worker.py PATH REPLAYS QUALIFY

HipSync (gpusync-hip on the shim) driven through torch on an NVIDIA GPU, the hybrid overlap's shape:
submit -> torch work on the same stream -> finish.
  * eager: per case (layers 0-3, batches 1..8, with and without a residency mask, one with no CPU route) and
    per mode (new, out=, partial=), submit -> a torch op -> finish equals decode() of the same inputs bit for
    bit, and the executor's synchronous decode;
  * graph: one torch.cuda.graph of 4 steps (split into a partial computed between the halves; split into out=
    with a torch write to it between the halves; split with no CPU route into a partial; a plain decode into a
    partial) captured once, replayed REPLAYS times with fresh inputs and a fresh residency mask each time,
    every output compared bit for bit with eager decode() of the same inputs and with the executor.
PATH: gpusync-hip's path choice (auto, copy-native, copy-splice); QUALIFY 1: HipSync's start-up qualification
(sync_qualify: decode and the split, eager and graph-replayed) runs too. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import cpumoe_executor as ce
import cpumoe_formats as cf
import gpusync_hip

E, H, I, K, LAYERS, MAX_T = 8, 256, 64, 4, 4, 8
TIMEOUT_S = 10.0


def main(path: str, replays: int, qualify: bool) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skip": "torch sees no CUDA device"}
    rng = np.random.default_rng(20261130)
    banks = [cf.get_format("bf16").random_banks(E, H, I, rng) for _ in range(LAYERS)]
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=K, max_tokens=MAX_T, threads=2)
    sync = gpusync_hip.HipSync(ex, 0, path=path, qualify=qualify, timeout_s=TIMEOUT_S)
    out = {"path": sync.path, "mechanism": sync.mechanism, "summary": sync.summary()}
    try:
        if not sync.path.startswith("copy-"):
            out["error"] = f"no copy path was proven: {sync.summary()}"
            return out
        dev = torch.device("cuda", 0)
        gen = torch.Generator().manual_seed(7)
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        served = ex.health()["served"]
        with torch.cuda.stream(s):
            out.update(eager_checks(torch, sync, ex, gen, dev, s))
            out.update(graph_checks(torch, sync, ex, gen, dev, s, replays))
        torch.cuda.current_stream(dev).wait_stream(s)
        torch.cuda.synchronize(dev)
        words = sync.words
        out.update(served=ex.health()["served"] - served, pending=sync.pending(), pending_layer=sync.pending_layer,
                   ready=sync._iob.load_word(words["ready"]), done=sync._iob.load_word(words["done"]),
                   error_word=ex.health()["error"], pending_error=gpusync_hip._native._peek_error())
        return out
    finally:
        sync.close()
        ex.close()


def bits(torch, t):
    return t.detach().cpu().contiguous().view(torch.int16)


def rand_mask(torch, gen):
    m = torch.rand(E, generator=gen) < 0.5
    m[0], m[1] = True, False  # at least one GPU-resident and one CPU expert
    return m


def rand_step(torch, gen, T, mask, cpu=True):
    """x, w, ids on the host; cpu=False: every route -1 or GPU-resident under `mask` (nothing for the CPU)."""
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    w = torch.rand(T, K, generator=gen) + 0.05
    if cpu:
        ids = torch.randint(-1, E, (T, K), generator=gen, dtype=torch.int32)
        ids[0, 0] = int((~mask).nonzero()[0, 0])  # at least one CPU route
    else:
        res = mask.nonzero().flatten().to(torch.int32)
        ids = res[torch.randint(0, len(res), (T, K), generator=gen)]
        ids[0, 0] = -1
    return x, w, ids


def bf16(torch, gen, T):
    return torch.randn(T, H, generator=gen).to(torch.bfloat16)


def want(torch, ex, layer, x, w, ids, mask, partial=None):
    ids = ids.cpu()
    if mask is not None:
        hit = mask.cpu()[ids.clamp(0, E - 1).long()] & (ids >= 0)
        ids = ids.masked_fill(hit, -1)
    y = ex.decode(layer, x.cpu(), w.cpu().float(), ids)
    return y if partial is None else (partial.cpu().float() + y.float()).to(torch.bfloat16)


def eager_checks(torch, sync, ex, gen, dev, s) -> dict:
    bad, n = [], 0
    for layer, T, cpu, masked in ((0, 1, True, False), (1, 3, True, True), (2, 8, True, True), (3, 4, False, True)):
        mask = rand_mask(torch, gen)
        x, w, ids = rand_step(torch, gen, T, mask, cpu)
        p, q = bf16(torch, gen, T), bf16(torch, gen, T)
        xd, wd, idsd, pd, qd = (t.to(dev) for t in (x, w, ids, p, q))
        md = mask.to(dev) if masked else None
        for mode in ("new", "out", "partial"):
            kw = {"out": torch.empty(T, H, dtype=torch.bfloat16, device=dev)} if mode == "out" else \
                {"partial": pd + qd} if mode == "partial" else {}
            ref = sync.decode(layer, xd, wd, idsd, md, **kw)
            sync.submit(layer, xd, wd, idsd, md)
            if mode == "partial":
                kw = {"partial": pd + qd}  # the GPU-resident experts' stand-in, between the halves
            elif mode == "out":
                kw = {"out": torch.empty(T, H, dtype=torch.bfloat16, device=dev)}
                kw["out"].copy_(pd)  # other GPU work writes the output first; finish writes y over it
            else:
                _ = pd.float() @ qd.float().T  # other GPU work on the stream, its result unused
            got = sync.finish(layer, **kw)
            sync.synchronize(s)
            exp = want(torch, ex, layer, x, w, ids, mask if masked else None, (p.to(dev) + q.to(dev)).cpu()
                       if mode == "partial" else None)
            n += 1
            same = torch.equal(bits(torch, got), bits(torch, ref)) and torch.equal(bits(torch, got), exp.view(
                torch.int16))
            if not same or (mode != "new" and got is not next(iter(kw.values()))):
                bad.append({"layer": layer, "T": T, "mode": mode, "cpu": cpu, "masked": masked})
    return {"eager_checks": n, "eager_bad": bad}


def graph_checks(torch, sync, ex, gen, dev, s, replays) -> dict:
    # Static inputs: (layer, T, cpu route?) per step; each replay refills them and the residency mask in place.
    steps = ((0, 2, True), (1, 3, True), (2, 8, False), (3, 1, True))
    mask = rand_mask(torch, gen)
    md = mask.to(dev)
    host = [rand_step(torch, gen, T, mask, cpu) + (bf16(torch, gen, T), bf16(torch, gen, T)) for _l, T, cpu in steps]
    dst = [tuple(t.to(dev) for t in h) for h in host]
    o1 = torch.empty(steps[1][1], H, dtype=torch.bfloat16, device=dev)

    def body():
        (x0, w0, i0, p0, q0), (x1, w1, i1, p1, _q1), (x2, w2, i2, p2, q2), (x3, w3, i3, p3, q3) = dst
        sync.submit(0, x0, w0, i0, md)
        y0 = sync.finish(0, partial=p0 + q0)  # the partial computed between the halves
        sync.submit(1, x1, w1, i1, md)
        o1.copy_(p1)  # other GPU work writes the output first
        sync.finish(1, out=o1)
        sync.submit(2, x2, w2, i2, md)  # no CPU route
        y2 = sync.finish(2, partial=p2 + q2)
        y3 = sync.decode(3, x3, w3, i3, md, partial=p3 + q3)
        return y0, o1, y2, y3

    body()  # warm-up outside the capture: kernels loaded, each task's release event created
    sync.synchronize(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        outs = body()
    bad = []
    for r in range(replays):
        mask.copy_(rand_mask(torch, gen))
        md.copy_(mask)
        for (_layer, T, cpu), d in zip(steps, dst):
            fresh = rand_step(torch, gen, T, mask, cpu) + (bf16(torch, gen, T), bf16(torch, gen, T))
            for a, b in zip(d, fresh):
                a.copy_(b)
        graph.replay()
        sync.synchronize(s)
        for i, ((layer, T, _cpu), (x, w, ids, p, q), got) in enumerate(zip(steps, dst, outs)):
            if i == 1:
                ref = sync.decode(layer, x, w, ids, md, out=torch.empty(T, H, dtype=torch.bfloat16, device=dev))
                exp = want(torch, ex, layer, x, w, ids, mask)
            else:
                ref = sync.decode(layer, x, w, ids, md, partial=p + q)
                exp = want(torch, ex, layer, x, w, ids, mask, (p + q).cpu())
            sync.synchronize(s)
            if not (torch.equal(bits(torch, got), bits(torch, ref)) and torch.equal(bits(torch, got), exp.view(
                    torch.int16))):
                bad.append({"replay": r, "step": i, "layer": layer})
    del graph
    return {"replays": replays, "graph_bad": bad[:10], "graph_bad_count": len(bad)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1")), flush=True)
