"""strategy="auto"'s choice from a measured profile (moe_engine.placement.choose / profile), pure logic on synthetic
profiles: seed 002's two regimes with its bandwidths and miss rates, the split's q and expected step time (against
the model written out as sums), the profile file (versioned,
atomic, XDG cache dir, stale / foreign ones ignored when cached and refused when passed), and bad input."""
from __future__ import annotations

import json
import logging
import math
import os
from fractions import Fraction

import pytest

import cpumoe_formats as cf
from moe_engine.placement import profile as prof
from moe_engine.placement.choose import SPLIT_QS, choose, slots_from_budget, touched
from moe_engine.placement.profile import Profile, ProfileError

# seed 002: Qwen3.6-35B-A3B-FP8 (40 MoE layers, E=256, H=2048, I=512, top-8), fp8_block executor 53.7 GB/s, PCIe
# 25.1 GB/s; tok/s at matched residency: offload 43.94 (10%) 82.65 (25%), hybrid 50.94 (10%) 55.12 (25%)
E, H, I, K, LAYERS = 256, 2048, 512, 8, 40
B_CPU, B_PCIE = 53.7, 25.1
BPE = cf.get_format("fp8_block").bytes_per_expert(H, I)
S = LAYERS * K * BPE  # expert bytes one token routes


def seed002_miss_rates():
    """hybrid pins a static set (routes miss at 1 - r, uniform routing); t_token = a + m * S / B. hybrid's two
    points give a (the non-expert time per token, their mean); offload's then give its own miss rate (it caches:
    lower than 1 - r)."""
    a = sum(1 / tok - (1 - r) * S / (B_CPU * 1e9) for r, tok in ((0.10, 50.94), (0.25, 55.12))) / 2
    off = {r: (1 / tok - a) * B_PCIE * 1e9 / S for r, tok in ((0.10, 43.94), (0.25, 82.65))}
    return a, off


def seed002_profile(**kw):
    return Profile(gpu="seed002-gpu", cpu_read=B_CPU, executor={"fp8_block": B_CPU}, h2d=B_PCIE,
                   zero_copy={"fp8_block": B_PCIE}, **kw)


def test_seed002_miss_rates_are_sane():
    a, off = seed002_miss_rates()
    assert 2e-3 < a < 5e-3  # 2-5 ms of attention and dense layers per token
    assert 0.40 < off[0.10] < 0.55 and 0.15 < off[0.25] < 0.30


@pytest.mark.parametrize("r, want", [(0.10, "hybrid"), (0.25, "gpu_misses")])
def test_seed002_regimes_without_the_split(r, want):
    # seed 002's system has no split: hybrid at 10% (+15.9% measured), offload at 25% (-33% for hybrid)
    _, off = seed002_miss_rates()
    c = choose(seed002_profile(), "fp8_block", bytes_per_expert=BPE, E=E, top_k=K, batch=1, miss_rate=1 - r,
               residency=r, gpu_misses_miss_rate=off[r], modes=("hybrid", "gpu_misses"))
    assert c.mode == want, c.reason
    assert c.reason.startswith(f"auto: {want}")
    # the modelled hybrid/offload step-time ratio has the sign and rough size of the measured one
    ratio = c.step_us["gpu_misses"] / c.step_us["hybrid"]
    assert (ratio > 1.05) if r == 0.10 else (ratio < 0.75), ratio


def _expected(n, m, q, b, *, b_cpu, b_zc, b_hbm, c_cpu, c_gpu, rule="step"):
    """The model's step time written out: E[max(t_cpu, t_gpu)] over k ~ Bin(n, m) misses and g of them to the GPU:
    round(q k) with halves up, in exact fractions (rule "step"), g ~ Bin(k, q) (rule "expert")."""
    t = 0.0
    for k in range(n + 1):
        pk = math.comb(n, k) * m**k * (1 - m) ** (n - k)
        for g in range(k + 1):
            if rule == "step":
                p = pk * (g == math.floor(Fraction(str(q)) * k + Fraction(1, 2)))
            else:
                p = pk * math.comb(k, g) * q**g * (1 - q) ** (k - g)
            t_gpu = c_gpu + (n - k) * b / (b_hbm * 1e3) + g * b / (b_zc * 1e3)
            t_cpu = c_cpu + (k - g) * b / (b_cpu * 1e3) if k > g else 0.0
            t += p * max(t_gpu, t_cpu)
    return t


def test_seed002_with_the_split():
    _, off = seed002_miss_rates()
    c = choose(seed002_profile(), "fp8_block", bytes_per_expert=BPE, E=E, top_k=K, batch=1, miss_rate=0.9,
               residency=0.1, gpu_misses_miss_rate=off[0.10])
    assert c.mode == "split" and 0 < c.q < 1, c.reason
    assert c.step_us["split"] < min(c.step_us["hybrid"], c.step_us["gpu_misses"])
    # above the two sides' mean rates balanced (q = B_zc / (B_zc + B_cpu)): a step waits for the slower side
    assert c.step_us["split"] > 0.9 * K * BPE / ((B_PCIE + B_CPU) * 1e3)
    c = choose(seed002_profile(), "fp8_block", bytes_per_expert=BPE, E=E, top_k=K, batch=1, miss_rate=0.75,
               residency=0.25, gpu_misses_miss_rate=off[0.25])
    assert c.mode == "gpu_misses", c.reason  # the cache's low miss rate still beats splitting 75% misses


@pytest.mark.parametrize("rule", ["step", "expert"])
@pytest.mark.parametrize("batch, m", [(1, 0.5), (1, 1.0), (8, 0.3)])
def test_split_is_the_expected_step_time_at_its_best_q(batch, m, rule):
    p = Profile(gpu="g", cpu_read=100.0, executor={"bf16": 100.0}, zero_copy={"bf16": 50.0},
                both={"bf16": {"cpu": 80.0, "zero_copy": 40.0}}, cpu_fixed_us=20.0, gpu_fixed_us=10.0, hbm=3000.0)
    c = choose(p, "bf16", bytes_per_expert=10_000_000, E=128, top_k=8, batch=batch, miss_rate=m, residency=0.25,
               rule=rule)
    n = round(touched(128, 8, batch))
    kw = dict(b_cpu=100.0, b_zc=50.0, b_hbm=3000.0, c_cpu=20.0, c_gpu=10.0)  # the lone rates, not the at-once ones
    want = {q: _expected(n, m, q, 1e7, rule=rule, **kw) for q in SPLIT_QS}
    best = min(want, key=lambda q: (round(want[q], 6), q))  # several q round to the same counts: the smallest
    assert c.mode == "split" and c.q == best, c.reason
    assert c.step_us["split"] == pytest.approx(want[best], rel=1e-9)
    assert c.step_us["hybrid"] == pytest.approx(_expected(n, m, 0.0, 1e7, **kw), rel=1e-9)
    assert c.step_us["gpu_misses"] == pytest.approx(_expected(n, m, 1.0, 1e7, **kw), rel=1e-9)


def test_gpu_alone_and_tiny_misses():
    p = Profile(gpu="g", cpu_read=100.0, executor={"bf16": 100.0}, zero_copy={"bf16": 50.0}, cpu_fixed_us=20.0,
                gpu_fixed_us=10.0, hbm=3000.0)
    # nothing missing: every route resident, the GPU alone
    c = choose(p, "bf16", bytes_per_expert=10_000_000, E=128, top_k=8, batch=1, miss_rate=0.0, residency=1.0)
    assert c.mode == "gpu" and c.strategy == "gpu" and c.q == 0.0
    # tiny misses: the CPU's fixed cost exceeds reading them over the link
    c = choose(p, "bf16", bytes_per_expert=10_000, E=128, top_k=8, batch=1, miss_rate=0.5, residency=0.5)
    assert c.mode == "gpu_misses" and c.q == 1.0


def test_touched_experts():
    assert touched(128, 8, 1) == pytest.approx(8)
    assert 8 < touched(128, 8, 8) < 64


def test_choose_bad_input():
    p = seed002_profile()
    kw = dict(bytes_per_expert=BPE, E=E, top_k=K, batch=1, residency=0.1)
    with pytest.raises(ValueError, match=r"miss_rate=1.5: expected a fraction in \[0, 1\]"):
        choose(p, "fp8_block", miss_rate=1.5, **kw)
    with pytest.raises(ProfileError, match=r"no executor figure for format 'bf16' .*'fp8_block'.*--format bf16"):
        choose(p, "bf16", miss_rate=0.5, **kw)
    with pytest.raises(ValueError, match=r"modes=\('offload',\)"):
        choose(p, "fp8_block", miss_rate=0.5, modes=("offload",), **kw)
    with pytest.raises(ValueError, match="split_rates='both': expected 'lone' or 'at_once'"):
        choose(p, "fp8_block", miss_rate=0.5, split_rates="both", **kw)
    with pytest.raises(ProfileError, match="split_rates='at_once': the profile has no both-at-once figures for "
                                           "'fp8_block'"):
        choose(p, "fp8_block", miss_rate=0.9, split_rates="at_once", **kw)
    # at once (the CPU 80 of its 100 lone, the link 20 of 25) the split is modelled slower than from the lone rates
    pb = seed002_profile(both={"fp8_block": {"cpu": 0.8 * B_CPU, "zero_copy": 20.0}})
    lone, once = (choose(pb, "fp8_block", miss_rate=0.9, split_rates=s, **kw) for s in ("lone", "at_once"))
    assert once.step_us["split"] > lone.step_us["split"] and once.step_us["hybrid"] == lone.step_us["hybrid"]
    with pytest.raises(ValueError, match="smaller than one expert"):
        slots_from_budget(BPE - 1, BPE, LAYERS, E)
    assert slots_from_budget(10 * BPE * LAYERS + 5, BPE, LAYERS, E) == 10


def test_profile_file_round_trip_atomic_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    p = seed002_profile(shape={"E": E, "H": H, "I": I, "top_k": K})
    path = prof.save(p)
    assert path == str(tmp_path / "moe-engine" / "profile-seed002-gpu.json")
    assert [f.name for f in (tmp_path / "moe-engine").iterdir()] == ["profile-seed002-gpu.json"]  # no temp left
    q = prof.load(path)
    assert q.executor == p.executor and q.created > 0 and q.version == prof.VERSION
    assert prof.find("seed002-gpu", "fp8_block").zero_copy == {"fp8_block": B_PCIE}


def test_stale_or_foreign_profiles(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = prof.save(seed002_profile())
    caplog.set_level(logging.WARNING, logger="moe_engine")
    assert prof.find("seed002-gpu", "bf16") is None  # missing format: ignored, with what to rerun
    assert "rerun `moe-engine bench --profile --format bf16`" in caplog.text
    d = json.load(open(path))
    d["version"] = prof.VERSION - 1
    json.dump(d, open(path, "w"))
    caplog.clear()
    assert prof.find("seed002-gpu", "fp8_block") is None
    assert f"profile version {prof.VERSION - 1}, expected {prof.VERSION}; rerun `moe-engine bench --profile`" \
        in caplog.text
    # a profile measured elsewhere, copied into this GPU's cache slot: ignored when found, refused when passed
    d["version"], d["gpu"] = prof.VERSION, "NVIDIA H100 80GB HBM3"
    json.dump(d, open(path, "w"))
    caplog.clear()
    assert prof.find("seed002-gpu", "fp8_block") is None
    assert "measured on GPU 'NVIDIA H100 80GB HBM3', this is 'seed002-gpu'" in caplog.text
    with pytest.raises(ProfileError, match="measured on GPU 'NVIDIA H100 80GB HBM3', this is 'seed002-gpu'; rerun"):
        prof.resolve(path, gpu="seed002-gpu", format="fp8_block")
    open(path, "w").write("{not json")
    with pytest.raises(ProfileError, match="not JSON"):
        prof.load(path)
    with pytest.raises(ProfileError, match=r"profile lacks \['executor'\]"):
        Profile.from_json({"gpu": "g", "cpu_read": 1.0})
    with pytest.raises(ProfileError, match=r"executor=\{'bf16': -1\.0\}"):
        Profile(gpu="g", cpu_read=1.0, executor={"bf16": -1.0})
    assert not os.path.exists(tmp_path / "moe-engine" / "profile-none.json")


def test_split_model_tool(tmp_path, capsys):
    """tools/split_model: per format, batch and rule, the model's best split from a profile's lone and at-once
    rates. At equal rates (the CPU twice the link) the even division of each step's misses beats the binomial draw
    of a fixed set; a profile without a format's figures is refused by name."""
    from moe_engine.tools.split_model import main

    p = Profile(gpu="g", cpu_read=100.0, executor={"bf16": 100.0}, zero_copy={"bf16": 50.0}, hbm=3000.0,
                both={"bf16": {"cpu": 80.0, "zero_copy": 40.0}}, cpu_fixed_us=5.0, gpu_fixed_us=5.0)
    path = prof.save(p, str(tmp_path / "p.json"))
    assert main(["--profile", path, "--formats", "bf16", "--json", str(tmp_path / "m.json")]) == 0
    rows = {(r["batch"], r["rule"]): r for r in json.load(open(tmp_path / "m.json"))["rows"]}
    assert set(rows) == {(1, "expert"), (1, "step"), (8, "expert"), (8, "step")}
    for T in (1, 8):
        assert rows[T, "step"]["lone"]["speedup"] > rows[T, "expert"]["lone"]["speedup"] > 1.0
        assert rows[T, "step"]["at_once"]["speedup"] < rows[T, "step"]["lone"]["speedup"]  # the shared memory
        assert rows[T, "step"]["lone"]["speedup"] <= 1.5 + 1e-9  # the two rates' sum over the CPU's: (100 + 50) / 100
    assert "bf16 batch 1 by   step" in capsys.readouterr().out
    # a grid cell replayed: each rate choice's pick and how it ran in the cell (None where it was not timed)
    cell = {"format": "bf16", "batch": 1, "residency": 0.0, "hit_rate": 0.0, "best_q": 0.2, "cpu_GBps": {"0.0": 100.0},
            "us": {"0.0": 500.0, "0.2": 400.0, "1.0": 900.0}}
    grid = tmp_path / "g.json"
    grid.write_text(json.dumps({"shape": "qwen3-30b-a3b", "rows": [cell, dict(cell, hit_rate=1.0)]}))
    assert main(["--profile", path, "--formats", "bf16", "--grid", str(grid), "--json", str(tmp_path / "m.json")]) == 0
    (g,) = json.load(open(tmp_path / "m.json"))["grid"]  # the all-hit row has no misses to place
    # lone rates: a split (q 0.2 timed at the best, any other q untimed); at once (80 / 40 GB/s) the CPU alone wins
    assert 0 < g["lone"]["q"] < 1 and g["lone"]["over_best"] == {0.2: 0.0}.get(g["lone"]["q"]), g
    assert g["at_once"] == {"q": 0.0, "over_best": pytest.approx(500 / 400 - 1)}, g
    with pytest.raises(SystemExit, match=r"lacks executor, zero-copy or both-at-once figures for \['fp8_block'\]"):
        main(["--profile", path, "--formats", "fp8_block"])
