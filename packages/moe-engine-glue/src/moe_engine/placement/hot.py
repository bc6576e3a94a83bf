"""residency="hot" in a MoERunner: routing counts from the device (counts.py) folded into a HotPlacer
(policies.py) every `every` steps, and the new placement applied between steps through the runner's in-place
tables (no recapture), the weights of newly resident experts copied on their own stream.

A move runs in two stream-ordered phases so that no step reads a slot mid-copy: the tables first drop the leaving
experts (their routes go to the CPU), the copy stream then waits for that and fills the freed slots, and the decode
stream waits for the copies before the tables add the new experts. Every step between sees a consistent table.

Thread contract: owned by its MoERunner; end_step() runs under the runner's lock between steps."""
from __future__ import annotations

import logging

import numpy as np

from .counts import RoutingCounts
from .policies import HotPlacer

log = logging.getLogger("moe_engine")


class HotResidency:
    def __init__(self, runner, *, every: int, half_life: float, hysteresis: float):
        import torch

        r = runner.residency
        self.runner = runner
        initial = np.stack([r.host_mask(li) for li in range(runner.num_layers)])
        self.placer = HotPlacer(runner.num_layers, runner.E, r.capacity, every=every, half_life=half_life,
                                hysteresis=hysteresis, initial=initial)
        self.counts = RoutingCounts(runner.num_layers, runner.E, runner.max_tokens * runner.top_k, runner.device)
        self._copy = torch.cuda.Stream(runner.device) if runner.device.type == "cuda" else None
        self.steps = self._since = 0
        self._pending = False
        self.moves = self.loads = 0
        self.hit_rate = None  # routes on resident experts in the last folded window (choose.py's live miss rate)
        self.tokens_per_step = 1.0  # the last window's mean batch

    def end_step(self) -> int:
        """One decode step ended: start a snapshot of the counts when a window is full, fold a landed one into the
        averages and re-place. Returns the experts loaded now. Never waits for the device."""
        self.steps += 1
        self._since += 1
        if not self._pending and self._since >= self.placer.every:
            self.counts.snapshot()
            self._pending, self._window, self._since = True, self._since, 0
        if not self._pending:
            return 0
        d = self.counts.poll()  # None while the copy is in flight: a later step folds it
        if d is None:
            return 0
        self._pending = False
        self.placer.observe(d, steps=self._window)
        for li in range(self.runner.num_layers):  # set_residency() calls in between stand
            self.placer.mask[li] = self.runner.residency.host_mask(li)
        if d.sum() > 0:
            self.hit_rate = float((d * self.placer.mask).sum() / d.sum())
            self.tokens_per_step = float(d.sum() / (self.runner.num_layers * self.runner.top_k * self._window))
        loaded = self._apply(self.placer.place())
        if self.runner.split is not None:
            self.runner.split.rechoose()
        return loaded

    def _apply(self, masks: np.ndarray) -> int:
        r = self.runner.residency
        loaded = 0
        for li in range(self.runner.num_layers):
            old = r.host_mask(li)
            if np.array_equal(old, masks[li]):
                continue
            loaded += move(self.runner, li, masks[li], self._copy)
        if loaded:
            self.moves += 1
            self.loads += loaded
            log.debug("hot residency: %d experts loaded at step %d", loaded, self.steps)
        return loaded


def move(runner, layer: int, mask, copy_stream=None) -> int:
    """Make `mask` layer `layer`'s residency: leaving experts drop out of the tables first, new ones are copied on
    `copy_stream` (None: the current stream) and enter the tables once their copies are done."""
    import torch

    r = runner.residency
    keep = r.host_mask(layer) & np.asarray(mask, bool)
    r.plan(layer, keep)
    r.commit(layer)  # phase 1: the leaving experts' routes go to the CPU from the next step on
    loads = r.plan(layer, mask)
    if not loads:
        return 0
    if copy_stream is None:
        for e, slot in loads:
            runner.gpu.load(layer, slot, runner.host_banks[layer], e)
    else:
        main = torch.cuda.current_stream(runner.device)
        copy_stream.wait_stream(main)  # the steps that still read the freed slots come first
        with torch.cuda.stream(copy_stream):
            for e, slot in loads:
                runner.gpu.load(layer, slot, runner.host_banks[layer], e, non_blocking=True)
        main.wait_stream(copy_stream)  # a device-side wait: the host goes on
    r.commit(layer)  # phase 2: the new experts serve their routes
    return len(loads)
