"""The moe-engine command: info (text and JSON) and a small demo that verifies itself."""
from __future__ import annotations

import json

from moe_engine.cli import main


def test_info_json(capsys):
    assert main(["info", "--json", "--no-probe"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d["cpu"]["kernels"]) == {"bf16", "fp8_block", "nvfp4", "mxfp4", "ds_fp4", "q4_0"}
    assert d["cpu"]["usable_tiers"][0] == "scalar" and d["cpu"]["workers"] >= 1
    assert "handshake" in d["gpu"]


def test_info_text(capsys):
    assert main(["info", "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert "CPU:" in out and "fp8_block" in out and "GPU:" in out


def test_demo_verifies(tmp_path, capsys):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--shape", "16,256,128,4", "--layers", "2", "--steps", "30", "--check-every", "10",
               "--format", "fp8_block", "--threads", "2", "--quiet", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["verified"] and res["checks"] == 4 and res["steps"] == 30
    assert res["ceiling_gbps"] > 0 and res["cpu_gbps"] > 0
    assert "verification passed" in capsys.readouterr().out


def test_demo_rejects_a_bad_shape(capsys):
    assert main(["demo", "--shape", "16,256", "--quiet"]) == 2
    assert "expected four positive ints" in capsys.readouterr().err


def test_info_probes_the_handshake_on_a_gpu(capsys):
    import pytest
    from conftest import cuda_missing

    if cuda_missing():
        pytest.skip(cuda_missing())
    assert main(["info", "--json"]) == 0
    hs = json.loads(capsys.readouterr().out)["gpu"]["handshake"]
    assert hs["chosen"] == "kernel", hs
    assert set(hs["paths"]) >= {"kernel", "memop", "host-func"}
