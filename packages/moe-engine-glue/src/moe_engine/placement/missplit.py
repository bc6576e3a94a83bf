"""A MoERunner's miss split (split=q | "auto"): the zero-copy bank over its page-locked host banks, the split's device
tables (split.py: rule "expert", the default, a fixed set per layer; rule "step", round(q n) of each step's n misses
to the GPU) and the step that serves each route once: resident -> its GPU slot, taken by the GPU -> the GPU experts
reading host memory, else the CPU executor, the CPU started first and both sides at once.

Under split="auto" the model's pick of a fraction q > 0 is checked on the decode's own step times before it stands
(livecheck.py), and the CPU's rate is the runner's own where it has one: the executor's experts per second over the
last re-placement window that ran with q = 0 (the first window always does), the lone rate the model wants; the
profile's until then. A profile's one-off figure can be far off the live one: an H100 host's profile read fp8_block
at 34.3 GB/s where the runner's CPU-only misses read 91 a minute later, and auto then leaned to the split (+34-46%).

Thread contract: owned by its MoERunner; assign() / rechoose() / set_q() / set_rule() between steps under the runner's
lock, step() is the body a graph captures."""
from __future__ import annotations

import contextlib
import logging
import time

import numpy as np

from .split import DEFAULT_RULE, RULES, SplitTable, zero_copy_set

log = logging.getLogger("moe_engine")
LIVE_MIN_EXPERTS = 64  # a window's CPU experts below which its rate is not taken (a few steps' wake-ups dominate)


def live_GBps(before, after, bytes_per_expert: int, min_experts: int = 1) -> float | None:
    """GB/s the executor's steps read between two CpuMoeExecutor.work() readings (experts x bytes / their time);
    None below `min_experts`."""
    ds, dn = after[0] - before[0], after[1] - before[1]
    return dn * bytes_per_expert / ds / 1e9 if dn >= min_experts and dn > 0 and ds > 0 else None


def _rule(rule) -> str:
    if rule not in RULES:
        raise ValueError(f"split_rule={rule!r}: expected one of {list(RULES)}")
    return rule


def _fraction(q, E: int) -> float:
    zero_copy_set(np.zeros(E, bool), None, q)  # checks the fraction, naming split=
    return float(q)


class MissSplit:
    def __init__(self, runner, split, pinned, profile, rule: str | None = None):
        from .zerocopy import ZeroCopyBank

        r = runner
        self.runner, self.auto, self.profile, self.choice = r, split == "auto", None, None
        self.rule = _rule(DEFAULT_RULE if rule is None else rule)
        if self.auto:
            if r.hot is None:
                raise ValueError("split='auto' sets q from the live miss rate of residency='hot'; give a fraction "
                                 "or use residency='hot'")
            from .profile import resolve

            gpu = r.torch_device_name()
            self.profile = resolve(profile, gpu=gpu, format=r.format)
            if self.profile is None:
                log.warning("split='auto': no bandwidth profile for %s; the misses stay on the CPU until one exists "
                            "(run `moe-engine bench --profile`)", gpu)
            from .livecheck import LiveCheck

            self.q = 0.0
            self.cpu_GBps = None  # the CPU's lone rate measured live (windows with q = 0)
            self._work = r.executor.work() if r.executor is not None else None
            self.check = LiveCheck()  # the model's split against hybrid on the windows' own step times
            self._clock = (time.perf_counter(), r.hot.steps)  # (seconds, hot's steps) when the window began
        else:
            self.q = _fraction(split, r.E)
        flags = pinned.pinned if pinned is not None else [True] * r.num_layers  # the interpreter reads CPU tensors
        self.bank = ZeroCopyBank(r.format, r.host_banks, flags, E=r.E, H=r.H, I=r.I, device=r.device)
        self.table = SplitTable(r.num_layers, r.E, r.device)
        for layer in range(r.num_layers):
            self.assign(layer)

    def host_mask(self, layer: int) -> np.ndarray:
        return self.table.host_mask(layer)

    def assign(self, layer: int) -> None:
        """The layer's tables from q and the rule: "step", q itself; "expert", the zero-copy set from its residency
        and hot's routing rates (else equal)."""
        r = self.runner
        ok = self.bank.layers[layer]
        if self.rule == "step":
            self.table.set(layer, np.zeros(r.E, bool), self.q if ok else 0.0)
            return
        load = r.hot.placer.rate()[layer] if r.hot is not None else None
        self.table.set(layer, zero_copy_set(r.residency.host_mask(layer), load, self.q, eligible=ok))

    def set_rule(self, rule: str) -> None:
        """"step" or "expert" from now on (module docstring of split.py); a captured graph follows (no recapture)."""
        self.rule = _rule(rule)
        for layer in range(self.runner.num_layers):
            self.assign(layer)

    @contextlib.contextmanager
    def cpu_only(self, layer: int):
        """Every miss of `layer` on the CPU while inside (qualification's CPU-only steps, compared with the executor
        bit for bit); the tables as they were after."""
        q, self.q = self.q, 0.0
        try:
            self.assign(layer)
            yield
        finally:
            self.q = q
            self.assign(layer)

    def rechoose(self) -> None:
        """After a re-placement: under "auto", the mode and q from the profile and the last window's miss rate and
        batch (one log line when the mode changes); then every layer's set."""
        r = self.runner
        if self.auto:
            self._measure()
        if self.auto and self.profile is not None and r.hot.hit_rate is not None:
            from .choose import choose

            c = choose(self.profile, r.format, bytes_per_expert=r.bytes_per_expert, E=r.E, top_k=r.top_k,
                       batch=max(1, round(r.hot.tokens_per_step)), miss_rate=1.0 - r.hot.hit_rate,
                       residency=r.residency.fraction(), modes=("hybrid", "split", "gpu_misses"),
                       cpu_GBps=self.cpu_GBps, rule=self.rule)
            if self.choice is None or c.mode != self.choice.mode:
                log.info("%s", c.reason)
            kept = self.check.kept
            self.choice, self.q = c, self.check.next_q(c.q)
            if self.check.kept is not None and self.check.kept != kept:
                u = self.check.us
                log.info("auto: the decode's own steps: split q=%.2f %.0f us, hybrid %.0f us: %s for %d windows",
                         c.q, u["split"], u["hybrid"], "split" if self.check.kept else "hybrid", self.check.recheck)
        for layer in range(r.num_layers):
            self.assign(layer)

    def set_q(self, q) -> None:
        """A fixed fraction q from now on: every layer's zero-copy set follows (the tables in place; no recapture)."""
        if self.auto:
            raise ValueError("set_split: split='auto' chooses q itself; open the runner with split=<a fraction> to "
                             "set it")
        self.q = _fraction(q, self.runner.E)
        for layer in range(self.runner.num_layers):
            self.assign(layer)

    def restart_window(self) -> None:
        """The live rate's window starts now (the runner: after its start-up qualification's steps)."""
        if self.auto and self.runner.executor is not None:
            self._work = self.runner.executor.work()
        if self.auto:
            self._clock = (time.perf_counter(), self.runner.hot.steps)

    def _measure(self) -> None:
        """The window just ended: its step time goes to the check, and its CPU rate becomes cpu_GBps when it ran with
        q = 0 and enough experts."""
        hot, now = self.runner.hot, time.perf_counter()
        if hot.steps > self._clock[1]:
            self.check.ended(self.q, (now - self._clock[0]) / (hot.steps - self._clock[1]), hot.tokens_per_step)
        self._clock = (now, hot.steps)
        if self._work is None:
            return
        now = self.runner.executor.work()
        rate = live_GBps(self._work, now, self.runner.bytes_per_expert, LIVE_MIN_EXPERTS)
        self._work = now
        if self.q == 0.0 and rate is not None:
            self.cpu_GBps = rate

    def step(self, layer: int, x, wf, ids):
        import torch

        r = self.runner
        mask = r.residency.mask[layer]
        ok = self.bank.layers[layer]
        zc, skip = self.table.routes(layer, ids, mask) if ok else (None, mask)
        # the CPU starts first; it skips what the GPU serves: resident or read zero-copy (the live tables)
        r.sync.submit(layer, x, wf, ids, skip, check=False)
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        y = r.gpu.forward(layer, xb, wf, r.residency.slots(layer, ids))
        if ok:
            y = y + r.gpu.forward(layer, xb, wf, zc, bank=self.bank)
        return r.sync.finish(layer, partial=y)
