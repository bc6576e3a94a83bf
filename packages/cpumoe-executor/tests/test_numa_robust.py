"""NUMA worker groups under the executor's contracts, on a fake two-node topology (real CPUs on fake nodes):
placement (mbind's answer, first touch by the node's own pinned workers, pages found on the node; numa_report),
node memory checks, layer_banks of placed copies, and for the new threads: threads sharing the executor, the
doorbell, the trace, close() joining every group, the closed contract, a forked child; the per-node read
ceilings the bench uses."""
import os

import numpy as np
import pytest
from conftest import UNDER_TSAN, bits, fake_sysfs, routing, two_real_nodes
from test_robust_lifetime import proc_status
from test_robust_process import FORKED, in_os_fork
from test_robust_threads import hammer

import cpumoe_executor as ce
import cpumoe_formats as cf
from cpumoe_executor import _native

HOST_NODES = {int(d[4:]) for d in os.listdir("/sys/devices/system/node") if d[4:].isdigit()} \
    if os.path.isdir("/sys/devices/system/node") else set()


def banks_for(fmt, rng, E=6, H=96, I=64, layers=2):  # noqa: E741
    return [cf.get_format(fmt).random_banks(E, H, I, rng) for _ in range(layers)]


def step(rng, ex, T, layer=0):
    x = rng.standard_normal((T, ex.H)).astype(np.float32)
    return (layer, x, *routing(rng, T, ex.top_k, ex.E))


@pytest.mark.parametrize("mode", ["split", "replicate"])
def test_placement_report(mode, rng, tmp_path):
    root = two_real_nodes(tmp_path)
    banks = banks_for("q4_0", rng)
    with ce.CpuMoeExecutor("q4_0", banks, top_k=4, sysfs_root=root, numa=mode) as ex:
        rep = ex.numa_report()
        assert rep["mode"] == mode and rep["root"] == root and [g["node"] for g in rep["groups"]] == [0, 1]
        pl = rep["placements"]
        assert sorted((r["layer"], r["group"], r["part"]) for r in pl) == \
            ([(0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)] if mode == "split" else
             [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)])
        layer_bytes = sum(a.nbytes for a in ex.layer_banks(0).values())
        per_layer = sum(r["bytes"] for r in pl if r["layer"] == 0)
        want = layer_bytes if mode == "split" else 2 * layer_bytes
        assert want <= per_layer < want + 4 * 4096  # page-rounded banks
        for r in pl:
            assert r["node"] == r["group"]
            assert r["mbind"] == ("ok" if r["node"] in HOST_NODES else "EINVAL" if HOST_NODES else "ENOSYS")
            if r["mbind"] == "ok":
                assert r["pages_on_node"] == r["pages_checked"] > 0
            if r["group"] == 1:  # a group other than the caller's: its one worker, pinned, wrote the pages
                assert r["touched_by"] == r["touchers_pinned"] == 1
            else:  # the caller's group has no worker here (one core): the caller wrote them, mbind placed them
                assert r["touched_by"] == 1
        assert "offsets" not in pl[0]


def test_node_memory_replicate_refused_split_warned(rng, tmp_path):
    cpus = list(_native.allowed_cpus())[:2]
    if len(cpus) < 2:
        pytest.skip("needs two usable CPUs")
    banks = banks_for("bf16", rng, H=256, I=128, E=8)  # 1.5 MiB a layer, 3 MiB in all
    root = fake_sysfs(tmp_path, {0: (str(cpus[0]), 8 << 20, 8 << 20), 1: (str(cpus[1]), 8 << 20, 1024)})
    with pytest.raises(ValueError, match="numa='replicate': node 1 needs 3.1 MB for its banks and has 1.0 MB free; "
                                         "expected numa='split'"):
        ce.CpuMoeExecutor("bf16", banks, top_k=2, sysfs_root=root, numa="replicate")
    with pytest.warns(RuntimeWarning, match="numa='split': node 1 needs .* the kernel places the rest"):
        ex = ce.CpuMoeExecutor("bf16", banks, top_k=2, sysfs_root=root)
    assert ex.numa == "split"
    ex.close()


def test_layer_banks_of_placed_copies(rng, tmp_path):
    root = two_real_nodes(tmp_path)
    banks = banks_for("bf16", rng)
    spec = cf.get_format("bf16")
    for mode in ("split", "replicate"):
        ex = ce.CpuMoeExecutor("bf16", banks, top_k=4, repack=False, sysfs_root=root, numa=mode)
        lb = ex.layer_banks(1)
        for n in spec.bank_names:
            np.testing.assert_array_equal(lb[n], banks[1][n])
        if mode == "replicate":  # views of the placed copy: read-only, alive after close()
            with pytest.raises(ValueError, match="read-only"):
                lb["down"][0, 0, 0] = 0
            ex.close()
            np.testing.assert_array_equal(lb["down"], banks[1]["down"])
        ex.close()


def test_threads_doorbell_and_trace_on_split(rng, tmp_path):
    root = two_real_nodes(tmp_path)
    ex = ce.CpuMoeExecutor("q4_0", banks_for("q4_0", rng), top_k=4, max_tokens=8, sysfs_root=root)
    assert ex.numa == "split" and ex.threads == 2 and ex._x.pinned == 1  # the caller's core is group 0's
    jobs = [step(rng, ex, T, T % 2) for T in (1, 3, 6, 8)]
    want = [bits(ex.decode(*j)).copy() for j in jobs]

    def caller(i):
        def fn():
            for r in range(20):
                np.testing.assert_array_equal(bits(ex.decode(*jobs[i])), want[i], err_msg=f"thread {i} round {r}")
        return fn

    ex.start_coordinator()
    a, iob = ex.io_arrays(), ex.io_block()

    def ringer():  # doorbell tasks served while the other threads decode
        layer, x, w, ids = jobs[2]
        T = x.shape[0]
        for r in range(20):
            a["x"][:T], a["w"][:T], a["ids"][:T] = x.astype(cf.numerics.BF16), w, ids
            assert _native.play_gpu(iob["ready"], iob["done"], layer << 32 | T, 30.0)
            np.testing.assert_array_equal(bits(a["y"][:T]), want[2], err_msg=f"doorbell round {r}")

    hammer([caller(0), caller(1), caller(3)])
    hammer([ringer])
    ex.stop_coordinator()
    ex.set_team_unit(0)
    ex.start_trace()
    for _ in range(5):
        ex.decode(*jobs[3])
    tr = ex.stop_trace()
    assert tr["steps"] == 5 and len(tr["raw"]["threads"]) == ex.threads == tr["threads"]
    ex.close()


def test_close_joins_every_group_and_later_calls_raise(rng, tmp_path):
    root = two_real_nodes(tmp_path)
    banks = banks_for("q4_0", rng)
    before = proc_status()["Threads"]
    exs = [ce.CpuMoeExecutor("q4_0", banks, top_k=4, sysfs_root=root, numa=m) for m in ("split", "replicate")]
    for ex in exs:
        ex.decode(*step(rng, ex, 3))
        ex.start_coordinator()
    assert proc_status()["Threads"] >= before + 2 * (1 + 1)  # per executor: group 1's worker + the coordinator
    for ex in exs:
        ex.close()
        ex.close()
        assert ex.closed and ex.threads == 2 and ex.numa in ("split", "replicate")
        for call in (lambda e=ex: e.decode(*step(rng, e, 1)), ex.numa_report, lambda e=ex: e.layer_banks(0)):
            with pytest.raises(RuntimeError, match=r"CpuMoeExecutor\(.*\) is closed"):
                call()
    assert proc_status()["Threads"] == before


@pytest.mark.skipif(UNDER_TSAN, reason="ThreadSanitizer does not support threads in a forked child")
def test_forked_child_refuses_a_split_executor_and_builds_its_own(rng, tmp_path):
    root = two_real_nodes(tmp_path)
    banks = banks_for("q4_0", rng)
    ex = ce.CpuMoeExecutor("q4_0", banks, top_k=4, sysfs_root=root)
    s = step(rng, ex, 5, 1)
    want = bits(ex.decode(*s)).copy()

    def child():
        for call in (lambda: ex.decode(*s), ex.numa_report, lambda: ex.layer_banks(0)):
            with pytest.raises(RuntimeError, match=FORKED):
                call()
        ex.close()
        with ce.CpuMoeExecutor("q4_0", banks, top_k=4, sysfs_root=root) as mine:
            assert mine.numa == "split"
            np.testing.assert_array_equal(bits(mine.decode(*s)), want)

    assert in_os_fork(child) == "ok"
    np.testing.assert_array_equal(bits(ex.decode(*s)), want)
    ex.close()


def test_node_read_ceilings(rng, tmp_path):
    root = two_real_nodes(tmp_path)
    with ce.CpuMoeExecutor("bf16", banks_for("bf16", rng), top_k=2, sysfs_root=root) as ex:
        for g in (-1, 0, 1):
            bw = ex._x.node_read_bandwidth(1 << 20, 3, g)
            assert len(bw) == 3 and min(bw) > 0, (g, bw)
        with pytest.raises(IndexError):
            ex._x.node_read_bandwidth(1 << 20, 1, 2)
