"""The host memory a GPU decode process holds before any model: python + torch, the CUDA context, cuBLAS, transformers
and a Triton kernel, sdpa; peak RSS after each (what docs/end-to-end.md subtracts from the FP8 30B run's peak).

    python bench/device/rss_baseline.py [--json F]     # on the GPU host, ~10 s
"""
import argparse
import json
import resource

import torch

rows = []


def rss(tag):
    rows.append({"after": tag, "peak_rss_GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})
    print(f"{tag}: {rows[-1]['peak_rss_GiB']:.3f} GiB peak", flush=True)


ap = argparse.ArgumentParser()
ap.add_argument("--json", default=None)
a = ap.parse_args()
rss("python+torch")
x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
rss("+cuda context")
y = x @ x
torch.cuda.synchronize()
rss("+cublas bf16 matmul")
import transformers  # noqa: E402,F401
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _inc(p, n: tl.constexpr):
    o = tl.arange(0, n)
    tl.store(p + o, tl.load(p + o) + 1)


_inc[(1,)](x, 1024)
torch.cuda.synchronize()
rss("+transformers, triton kernel")
q = x[None, None, :16, :128]
torch.nn.functional.scaled_dot_product_attention(q, q, q)
torch.cuda.synchronize()
rss("+sdpa")
if a.json:
    with open(a.json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1)
