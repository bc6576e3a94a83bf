"""Start-up qualification: a wrong eager step stops start-up, on every rank; a graph failure on one tensor-parallel
rank refuses graphs on all of them (two CPU ranks over gloo); residency tables route every expert exactly once."""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from conftest import make_banks

from moe_engine import qualify
from moe_engine.residency import Residency
from moe_engine.runner import MoERunner


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, case: str, out) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if case == "graphs":
            out.put((rank, qualify.consensus(True, rank == 0, "ok" if rank == 0 else "replay 2 differs")))
        else:  # an eager failure on rank 1 stops start-up on both ranks, naming the rank
            rng = np.random.default_rng(rank)
            banks, _ = make_banks("bf16", rng)
            if rank == 1:
                qualify.check_eager = _broken
            try:
                MoERunner("bf16", banks, top_k=2, device="cpu", threads=1, progress=False)
                out.put((rank, "started"))
            except RuntimeError as e:
                out.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


def _broken(r, layer, gen, **kw):
    raise AssertionError("eager mixed step (T=1): max rel error 0.5")


@pytest.mark.parametrize("case", ["graphs", "eager"])
def test_tensor_parallel_ranks_agree(case):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(rk, port, case, q)) for rk in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    if case == "graphs":
        for rk in (0, 1):
            assert got[rk] == (True, False, "rank 1: replay 2 differs")
    else:
        for rk in (0, 1):
            assert "start-up qualification failed eagerly (rank 1: AssertionError: eager mixed step" in got[rk], got


def test_wrong_eager_step_stops_start_up(rng, monkeypatch):
    banks, _ = make_banks("bf16", rng)
    monkeypatch.setattr(qualify, "TOLERANCE", {"native": 0.0, "w4a8": 0.0})  # nothing is that exact
    with pytest.raises(RuntimeError, match="start-up qualification failed eagerly .*expected < 0.0"):
        MoERunner("bf16", banks, top_k=2, device="cpu", threads=1, progress=False)


def test_residency_plan_routes_each_expert_once():
    E, cap = 10, 4
    res = Residency(2, E, cap, "cpu")
    m = np.zeros(E, bool)
    m[[1, 4, 7]] = True
    assert res.plan(0, m) == [(1, 0), (4, 1), (7, 2)]
    res.commit(0)
    m2 = m.copy()
    m2[[4]] = False
    m2[[2, 9]] = True  # 4 leaves, 2 and 9 arrive: 1 and 7 keep their slots
    loads = res.plan(0, m2)
    res.commit(0)
    assert sorted(loads) == [(2, 1), (9, 3)]
    assert res.slot_of[0].tolist() == [-1, 0, 1, -1, -1, -1, -1, 2, -1, 3]
    assert res.mask[0].tolist() == m2.tolist()
    ids = torch.tensor([[1, 2, -1, 5], [9, 7, 4, 0]], dtype=torch.int32)
    assert res.slots(0, ids).tolist() == [[0, 1, -1, -1], [3, 2, -1, -1]]
    assert res.slots(1, ids).tolist() == [[-1] * 4] * 2  # layer 1: nothing resident
    with pytest.raises(ValueError, match="5 resident experts, expected at most capacity=4"):
        res.plan(0, np.arange(E) < 5)
    with pytest.raises(ValueError, match="expected a bool array of length E=10"):
        res.plan(0, np.ones(9, bool))


# ---- every layer is sampled; NaN / Inf ---------------------------------------------------------------------------
def _poison(fmt: str, banks: dict) -> None:
    """Every expert of one layer computes non-finite values: gate row 0 gets a NaN weight (bf16), a NaN block scale
    (fp8_block) or an Inf fp16 d in its first block (q4_0, a poisoned GGUF)."""
    if fmt == "bf16":
        banks["gate_up"][:, 0, 0] = np.nan
    elif fmt == "fp8_block":
        banks["gate_up_scale"][:, 0, 0] = np.nan
    else:
        banks["gate_up"][:, 0, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)


@pytest.mark.parametrize("fmt,layer", [("bf16", 0), ("bf16", 1), ("fp8_block", 0), ("q4_0", 0)])
def test_poisoned_layer_stops_start_up(rng, fmt, layer):
    """The last layer gets the full checks; every other layer one step: a poisoned layer 0 no longer serves."""
    banks, _ = make_banks(fmt, rng, layers=3)
    _poison(fmt, banks[layer])
    with pytest.raises(RuntimeError, match=rf"failed eagerly \(AssertionError: layer {layer}: one-token step with "
                                           r"experts \[\d+\]: \d+ of \d+ outputs are NaN/Inf"):
        MoERunner(fmt, banks, top_k=2, device="cpu", threads=1, progress=False)


def test_allow_nonfinite_follows_the_reference(rng):
    banks, _ = make_banks("bf16", rng)
    _poison("bf16", banks[0])
    r = MoERunner("bf16", banks, top_k=2, device="cpu", threads=1, progress=False, qualify=False)
    qualify.qualify_runner(r, allow_nonfinite=True)  # NaN exactly where the float64 reference has it
    ids = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    y = r.forward(0, torch.randn(2, r.H).to(torch.bfloat16), torch.rand(2, 2) + 0.1, ids)
    assert torch.isnan(y.float()).all()
    r.close()


def test_compare_nonfinite_rules():
    ref = np.array([[1.0, 2.0], [np.nan, np.nan]])
    ok = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert qualify.compare(ok[:1], ref[:1], 1e-2) is None
    assert "NaN/Inf" in qualify.compare(ok, ref, 1e-2)  # strict: the reference's NaN fails
    assert "different places" in qualify.compare(ok, ref, 1e-2, allow_nonfinite=True)  # a kernel that hid the NaN
    assert qualify.compare(torch.tensor([[1.0, 2.0], [float("nan")] * 2]), ref, 1e-2, allow_nonfinite=True) is None
    assert "max rel error" in qualify.compare(ok[:1] * 1.1, ref[:1], 1e-2)


def test_sample_ids_rotate_through_both_sides():
    from types import SimpleNamespace

    E, K = 8, 4
    gpu = np.arange(E) % 2 == 1  # odd experts on the GPU
    hybrid = SimpleNamespace(E=E, top_k=K, executor=object(), residency=SimpleNamespace(host_mask=lambda _: gpu))
    picks = [qualify.sample_ids(hybrid, layer)[0] for layer in range(4)]
    for p in picks:
        assert list(p[2:]) == [-1, -1] and not gpu[p[0]] and gpu[p[1]]  # one expert on each side
    assert sorted(int(e) for p in picks for e in p[:2]) == list(range(E))  # 4 layers cover every expert
    cpu = SimpleNamespace(E=E, top_k=1, executor=object(), residency=None)
    assert [int(qualify.sample_ids(cpu, layer)[0, 0]) for layer in range(E)] == list(range(E))
