"""Where the miss split's graph replay fails (issue 40), second pass: the runners of test_runner_split built in one
process in its order (two on the same banks, then the qualified split runner), N times; each split runner's
qualification verdict, and for a refusal check_graphs again stage by stage, with cudart's last error peeked before
each stage (a stale last error from a call outside torch would surface at torch's next launch check as its own)."""
import ctypes
import os
import sys
import traceback

import numpy as np
import torch

sys.path.insert(0, "packages/moe-engine-glue/tests")
from conftest import make_banks  # noqa: E402

from moe_engine import qualify  # noqa: E402
from moe_engine.runner import MoERunner  # noqa: E402

_check_graphs = qualify.check_graphs


def check_graphs_traced(r, layer, gen, replays=4):
    try:
        return _check_graphs(r, layer, gen, replays)
    except Exception:
        traceback.print_exc()  # where qualification's replay failed (qualify keeps only the message)
        print("  last error after:", rt.cudaPeekAtLastError() if rt is not None else None, flush=True)
        raise


qualify.check_graphs = check_graphs_traced
rt = None
for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
    try:
        rt = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        break
    except OSError:
        continue


def peek(stage):
    torch.cuda.synchronize()
    e = rt.cudaPeekAtLastError() if rt is not None else -1
    if e:
        print(f"  last error {e} before {stage}", flush=True)


def runner(banks, **kw):
    return MoERunner("bf16", banks, top_k=3, strategy="hybrid", device="cuda", threads=2, graph_batch_sizes=(1, 3),
                     progress=False, **kw)


def staged(r):
    gen = torch.Generator().manual_seed(1)
    layer = r.num_layers - 1
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for T in r.graph_batch_sizes:
            xs, ws, ids_s = qualify.step_inputs(r, gen, T, "mixed", layer)
            peek(f"T={T} warm-up")
            r.step(layer, xs, ws, ids_s)
            qualify._sync(r, s)
            peek(f"T={T} capture")
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                ys = r.step(layer, xs, ws, ids_s)
            for rep in range(6):
                kind = qualify.KINDS[rep % 3]
                x, w, ids = qualify.step_inputs(r, gen, T, kind, layer)
                for d, src in ((xs, x), (ws, w), (ids_s, ids)):
                    d.copy_(src)
                peek(f"T={T} replay {rep} ({kind})")
                g.replay()
                qualify._sync(r, s)
                peek(f"T={T} eager {rep}")
                want = r.step(layer, x, w, ids)
                qualify._sync(r, s)
                eq = torch.equal(ys.view(torch.int16), want.view(torch.int16))
                print(f"  T={T} replay {rep} ({kind}) equal={eq}", flush=True)
    torch.cuda.current_stream().wait_stream(s)


N = int(os.environ.get("N", "4"))
rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
refused = 0
for i in range(N):
    banks, _ = make_banks("bf16", rng, E=8)
    fast = dict(residency=0.25, capacity=4, qualify=False)
    if os.environ.get("PAIR", "1") == "1":
        with runner(banks, **fast) as hy, runner(banks, split=0.0, **fast) as s0:
            print(f"[{i}] pair pinned: {hy.pinned.summary() if hy.pinned else None} / "
                  f"{s0.pinned.summary() if s0.pinned else None}", flush=True)
    peek("split runner")
    split = None if os.environ.get("NOSPLIT") == "1" else 0.5
    with runner(banks, residency=0.25, capacity=4, split=split, pin_memory=True) as sp:
        print(f"[{i}] graphs_ok={sp.graphs_ok} path={getattr(sp.sync, 'path', None)} "
              f"pinned={sp.pinned.summary() if sp.pinned else None}", flush=True)
        if not sp.graphs_ok:
            refused += 1
            print("  reason:", sp.graphs_reason[:300], flush=True)
            if os.environ.get("STAGED", "0") == "1":
                try:
                    staged(sp)
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
print(f"refused {refused} of {N} (CUDA_LAUNCH_BLOCKING={os.environ.get('CUDA_LAUNCH_BLOCKING', '0')})", flush=True)
