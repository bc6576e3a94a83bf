"""The versioned C ABI: the header ships (with cpumoe-executor), a real C consumer compiled against
get_include() binds it, a mismatched one is refused with both versions named;
the executor ABI gpusync-cuda binds is checked the same way."""
import ctypes
import importlib.util
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

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
    for fn in ("probe", "iob_register", "submit", "wait", "path_name", "module_load", "launch"):
        assert f"(*{fn})" in text


def test_matching_consumer_binds(tmp_path):
    mod = build_consumer(tmp_path)
    assert mod.bind() == (*gpusync_cuda.ABI_VERSION, "cuda", "memop")
    rc, msg = mod.open_device()
    st = gpusync_cuda.driver_status()
    if not st["initialized"]:  # no driver here: a clean error code and the loader's reason
        assert rc == -1 and msg == st["error"]


@pytest.mark.parametrize("defines, want", [(["-DWANT_MAJOR=2"], "2.0"), (["-DWANT_MINOR=7"], "1.7")])
def test_mismatched_consumer_names_both_versions(tmp_path, defines, want):
    mod = build_consumer(tmp_path, *defines)
    with pytest.raises(ImportError) as e:
        mod.bind()
    msg = str(e.value)
    assert "provides ABI 1.0" in msg and f"built against ABI {want}" in msg and "gpusync-cuda" in msg


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
