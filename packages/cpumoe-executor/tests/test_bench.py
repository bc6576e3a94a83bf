"""Smoke test of the executor bench (a tiny run; no timing is asserted)."""
import json
import math

import pytest

from cpumoe_executor import bench


def test_quick_bench_writes_the_report(tmp_path):
    out = tmp_path / "b.json"
    assert bench.main(["--quick", "--format", "bf16", "--batch", "1,2", "--trace", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["formats"]["bf16"]
    for key in ("gbps", "ceiling_gbps", "batch", "threads", "step_us"):
        assert key in r and math.isfinite(r[key]) and r[key] > 0
    assert set(r["results"]) == {"random/1", "random/2", "shared/1", "shared/2"}
    assert r["shared_batch2_over_batch1"] > 0
    tr = r["results"]["shared/2"]["trace"]
    assert tr["threads"] >= 1 and tr["step_us"] > 0 and tr["gate_up_us"] > 0 and tr["down_us"] > 0
    roof = r["compute_roof"]  # bf16 runs a SIMD tier on every CI machine: its roof is measured
    assert roof["kind"] == "bf16" and roof["tier"] == r["isa"].partition("+")[0] and roof["gmacs"] > 0
    for x in r["results"].values():
        assert x["macs_per_step"] == x["batch"] * 4 * 3 * 256 * 256  # --quick: H = I = 256, top_k 4
        assert 0 < x["compute_floor_us"] and 0 < x["memory_floor_us"] <= x["roofline_us"]
    assert r["shared_batch2_floor_over_batch1"] > 0
    # repeats interleave the runs: batch 2 / batch 1 per repeat, and % of the ceiling window next to each repeat
    one, two = (r["results"][f"shared/{b}"]["step_us"]["samples"] for b in (1, 2))
    paired = r["shared_batch2_over_batch1_paired"]
    assert paired["samples"] == pytest.approx([b / a for a, b in zip(one, two)]) and len(one) == 2  # --quick: 2
    assert r["results"]["shared/2"]["over_batch1_paired"] == paired
    for x in r["results"].values():
        pct = x["pct_of_ceiling_paired"]
        assert len(pct["samples"]) == 2 and all(0 < v for v in pct["samples"])


def test_roofline_arithmetic():
    """Floors from known numbers: 1e9 multiply-adds at 100 G/s is 10 ms; 1 GB at 50 GB/s is 20 ms."""
    m = bench.Model(H=1000, I=1000, E=8, top_k=2)
    res = {f"shared/{b}": {"routing": "shared", "batch": b, "bytes_per_step": 1e9,
                           "step_us": {"median": us}} for b, us in ((1, 25_000.0), (500, 200_000.0))}
    e = {"ceiling_gbps": 50.0, "compute_roof": {"gmacs": 100.0}, "results": res}
    bench.add_roofline(e, m)
    one, big = res["shared/1"], res["shared/500"]
    assert one["macs_per_step"] == 6e6 and big["macs_per_step"] == 3e9
    assert one["memory_floor_us"] == pytest.approx(20_000) and one["compute_floor_us"] == pytest.approx(60)
    assert big["compute_floor_us"] == pytest.approx(30_000) and big["roofline_us"] == pytest.approx(30_000)
    assert one["roofline_pct"] == pytest.approx(80) and big["roofline_pct"] == pytest.approx(15)
    assert e["shared_batch500_floor_over_batch1"] == pytest.approx(30_000 / 25_000)
    assert e["shared_batch500_over_batch1"] == pytest.approx(200_000 / 25_000)
    assert "shared_batch500_over_batch1_paired" not in e  # no samples: no per-repeat ratio
    res["shared/1"]["step_us"]["samples"] = [20_000.0, 25_000.0, 40_000.0]  # repeat 3 in a slow minute for both
    res["shared/500"]["step_us"]["samples"] = [30_000.0, 200_000.0, 48_000.0]
    bench.add_roofline(e, m)
    p = e["shared_batch500_over_batch1_paired"]
    assert (p["median"], p["min"], p["max"]) == pytest.approx((1.5, 1.2, 8.0))
    assert res["shared/500"]["over_batch1_paired"] is p and "over_batch1_paired" not in res["shared/1"]
    res["shared/500"]["step_us"]["median"] = 20_000.0  # memory-bound batch: the floor ratio is the compute one
    res["shared/500"]["bytes_per_step"] = 1e10
    bench.add_roofline(e, m)
    assert res["shared/500"]["roofline_us"] == pytest.approx(200_000)
    assert e["shared_batch500_floor_over_batch1"] == pytest.approx(30_000 / 25_000)
    e = {"ceiling_gbps": 50.0, "compute_roof": None, "results": {"shared/1": dict(res["shared/1"])}}
    bench.add_roofline(e, m)  # no roof (scalar): the memory floor alone
    assert e["results"]["shared/1"]["compute_floor_us"] is None
    assert e["results"]["shared/1"]["roofline_us"] == pytest.approx(20_000)


def test_quick_bench_every_format(tmp_path):
    """--quick runs every format at its preset scaled down (the shapes must satisfy each format's K multiple)."""
    out = tmp_path / "all.json"
    assert bench.main(["--quick", "--batch", "1", "--routing", "shared", "--json", str(out)]) == 0
    formats = json.loads(out.read_text())["formats"]
    assert set(formats) == set(bench.FORMAT_MODEL)
    assert all(e["step_us"] > 0 for e in formats.values())


def test_model_presets_cover_every_format():
    import cpumoe_formats as cf

    assert set(bench.FORMAT_MODEL) == set(cf.FORMATS)  # every registered format and layout has a preset
    for fmt, model in bench.FORMAT_MODEL.items():
        assert fmt in bench.MODELS[model][1]


def test_doorbell_bench_quick(tmp_path):
    out = tmp_path / "d.json"
    assert bench.main(["--doorbell", "--quick", "--threads", "1", "--batch", "1,2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["ping_pong_us"]["median"] > 0 and [e["threads"] for e in r["runs"]] == [1]
    for T in ("1", "2"):
        for kind in ("task", "empty"):
            v = r["runs"][0]["batches"][T][kind]
            assert v["round_trip_us"]["median"] > 0 and v["task_alone_us"]["median"] > 0
            assert math.isfinite(v["overhead_us"])


def test_ring_loop_is_bounded():
    """A doorbell nobody answers raises after timeout_s instead of hanging."""
    import numpy as np

    from cpumoe_executor import _native

    words = np.zeros(16, np.uint64)
    with pytest.raises(RuntimeError, match="not answered"):
        _native.ring_loop(words.ctypes.data, words.ctypes.data + 64, [1], 0, 0, 0, 0, 1, 0, 0.05)


def test_mode_option(tmp_path):
    import cpumoe_formats as cf

    want = {f: "w4a8" for f, spec in cf.FORMATS.items() if "w4a8" in spec.modes}
    assert {"nvfp4", "mxfp4", "ds_fp4", "q4_0", "q4_0_x16"} <= set(want) and "bf16" not in want
    assert bench.parse_modes("w4a8") == want
    assert bench.parse_modes("nvfp4=w4a8,mxfp4_triton=native") == {"nvfp4": "w4a8", "mxfp4": "native"}
    with pytest.raises(ValueError, match="format 'bf16' has modes"):
        bench.parse_modes("bf16=w4a8")
    with pytest.raises(ValueError, match="no format has mode 'int3'"):
        bench.parse_modes("int3")
    with pytest.raises(SystemExit):  # argparse reports it as a usage error
        bench.parse_args(["--mode", "nvfp4=int3"])
    out = tmp_path / "b.json"
    assert bench.main(["--quick", "--format", "nvfp4", "--batch", "1", "--mode", "w4a8", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["formats"]["nvfp4"]["isa"].endswith("+w4a8")


@pytest.mark.parametrize("repack,layout", [("auto", "mxfp4_panel"), ("off", "mxfp4")])
def test_quick_bench_repack(tmp_path, capsys, repack, layout):
    """mxfp4 runs repacked by default, as the executor does, and the table says so; --repack off keeps its layout."""
    out = tmp_path / "m.json"
    assert bench.main(["--quick", "--format", "mxfp4", "--batch", "1", "--routing", "shared", "--repack", repack,
                       "--json", str(out)]) == 0
    assert json.loads(out.read_text())["formats"]["mxfp4"]["layout"] == layout
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("mxfp4")][0]
    assert row.split()[0] == ("mxfp4>mxfp4_panel" if repack == "auto" else "mxfp4")


def test_quick_bench_numa_modes_on_a_fake_two_node_host(tmp_path, monkeypatch, capsys):
    """--numa off,split,replicate: one run per mode, the per-node and all-nodes read ceilings, % of the all-nodes
    ceiling per result and each mode over off (a fake topology: this machine's CPUs on two nodes)."""
    from conftest import two_real_nodes

    monkeypatch.setenv("CPUMOE_SYSFS_ROOT", two_real_nodes(tmp_path))
    out = tmp_path / "n.json"
    assert bench.main(["--quick", "--format", "q4_0", "--batch", "1", "--routing", "shared", "--numa",
                       "off,split,replicate", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    nc = r["numa_ceilings"]
    assert set(nc["per_node"]) == {"0", "1"} and nc["all_nodes"]["median"] > 0 and nc["one_buffer"]["median"] > 0
    assert set(r["formats"]) == {"q4_0:off", "q4_0:split", "q4_0:replicate"}
    assert [r["formats"][f"q4_0:{m}"]["numa"] for m in ("off", "split", "replicate")] == ["off", "split", "replicate"]
    assert r["formats"]["q4_0:split"]["numa_bounds"] == [0, 128, 256]  # --quick: I = 256, two one-core nodes
    for e in r["formats"].values():
        assert e["results"]["shared/1"]["pct_of_all_nodes"] > 0
    over = r["formats"]["q4_0:split"]["over_off"]["shared/1"]  # paired per repeat
    assert len(over["samples"]) == 2 and over["median"] > 0 and "over_off" not in r["formats"]["q4_0:off"]
    assert "read ceilings GB/s: node 0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.parse_args(["--numa", "split,half"])


def test_quick_bench_format_pair_in_cache(tmp_path):
    """A (gate_up, down) pair (q4_k_m: q4_k gate_up, q6_k down) runs as the executor's one-layer pair; the cache
    working set is one window of top_k x max batch experts."""
    out = tmp_path / "pair.json"
    assert bench.main(["--quick", "--format", "q4_k_m,q4_k/q8_0", "--batch", "1,2", "--working-set", "cache",
                       "--json", str(out)]) == 0
    formats = json.loads(out.read_text())["formats"]
    import cpumoe_formats as cf

    for name, (g, d) in (("q4_k_m", ("q4_k", "q6_k")), ("q4_k/q8_0", ("q4_k", "q8_0"))):
        e = formats[name]
        assert e["formats"] == [g, d] and e["layout"].split("/")[1].startswith(d) and e["mode"] == "w4a8"
        H, I, k = e["shape"]["H"], e["shape"]["I"], e["shape"]["top_k"]  # noqa: E741
        assert e["bytes_per_expert"] == (cf.get_format(g).role_bytes_per_expert("gate_up", H, I)
                                         + cf.get_format(d).role_bytes_per_expert("down", H, I))
        assert e["working_set"] == "cache" and e["bank_experts"] == k * 2
        assert all(r["step_us"]["median"] > 0 for r in e["results"].values())
    assert bench.format_pair("q8_0") == ("q8_0", "q8_0")


def test_route_plans_rule():
    """The route plans both sides of bench/llamacpp/compare.sh draw: K distinct experts of window j per token
    (random) or for all tokens (shared), from one splitmix64 stream; the digests are the ggml harness's
    (moe_ggml_bench's routes_digest for the same arguments), so a change on one side alone shows here."""
    import numpy as np

    p = bench.route_plans(0, 2, 16, 2, 4, False)
    assert [x.tolist() for x in p] == [[[4, 2, 14, 12], [7, 1, 3, 6]], [[24, 30, 28, 16], [28, 25, 31, 16]]]
    for j, x in enumerate(bench.route_plans(1, 3, 64, 8, 8, False)):
        assert x.shape == (8, 8) and x.dtype == np.int32 and ((j * 64 <= x) & (x < (j + 1) * 64)).all()
        assert all(len(set(row)) == 8 for row in x.tolist())
    shared = bench.route_plans(0, 4, 8, 8, 8, True)
    assert all((x == x[0]).all() and sorted(x[0].tolist()) == list(range(j * 8, j * 8 + 8))
               for j, x in enumerate(shared))
    # moe_ggml_bench --format q4_k_m --batch 1,8 --routing both (dram, 32 MiB LLC: E_bank 128)
    assert bench.routes_digest(bench.route_plans(0, 16, 8, 1, 8, False)) == "e6ac514629fa6483"
    assert bench.routes_digest(bench.route_plans(0, 2, 64, 8, 8, False)) == "c4e9145d99770512"
    assert bench.routes_digest(bench.route_plans(0, 16, 8, 1, 8, True)) == "dc4ff511241378f3"
    assert bench.routes_digest(bench.route_plans(0, 16, 8, 8, 8, True)) == "9d1b3d94357f0975"


def test_llc_size_argument():
    """--llc sizes the dram bank, the evicting reads and the ceiling buffer (a VM may report a smaller L3)."""
    import argparse

    assert bench.size_arg("96M") == 96 << 20 and bench.size_arg("1024") == 1024 and bench.size_arg("2GiB") == 2 << 30
    assert bench.parse_args(["--llc", "512K"]).llc == 512 << 10 and bench.parse_args([]).llc is None
    for bad in ("x", "-1M", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.size_arg(bad)
