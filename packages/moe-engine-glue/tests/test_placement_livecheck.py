"""split="auto"'s live check (placement/livecheck.py): the model's split runs a trial against hybrid on the windows'
step times, the faster stands for `recheck` windows, then both are tried again; a new q or batch restarts it."""
from __future__ import annotations

import pytest

from moe_engine.placement.livecheck import LiveCheck


def _run(check, q_model, step_us, windows, batch=1.0):
    """`windows` windows: each runs the q the check gives, at step_us(q) us a step; returns the qs in order."""
    qs, q = [], 0.0  # the runner's first window runs q = 0
    for _ in range(windows):
        check.ended(q, step_us(q) * 1e-6, batch)
        q = check.next_q(q_model)
        qs.append(q)
    return qs


def test_a_slower_split_gives_way_to_hybrid_until_the_recheck():
    c = LiveCheck(trial=2, recheck=5)
    qs = _run(c, 0.3, lambda q: 400.0 if q else 300.0, 12)
    # the trial: the split's two windows, then a second hybrid one; hybrid stands 5 windows, then the split's trial
    assert qs == [0.3, 0.3, 0.0] + [0.0] * 5 + [0.3, 0.3] + [0.0] * 2
    assert c.kept is False and c.us == pytest.approx({"split": 400.0, "hybrid": 300.0})


def test_a_faster_split_stands_and_follows_the_model():
    c = LiveCheck(trial=2, recheck=5)
    qs = _run(c, 0.3, lambda q: 250.0 if q else 300.0, 12)
    # at the recheck the split keeps its last windows and hybrid runs its two
    assert qs == [0.3, 0.3, 0.0] + [0.3] * 5 + [0.0, 0.0] + [0.3] * 2
    assert c.kept is True
    assert c.next_q(0.35) == 0.35  # within the tolerance the verdict stands and the model's q is taken


def test_a_new_q_or_batch_restarts_the_trial():
    c = LiveCheck(trial=1, recheck=10)
    _run(c, 0.3, lambda q: 250.0 if q else 300.0, 3)
    assert c.kept is True
    assert c.next_q(0.6) == 0.6 and c.kept is None  # another q: a new trial, its own window first
    c.ended(0.6, 500e-6, 1.0)
    assert c.next_q(0.6) == 0.0  # hybrid's window of before stands; the split lost
    assert c.kept is False
    c.ended(0.0, 300e-6, 8.0)  # the batch went from 1 to 8: nothing before compares
    assert c.next_q(0.6) == 0.6 and c.kept is None


def test_the_model_at_hybrid_needs_no_trial():
    c = LiveCheck()
    assert _run(c, 0.0, lambda q: 300.0, 5) == [0.0] * 5 and c.kept is None


@pytest.mark.parametrize("kw", [dict(trial=0), dict(recheck=-1), dict(trial=1.5), dict(recheck=True)])
def test_bad_windows(kw):
    with pytest.raises(ValueError, match=f"{next(iter(kw))}=.*expected a positive int"):
        LiveCheck(**kw)
