"""Smoke test of the executor bench (a tiny run; no timing is asserted)."""
import json
import math

from cpumoe_executor import bench


def test_quick_bench_writes_the_report(tmp_path):
    out = tmp_path / "b.json"
    assert bench.main(["--quick", "--format", "bf16", "--batch", "1,2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["formats"]["bf16"]
    for key in ("gbps", "ceiling_gbps", "batch", "threads", "step_us"):
        assert key in r and math.isfinite(r[key]) and r[key] > 0
    assert set(r["results"]) == {"random/1", "random/2", "shared/1", "shared/2"}
    assert r["shared_batch2_over_batch1"] > 0


def test_model_presets_cover_every_format():
    assert set(bench.FORMAT_MODEL) == {"bf16", "fp8_block", "nvfp4", "mxfp4", "ds_fp4", "q4_0"}
    for fmt, model in bench.FORMAT_MODEL.items():
        assert fmt in bench.MODELS[model][1]
