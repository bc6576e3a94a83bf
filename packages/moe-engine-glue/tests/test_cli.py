"""The moe-engine command: info (text and JSON) and a small demo that verifies itself."""
from __future__ import annotations

import json

from moe_engine.tools.cli import main


def test_info_json(capsys):
    assert main(["info", "--json", "--no-probe"]) == 0
    d = json.loads(capsys.readouterr().out)
    import cpumoe_formats as cf

    assert set(d["cpu"]["kernels"]) == set(cf.formats.WEIGHT_FORMATS) >= {"bf16", "fp8_block", "nvfp4", "mxfp4",
                                                                          "ds_fp4", "q4_0"}
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


def test_bare_command_shows_the_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage: moe-engine" in err and "COMMAND" in err and "demo" in err and "info" in err
    assert "arguments are required: cmd" not in err


def test_ready_line_names_the_package_once(caplog):
    import logging

    import numpy as np
    import torch

    import cpumoe_formats as cf
    from moe_engine import MoERunner

    banks = [cf.get_format("bf16").random_banks(4, 64, 32, np.random.default_rng(0)) for _ in range(1)]
    with caplog.at_level(logging.INFO, logger="moe_engine"):
        with MoERunner("bf16", banks, top_k=2, device=torch.device("cpu"), progress=False):
            pass
    ready = [r for r in caplog.records if r.getMessage().startswith("ready: strategy=")]
    assert len(ready) == 1 and ready[0].name == "moe_engine" and "moe_engine" not in ready[0].getMessage()


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


def test_demo_says_why_it_reads_above_the_dram_rate():
    from moe_engine.tools.demo import render

    res = {"preset": "p", "layers": 2, "format": "bf16", "batch": 1, "strategy": "cpu", "graphs": False,
           "steps_per_s": 10.0, "step_us": 100.0, "layer_us": 50.0, "cpu_gbps": 30.0, "ceiling_gbps": 20.0,
           "llc_bytes": 32 << 20, "cpu_experts_bytes": 40 << 20, "verified": True, "checks": 1, "max_rel_err": 1e-3,
           "tolerance": 2e-2, "graph_mismatches": None}
    out = render(res)
    assert "150% of the DRAM read rate" in out and "is read from cache" in out and "ceiling" not in out
    res["cpu_gbps"] = 10.0
    assert "is read from cache" not in render(res)


def test_missing_transformers_names_the_extra(monkeypatch):
    import sys

    import pytest

    from moe_engine.integrations.transformers import adapter

    monkeypatch.setitem(sys.modules, "transformers.integrations.moe", None)  # as if transformers were absent
    with pytest.raises(ImportError, match=r"pip install 'moe-engine-glue\[transformers\]'"):
        adapter.register()
