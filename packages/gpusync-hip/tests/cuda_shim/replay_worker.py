"""One process of the HIP-on-CUDA replay test (tests/test_hip_on_cuda.py), run as

    GPUSYNC_HIP_LIBRARY=libhip_on_cuda.so HIPSHIM_MODE=<native|eager-capture> \\
        python replay_worker.py PATH REPLAYS

PATH is gpusync-hip's path choice (auto, copy-native, copy-splice). The worker opens HipSync on an
executor of 4 layers, captures ONE graph of the copy step on layers 0, 1 and 3 (layer 1's routes
all -1: the CPU answers zeros; layer 2 is skipped: no step, no doorbell, its output stays poisoned),
then REPLAYS times: fresh x/ids/w written into the same device buffers, outputs poisoned, replay,
bounded sync, compare bit for bit with CpuMoeExecutor.decode of the same inputs. Everything GPU-side
goes through the shim's HIP API (ctypes) and gpusync-hip; no torch. Prints one JSON line.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import numpy as np

import cpumoe_executor as ce
import cpumoe_formats as cf
import gpusync_hip

E, H, I, K, T, LAYERS = 8, 256, 64, 4, 4, 4
RINGING = (0, 1, 3)  # layers with a step in the graph (each rings the doorbell once per replay)
ALL_GPU = 1  # a ringing layer whose routes are all -1 (every expert GPU-resident): y must be exact zeros
SKIPPED = 2  # no step captured: no doorbell, its output buffer must keep the poison
POISON = 0x7FA1  # a bf16 NaN payload no decode produces
TIMEOUT_S = 10.0
CAPTURE_THREAD_LOCAL = 1


def main(path: str, replays: int) -> dict:
    lib = ctypes.CDLL(os.environ["GPUSYNC_HIP_LIBRARY"])  # the very library gpusync-hip dlopen'd
    vp, sz = ctypes.c_void_p, ctypes.c_size_t

    def hip(name, *args):
        rc = getattr(lib, name)(*args)
        if rc:
            raise RuntimeError(f"{name} failed: {lib.hipGetErrorName(rc)} ({rc})")

    lib.hipGetErrorName.restype = ctypes.c_char_p
    lib.hipMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
    lib.hipMalloc.argtypes = [ctypes.POINTER(vp), sz]
    lib.hipHostRegister.argtypes = [vp, sz, ctypes.c_uint]
    lib.hipHostUnregister.argtypes = [vp]
    for f in ("hipStreamBeginCapture", "hipGraphLaunch"):
        getattr(lib, f).argtypes = [vp, ctypes.c_int if f == "hipStreamBeginCapture" else vp]
    lib.hipStreamEndCapture.argtypes = [vp, ctypes.POINTER(vp)]
    lib.hipGraphInstantiate.argtypes = [ctypes.POINTER(vp), vp, vp, vp, sz]
    lib.hipStreamDestroy.argtypes = lib.hipGraphExecDestroy.argtypes = lib.hipGraphDestroy.argtypes = [vp]
    lib.hipFree.argtypes = [vp]

    rng = np.random.default_rng(20261129)
    banks = [cf.get_format("bf16").random_banks(E, H, I, rng) for _ in range(LAYERS)]
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=K, max_tokens=8, threads=2)
    sync = gpusync_hip.HipSync(ex, 0, path=path, qualify=False, timeout_s=TIMEOUT_S)
    out = {"path": sync.path, "mechanism": sync.mechanism, "summary": sync.summary()}
    if not sync.path.startswith("copy-"):
        raise RuntimeError(f"no copy path was proven: {sync.summary()}")
    iob, memop = sync._iob, dict(gpusync_hip._native.PATHS)["memop"]

    # One page-aligned, registered (pinned) host area for every staging buffer: async copies, bounded syncs.
    nx, nk = T * H * 2, T * K * 4
    per_layer = 2 * nx + 2 * nk
    raw = np.zeros(LAYERS * per_layer + nx + 2 * 4096, np.uint8)
    base = (-raw.ctypes.data) % 4096
    host = raw[base : base + LAYERS * per_layer + nx]
    hip("hipHostRegister", host.ctypes.data, host.nbytes, 0x3)  # Mapped | Portable

    def view(off, n, dtype, shape):
        return host[off : off + n].view(dtype).reshape(shape)

    hx = [view(l * per_layer, nx, cf.numerics.BF16, (T, H)) for l in range(LAYERS)]
    hy = [view(l * per_layer + nx, nx, np.uint16, (T, H)) for l in range(LAYERS)]
    hids = [view(l * per_layer + 2 * nx, nk, np.int32, (T, K)) for l in range(LAYERS)]
    hw = [view(l * per_layer + 2 * nx + nk, nk, np.float32, (T, K)) for l in range(LAYERS)]
    hpoison = view(LAYERS * per_layer, nx, np.uint16, (T, H))
    hpoison[:] = POISON

    def dalloc(n):
        p = vp()
        hip("hipMalloc", ctypes.byref(p), n)
        return p.value

    dx, dy, dids, dw = ([dalloc(n) for _ in range(LAYERS)] for n in (nx, nx, nk, nk))
    stream = vp()
    hip("hipStreamCreateWithFlags", ctypes.byref(stream), 1)
    s = stream.value

    def copy(dst, src, n):
        hip("hipMemcpyAsync", dst, src, n, 4, s)  # hipMemcpyDefault: unified addressing

    def fresh():
        for l in range(LAYERS):
            hx[l][:] = rng.standard_normal((T, H)).astype(np.float32).astype(cf.numerics.BF16)
            hw[l][:] = rng.random((T, K), np.float32) + 0.05
            ids = rng.integers(-1, E, (T, K), dtype=np.int32)
            ids[0, 0] = l % E  # at least one CPU route
            hids[l][:] = -1 if l == ALL_GPU else ids
            copy(dx[l], hx[l].ctypes.data, nx), copy(dids[l], hids[l].ctypes.data, nk)
            copy(dw[l], hw[l].ctypes.data, nk), copy(dy[l], hpoison.ctypes.data, nx)

    # ---- capture once ----
    fresh()
    assert iob.sync(s, TIMEOUT_S), "upload did not complete"
    graph, exe = vp(), vp()
    hip("hipStreamBeginCapture", s, CAPTURE_THREAD_LOCAL)
    try:
        for l in RINGING:
            iob.step(memop, s, l, T, dx[l], dids[l], dw[l], dy[l])
    finally:
        hip("hipStreamEndCapture", s, ctypes.byref(graph))
    hip("hipGraphInstantiate", ctypes.byref(exe), graph, None, None, 0)

    # ---- replay ----
    served0 = ex.health()["served"]
    mismatches, first_bad, t0 = 0, None, time.perf_counter()
    for r in range(replays):
        fresh()
        want = {l: ex.decode(l, hx[l], hw[l], hids[l]).view(np.uint16).copy() for l in RINGING}
        hip("hipGraphLaunch", exe, s)
        for l in range(LAYERS):
            copy(hy[l].ctypes.data, dy[l], nx)
        if not iob.sync(s, TIMEOUT_S):
            raise RuntimeError(
                f"replay {r}: the stream did not drain in {TIMEOUT_S} s (released); executor health {ex.health()}"
            )
        bad = [l for l in RINGING if not np.array_equal(hy[l], want[l])]
        bad += [l for l in (ALL_GPU,) if hy[l].any()]
        bad += [SKIPPED] if not (hy[SKIPPED] == POISON).all() else []
        if bad:
            mismatches += 1
            first_bad = first_bad or {"replay": r, "layers": sorted(set(bad))}
    elapsed = time.perf_counter() - t0
    words = iob.words
    out.update(
        replays=replays,
        mismatches=mismatches,
        first_bad=first_bad,
        served=ex.health()["served"] - served0,
        expected_served=replays * len(RINGING),
        ready=iob.load_word(words["ready"]),
        done=iob.load_word(words["done"]),
        signal=words["signal"],
        error=ex.health()["error"],
        us_per_replay=round(elapsed / max(replays, 1) * 1e6, 1),
        param_entries=iob.param_entries,
        event_count=iob.event_count,
    )

    # The kernel path's image is a HIP code-object bundle: the CUDA driver behind the shim cannot
    # load it, so kernelio reports that and the copy path is what runs (no crash, no silent use).
    try:
        import kernelio

        out["kernel_probe"] = kernelio.probe(gpusync_hip.C_API_CAPSULE, sync._dev.handle, timeout_s=TIMEOUT_S)
    except ImportError as e:
        out["kernel_probe"] = f"skipped: {e}"
    # gpusync-hip consumes the errors its own calls create (the failed module load included)
    out["pending_error"] = lib.hipPeekAtLastError()

    out["shim"] = None  # a HIP runtime other than the shim (e.g. the fake one, for a CPU dry run) has no counters
    if hasattr(lib, "hipshim_stats"):
        stats = (ctypes.c_long * 8)()
        lib.hipshim_stats(stats)
        out["shim"] = dict(
            zip(
                (
                    "memops_captured",
                    "memops_eager",
                    "eager_waits_unsatisfied",
                    "batch_nodes",
                    "external_records",
                    "release_events",
                    "host_funcs",
                    "signal_allocs",
                ),
                stats,
            )
        )
    hip("hipGraphExecDestroy", exe), hip("hipGraphDestroy", graph)
    for p in dx + dy + dids + dw:
        hip("hipFree", p)
    hip("hipStreamDestroy", s)
    hip("hipHostUnregister", host.ctypes.data)
    sync.close()
    ex.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))), flush=True)
