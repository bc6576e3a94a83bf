"""split="auto"'s check of the model's pick on the decode's own step time: before a split fraction q > 0 the model
picks is kept, it runs a trial of `trial` windows at q, and their mean step time is set against the last `trial`
windows at q = 0 (hybrid: the CPU takes every miss). The faster stands for `recheck` windows, then the two are
tried again (a trial from the side in force: the other side's windows). A change of the model's q by more than
`tolerance`, or of the batch by more than 10%, restarts it.

Why: the model (choose.py) sets lone bandwidths against each other, and at once the two paths slow each other
more than the profile's at-once figures say. On an H100 host (2026-12-06, fp8_block and bf16, batch 1, 0%
resident) every split tried ran 0.84-0.92x the CPU alone where the model gave the split 1.1-1.3x.

A trial costs at most `trial` windows at the slower side every `recheck` windows: 2 of 20 by default (100 of
1,000 steps at re-placement every 50). An idle gap inside a window (an engine waiting for requests) counts as that
window's step time; a verdict it spoils stands only until the next trial.

Thread contract: owned by its MissSplit; called between steps under the runner's lock."""
from __future__ import annotations

import statistics

TRIAL = 2  # windows of each side a verdict compares
RECHECK = 20  # windows a verdict stands
TOLERANCE = 0.1  # the model's q may move this far under a standing verdict (window-to-window jitter of the miss rate)
BATCH_CHANGE = 0.1  # a window's mean batch this far (relative) from the last one's: the windows no longer compare


class LiveCheck:
    def __init__(self, trial: int = TRIAL, recheck: int = RECHECK, tolerance: float = TOLERANCE):
        for name, v in (("trial", trial), ("recheck", recheck)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: expected a positive int (windows)")
        self.trial, self.recheck, self.tolerance = trial, recheck, tolerance
        self.kept: bool | None = None  # the last verdict: the split faster than hybrid
        self.us = {"split": None, "hybrid": None}  # the last verdict's mean step us per side
        self.left = 0  # windows the verdict stands
        self._q = None  # the split's q under trial or verdict
        self._seen = {"split": [], "hybrid": []}  # step seconds of the windows since the trial began
        self._batch = None

    def ended(self, q: float, step_s: float, batch: float) -> None:
        """The window that just ended ran fraction q at step_s seconds a step and a mean batch of `batch` tokens."""
        if self._batch is not None and abs(batch - self._batch) > BATCH_CHANGE * self._batch:
            self._restart()  # windows of different batches do not compare
            self._seen["hybrid"] = []
        self._batch = batch
        side = "hybrid" if q == 0.0 else "split" if self._q is not None and abs(q - self._q) <= self.tolerance \
            else None
        if side is not None:
            self._seen[side] = (self._seen[side] + [step_s])[-self.trial:]

    def next_q(self, q_model: float) -> float:
        """The fraction for the next window, given the model's pick for it."""
        if q_model == 0.0:
            return 0.0
        if self._q is not None and abs(q_model - self._q) > self.tolerance:
            self._restart()  # another q: the hybrid windows stand, the split's do not
        self._q = q_model
        if self.kept is not None:
            self.left -= 1
            if self.left > 0:
                return q_model if self.kept else 0.0
            self._seen["hybrid" if self.kept else "split"] = []  # a new trial of the side not in force
            self.kept = None
        s, h = self._seen["split"], self._seen["hybrid"]
        if len(s) >= self.trial and len(h) >= self.trial:
            self.us = {"split": 1e6 * statistics.fmean(s), "hybrid": 1e6 * statistics.fmean(h)}
            self.kept, self.left = self.us["split"] < self.us["hybrid"], self.recheck
            return q_model if self.kept else 0.0
        return q_model if len(s) < self.trial else 0.0  # the trial's side short of windows

    def _restart(self) -> None:
        self.kept, self.left, self._q = None, 0, None
        self._seen["split"] = []
