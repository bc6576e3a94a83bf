"""gpusync-hip's control logic on a real GPU without an AMD one: cuda_shim/hip_on_cuda.cpp exports
every HIP entry point gpusync-hip resolves (csrc/hip_types.h) on top of the CUDA driver, and
GPUSYNC_HIP_LIBRARY loads it in place of libamdhip64.

CPU (run by `nox -s test-rocm` everywhere): the shim compiles with g++ against hip_types.h and
cuda_types.h, exports exactly the entry-point list, its signatures match (static_asserts), its local
CUDA structs match cuda.h where one is installed, and without a CUDA driver it reports "no device"
through gpusync-hip instead of crashing.

NVIDIA GPU (marked cuda; skipped with the reason elsewhere): for each path, one process
(cuda_shim/replay_worker.py) captures a graph of 4 layers (3 ringing, one of them with every route
GPU-resident, 1 skipped) once and replays it REPLAYS times with fresh inputs, bit-identical to
CpuMoeExecutor.decode:
  * native memops (HIPSHIM_MODE=native: CUDA records memops under capture, like HIP >= 10);
  * spliced batch-memop nodes, chosen by gpusync-hip's own probe because HIPSHIM_MODE=eager-capture
    executes memops at once and records nothing under capture (ROCm < 10);
  * spliced nodes forced on the native runtime;
each a copy path with its system-release event recorded as an external event node. The kernel path
cannot run (kernelio's image is an AMD code-object bundle): kernelio's probe reports it and the copy
path is what runs. And HipSync driven through torch (cuda_shim/split_worker.py, needs torch with CUDA):
submit -> a torch op on the same stream -> finish equals decode() bit for bit, eagerly and in one
torch.cuda graph replayed HIPSHIM_SPLIT_REPLAYS (24) times with fresh inputs and residency masks, native
memops and spliced nodes, with and without HipSync's start-up qualification.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SHIM_DIR = HERE / "cuda_shim"
HIP_CSRC = HERE.parent / "csrc"
CUDA_CSRC = HERE.parent.parent / "gpusync-cuda" / "csrc"  # cuda_types.h, from the monorepo checkout
REPLAYS = int(os.environ.get("HIPSHIM_REPLAYS", "1000"))
WORKER_TIMEOUT_S = float(os.environ.get("HIPSHIM_WORKER_TIMEOUT_S", "150"))


def _cxx() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")


def build_shim(out_dir: Path) -> Path:
    cxx = _cxx()
    if cxx is None or not (HIP_CSRC / "hip_types.h").is_file() or not (CUDA_CSRC / "cuda_types.h").is_file():
        pytest.skip(
            "needs g++ and the monorepo checkout (gpusync-hip/csrc/hip_types.h, gpusync-cuda/csrc/cuda_types.h)"
        )
    out = out_dir / "libhip_on_cuda.so"
    cmd = [
        cxx,
        "-std=c++17",
        "-O2",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        "-Wall",
        "-Wextra",
        "-Werror",
        f"-I{HIP_CSRC}",
        f"-I{CUDA_CSRC}",
        "-o",
        str(out),
        str(SHIM_DIR / "hip_on_cuda.cpp"),
        "-ldl",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
    return out


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    return build_shim(tmp_path_factory.mktemp("hipshim"))


def entry_points() -> list[str]:
    text = (HIP_CSRC / "hip_types.h").read_text()
    block = text[text.index("#define GPUSYNC_HIP_ENTRY_POINTS") :]
    block = block[: block.index("}  // namespace hip")]
    return re.findall(r"X\((\w+),\s*(?:true|false)\)", block)


def run_py(code: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("HIPSHIM_")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=timeout)


# ---- CPU: the shim itself ------------------------------------------------------------------------------
def test_shim_exports_exactly_the_entry_points(shim):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    syms = subprocess.run([nm, "-D", "--defined-only", str(shim)], capture_output=True, text=True, check=True).stdout
    exported = {ln.split()[-1] for ln in syms.splitlines() if " T " in ln}
    wanted = set(entry_points())
    assert len(wanted) >= 40, wanted
    assert wanted <= exported, f"missing: {sorted(wanted - exported)}"
    assert {s for s in exported if s.startswith("hip")} - wanted == {"hipshim_stats", "hipshim_status"}


def test_shim_cuda_structs_match_cuda_h():
    """The shim declares CUDA's batch-memop and host-node structs and flags itself (cuda_shim/cuda_extra.h:
    no CUDA toolkit needed to build it); where cuda.h is installed, cuda_check.cpp asserts them against it."""
    roots = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))]
    inc = next((f"{r}/include" for r in roots if r and Path(f"{r}/include/cuda.h").is_file()), None)
    if inc is None or _cxx() is None or not (CUDA_CSRC / "cuda_types.h").is_file():
        pytest.skip("needs cuda.h (CUDA_HOME or /usr/local/cuda), g++ and the monorepo checkout")
    cmd = [
        _cxx(),
        "-std=c++17",
        "-fsyntax-only",
        "-Wall",
        "-Werror",
        f"-I{inc}",
        f"-I{CUDA_CSRC}",
        str(SHIM_DIR / "cuda_check.cpp"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"


def test_shim_without_a_driver_reports_no_device(shim):
    # this machine may have a GPU: point the shim at a driver library that is not there
    r = run_py(
        f"""
import ctypes
lib = ctypes.CDLL({str(shim)!r})
n = ctypes.c_int(-1)
msg = ctypes.create_string_buffer(512)
print(lib.hipGetDeviceCount(ctypes.byref(n)), lib.hipPeekAtLastError(), lib.hipGetLastError(), lib.hipGetLastError(),
      lib.hipshim_status(msg, 512), msg.value.decode())
""",
        {"HIPSHIM_LIBCUDA": "libcuda_absent.so.1"},
    )
    assert r.returncode == 0, r.stderr
    rc, peek, last, again, status, msg = r.stdout.split(maxsplit=5)
    # hipErrorNoDevice, kept as the thread's last error until hipGetLastError consumes it
    assert (rc, peek, last, again, status) == ("100", "100", "100", "0", "1"), r.stdout
    assert "dlopen(libcuda_absent.so.1) failed" in msg


def test_gpusync_hip_on_the_shim_without_a_driver_stays_eager(shim):
    pytest.importorskip("gpusync_hip")
    r = run_py(
        """
import gpusync_hip
st = gpusync_hip.driver_status()
print(st["loaded"], st["initialized"]); print(st["error"])
""",
        {"GPUSYNC_HIP_LIBRARY": str(shim), "HIPSHIM_LIBCUDA": "libcuda_absent.so.1"},
    )
    assert r.returncode == 0, r.stderr
    flags, err = r.stdout.split("\n", 1)
    assert flags.split() == ["True", "False"], r.stdout  # every entry point resolved; no device behind them
    assert "no usable HIP device" in err


def test_shim_rejects_an_unknown_mode(shim):
    r = run_py(
        f"""
import ctypes
lib = ctypes.CDLL({str(shim)!r})
msg = ctypes.create_string_buffer(512)
lib.hipshim_status(msg, 512); print(msg.value.decode())
""",
        {"HIPSHIM_MODE": "sometimes"},
    )
    assert r.returncode == 0, r.stderr
    assert "HIPSHIM_MODE=sometimes: expected native or eager-capture" in r.stdout or "dlopen(" in r.stdout


# ---- CPU: the replay harness itself, on the fake HIP runtime (tests/fake_hip) ---------------------------
@pytest.mark.parametrize(
    "config, path, mechanism", [("capture=record", "copy-native", "native"), ("capture=eager", "auto", "splice")]
)
def test_replay_harness_on_the_fake_runtime(tmp_path, config, path, mechanism):
    """The same worker the GPU test runs, against the CPU model of the HIP runtime, so a harness bug
    shows up here and not on the GPU machine: 20 replays, bit-identical, served == ringing layers."""
    pytest.importorskip("gpusync_hip")
    src = HERE / "fake_hip" / "fake_libamdhip64.cpp"
    if _cxx() is None or not src.is_file():
        pytest.skip("needs g++ and tests/fake_hip/fake_libamdhip64.cpp")
    fake = tmp_path / "libfakehip.so"
    subprocess.run(
        [_cxx(), "-std=c++17", "-shared", "-fPIC", "-O1", "-pthread", "-o", str(fake), str(src)],
        check=True,
        capture_output=True,
    )
    res = run_worker(fake, {"FAKEHIP_CONFIG": config}, path, 20)
    assert res["mechanism"] == mechanism and res["path"] == f"copy-{mechanism}", res["summary"]
    assert res["replays"] == 20 and res["mismatches"] == 0, res["first_bad"]
    assert res["served"] == res["expected_served"] == 60 and res["ready"] == 0 and res["done"] >= 1, res
    assert res["shim"] is None  # no shim counters on the fake runtime
    assert res["kernel_probe"].startswith(("kernelio probe failed", "skipped")), res["kernel_probe"]
    assert res["pending_error"] == 0, res


# ---- NVIDIA GPU: 4 layers x REPLAYS graph replays per path ---------------------------------------------
def _nvidia_missing() -> str | None:
    if not glob.glob("/dev/nvidia[0-9]*"):
        return "no NVIDIA GPU (/dev/nvidia<N> absent)"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"libcuda.so.1 cannot be loaded: {e}"
    return None


MISSING = _nvidia_missing()
needs_nvidia = pytest.mark.skipif(MISSING is not None, reason=f"the HIP-on-CUDA shim needs an NVIDIA GPU: {MISSING}")


def run_worker(library: Path, env: dict, path: str, replays: int) -> dict:
    e = {"GPUSYNC_HIP_LIBRARY": str(library), "PYTHONPATH": os.pathsep.join(sys.path), **env}
    r = run_py(
        f"import runpy, sys; sys.argv = ['w', {path!r}, '{replays}']; "
        f"runpy.run_path({str(SHIM_DIR / 'replay_worker.py')!r}, run_name='__main__')",
        e,
        timeout=WORKER_TIMEOUT_S,
    )
    assert r.returncode == 0, f"worker ({env}, {path}) failed:\n{r.stdout}\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def replay(shim: Path, mode: str, path: str) -> dict:
    pytest.importorskip("gpusync_hip")
    res = run_worker(shim, {"HIPSHIM_MODE": mode}, path, REPLAYS)
    print(f"\n[{mode}/{path}] {json.dumps(res)}")  # bench/device/gpu_hip_on_cuda.sh greps these lines
    return res


def check_replays(res: dict) -> None:
    assert res["replays"] == REPLAYS, res
    assert res["mismatches"] == 0, res["first_bad"]
    assert res["served"] == res["expected_served"], res  # exactly the ringing layers, every replay
    assert res["ready"] == 0 and res["done"] >= 1, res  # nothing pending
    assert res["error"] == 0 and res["signal"], res
    st = res["shim"]
    # the system-release event: created with hipEventReleaseToSystem, recorded as external event nodes
    assert st["release_events"] >= 1 and st["external_records"] >= 3, st
    assert st["host_funcs"] == 0, st  # no host function ever enters a graph on ROCm (an eager probe call may)
    # kernelio's HIP image cannot load on the CUDA driver: reported, and the copy path ran
    assert res["kernel_probe"].startswith(("kernelio probe failed", "skipped")), res["kernel_probe"]
    assert res["pending_error"] == 0, res  # no residual HIP error left on the thread


@pytest.mark.cuda
@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize(
    "mode, path, mechanism",
    [
        ("native", "copy-native", "native"),  # memops recorded by the capture (HIP >= 10)
        ("eager-capture", "auto", "splice"),  # ROCm < 10: the probe must see the eager memop and splice nodes
        ("native", "copy-splice", "splice"),  # explicit nodes on a runtime that would record memops too
    ],
    ids=["native-memops", "eager-capture-spliced", "forced-splice"],
)
def test_graph_replay_on_cuda(shim, mode, path, mechanism):
    res = replay(shim, mode, path)
    assert res["mechanism"] == mechanism and res["path"] == f"copy-{mechanism}", res["summary"]
    check_replays(res)
    st = res["shim"]
    if mode == "eager-capture":
        assert st["memops_eager"] >= 1 and st["memops_captured"] == 0, st  # the probe met the ROCm<10 behaviour
    if mechanism == "splice":
        assert st["batch_nodes"] >= 2 * 3, st  # a write node and a wait node per ringing step
        assert res["param_entries"] >= 1, res
    else:
        assert st["batch_nodes"] == 0 and st["memops_captured"] >= 2 * 3, st


@pytest.mark.cuda
@pytest.mark.gpu
@needs_nvidia
def test_native_memops_are_refused_where_capture_does_not_record_them(shim):
    """eager-capture mode: forcing the native mechanism must fail its probe, never run unrecorded memops."""
    pytest.importorskip("gpusync_hip")
    r = run_py(
        """
import numpy as np, cpumoe_executor as ce, cpumoe_formats as cf, gpusync_hip
rng = np.random.default_rng(1)
ex = ce.CpuMoeExecutor("bf16", [cf.get_format("bf16").random_banks(8, 256, 64, rng)], top_k=4, threads=1)
try:
    gpusync_hip.HipSync(ex, 0, path="copy-native", qualify=False, timeout_s=10)
    print("ACCEPTED")
except gpusync_hip.GpuSyncError as e:
    print("REFUSED", e)
ex.close()
""",
        {"GPUSYNC_HIP_LIBRARY": str(shim), "HIPSHIM_MODE": "eager-capture", "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=WORKER_TIMEOUT_S,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.startswith("REFUSED"), r.stdout


# ---- NVIDIA GPU: HipSync's split (submit -> torch work on the same stream -> finish) through torch --------
SPLIT_REPLAYS = int(os.environ.get("HIPSHIM_SPLIT_REPLAYS", "24"))


def split_worker(shim: Path, mode: str, path: str, qualify: bool) -> dict:
    pytest.importorskip("gpusync_hip")
    pytest.importorskip("torch")
    e = {"GPUSYNC_HIP_LIBRARY": str(shim), "HIPSHIM_MODE": mode, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = run_py(
        f"import runpy, sys; sys.argv = ['w', {path!r}, '{SPLIT_REPLAYS}', '{int(qualify)}']; "
        f"runpy.run_path({str(SHIM_DIR / 'split_worker.py')!r}, run_name='__main__')",
        e,
        timeout=WORKER_TIMEOUT_S,
    )
    assert r.returncode == 0, f"split worker ({mode}, {path}) failed:\n{r.stdout}\n{r.stderr[-4000:]}"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\n[split {mode}/{path} qualify={qualify}] {json.dumps(res)}")
    if "skip" in res:
        pytest.skip(res["skip"])
    return res


@pytest.mark.cuda
@pytest.mark.gpu
@needs_nvidia
@pytest.mark.parametrize(
    "mode, path, mechanism, qualify",
    [
        ("native", "copy-native", "native", False),  # memops recorded by the capture (HIP >= 10)
        ("eager-capture", "auto", "splice", False),  # ROCm < 10: spliced batch-memop nodes
        ("native", "copy-native", "native", True),  # + HipSync's start-up qualification (decode and the split)
        ("eager-capture", "copy-splice", "splice", True),
    ],
    ids=["native-memops", "eager-capture-spliced", "native-memops-qualified", "spliced-qualified"],
)
def test_split_on_cuda(shim, mode, path, mechanism, qualify):
    """submit -> a torch op on the same stream -> finish == decode() bit for bit (and == the executor), eagerly
    (new / out= / partial=, with and without a residency mask, a step with no CPU route) and in one
    torch.cuda graph of split and plain steps replayed HIPSHIM_SPLIT_REPLAYS (24) times with fresh inputs and
    residency masks."""
    res = split_worker(shim, mode, path, qualify)
    assert "error" not in res, res
    assert res["mechanism"] == mechanism and res["path"] == f"copy-{mechanism}", res["summary"]
    if qualify:
        assert "failed qualification" not in res["summary"], res["summary"]
    assert res["eager_checks"] == 12 and res["eager_bad"] == [], res["eager_bad"]
    assert res["replays"] == SPLIT_REPLAYS and res["graph_bad_count"] == 0, res["graph_bad"]
    assert res["pending_layer"] is None and not res["pending"], res
    assert res["ready"] == 0 and res["done"] >= 1 and res["error_word"] == 0 and res["pending_error"] == 0, res
