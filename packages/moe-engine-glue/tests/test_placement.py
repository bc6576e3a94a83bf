"""The routing-trace model and the placement policies (moe_engine.placement), on the CPU with numpy only: traces are
well formed and follow their popularity, each policy's hit rate is what its rule implies on hand-made traces, and
hot placement reaches 90% of the best static placement in hindsight at 10/25/50% residency (issue 40)."""
from __future__ import annotations

import numpy as np
import pytest

from moe_engine.placement.calibrate import CALIBRATED, HOT
from moe_engine.placement.policies import HotPlacer, static_masks
from moe_engine.placement.simulate import simulate
from moe_engine.placement.trace import TraceModel, counts


def test_trace_is_well_formed_and_seeded():
    m = TraceModel(E=64, top_k=6, layers=3, **CALIBRATED)
    ids = m.generate(300, batch=2, seed=5)
    assert ids.shape == (300, 2, 3, 6) and ids.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < 64
    assert all(len(set(r)) == 6 for r in ids.reshape(-1, 6))  # top-k ids are distinct
    assert np.array_equal(ids, m.generate(300, batch=2, seed=5))
    assert not np.array_equal(ids, m.generate(300, batch=2, seed=6))
    assert counts(ids, 64).sum(1).tolist() == [300 * 2 * 6] * 3


def test_trace_follows_zipf_popularity():
    # no stickiness, no shifts, top-1: each token's expert is drawn from p(rank) ~ (rank+1)^-zipf exactly
    m = TraceModel(E=16, top_k=1, layers=2, zipf=1.2, sticky=0.0, shift=0.0)
    n = 40000
    c = counts(m.generate(n, seed=3), 16)
    p = np.arange(1, 17, dtype=float) ** -1.2
    p /= p.sum()
    rank = m.base_ranking()
    for li in range(2):
        freq = c[li, rank[li]] / n
        # 5 binomial standard deviations of the largest probability: a false failure is below 1e-6
        assert np.abs(freq - p).max() < 5 * np.sqrt(p[0] * (1 - p[0]) / n), (freq, p)


def test_trace_stickiness_and_phases():
    m = TraceModel(E=64, top_k=4, layers=1, zipf=0.5, sticky=1.0, shift=1.0, phase_tokens=10.0)
    ids = m.generate(200, seed=2)[:, 0, 0]
    assert all(set(ids[t]) == set(ids[0]) for t in range(200))  # every route kept: phases cannot move them
    m = TraceModel(E=64, top_k=4, layers=1, zipf=0.5, sticky=0.5)
    ids = m.generate(4000, seed=2)[:, 0, 0]
    kept = np.mean([len(set(ids[t]) & set(ids[t - 1])) / 4 for t in range(1, 4000)])
    assert 0.5 <= kept < 0.6, kept  # the kept half plus fresh draws that happen to repeat


@pytest.mark.parametrize("kw, msg", [(dict(E=0, top_k=1), "E=0: expected a positive int"),
                                     (dict(E=8, top_k=9), "top_k=9: expected at most E=8"),
                                     (dict(E=8, top_k=2, sticky=1.5), r"sticky=1.5: expected a probability"),
                                     (dict(E=8, top_k=2, phase_tokens=0.0), "phase_tokens=0.0")])
def test_trace_bad_parameters(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TraceModel(**kw)


def test_static_masks():
    c = np.array([[5, 1, 9, 3], [0, 7, 7, 2]])
    assert static_masks("static", 2, 4, 2, counts=c).tolist() == [[True, False, True, False],
                                                                  [False, True, True, False]]
    for kind in ("random", "uniform"):
        assert (static_masks(kind, 3, 10, 4).sum(1) == 4).all()
    with pytest.raises(ValueError, match=r"counts: shape \(2, 3\), expected \[layers=2, E=4\]"):
        static_masks("static", 2, 4, 2, counts=c[:, :3])
    with pytest.raises(ValueError, match=r"capacity=5: expected an int \[0, 4\]"):
        static_masks("random", 2, 4, 5)
    with pytest.raises(ValueError, match="placement 'lfu'"):
        static_masks("lfu", 2, 4, 2)


def test_hot_placer_hysteresis():
    hp = HotPlacer(1, 4, 2, every=1, half_life=1e9, hysteresis=0.25, initial=np.zeros((1, 4), bool))
    hp.observe([[10, 8, 0, 0]])
    assert hp.place().tolist() == [[True, True, False, False]]  # empty slots take the hottest
    hp.observe([[0, 0, 0, 9]])  # expert 3: 9 against expert 1's 8, not 25% more: stays out
    assert hp.place().tolist() == [[True, True, False, False]]
    hp.observe([[0, 0, 0, 2]])  # 11 > 1.25 * 8: displaces the weakest resident
    assert hp.place().tolist() == [[True, False, False, True]]
    with pytest.raises(ValueError, match=r"every=0: expected an int >= 1"):
        HotPlacer(1, 4, 2, every=0)
    with pytest.raises(ValueError, match=r"counts: shape \(1, 3\), expected \[layers=1, E=4\]"):
        hp.observe([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"capacity=5: expected an int \[0, 4\]"):
        HotPlacer(1, 4, 5)


def test_hot_placer_forgets():
    hp = HotPlacer(1, 4, 1, every=10, half_life=10.0, hysteresis=0.0, initial=np.zeros((1, 4), bool))
    hp.observe([[100, 0, 0, 0]], steps=10)
    assert hp.place()[0, 0]
    for _ in range(4):  # expert 2 routes 30 a window while expert 0's 100 halves every window
        hp.observe([[0, 0, 30, 0]], steps=10)
        hp.place()
    assert hp.mask[0].tolist() == [False, False, True, False]


def test_simulated_hit_rates_follow_their_rules():
    # layer 0 routes expert 0 at every step and expert t % 4 + 1 otherwise; capacity 2
    steps = 40
    ids = np.stack([np.array([[[0, t % 4 + 1]]]) for t in range(steps)]).astype(np.int32)
    assert simulate("oracle", ids, 5, 2)["hit_rate"] == pytest.approx((40 + 10) / 80)
    # LRU of 2: expert 0 always cached after step 0; the other cycles through 4 ids, evicted before its return
    assert simulate("lru", ids, 5, 2)["hit_rate"] == pytest.approx(39 / 80)
    assert simulate("lru", ids, 5, 5)["hit_rate"] == pytest.approx((80 - 5) / 80)  # only the first touches miss
    assert simulate("uniform", ids, 5, 0)["hit_rate"] == 0.0
    assert simulate("static", ids, 5, 1, profile=np.array([[0, 0, 0, 0, 1]]))["hit_rate"] == pytest.approx(10 / 80)
    with pytest.raises(ValueError, match="policy='mru'"):
        simulate("mru", ids, 5, 2)


@pytest.mark.parametrize("E, K", [(128, 8), (512, 10)])
def test_hot_reaches_90_percent_of_the_oracle(E, K):
    m = TraceModel(E=E, top_k=K, layers=2, **CALIBRATED)
    ids = m.generate(3000, seed=11)
    for r in (0.10, 0.25, 0.50):
        cap = round(r * E)
        hot = simulate("hot", ids, E, cap, **HOT)["hit_rate"]
        oracle = simulate("oracle", ids, E, cap)["hit_rate"]
        rnd = simulate("random", ids, E, cap)["hit_rate"]
        assert hot >= 0.9 * oracle, (r, hot, oracle)
        assert oracle > rnd + 0.1, (r, oracle, rnd)  # the trace is skewed: placement matters
