"""Smoke tests of the bench (python -m cpumoe_formats.bench): it runs, its JSON has
the keys the issue names, and formats without kernels are skipped with a reason.
No timing is asserted."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cpumoe_formats as cf
from cpumoe_formats import _bench_report, bench, machine
from cpumoe_formats.numerics import BF16
from cpumoe_formats.schema import BankSpec, FormatSpec


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    md = d / "table.md"
    md.write_text(f"# Title\n\nprose\n\n{_bench_report.BEGIN}\nold table\n{_bench_report.END}\n\nmore prose\n")
    env = dict(os.environ)
    src = str(Path(cf.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "cpumoe_formats.bench", "--quick", "--formats", "bf16", "--json", str(d / "r.json"),
           "--markdown", str(md)]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads((d / "r.json").read_text()), md.read_text(), r


def test_quick_json_keys(quick_run):
    report, _, _ = quick_run
    f = report["formats"]["bf16"]
    for key in ("gbps", "ceiling_gbps", "tier", "ratio", "shape", "bytes_per_expert", "results", "default_kernel"):
        assert key in f, key
    assert math.isfinite(f["ratio"]) and f["ratio"] > 0
    assert f["gbps"] > 0 and f["ceiling_gbps"] > 0
    assert f["tier"] in f["results"]
    assert f["bytes_per_expert"] == cf.get_format("bf16").bytes_per_expert(2048, 768)
    assert f["shape"]["E"] * f["bytes_per_expert"] >= report["settings"]["working_set_bytes"]
    for name, r in f["results"].items():
        assert r["gbps"]["min"] <= r["gbps"]["median"] <= r["gbps"]["max"], name
        assert len(r["gbps"]["samples"]) == report["settings"]["repeats"]
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0
    usable = set(cf.usable_tiers())
    own = {t for t in cf.get_format("bf16").kernel_tiers["native"] if t in usable}
    assert set(f["results"]) == own  # --tiers all: every own tier this CPU runs
    c = report["ceiling"]
    assert c["min"] <= c["median"] <= c["max"] and len(c["samples"]) >= 2
    for key in ("cpu", "logical_cpus", "llc_bytes", "usable_tiers", "build_info"):
        assert key in report["machine"], key


def test_quick_outputs(quick_run):
    _, md, r = quick_run
    assert md.startswith("# Title\n\nprose\n\n") and md.rstrip().endswith("more prose")
    assert "old table" not in md and "| bf16 |" in md
    assert "ceiling" in r.stdout and "bf16" in r.stdout
    assert "[bench] bf16" in r.stderr  # progress


def test_a_format_without_both_roles_is_refused_at_definition():
    # a bank-less placeholder schema cannot exist, so the bench never meets one (it used to skip it)
    for banks in ((), (BankSpec("gate_up", (np.uint8,), lambda E, H, I: (E, 2 * I, H)),)):  # noqa: E741
        with pytest.raises(ValueError, match="must be gate_up banks, then down banks"):
            FormatSpec(name="placeholder_test", id=99, banks=banks)
    assert "placeholder_test" not in cf.FORMATS


def test_kernel_plan():
    spec = cf.get_format("bf16")
    usable = cf.usable_tiers()
    assert bench.kernel_plan(spec, "auto", usable) == [("native", None)]
    plan = bench.kernel_plan(spec, "all", usable)
    assert ("native", "scalar") in plan and ("native", None) in plan
    assert all(t is None or t in usable for _, t in plan)
    assert bench.kernel_plan(spec, "scalar", usable) == [("native", "scalar")]
    with pytest.raises(SystemExit):
        bench.kernel_plan(spec, "avx9", usable)


def test_presets_cover_formats():
    assert set(bench.PRESETS) == set(cf.FORMATS)


def test_llc_from_sysfs(tmp_path):
    for i, (lvl, typ, size) in enumerate([(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                          (3, "Unified", "32768K")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{lvl}\n")
        (d / "type").write_text(f"{typ}\n")
        (d / "size").write_text(f"{size}\n")
    assert machine.llc_bytes(str(tmp_path)) == 32 << 20
    (tmp_path / "index3" / "level").write_text("2\n")  # no level 3: the largest one
    assert machine.llc_bytes(str(tmp_path)) == 32 << 20
    assert machine.llc_bytes(str(tmp_path / "missing")) is None


def test_bind_matches_forward(rng):
    E, H, I, k = 4, 64, 32, 2  # noqa: E741
    spec = cf.get_format("bf16")
    banks = spec.random_banks(E, H, I, rng)
    kern = cf.Kernel("bf16", E, H, I)
    step = kern.bind(banks)
    x = rng.standard_normal((3, H), np.float32).astype(BF16)
    w = rng.random((3, k), np.float32)
    ids = np.array([[0, 1], [2, -1], [3, 0]], np.int32)
    out = cf.aligned_empty((3, H), BF16)
    step(x, w, ids, out)
    ref = kern.forward(banks, x, w, ids)
    assert np.array_equal(out.view(np.uint16), ref.view(np.uint16))
    with pytest.raises(ValueError, match="bound step"):
        step(x, w, ids.astype(np.int64), out)
    with pytest.raises(ValueError):
        step(x, w, np.full((3, k), E, np.int32), out)  # range-checked natively
    with pytest.raises(ValueError, match="banks have"):
        cf.Kernel("bf16", E + 1, H, I).bind(banks)


def test_failing_kernel_is_skipped(monkeypatch):
    def bind(self, banks):
        def step(*a):
            raise ValueError("boom")
        return step

    monkeypatch.setattr(cf.Kernel, "bind", bind)
    monkeypatch.setattr(bench, "build_banks", lambda *a, **k: {})
    opts = bench.parse_args(["--quick", "--formats", "bf16"])
    with pytest.raises(bench.Skip, match="every kernel failed its first step.*boom"):
        bench.bench_format("bf16", bench.PRESETS["bf16"], opts, np.random.default_rng(0), "t")


def test_plot(quick_run, tmp_path):
    pytest.importorskip("matplotlib")
    report, _, _ = quick_run
    _bench_report.plot(report, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 1000
