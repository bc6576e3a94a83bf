"""The miss split on any machine (Triton's interpreter where no GPU is): the zero-copy bank reads the host banks in the
GPU experts' layout (bit-equal to the same experts loaded into slots, every format it serves, edge codes included),
each step gives the GPU round(q n) of the n experts it misses (rule "step"; the kernel against a numpy rendering) or
the fixed per-expert sets carry their share of the miss bytes (rule "expert"), every route is served once under
changing routes, residency, rule and q (against the float64 reference), q = 0 is hybrid bit for bit, q = 1 leaves the
CPU idle and split='auto' follows a profile (pinning: test_pinning.py). The [cuda] cases read real page-locked host
memory."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import cuda_missing, make_banks, routes, triton_missing

from moe_engine.placement.pinning import PinnedBanks
from moe_engine.placement.profile import Profile, ProfileError
from moe_engine.placement.split import zero_copy_set
from moe_engine.reference import TOLERANCE, reference
from moe_engine.runner import MoERunner

pytestmark = pytest.mark.skipif(triton_missing() is not None, reason=str(triton_missing()))
DEVICE = "cpu" if cuda_missing() else "cuda"


def _runner(banks, fmt="bf16", **kw):
    kw.setdefault("capacity", 2)
    kw.setdefault("residency", "hot")
    return MoERunner(fmt, banks, top_k=3, strategy="hybrid", device=DEVICE, threads=2, graph_batch_sizes=(1, 3),
                     progress=False, **kw)


def _inputs(rng, T, E, H):
    x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16).to(DEVICE)
    ids, w = routes(rng, T, 3, E)
    return x, w.to(DEVICE), ids.to(DEVICE)


def _gpu_name() -> str:
    """The name a runner on DEVICE checks a profile against (none in the interpreter: any profile's name passes)."""
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "interp"


def _rel(y, ref) -> float:
    return float(np.abs(y.float().cpu().numpy() - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "nvfp4"])
def test_zero_copy_bank_reads_the_gpu_layout(fmt, rng):
    from moe_engine.gpu.experts import GpuExperts
    from moe_engine.placement.zerocopy import ZeroCopyBank

    banks, (E, H, I) = make_banks(fmt, rng, layers=1, E=5)
    b = banks[0]
    if fmt == "fp8_block":  # +-480 codes in one expert: its flag must come through
        b["gate_up"].reshape(-1).view(np.uint8)[:: 997] = 0x7F
    dev = torch.device(DEVICE)
    ge = GpuExperts(fmt, num_layers=1, capacity=E, E=E, H=H, I=I, top_k=3, max_tokens=4, device=dev)
    for e in range(E):
        ge.load(0, e, b, e)  # slot e = expert e: the same numbering as the zero-copy bank
    if DEVICE == "cuda":  # a pageable bank is refused by name, before any kernel reads it
        with pytest.raises(ValueError, match="not page-locked for cuda"):
            ZeroCopyBank(fmt, banks, [True], E=E, H=H, I=I, device=dev)
    pin = PinnedBanks(banks, dev)
    banks = pin.banks
    try:
        assert DEVICE == "cpu" or pin.pinned == [True], pin.summary()
        zc = ZeroCopyBank(fmt, banks, [True], E=E, H=H, I=I, device=dev)
        x, w, ids = _inputs(rng, 3, E, H)
        ids = ids.clamp(min=0).int()
        want = ge.forward(0, x, w, ids).view(torch.int16)
        assert torch.equal(want, ge.forward(0, x, w, ids, bank=zc).view(torch.int16))
    finally:
        pin.close()


def test_zero_copy_bank_refuses_transposed_formats(rng):
    from moe_engine.placement.zerocopy import ZeroCopyBank

    banks, (E, H, I) = make_banks("mxfp4", rng, layers=1, E=4)
    with pytest.raises(ValueError, match=r"format 'mxfp4' has no zero-copy bank .* \['bf16', 'fp8_block', 'nvfp4'\]"):
        ZeroCopyBank("mxfp4", banks, [True], E=E, H=H, I=I, device=torch.device("cpu"))


def test_zero_copy_set_shares():
    res = np.array([True, False, False, False, False])
    assert zero_copy_set(res, None, 0.0).sum() == 0
    assert zero_copy_set(res, None, 1.0).tolist() == [False, True, True, True, True]
    assert zero_copy_set(res, None, 0.5).sum() == 2  # equal loads: half the misses
    load = np.array([9.0, 3.0, 0.01, 0.01, 0.01])  # expert 1 is touched nearly every step, the rest rarely
    assert zero_copy_set(res, load, 0.9).tolist() == [False, True, False, False, False]
    assert not zero_copy_set(res, load, 0.9, eligible=False).any()
    with pytest.raises(ValueError, match=r"split=1.5: expected the fraction of the miss bytes the GPU reads"):
        zero_copy_set(res, None, 1.5)


def _step_split(ids, res, zset, q):
    """numpy: (skip [E], zero-copy expert per route) of split_routes."""
    from moe_engine.placement.split import take_count

    E = res.size
    ok = (ids >= 0) & (ids < E)
    touched = np.zeros(E, bool)
    touched[ids[ok]] = True
    miss = np.flatnonzero(touched & ~res)
    take = np.zeros(E, bool)
    take[miss[:take_count(q, miss.size)]] = True
    take |= zset & touched & ~res
    return res | take, np.where(ok & take[np.clip(ids, 0, E - 1)], ids, -1)


@pytest.mark.parametrize("E,T,K", [(8, 1, 3), (128, 1, 8), (128, 8, 8), (100, 7, 5), (256, 64, 8)])
def test_split_routes_kernel(E, T, K, rng):
    """Ragged E and route counts (several chunks at 64 x 8), ids -1 and >= E, resident experts, a fixed set, q at
    0, 1 and exact halves (q 0.35 of 10 misses rounds to 4: fixed point, not float32's 3.4999)."""
    from moe_engine.gpu.split_routes import split_routes
    from moe_engine.placement.split import SHIFT, q_fixed, take_count

    assert take_count(0.35, 10) == 4 and take_count(0.25, 2) == 1 and take_count(0.2, 2) == 0
    assert take_count(1.0, 512) == 512 and take_count(0.0, 512) == 0
    for q in (0.0, 0.2, 0.35, 0.5, 1.0):
        ids = rng.integers(-1, E + 2, (T, K))
        res, zset = rng.random(E) < 0.3, rng.random(E) < 0.1
        skip, zc = split_routes(torch.from_numpy(ids).to(DEVICE), torch.from_numpy(res).to(DEVICE),
                                torch.from_numpy(zset).to(DEVICE),
                                torch.tensor([q_fixed(q)], dtype=torch.int32, device=DEVICE), SHIFT)
        want_skip, want_zc = _step_split(ids, res, zset, q)
        assert np.array_equal(skip.cpu().numpy(), want_skip), q
        assert np.array_equal(zc.cpu().numpy(), want_zc), q


def test_split_serves_every_route_once(rng):
    banks, (E, H, _) = make_banks("bf16", rng, E=8)
    fast = dict(residency=0.25, capacity=4, qualify=False)  # qualification runs on `sp` below
    with _runner(banks, **fast) as hy, _runner(banks, split=0.0, **fast) as s0:
        x, w, ids = _inputs(rng, 3, E, H)
        assert torch.equal(hy.forward(1, x, w, ids).view(torch.int16), s0.forward(1, x, w, ids).view(torch.int16))
    with _runner(banks, residency=0.25, capacity=2, split=0.5, qualify=False) as de:
        assert de.split.rule == "expert" and "by expert" in de.describe()  # the default: the rule measured on a GPU
    with pytest.raises(ValueError, match="split_rule='step': it says how the miss split divides the misses; give "
                                         "split="):
        _runner(banks, split_rule="step", **fast)
    with _runner(banks, residency=0.25, capacity=4, split=0.5, split_rule="step") as sp:  # qualified by step
        assert sp.split.rule == "step" and "by step" in sp.describe()
        for t in range(12):
            if t == 6:
                sp.split.set_rule("expert")
            x, w, ids = _inputs(rng, 1 + t % 3, E, H)
            li = t % 2
            zc, res = sp.split.host_mask(li), sp.residency.host_mask(li)
            if sp.split.rule == "expert":
                assert not (zc & res).any() and zc.sum() == round(0.5 * (~res).sum())
            else:  # the step's own share: the CPU computes the misses the GPU does not take
                assert not zc.any()
                skip, _ = _step_split(ids.cpu().numpy(), res, zc, 0.5)
                v = ids.cpu().numpy()
                n0 = sp.executor.work()[1]
            rel = _rel(sp.forward(li, x, w, ids), reference(sp, li, x, w, ids))
            assert rel < TOLERANCE["native"], (t, rel)
            if sp.split.rule == "step":
                assert sp.executor.work()[1] - n0 == len(set(v[v >= 0].tolist()) - set(np.flatnonzero(skip))), t
            if t == 8:  # a residency change re-assigns the set; a stale zero-copy entry would count twice
                # every expert, resident ones too: the step's guard keeps each route once
                sp.split.table.set(0, np.ones(E, bool))
                rel = _rel(sp.forward(0, x, w, ids), reference(sp, 0, x, w, ids))
                assert rel < TOLERANCE["native"], rel
                sp.set_residency(0, np.roll(sp.residency.host_mask(0), 3))
        with pytest.raises(ValueError, match=r"split_rule='lru': expected one of \['expert', 'step'\]"):
            sp.split.set_rule("lru")
    for rule in ("step", "expert"):
        with _runner(banks, split=1.0, **fast) as s1:
            s1.split.set_rule(rule)
            x, w, ids = _inputs(rng, 3, E, H)
            served = s1.executor.health()["served"]
            y = s1.forward(0, x, w, ids)
            assert _rel(y, reference(s1, 0, x, w, ids)) < TOLERANCE["native"]
            assert s1.executor.health()["served"] == served, rule  # every miss read by the GPU: none reached the CPU


def test_set_split_moves_the_zero_copy_sets(rng):
    """set_split(q) between steps: every layer's set carries the new share, the step stays right, nothing reaches the
    CPU at q = 1; bad calls name what is expected."""
    banks, (E, H, _) = make_banks("bf16", rng, E=8)
    with _runner(banks, residency=0.25, capacity=2, split=0.0, qualify=False) as sp:
        x, w, ids = _inputs(rng, 3, E, H)
        sp.split.set_rule("expert")
        for q in (0.5, 1.0, 0.0):
            sp.set_split(q)
            for li in range(sp.num_layers):
                zc, res = sp.split.host_mask(li), sp.residency.host_mask(li)
                assert not (zc & res).any() and zc.sum() == round(q * (~res).sum()), (q, li)
            n0 = sp.executor.work()[1]
            assert _rel(sp.forward(1, x, w, ids), reference(sp, 1, x, w, ids)) < TOLERANCE["native"], q
            cpu = ~(sp.split.host_mask(1) | sp.residency.host_mask(1))  # the CPU's experts: none at q = 1
            assert (sp.executor.work()[1] > n0) == bool(cpu[ids.cpu().numpy().ravel()].any()), q
        with pytest.raises(ValueError, match=r"split=1.5: expected the fraction"):
            sp.set_split(1.5)
        assert sp.split.q == 0.0
    with pytest.raises(RuntimeError, match="set_split: the runner is closed"):
        sp.set_split(0.5)
    with _runner(banks, residency=0.25, capacity=2, qualify=False) as hy:
        with pytest.raises(RuntimeError, match="set_split: this runner has no miss split"):
            hy.set_split(0.5)
    p = Profile(gpu=_gpu_name(), cpu_read=100.0, executor={"bf16": 50.0}, zero_copy={"bf16": 50.0}, hbm=3000.0)
    with _runner(banks, split="auto", profile=p, qualify=False) as sa:
        with pytest.raises(ValueError, match="split='auto' chooses q itself"):
            sa.set_split(0.5)


def test_split_auto_takes_the_cpu_rate_live(rng, caplog):
    """The first window runs with q = 0: its executor rate (experts x bytes / the steps' time) replaces the profile's
    in the choice; a window with q > 0 (the CPU beside the zero-copy reads) leaves it as it is."""
    from moe_engine.placement.missplit import LIVE_MIN_EXPERTS

    banks, (E, H, _) = make_banks("bf16", rng, E=8)
    p = Profile(gpu=_gpu_name(), cpu_read=50.0, executor={"bf16": 50.0}, zero_copy={"bf16": 25.0})
    caplog.set_level(logging.INFO, logger="moe_engine")
    # 16 steps of 2 layers a window: ~4 CPU experts a layer-step, so ~128 >= LIVE_MIN_EXPERTS (8 steps gave 63 on
    # CPUMOE_TEST_SEED=560613285)
    with _runner(banks, split="auto", profile=p, replace_every=16) as sp:  # qualification's steps do not count
        s0, n0 = sp.executor.work()

        def window():
            for _ in range(16):
                for li in range(2):
                    x, w, ids = _inputs(rng, 3, E, H)
                    rel = _rel(sp.forward(li, x, w, ids), reference(sp, li, x, w, ids))
                    assert rel < TOLERANCE["native"], rel

        window()  # the last layer's forward ends the step: the window folds, rechoose() measures and chooses
        s1, n1 = sp.executor.work()
        assert n1 - n0 >= LIVE_MIN_EXPERTS and s1 > s0
        assert sp.split.cpu_GBps == pytest.approx((n1 - n0) * sp.bytes_per_expert / (s1 - s0) / 1e9)
        assert f"cpu {sp.split.cpu_GBps:.1f} GB/s live" in sp.split.choice.reason
        if sp.split.q > 0:
            live = sp.split.cpu_GBps
            window()
            assert sp.split.cpu_GBps == live


def test_split_auto_follows_the_profile(rng, caplog):
    # the CPU and the link at one rate: with 2 slots for a token's 3 routes a layer misses >= 1 expert a step, and
    # splitting >= 2 misses beats either path alone, whatever the window's miss rate (at 50 / 25 GB/s the modelled
    # modes tie near a 50% miss rate, and the tie went to hybrid on some seeds)
    banks, (E, H, _) = make_banks("bf16", rng, E=8)
    p = Profile(gpu=_gpu_name(), cpu_read=50.0, executor={"bf16": 50.0}, zero_copy={"bf16": 50.0})
    caplog.set_level(logging.INFO, logger="moe_engine")
    with _runner(banks, split="auto", profile=p, replace_every=2) as sp:
        assert sp.split.q == 0.0
        for _ in range(4):
            for li in range(2):
                x, w, ids = _inputs(rng, 1, E, H)
                rel = _rel(sp.forward(li, x, w, ids), reference(sp, li, x, w, ids))
                assert rel < TOLERANCE["native"], rel
        c = sp.split.choice
        assert c is not None and c.mode == "split" and 0 < c.q < 1 and sp.split.q == c.q, c.reason
        assert caplog.text.count("auto: split q=") == 1  # one line when the mode changes; q follows the window
        # the live check: the split's trial windows against hybrid's, then the faster of the two on the step times
        for _ in range(12):
            if sp.split.check.kept is not None:
                break
            for li in range(2):
                x, w, ids = _inputs(rng, 1, E, H)
                sp.forward(li, x, w, ids)
        chk = sp.split.check
        assert chk.kept is not None and chk.kept == (chk.us["split"] < chk.us["hybrid"]), chk.us
        assert sp.split.q == (sp.split.choice.q if chk.kept else 0.0)
        assert "auto: the decode's own steps: split q=" in caplog.text
    assert sp.split.cpu_GBps is None  # 2-step windows of a few experts: under LIVE_MIN_EXPERTS, the profile's rate
    with pytest.raises(ProfileError, match="no executor figure for format 'bf16'"):
        _runner(banks, split="auto", profile=Profile(gpu=_gpu_name(), cpu_read=1.0, executor={"fp8_block": 1.0}))
    with pytest.raises(ValueError, match="split='auto' sets q from the live miss rate of residency='hot'"):
        _runner(banks, split="auto", residency=0.25)
    with pytest.raises(ValueError, match=r"split=2: expected the fraction"):
        _runner(banks, split=2)
    with pytest.raises(ValueError, match="split=0.5: the miss split runs under strategy='hybrid', not 'cpu'"):
        MoERunner("bf16", banks, top_k=3, strategy="cpu", device="cpu", threads=2, split=0.5, progress=False)


@pytest.mark.cuda
@pytest.mark.skipif(cuda_missing() is not None, reason=str(cuda_missing()))
def test_split_reads_page_locked_memory_on_the_gpu(rng):
    banks, (E, H, _) = make_banks("bf16", rng, E=8)
    with _runner(banks, residency=0.25, capacity=4, split=1.0, pin_memory=1 << 30) as s1:
        assert all(s1.pinned.pinned) and s1.split.bank.parts["gu_w"][0].is_cuda
        x, w, ids = _inputs(rng, 3, E, H)
        assert _rel(s1.forward(0, x, w, ids), reference(s1, 0, x, w, ids)) < TOLERANCE["native"]


def test_bench_profile_on_the_cpu(tmp_path, capsys, monkeypatch):
    from moe_engine.placement import profile as prof
    from moe_engine.tools.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["bench", "--profile", "--shape", "16,256,128,4", "--formats", "bf16", "--steps", "8", "-t", "2"]) == 0
    out = capsys.readouterr().out
    gpu = "none" if cuda_missing() else torch.cuda.get_device_name(0)
    p = prof.load(prof.default_path(gpu))
    assert p.executor["bf16"] > 0 and p.cpu_read > 0 and p.shape == {"E": 16, "H": 256, "I": 128, "top_k": 4}
    assert (tmp_path / "moe-engine" / f"profile-{prof._slug(gpu)}.png").exists()
    if cuda_missing():
        assert p.notes == {"bf16": "GPU parts skipped: torch sees no CUDA device"} and "GPU parts skipped" in out
        assert p.h2d == 0 and p.zero_copy == {}
    else:
        assert p.h2d > 0 and p.zero_copy["bf16"] > 0 and set(p.both["bf16"]) == {"cpu", "zero_copy"}


def test_bench_profile_takes_the_runners_workers_beside_a_gpu(monkeypatch):
    """Beside a GPU the profile's executor has the runner's worker count (cores - 1), so it measures the CPU side as
    the runner runs it; -t overrides; with no GPU every core."""
    import moe_engine.runner as runner_mod
    from moe_engine.tools.bench_profile import workers

    monkeypatch.setattr(runner_mod, "threads_beside_gpu", lambda: 15)
    assert workers(None, "NVIDIA H100 80GB HBM3") == 15
    assert workers(4, "NVIDIA H100 80GB HBM3") == 4
    assert workers(None, "none") is None and workers(3, "none") == 3


@pytest.mark.cuda
@pytest.mark.skipif(cuda_missing() is not None, reason=str(cuda_missing()))
def test_staged_prefill_from_page_locked_banks(rng):
    banks, (E, H, _) = make_banks("bf16", rng, E=8)
    with MoERunner("bf16", banks, top_k=3, strategy="cpu", device="cuda", threads=2, graph_batch_sizes=(1,),
                   pin_memory=True, prefill="gpu", progress=False) as r:
        assert all(r.pinned.pinned) and "host banks pinned 2/2 layers" in r.describe()
        x, w, ids = _inputs(rng, 7, E, H)  # above max_tokens: staged prefill
        assert _rel(r.forward(0, x, w, ids), reference(r, 0, x, w, ids)) < TOLERANCE["native"]
        assert r.last_prefill["how"] == "gpu"


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="torch sees no CUDA device")
def test_split_runs_under_graphs(rng):
    """Qualification's last replay moves the residency (set_residency copies from the pinned banks): it failed in
    2 of 6 runners on the H100 while an array could lie over two registrations (pinning.spans)."""
    banks, _ = make_banks("bf16", rng, E=8)
    with _runner(banks, residency=0.25, capacity=4, split=0.5) as sp:
        assert sp.graphs_ok, sp.describe()
