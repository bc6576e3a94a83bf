"""How the kernel image loads, each in a fresh process: with PTX JIT disabled the
kernel path runs from the SASS; a PTX-only build with JIT disabled fails the
kernelio probe, warns, and decodes on the memop path; the same PTX-only build
with JIT allowed runs the kernel path from the JIT."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cuda, cuda_missing

MISSING = cuda_missing()
pytestmark = cuda + [pytest.mark.skipif(MISSING is not None, reason=f"no CUDA GPU: {MISSING}")]
ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import json, warnings, numpy as np, torch
import cpumoe_executor as ce, cpumoe_formats as cf, gpusync_cuda as gs
rng = np.random.default_rng(2)
banks = [cf.get_format("bf16").random_banks(8, 256, 32, rng) for _ in range(2)]
ex = ce.CpuMoeExecutor("bf16", banks, top_k=4, max_tokens=8, threads=2)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    s = gs.CudaSync(ex)
dev = torch.device("cuda", 0)
g = torch.Generator().manual_seed(4)
x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
w, ids = torch.rand(3, 4, generator=g), torch.randint(0, 8, (3, 4), generator=g, dtype=torch.int32)
graph, st = torch.cuda.CUDAGraph(), torch.cuda.Stream()
xs, ws, idss = x.to(dev), w.to(dev), ids.to(dev)
with torch.cuda.stream(st):
    y = s.decode(1, xs, ws, idss)
    s.synchronize(st)
    eager_ok = torch.equal(y.cpu().view(torch.int16), ex.decode(1, x, w, ids).view(torch.int16))
    with torch.cuda.graph(graph, stream=st):
        yg = s.decode(1, xs, ws, idss)
    ok = []
    for r in range(5):
        x2 = torch.randn(3, 256, generator=g).to(torch.bfloat16)
        xs.copy_(x2)
        graph.replay()
        s.synchronize(st)
        ok.append(torch.equal(yg.cpu().view(torch.int16), ex.decode(1, x2, w, ids).view(torch.int16)))
print(json.dumps({"path": s.path, "image": s.kernel_image, "kernel": s.reasons["kernel"], "eager_ok": eager_ok,
                  "replays_ok": all(ok), "warnings": [str(c.message) for c in caught]}))
"""


def run(env):
    e = dict(os.environ, CUDA_CACHE_DISABLE="1", **env)
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=e, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ptx_only(tmp_path_factory) -> Path:
    """kernelio built with only the compute_75 PTX (needs nvcc and the kernelio sources)."""
    hb = ROOT / "packages" / "kernelio" / "hatch_build.py"
    if not hb.is_file():
        pytest.skip("kernelio sources are not in this checkout")
    spec = importlib.util.spec_from_file_location("kernelio_hatch_build", hb)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        mod.find_nvcc()
    except RuntimeError as e:
        pytest.skip(str(e))
    return mod.build_fatbin(out=tmp_path_factory.mktemp("ptx") / "kernelio.fatbin", archs="compute_75")


def test_sass_runs_with_jit_disabled():
    out = run({"CUDA_DISABLE_PTX_JIT": "1"})
    assert out["path"] == "kernel", out
    assert out["image"].endswith("SASS") and out["eager_ok"] and out["replays_ok"], out


def test_ptx_only_with_jit_disabled_falls_back_to_memop(ptx_only):
    import kernelio

    assert kernelio.fatbin_entries(ptx_only.read_bytes()) == [("ptx", "compute_75")]
    out = run({"CUDA_DISABLE_PTX_JIT": "1", "KERNELIO_FATBIN": str(ptx_only)})
    assert out["path"] == "memop", out
    assert "kernelio probe failed" in out["kernel"], out
    assert any("kernel IO unavailable" in w for w in out["warnings"]), out
    assert out["eager_ok"] and out["replays_ok"], out


def test_ptx_only_with_jit_runs_the_kernel_path(ptx_only):
    out = run({"KERNELIO_FATBIN": str(ptx_only)})
    assert out["path"] == "kernel" and out["image"] == "PTX (JIT)", out
    assert out["eager_ok"] and out["replays_ok"], out
