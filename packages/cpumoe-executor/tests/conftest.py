"""Executor test machinery: fresh random banks per format, fresh routing."""
from __future__ import annotations

import os

import numpy as np
import pytest

import cpumoe_executor as ce
import cpumoe_formats as cf
from cpumoe_executor import _native

# Formats with kernels in this build (all six once cpumoe-formats is complete).
FORMATS = [n for n, s in cf.FORMATS.items() if s.banks]

# Small shapes per format that satisfy its divisibility, with ragged sizes where allowed.
SHAPES = {"bf16": (96, 40), "fp8_block": (259, 131), "nvfp4": (96, 48), "mxfp4": (96, 64), "ds_fp4": (256, 128),
          "q4_0": (96, 64), "mxfp4_panel": (96, 64),  # mxfp4_panel: H = 96 is 1.5 panels
          "q4_0_x16": (96, 64),  # 6 and 8 groups of 16 rows
          "fp8_block_x16": (272, 144),  # 17 and 18 groups, partial 128-blocks; fp8_block's (259, 131) stays as given
          "nvfp4_x16": (80, 48),  # 5 and 6 groups of 16 rows, 5 and 3 blocks (partial 4-block chunks)
          "ds_fp4_x16": (256, 128),  # 16 and 16 groups of 16 rows
          "bf16_x16": (96, 48),  # 6 and 3 + 3 groups; bf16's (96, 40) stays as given
          "mxfp4_x16": (96, 64)}  # 6 and 4 + 4 groups of 16 rows
ACT = {"mxfp4": dict(activation="swigluoai", alpha=1.702, limit=7.0),
       "mxfp4_panel": dict(activation="swigluoai", alpha=1.702, limit=7.0),
       "mxfp4_x16": dict(activation="swigluoai", alpha=1.702, limit=7.0),
       "ds_fp4": dict(activation="swiglu_clamp", alpha=1.0, limit=10.0),
       "ds_fp4_x16": dict(activation="swiglu_clamp", alpha=1.0, limit=10.0)}


@pytest.fixture
def rng():
    seed = int(os.environ.get("CPUMOE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"CPUMOE_TEST_SEED={seed}")
    return np.random.default_rng(seed)


def make_banks(fmt, rng, layers=2, E=6):
    spec = cf.get_format(fmt)
    H, I = SHAPES.get(fmt, (spec.k_multiple * 2, spec.k_multiple))  # noqa: E741
    return [spec.random_banks(E, H, I, rng) for _ in range(layers)], (E, H, I)


def ran_banks(ex, banks):
    """The banks in the format the executor runs (its repack into a CPU layout, or the given ones), for references."""
    if ex.spec.name == ex.given_format:
        return banks
    return [cf.get_format(ex.given_format).to_layout(b, ex.spec.name) for b in banks]


def reference(ex, banks, layer, x, w, ids, **kw):
    """cf.moe_forward of the format the executor runs (its CPU layout when it repacked), on those banks."""
    return cf.moe_forward(ex.spec.name, ran_banks(ex, banks)[layer], x, w, ids, mode=ex.mode, **kw)


def workers(n):
    """Executor kwargs for n workers: threads=n where this process may use n CPUs, else core_ids cycling the allowed
    CPUs (several workers on one core on purpose; threads=n would be clamped with a warning)."""
    if n <= ce.usable_cpus():
        return dict(threads=n)
    cpus = list(_native.allowed_cpus())
    return dict(core_ids=[cpus[i % len(cpus)] for i in range(n)])


def routing(rng, T, K, E, dup=True, skip=True):
    ids = rng.integers(0, E, size=(T, K)).astype(np.int32)
    if dup and K > 1:
        ids[0, 1] = ids[0, 0]
    if skip and T > 1:
        ids[-1, 0] = -1
    w = (rng.random((T, K), dtype=np.float32) + 0.05).astype(np.float32)
    return w, ids


def bits(a):
    return np.asarray(a).view(np.uint16)


def run_concurrently(ex, check, n: int, reps: int = 20) -> None:
    """n threads each calling check(i) reps times on `ex` (closed after them); the first error any raised is re-raised
    here."""
    import threading

    errors = []

    def run(i):
        try:
            for _ in range(reps):
                check(i)
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    with ex:
        ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    if errors:
        raise errors[0]


def executor_kwargs(fmt, **kw):
    """CpuMoeExecutor kwargs for `fmt`'s tests: its activation, top_k 4, max_tokens 8 and 2 workers unless kw
    says otherwise."""
    placed = {"threads", "core_ids"} & kw.keys()
    return {"top_k": 4, "max_tokens": 8, **({} if placed else workers(2)), **ACT.get(fmt, {}), **kw}


def executor_for(fmt, rng, layers=2, **kw):
    """(executor, banks, (E, H, I)): `fmt` on fresh random banks of its small test shape (executor_kwargs)."""
    banks, dims = make_banks(fmt, rng, layers=layers)
    return ce.CpuMoeExecutor(fmt, banks, **executor_kwargs(fmt, **kw)), banks, dims


def step_inputs(rng, ex, T):
    """(x float32 [T, H], topk_weights, topk_ids) for one step of `ex` (routing(): a duplicate and a -1 route)."""
    x = rng.standard_normal((T, ex.H)).astype(np.float32)
    return (x, *routing(rng, T, ex.top_k, ex.E))


# ThreadSanitizer does not follow a multi-threaded process into a forked child that starts threads.
UNDER_TSAN = "tsan" in os.environ.get("LD_PRELOAD", "")
# AddressSanitizer keeps freed memory in its quarantine (256 MB by default): RSS says nothing about leaks there.
UNDER_ASAN = "asan" in os.environ.get("LD_PRELOAD", "")


def fake_sysfs(root, nodes: dict, online: str | None = None, siblings: dict | None = None,
               cpu_max: str | None = None) -> str:
    """A sysfs tree under `root` describing a machine (numa.topology reads it): nodes = {id: (cpulist, MemTotal kB,
    MemFree kB)} (cpulist "" for a memory-only node), online = devices/system/cpu/online (default: every listed CPU),
    siblings = {cpu: thread_siblings_list}, cpu_max = fs/cgroup/cpu.max ("200000 100000": 2 CPUs). Returns root."""
    root = str(root)
    for nid, (cpus, total, free) in nodes.items():
        d = os.path.join(root, "devices/system/node", f"node{nid}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "cpulist"), "w") as f:
            f.write(cpus + "\n")
        with open(os.path.join(d, "meminfo"), "w") as f:
            f.write(f"Node {nid} MemTotal:       {total} kB\nNode {nid} MemFree:        {free} kB\n"
                    f"Node {nid} MemUsed:        {total - free} kB\n")
    cpu = os.path.join(root, "devices/system/cpu")
    os.makedirs(cpu, exist_ok=True)
    if online is None:
        listed = sorted(c for cpus, _, _ in nodes.values() for c in _native.parse_cpulist(cpus))
        online = ",".join(map(str, listed))
    with open(os.path.join(cpu, "online"), "w") as f:
        f.write(online + "\n")
    for c, sib in (siblings or {}).items():
        os.makedirs(os.path.join(cpu, f"cpu{c}", "topology"), exist_ok=True)
        with open(os.path.join(cpu, f"cpu{c}", "topology", "thread_siblings_list"), "w") as f:
            f.write(sib + "\n")
    if cpu_max is not None:
        os.makedirs(os.path.join(root, "fs/cgroup"), exist_ok=True)
        with open(os.path.join(root, "fs/cgroup/cpu.max"), "w") as f:
            f.write(cpu_max + "\n")
    return root


GB_KB = 1 << 20  # kB in a GiB, for fake_sysfs' meminfo


def two_real_nodes(tmp_path, free_kb: int = 64 * GB_KB) -> str:
    """A fake sysfs splitting this machine's first two usable CPUs across nodes 0 and 1 (the executor's groups then
    run on real CPUs; mbind for node 1 fails where the host has one node, and the report says so)."""
    cpus = list(_native.allowed_cpus())[:2]
    if len(cpus) < 2:
        pytest.skip("needs two usable CPUs")
    return fake_sysfs(tmp_path, {0: (str(cpus[0]), 2 * free_kb, free_kb), 1: (str(cpus[1]), 2 * free_kb, free_kb)})
