"""Where the miss split's graph replay fails (issue 40): the split runner as test_split_runs_under_graphs builds it,
check_graphs called directly with the traceback printed; then the pieces captured one by one."""
import sys
import traceback

import numpy as np
import torch

sys.path.insert(0, "packages/moe-engine-glue/tests")
from conftest import make_banks  # noqa: E402

from moe_engine import qualify  # noqa: E402
from moe_engine.runner import MoERunner  # noqa: E402

rng = np.random.default_rng(0)
banks, (E, H, I) = make_banks("bf16", rng, E=8)  # noqa: E741
r = MoERunner("bf16", banks, top_k=3, strategy="hybrid", device="cuda", threads=2, graph_batch_sizes=(1, 3),
              progress=False, residency=0.25, capacity=4, split=0.5)
print("graphs_ok", r.graphs_ok, r.graphs_reason, flush=True)
gen = torch.Generator().manual_seed(1)  # qualify draws its routes from a torch generator
try:
    qualify.check_graphs(r, 0, gen)
    print("check_graphs ok", flush=True)
except Exception:
    traceback.print_exc()
# the pieces: the zero-copy GPU forward alone under capture
dev = torch.device("cuda")
x = torch.randn(1, H, device=dev).to(torch.bfloat16)
w = torch.rand(1, 3, device=dev)
slots = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=dev)
for name, fn in [("zc forward", lambda: r.gpu.forward(0, x, w, slots, bank=r.split.bank)),
                 ("resident forward", lambda: r.gpu.forward(0, x, w, torch.zeros_like(slots)))]:
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                y = fn()
            g.replay()
            torch.cuda.synchronize()
        print(name, "captured and replayed ok", float(y.float().abs().sum()), flush=True)
    except Exception:
        print(name, "FAILED", flush=True)
        traceback.print_exc()
r.close()
