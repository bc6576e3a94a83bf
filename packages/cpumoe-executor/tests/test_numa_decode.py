"""numa='split' and 'replicate' results on fake NUMA topologies (real CPUs split across fake nodes), every format,
every ISA tier forced (CPUMOE_ISA), batch 1 and 8, two layers:
- replicate is the single pool's bits (the same items on a copy of the banks per node);
- split is, bit for bit, the single pool summing the same slices in split's order (NumaPlan.on_one_group(): one
  group running every slice), whatever the groups, their threads and team sizes; and it stays within the format's
  own tolerance of the float64 reference (test_decode.REL_TOL), as the single pool does (docs/numa.md);
- one slice (numa='split' on one node) is the single pool's bits."""
import numpy as np
import pytest
from conftest import ACT, FORMATS, SHAPES, bits, fake_sysfs, routing, two_real_nodes
from test_decode import REL_TOL

import cpumoe_executor as ce
import cpumoe_formats as cf
from cpumoe_executor import _native, numa, numa_banks

# I a multiple of fp8_block's 128-row blocks (its executor SHAPES are ragged: split refuses those, tested below)
NUMA_SHAPES = {**SHAPES, "fp8_block": (259, 256), "fp8_block_x16": (272, 256)}
MEM = (64 << 20, 60 << 20)


def layers(fmt, rng, n=2, E=6):
    spec = cf.get_format(fmt)
    H, I = NUMA_SHAPES.get(fmt, (spec.k_multiple * 2, spec.k_multiple * 2))  # noqa: E741 - two slices of I
    return [spec.random_banks(E, H, I, rng) for _ in range(n)], (E, H, I)


def steps(ex, rng, T):
    for layer in range(ex.num_layers):
        x = rng.standard_normal((T, ex.H)).astype(np.float32)
        yield (layer, x, *routing(rng, T, ex.top_k, ex.E))


def rel(y, ref):
    return np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_split_and_replicate_every_tier(fmt, rng, tmp_path, monkeypatch):
    root = two_real_nodes(tmp_path)
    banks, (E, H, I) = layers(fmt, rng)
    act = ACT.get(fmt, {})
    kw = dict(top_k=4, max_tokens=8, **act)
    seen = set()
    for tier in cf.usable_tiers():
        monkeypatch.setenv("CPUMOE_ISA", tier)
        with ce.CpuMoeExecutor(fmt, banks, threads=2, numa="off", **kw) as off:
            if (off.spec.name, off.isa) in seen:
                continue  # this tier runs the kernel a lower one ran
            seen.add((off.spec.name, off.isa))
            rep = ce.CpuMoeExecutor(fmt, banks, sysfs_root=root, numa="replicate", **kw)
            assert (rep.numa, rep.spec.name, rep.isa) == ("replicate", off.spec.name, off.isa)
            splittable = isinstance(numa_banks.cut_unit(off.spec, I), int)
            if splittable:
                sp = ce.CpuMoeExecutor(fmt, banks, sysfs_root=root, **kw)  # auto: two nodes with workers
                one = ce.CpuMoeExecutor(fmt, banks, numa=sp.numa_plan.on_one_group(), **kw)
                assert sp.numa == "split" and len(sp.numa_plan.groups) == 2 and sp.numa_plan.bounds[-1] == I
                assert one._x.num_groups == 1 and one._x.num_parts == 2
            else:
                with pytest.warns(RuntimeWarning, match="numa='split' is unavailable"):
                    auto = ce.CpuMoeExecutor(fmt, banks, sysfs_root=root, **kw)
                assert auto.numa == "off"
                auto.close()
                with pytest.raises(ValueError, match="numa='split'.*expected numa='replicate'"):
                    ce.CpuMoeExecutor(fmt, banks, sysfs_root=root, numa="split", **kw)
            for T in (1, 8):
                for layer, x, w, ids in steps(off, rng, T):
                    y = off.decode(layer, x, w, ids)
                    ctx = f"tier={tier} T={T} layer={layer}"
                    np.testing.assert_array_equal(bits(rep.decode(layer, x, w, ids)), bits(y), err_msg=ctx)
                    if splittable:
                        ys = sp.decode(layer, x, w, ids)
                        np.testing.assert_array_equal(bits(ys), bits(one.decode(layer, x, w, ids)), err_msg=ctx)
                        ref = cf.reference.moe(fmt, banks[layer], x, w, ids, **act)
                        assert rel(ys, ref) < REL_TOL[fmt], (ctx, rel(ys, ref), rel(y, ref))
            rep.close()
            if splittable:
                sp.close(), one.close()


def test_split_bits_do_not_depend_on_threads_or_teams(rng):
    banks, (E, H, I) = layers("q4_0", rng, E=8)
    cpus = list(_native.allowed_cpus())
    a, b = cpus[0], cpus[-1]
    bounds = (0, 32, I)
    plans = [numa.NumaPlan("split", (numa.Group(0, (a,), (0,)), numa.Group(1, (b,), (1,))), bounds),
             numa.NumaPlan("split", (numa.Group(0, (a, a, b), (0,)), numa.Group(1, (b,), (1,))), bounds),
             numa.NumaPlan("split", (numa.Group(1, (b, b), (1,)), numa.Group(0, (a,), (0,))), bounds),
             numa.NumaPlan("split", (numa.Group(0, (a, b, a, b), (0, 1)),), bounds)]
    exs = [ce.CpuMoeExecutor("q4_0", banks, top_k=4, max_tokens=8, numa=p) for p in plans]
    for T in (1, 3, 8):
        for layer, x, w, ids in steps(exs[0], rng, T):
            want = None
            for ex in exs:
                for unit in (0, 1 << 16, 1 << 40):  # every thread, sized teams, the caller alone
                    _native.set_team_unit(ex.handle, unit)
                    y = bits(ex.decode(layer, x, w, ids))
                    want = y if want is None else want
                    np.testing.assert_array_equal(y, want, err_msg=f"{ex.numa_plan} unit={unit} T={T}")
    for ex in exs:
        ex.close()


def test_four_nodes_and_uneven_slices(rng):
    banks, (E, H, I) = layers("q4_0", rng)
    I4 = 128
    banks = [cf.get_format("q4_0").random_banks(6, H, I4, rng) for _ in range(2)]
    cpus = list(_native.allowed_cpus())
    c = [cpus[i % len(cpus)] for i in range(4)]
    for bounds in (numa.cut_bounds(I4, 32, [1, 1, 1, 1]), (0, 32, 64, 96, 128), (0, 64, 96, 128)):
        groups = tuple(numa.Group(k, (c[k],), (k,)) for k in range(len(bounds) - 1))
        plan = numa.NumaPlan("split", groups, bounds)
        with ce.CpuMoeExecutor("q4_0", banks, top_k=4, numa=plan) as sp, \
                ce.CpuMoeExecutor("q4_0", banks, top_k=4, numa=plan.on_one_group()) as one:
            assert sp._x.num_groups == len(bounds) - 1
            for T in (1, 8):
                for layer, x, w, ids in steps(sp, rng, T):
                    y = sp.decode(layer, x, w, ids)
                    np.testing.assert_array_equal(bits(y), bits(one.decode(layer, x, w, ids)))
                    assert rel(y, cf.reference.moe("q4_0", banks[layer], x, w, ids)) < REL_TOL["q4_0"]


def test_one_slice_is_the_single_pool_and_a_cpuless_node_gets_no_group(rng, tmp_path):
    banks, (E, H, I) = layers("bf16", rng)
    cpus = list(_native.allowed_cpus())
    one_node = fake_sysfs(tmp_path / "one", {0: (",".join(map(str, cpus)), *MEM)})
    with ce.CpuMoeExecutor("bf16", banks, top_k=4, threads=2, numa="off") as off, \
            ce.CpuMoeExecutor("bf16", banks, top_k=4, threads=2, sysfs_root=one_node, numa="split") as sp:
        assert sp.numa == "split" and sp.numa_plan.bounds == (0, I) and sp._x.num_parts == 1
        for T in (1, 8):
            for layer, x, w, ids in steps(off, rng, T):
                np.testing.assert_array_equal(bits(sp.decode(layer, x, w, ids)), bits(off.decode(layer, x, w, ids)))
    if len(cpus) < 2:
        pytest.skip("needs two usable CPUs")
    three = fake_sysfs(tmp_path / "three", {0: (str(cpus[0]), *MEM), 1: ("", *MEM), 2: (str(cpus[1]), *MEM)})
    with ce.CpuMoeExecutor("bf16", banks, top_k=4, sysfs_root=three) as sp:
        assert [g.node for g in sp.numa_plan.groups] == [0, 2]  # node 1 holds memory only
        assert [n["id"] for n in sp.numa_report()["nodes"]] == [0, 1, 2]
        assert {r["node"] for r in sp.numa_report()["placements"]} == {0, 2}


def test_auto_stays_the_single_pool_on_one_node(rng, tmp_path):
    banks, _ = layers("bf16", rng)
    root = fake_sysfs(tmp_path, {0: (",".join(map(str, _native.allowed_cpus())), *MEM)})
    with ce.CpuMoeExecutor("bf16", banks, top_k=4, sysfs_root=root) as ex:
        assert ex.numa == "off" and ex.numa_plan is None and ex.numa_report()["placements"] == []
        assert ex.layer_banks(0)["down"] is ex._arrays[0][1]  # the given arrays, in place
