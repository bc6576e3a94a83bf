"""NUMA topology from a sysfs tree (fake_sysfs: any machine) and the plan built on it: which CPUs each group gets
(physical cores, affinity, online, cgroup limit, memory-only nodes) and which I rows each slice takes."""
import os
import warnings

import pytest
from conftest import GB_KB, fake_sysfs

from cpumoe_executor import _native, numa

BIG = (64 * GB_KB, 60 * GB_KB)


def machine(tmp_path, nodes, **kw):
    return numa.topology(fake_sysfs(tmp_path, {k: (v, *BIG) for k, v in nodes.items()}, **kw))


def test_topology_reads_nodes_cpus_memory_and_online(tmp_path):
    t = numa.topology(fake_sysfs(tmp_path, {0: ("0-3", 1000, 600), 1: ("4-7", 2000, 100), 2: ("", 512, 512)},
                                 online="0-2,4-7"))
    assert [n.id for n in t.nodes] == [0, 1, 2]
    assert t.nodes[0].cpus == (0, 1, 2)  # cpu 3 offline
    assert t.nodes[1].cpus == (4, 5, 6, 7)
    assert t.nodes[2].cpus == ()  # memory only
    assert (t.nodes[1].mem_total, t.nodes[1].mem_free) == (2000 * 1024, 100 * 1024)
    assert t.node_of(5) == 1 and t.node_of(3) is None


def test_root_from_the_environment_and_no_node_directory(tmp_path, monkeypatch):
    root = fake_sysfs(tmp_path / "a", {0: ("0", *BIG), 1: ("1", *BIG)})
    monkeypatch.setenv(numa.SYSFS_ENV, root)
    assert numa.topology().root == root and len(numa.topology().nodes) == 2
    flat = tmp_path / "b" / "devices/system/cpu"
    flat.mkdir(parents=True)
    (flat / "online").write_text("0-5\n")
    t = numa.topology(str(tmp_path / "b"))  # a kernel without NUMA: one node 0 with every online CPU
    assert [(n.id, n.cpus, n.mem_free) for n in t.nodes] == [(0, tuple(range(6)), -1)]


def test_two_nodes_physical_cores_interleaved(tmp_path):
    # 2 nodes x 4 cores x 2 SMT threads: cpu c and c + 8 are siblings
    sib = {c: f"{c % 8},{c % 8 + 8}" for c in range(16)}
    t = machine(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, siblings=sib)
    by, why = numa.select_cores(t, allowed=range(16), limit=0)
    assert by == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]} and "8 physical cores on 2 nodes" in why
    by, _ = numa.select_cores(t, threads=4, allowed=range(16), limit=0)
    assert by == {0: [0, 1], 1: [4, 5]}  # each node its share, not node 0's first four
    by, _ = numa.select_cores(t, threads=12, allowed=range(16), limit=0)
    assert sorted(by[0]) == [0, 1, 2, 3, 8, 9] and sorted(by[1]) == [4, 5, 6, 7, 12, 13]  # then the siblings


def test_affinity_cgroup_and_offline_cpus(tmp_path):
    t = machine(tmp_path, {0: "0-3", 1: "4-7"}, online="0-6")
    by, _ = numa.select_cores(t, allowed=[1, 2, 4, 5, 6, 7], limit=0)  # 7 offline: gone from the node
    assert by == {0: [1, 2], 1: [4, 5, 6]}
    by, why = numa.select_cores(t, allowed=range(8), limit=4)  # the cgroup cap is spread over the nodes
    assert by == {0: [0, 1], 1: [4, 5]} and "capped to 4 by the cgroup CPU limit" in why
    with pytest.warns(RuntimeWarning, match="threads=9 is more than the 4 CPUs"):
        by, _ = numa.select_cores(t, threads=9, allowed=range(8), limit=4)
    assert sum(map(len, by.values())) == 4
    cg = fake_sysfs(tmp_path / "cg", {0: ("0-3", *BIG), 1: ("4-7", *BIG)}, cpu_max="300000 100000")
    by, _ = numa.select_cores(numa.topology(cg), allowed=range(8))  # the limit read from the root's fs/cgroup
    assert sum(map(len, by.values())) == 3


def test_core_ids_grouped_by_node_caller_node_first(tmp_path):
    t = machine(tmp_path, {0: "0-3", 1: "4-7"})
    by, why = numa.select_cores(t, core_ids=[5, 1, 5, 6])
    assert list(by) == [1, 0] and by == {1: [5, 5, 6], 0: [1]} and why == "core_ids given"
    with pytest.raises(ValueError, match="core 9 is on no NUMA node"):
        numa.select_cores(t, core_ids=[9])


def test_plan_split_two_nodes_uneven_cpus(tmp_path):
    t = machine(tmp_path, {0: "0-5", 1: "6-7"})
    p = numa.plan(None, 768, 32, topo=t, allowed=range(8), limit=0)
    assert p.mode == "split"
    assert [(g.node, g.cores, g.parts) for g in p.groups] == [(0, (0, 1, 2, 3, 4, 5), (0,)), (1, (6, 7), (1,))]
    assert p.bounds == (0, 576, 768)  # rows by workers: 6 : 2, at multiples of 32
    assert p.parts == [(0, 576), (576, 768)] and p.cores == list(range(8))


def test_plan_four_nodes_and_a_memory_only_node(tmp_path):
    t = machine(tmp_path, {0: "0-1", 1: "2-3", 2: "", 3: "4-5", 4: "6-7"})
    p = numa.plan("split", 2880, 32, topo=t, allowed=range(8), limit=0)
    assert [g.node for g in p.groups] == [0, 1, 3, 4]  # node 2 has no CPU: no group
    assert p.bounds == (0, 704, 1440, 2176, 2880) and all(b % 32 == 0 for b in p.bounds[:-1])
    r = numa.plan("replicate", 2880, 32, topo=t, allowed=range(8), limit=0)
    assert r.bounds == (0, 2880) and [g.parts for g in r.groups] == [(0,)] * 4
    one = p.on_one_group()
    assert len(one.groups) == 1 and one.groups[0].parts == (0, 1, 2, 3) and one.bounds == p.bounds
    assert one.groups[0].cores == tuple(p.cores)


def test_plan_auto_off_on_one_node_or_where_the_format_cannot_be_cut(tmp_path):
    one = machine(tmp_path / "one", {0: "0-7"})
    assert numa.plan(None, 768, 32, topo=one, allowed=range(8), limit=0).mode == "off"
    two = machine(tmp_path / "two", {0: "0-3", 1: "4-7"})
    assert numa.plan(None, 768, 32, topo=two, allowed=range(4), limit=0).mode == "off"  # mask on node 0 only
    why = "format 'ds_fp4' rounds each route's whole down term to bf16"
    with pytest.warns(RuntimeWarning, match="numa='replicate' places a full copy"):
        assert numa.plan(None, 768, why, topo=two, allowed=range(8), limit=0).mode == "off"
    with pytest.raises(ValueError, match="numa='split': format 'ds_fp4' rounds.*expected numa='replicate'"):
        numa.plan("split", 768, why, topo=two, allowed=range(8), limit=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert numa.plan("replicate", 768, why, topo=two, allowed=range(8), limit=0).mode == "replicate"
    with pytest.raises(ValueError, match="I=32 has fewer than 2 slices of 32 rows"):
        numa.plan("split", 32, 32, topo=two, allowed=range(8), limit=0)
    with pytest.raises(ValueError, match="numa='half'"):
        numa.plan("half", 768, 32, topo=two)


@pytest.mark.parametrize("I,unit,weights", [(768, 32, [1, 1]), (40, 1, [1, 1]), (2880, 32, [3, 1, 1, 5]),
                                            (256, 128, [1, 7]), (48, 16, [1, 1, 1]), (131, 1, [2, 1])])
def test_cut_bounds_rise_at_unit_multiples_and_end_at_I(I, unit, weights):  # noqa: E741
    b = numa.cut_bounds(I, unit, weights)
    assert b[0] == 0 and b[-1] == I and len(b) == len(weights) + 1
    assert all(x < y for x, y in zip(b, b[1:])) and all(x % unit == 0 for x in b[1:-1])


def test_check_plan_names_what_is_wrong():
    g = numa.Group(0, (0,), (0,))
    with pytest.raises(ValueError, match="bounds \\[0, 30, 64\\]: cuts must be multiples of 32"):
        numa.check_plan(numa.NumaPlan("split", (g, numa.Group(1, (0,), (1,))), (0, 30, 64)), 64, 32, {0})
    with pytest.raises(ValueError, match="rising"):
        numa.check_plan(numa.NumaPlan("split", (g,), (0, 32, 32, 64)), 64, 32, {0})
    with pytest.raises(ValueError, match="parts \\[1\\] are run by no group"):
        numa.check_plan(numa.NumaPlan("split", (g,), (0, 32, 64)), 64, 32, {0})
    with pytest.raises(ValueError, match="group 0: cores \\[5\\] must be non-empty and in the affinity mask"):
        numa.check_plan(numa.NumaPlan("split", (numa.Group(0, (5,), (0,)),), (0, 64)), 64, 32, {0})
    with pytest.raises(ValueError, match="cuts I into 2 parts but format"):
        numa.check_plan(numa.NumaPlan("split", (numa.Group(0, (0,), (0, 1)),), (0, 32, 64)), 64,
                        "format 'ds_fp4' rounds", {0})


@pytest.mark.parametrize("text, cpus", [("0-3,8,10-11\n", [0, 1, 2, 3, 8, 10, 11]), ("0", [0]), ("", []), ("\n", []),
                                        ("x,2-3", [2, 3]), ("5-", [5]), ("3-1", []), ("0-15\n", list(range(16)))])
def test_cpulist_text_as_sysfs_writes_it_and_malformed(text, cpus):
    assert list(_native.parse_cpulist(text)) == cpus


@pytest.mark.parametrize("files, limit", [
    ({"fs/cgroup/cpu.max": "max 100000\n"}, 0), ({"fs/cgroup/cpu.max": "300000 100000\n"}, 3),
    ({"fs/cgroup/cpu.max": "150000 100000"}, 2), ({"fs/cgroup/cpu.max": "garbage\n"}, 0),
    ({"fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n", "fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"}, 0),
    ({"fs/cgroup/cpu/cpu.cfs_quota_us": "50000\n", "fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"}, 1),
    ({}, 0)])
def test_cgroup_limit_v2_v1_missing_and_malformed(tmp_path, files, limit):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert _native.cgroup_cpu_limit(str(tmp_path)) == limit


def test_nodes_with_missing_meminfo_and_stray_entries(tmp_path):
    root = fake_sysfs(tmp_path, {0: ("0-1", *BIG), 2: ("", *BIG)})
    os.remove(os.path.join(root, "devices/system/node/node2/meminfo"))
    for stray in ("has_cpu", "possible", "nodeX", "node"):
        open(os.path.join(root, "devices/system/node", stray), "w").close()
    t = numa.topology(root)
    assert [(n.id, n.cpus, n.mem_total) for n in t.nodes] == [(0, (0, 1), BIG[0] * 1024), (2, (), -1)]
