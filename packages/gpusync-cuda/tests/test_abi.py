"""The versioned C ABI: the header ships (with cpumoe-executor), a real C consumer compiled against
get_include() binds it (1.1, and a 1.0 one: entries are only appended), a mismatched one is refused
with both versions named, the split copy step (1.1) runs through the table; the executor ABI
gpusync-cuda binds is checked the same way."""
import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from conftest import run_py

import cpumoe_executor as ce
import gpusync_cuda
from gpusync_cuda import _native

HERE = Path(__file__).resolve().parent
CC = os.environ.get("CC", "cc")


def build_consumer(tmp: Path, *defines: str):
    if shutil.which(CC) is None:
        pytest.fail(f"a C compiler ({CC}) is required to test the C ABI")
    so = tmp / ("abi_consumer" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = [CC, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-I{sysconfig.get_paths()['include']}",
           f"-I{gpusync_cuda.get_include()}", f"-I{ce.get_include()}", *defines, str(HERE / "abi_consumer.c"),
           "-o", str(so)]
    subprocess.run(cmd, check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("abi_consumer", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_header_ships_with_cpumoe_executor():
    assert gpusync_cuda.get_include() == ce.get_include()  # one copy, shared with gpusync-hip and kernelio
    text = (Path(gpusync_cuda.get_include()) / "gpusync" / "abi.h").read_text()
    assert f"#define GPUSYNC_ABI_MAJOR {gpusync_cuda.ABI_VERSION[0]}" in text
    assert f"#define GPUSYNC_ABI_MINOR {gpusync_cuda.ABI_VERSION[1]}" in text
    assert _native.CAPSULE_NAME.endswith(f"_C_API_v{gpusync_cuda.ABI_VERSION[0]}")
    for fn in ("probe", "iob_register", "submit", "wait", "path_name", "module_load", "launch", "step_submit",
               "step_finish"):
        assert f"(*{fn})" in text
    # 1.1 appended the split copy step after the 1.0 table's last entry (functions only appended: minor bump)
    assert text.index("(*memcpy_async)") < text.index("(*step_submit)") < text.index("(*step_finish)")


def test_matching_consumer_binds(tmp_path):
    mod = build_consumer(tmp_path)
    assert mod.bind() == (*gpusync_cuda.ABI_VERSION, "cuda", "memop")
    rc, msg = mod.open_device()
    st = gpusync_cuda.driver_status()
    if not st["initialized"]:  # no driver here: a clean error code and the loader's reason
        assert rc == -1 and msg == st["error"]


def test_consumer_built_for_1_1_binds_the_split(tmp_path):
    assert gpusync_cuda.ABI_VERSION == (1, 1)
    mod = build_consumer(tmp_path, "-DWANT_MINOR=1")
    assert mod.bind() == (1, 1, "cuda", "memop")
    assert mod.has_split() == (True, True)


def test_consumer_built_for_1_0_still_binds(tmp_path):
    """A 1.0 consumer (minor 0, the 1.0 table's size) binds the 1.1 table: entries were only appended."""
    mod = build_consumer(tmp_path, "-DWANT_MINOR=0", "-DWANT_SIZE=offsetof(gpusync_api,step_submit)")
    assert mod.bind() == (1, 1, "cuda", "memop")


@pytest.mark.parametrize("defines, want", [(["-DWANT_MAJOR=2"], "2.1"), (["-DWANT_MINOR=2"], "1.2"),
                                           (["-DWANT_MINOR=7"], "1.7")])
def test_mismatched_consumer_names_both_versions(tmp_path, defines, want):
    mod = build_consumer(tmp_path, *defines)
    with pytest.raises(ImportError) as e:
        mod.bind()
    msg = str(e.value)
    assert "provides ABI 1.1" in msg and f"built against ABI {want}" in msg and "gpusync-cuda" in msg


def test_split_step_through_the_table(tmp_path, fake_libcuda):
    """A C consumer registers the executor's block and runs step_submit, a stream-ordered copy of its own
    (other GPU work), step_finish on the fake driver: y is the executor's synchronous result bit for bit, the
    copy between the halves ran, and a kernel-path or out-of-range step is refused naming why, nothing enqueued."""
    so = build_consumer(tmp_path).__file__
    code = f"""
import importlib.util, json
import numpy as np
from conftest import make_executor
import cpumoe_executor as ce, cpumoe_formats as cf
spec = importlib.util.spec_from_file_location("abi_consumer", {so!r})
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
ex = make_executor(np.random.default_rng(7), layers=3, H=96, I=40, E=6, top_k=3)
ex.start_coordinator()
rng = np.random.default_rng(3)
res = []
for path, layer, T in ((1, 0, 2), (2, 2, 5), (1, 1, 8), (3, 0, 1), (1, 3, 1), (2, 0, 9)):
    x = rng.standard_normal((max(T, 1), ex.H)).astype(np.float32).astype(cf.numerics.BF16)
    ids = rng.integers(-1, ex.E, (max(T, 1), ex.top_k)).astype(np.int32)
    w = rng.random((max(T, 1), ex.top_k), dtype=np.float32)
    y = np.full((max(T, 1), ex.H), 0x7FC1, np.uint16)
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    served = ex.health()["served"]
    rc, msg = mod.split_step(ce.C_API_CAPSULE, ex.handle, path, layer, T, x.ctypes.data, ids.ctypes.data,
                             w.ctypes.data, y.ctypes.data, src.ctypes.data, dst.ctypes.data, 64)
    ok = rc == 0 and bool((y == ex.decode(layer, x, w, ids).view(np.uint16)).all())
    res.append([rc, msg, ok, bool((dst == src).all()), ex.health()["served"] - served])
h = ex.health()
print(json.dumps({{"res": res, "ready": h["ready"], "done": h["done"]}}))
"""
    r = run_py(code, env={"GPUSYNC_LIBCUDA": str(fake_libcuda)})
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    res = out["res"]
    assert [r[:5] for r in res[:3]] == [[0, "", True, True, 1]] * 3, res[:3]
    assert res[3][0] == -3 and "step_submit: path kernel is not a copy path" in res[3][1], res[3]
    for bad in res[4:]:
        assert bad[0] == -3 and "need layer < 3 and 1 <= num_tokens <= max_tokens=8" in bad[1], bad
    assert all(not r[3] and r[4] == 0 for r in res[3:]), res  # refused before anything ran
    assert out["ready"] == 0 and out["done"] == 1


class FakeExecutorApi(ctypes.Structure):
    _fields_ = [("abi_major", ctypes.c_uint32), ("abi_minor", ctypes.c_uint32), ("struct_size", ctypes.c_uint32),
                ("protocol_version", ctypes.c_uint32), ("build_info", ctypes.c_char_p)] + \
               [(f"fn{i}", ctypes.c_void_p) for i in range(5)]


_NAMES = (b"cpumoe_executor._native._C_API_v1", b"cpumoe_executor._native._C_API_v2")  # outlive the capsules


def _capsule(obj, name: bytes):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(obj), name, None)


def test_executor_capsule_is_checked():
    _native.check_executor_capsule(ce.C_API_CAPSULE)
    fake = FakeExecutorApi(9, 0, ctypes.sizeof(FakeExecutorApi), 1, b"fake")
    with pytest.raises(_native.GpuSyncError) as e:
        _native.check_executor_capsule(_capsule(fake, _NAMES[0]))
    assert "provides ABI 9.0" in str(e.value) and "built against ABI 1.0" in str(e.value)
    with pytest.raises(_native.GpuSyncError, match="expected the capsule cpumoe_executor._native._C_API_v1"):
        _native.check_executor_capsule(_capsule(fake, _NAMES[1]))
