"""bench_placement's grid logic with a stand-in runner (the real one needs a GPU): one runner per cell, every q timed
in each of --repeats rounds, in turn and rotated, the median kept; auto's pick is timed and compared with the best."""
from __future__ import annotations

import argparse
import contextlib

import pytest

from moe_engine.placement.profile import Profile
from moe_engine.tools import bench_placement as bp
from moe_engine.tools.shapes import preset


class _Executor:
    """work() as the executor's counters: each timed block adds 1 s and rate(q) GB/s worth of experts."""

    def __init__(self, rate, bpe):
        self.rate, self.bpe, self.s, self.n = rate, bpe, 0.0, 0

    def work(self):
        return self.s, self.n

    def run(self, q):
        if self.rate:
            self.s, self.n = self.s + 1.0, self.n + round(self.rate(q) * 1e9 / self.bpe)


class _Order(list):  # the q of each timed block, in order; .opened: the runners' split
    pass


def _fake(monkeypatch, times, cpu_GBps=None):
    order, opened = _Order(), []
    bpe = 9_437_184

    class Runner:
        def __init__(self, q):
            self.q, self.bytes_per_expert = q, bpe
            self.executor = _Executor(cpu_GBps, bpe)

        def set_split(self, q):
            self.q = q

    @contextlib.contextmanager
    def runner(fmt, banks, s, T, a, split, **kw):
        opened.append(split)
        yield Runner(split)

    class Driver:
        def __init__(self, r, layers, T, pool):
            self.r, self.stats, self.i = r, {"end_step_us": 1.0, "loads": 0}, 0

        def step(self):
            self.i += 1

        def rewind(self, i):
            self.i = i

        def timed(self, steps):
            assert self.i == 1 + 1  # --warmup 1, then each block rewinds to it and settles --settle 1 step
            order.append(self.r.q)
            self.r.executor.run(self.r.q)
            return times[self.r.q].pop(0), 0.5

    monkeypatch.setattr(bp, "_runner", runner)
    monkeypatch.setattr(bp, "Driver", Driver)
    monkeypatch.setattr(bp, "_pool", lambda *a, **k: None)
    order.opened = opened
    return order


def _args(**kw):
    d = dict(repeats=3, warmup=1, settle=1, steps=1, every=50, layers=2, qs=[0.2, 0.5], residencies=[0.25], smoke=False)
    d.update(kw)
    return argparse.Namespace(**d)


def test_modes_interleaves_the_repeats_and_keeps_the_median(monkeypatch):
    order = _fake(monkeypatch, {0.0: [300, 100, 200], 0.5: [50, 90, 70]})
    t = bp._modes(_args(), "bf16", 1, None, preset("qwen3-30b-a3b"), 0.25, [0.0, 0.5], None)
    assert order == [0.0, 0.5, 0.5, 0.0, 0.0, 0.5]  # every round each q in turn, rotated a place a round
    assert order.opened == [0.0]  # one runner for every q and round
    assert t[0.0][0] == 200 and t[0.5][0] == 70 and t[0.0][2] == [300, 100, 200] and t[0.0][1] == 0.5
    assert t[0.0][3] is None  # no CPU work counted: no live rate


def test_auto_takes_the_live_cpu_rate_of_the_q0_runs(monkeypatch):
    """The profile's one-off CPU figure (10 GB/s) against the q = 0 runs' own (95): the pick follows the live one,
    as split="auto" does in the runner."""
    s = preset("qwen3-30b-a3b")
    p = Profile(gpu="g", cpu_read=100.0, executor={"bf16": 10.0}, zero_copy={"bf16": 50.0}, hbm=3000.0,
                cpu_fixed_us=5.0, gpu_fixed_us=5.0)
    qs = [round(0.05 * i, 2) for i in range(21)]
    _fake(monkeypatch, {q: [1000.0] * 3 for q in qs}, cpu_GBps=lambda q: 95.0 if q == 0.0 else 40.0)
    (row,) = bp.bench_auto(_args(residencies=[0.0]), "bf16", 1, None, s, p)
    assert row["cpu_GBps"]["0.0"] == pytest.approx(95.0, rel=1e-3)
    assert "cpu 95.0 GB/s live" in row["auto"]["reason"]
    assert 0 < row["auto"]["model_q"] <= 0.35  # the profile's 10 GB/s alone gives q >= 0.8
    # every q ran 1000 us: the split's block is no faster than q = 0's, so the live check keeps hybrid
    assert row["auto"]["q"] == 0.0 and row["auto"]["checked"] is False and row["auto"]["mode"] == "hybrid"
    assert len(row["us_runs"][str(row["auto"]["model_q"])]) == 3  # the model's pick timed in every round
    from moe_engine.placement.choose import choose
    c = choose(p, "bf16", bytes_per_expert=bp.banks_bpe("bf16", s), E=s.E, top_k=s.top_k, batch=1, miss_rate=1.0,
               residency=0.0, modes=("hybrid", "split", "gpu_misses"))
    assert c.q >= 0.8


def test_auto_row_times_its_pick_against_the_best(monkeypatch):
    s = preset("qwen3-30b-a3b")
    p = Profile(gpu="g", cpu_read=100.0, executor={"bf16": 100.0}, zero_copy={"bf16": 50.0}, hbm=3000.0,
                cpu_fixed_us=5.0, gpu_fixed_us=5.0)
    times = {q: [1000 + 100 * abs(q - 0.3)] * 3 for q in [round(0.05 * i, 2) for i in range(21)]}
    order = _fake(monkeypatch, times)
    (row,) = bp.bench_auto(_args(), "bf16", 1, None, s, p)
    assert row["auto"]["mode"] == "split" and str(row["auto"]["q"]) in row["us"] and row["auto"]["checked"]
    q = row["auto"]["q"]
    # picked after the first q = 0 run, then timed in turn with the grid in every repeat (not minutes later)
    grid = [0.0, 1.0, 0.2, 0.5]
    qs = grid + ([q] if q not in grid else [])
    assert order == qs + qs[1:] + qs[:1] + qs[2:] + qs[:2]
    assert row["auto_over_best"] == pytest.approx(row["us"][str(q)] / min(row["us"].values()))
    assert all(len(v) == 3 for v in row["us_runs"].values())


def test_split_times_each_rule_in_the_same_rounds(monkeypatch):
    """--rules expert,step: each fraction under each rule, in turn in every round on one runner (the rule switched
    in place between blocks); the best of each rule against the better single path."""
    rules_seen = []

    class Split:
        rule = "expert"  # the runner's default

        def set_rule(self, rule):
            rules_seen.append(rule)
            self.rule = rule

    times = {0.0: [400] * 3, 1.0: [800] * 3, 0.2: [330] * 3, 0.5: [385] * 3}
    order = _fake(monkeypatch, times)
    real_runner = bp._runner

    @contextlib.contextmanager
    def runner(*a, **kw):
        with real_runner(*a, **kw) as r:
            r.split = Split()
            base = r.set_split

            def set_split(q, r=r, base=base):  # the blocks under rule "step" run 10% faster
                base(q if r.split.rule == "expert" else (q, "step"))  # keys of `times`
            r.set_split = set_split
            yield r

    monkeypatch.setattr(bp, "_runner", runner)
    times.update({(0.2, "step"): [300] * 3, (0.5, "step"): [350] * 3})
    row = bp.bench_split(_args(rules="expert,step"), "bf16", 1, None, preset("qwen3-30b-a3b"))
    assert row["best_q"] == {"step": 0.2, "expert": 0.2}
    assert row["speedup_vs_better_single"] == {"step": pytest.approx(400 / 300), "expert": pytest.approx(400 / 330)}
    assert row["us"]["0.5"] == 385 and row["us"]["0.5/step"] == 350  # plain keys: the default rule's
    assert len(order) == 6 * 3 and order.opened == [0.0] and rules_seen.count("step") == 3
