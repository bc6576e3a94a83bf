"""Without a GPU: the fatbin was built and holds what build.json says (read
from its entry headers, and by cuobjdump where installed), the headers ship,
the module imports, and a wrong or stale backend ABI is refused by name."""
import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import run_py

import kernelio
from kernelio import _native

EXPECTED_SASS = ["sm_75", "sm_80", "sm_90", "sm_100", "sm_120"]


def test_fatbin_is_package_data_with_the_expected_arches():
    if os.environ.get("KERNELIO_SKIP_FATBIN") == "1" and not kernelio.fatbin_path().is_file():
        pytest.skip("built with KERNELIO_SKIP_FATBIN=1 (no nvcc): no kernel image")
    data = kernelio.image()
    info = kernelio.build_info()
    entries = kernelio.fatbin_entries(data)
    assert info["ptx"] == ["compute_75"]
    # Every requested arch is either built or recorded as refused by this nvcc.
    assert sorted(info["sass"] + [a for a in info["refused_by_nvcc"] if a.startswith("sm_")]) == sorted(EXPECTED_SASS)
    assert sorted(a for k, a in entries if k == "sass") == sorted(info["sass"])
    assert [a for k, a in entries if k == "ptx"] == ["compute_75"]


@pytest.mark.skipif(shutil.which("cuobjdump") is None, reason="cuobjdump is not installed here")
def test_cuobjdump_agrees(tmp_path):
    f = tmp_path / "k.fatbin"
    f.write_bytes(kernelio.image())
    elf = subprocess.run(["cuobjdump", "--list-elf", str(f)], capture_output=True, text=True, check=True).stdout
    ptx = subprocess.run(["cuobjdump", "--list-ptx", str(f)], capture_output=True, text=True, check=True).stdout
    for a in kernelio.build_info()["sass"]:
        assert f".{a}." in elf, elf
    assert ".sm_75." in ptx or "compute_75" in ptx, ptx


def test_headers_ship():
    inc = Path(kernelio.get_include())
    text = (inc / "kernelio" / "params.h").read_text()
    assert "kio_publish_params" in text and "kio_combine_params" in text
    assert _native.PARAMS_VERSION == 2  # 2: combine carries done, timeout_ns, wait


def test_fatbin_parser_rejects_other_data():
    with pytest.raises(ValueError, match="not a fatbin"):
        kernelio.fatbin_entries(b"\x7fELF" + bytes(64))


def test_wrong_backend_capsule_is_refused():
    import cpumoe_executor as ce

    with pytest.raises(_native.KernelIOError, match="expected a gpusync backend capsule"):
        _native.check_backend(ce.C_API_CAPSULE)


class FakeGpusyncApi(ctypes.Structure):
    _fields_ = [("abi_major", ctypes.c_uint32), ("abi_minor", ctypes.c_uint32), ("struct_size", ctypes.c_uint32),
                ("protocol_version", ctypes.c_uint32), ("build_info", ctypes.c_char_p), ("backend", ctypes.c_char_p)]


_NAME = b"gpusync_cuda._native._C_API_v1"  # must outlive the capsule


def test_stale_backend_abi_names_both_versions():
    fake = FakeGpusyncApi(2, 3, 4096, 1, b"fake", b"cuda")
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    cap = new(ctypes.addressof(fake), _NAME, None)
    with pytest.raises(_native.KernelIOError) as e:
        _native.check_backend(cap)
    assert "provides ABI 2.3" in str(e.value) and "built against ABI 1.0" in str(e.value)


def test_real_backend_binds():
    gs = pytest.importorskip("gpusync_cuda")
    _native.check_backend(gs.C_API_CAPSULE)


def test_probe_without_gpu_reports_instead_of_raising(fake_libcuda):
    r = run_py("""
import gpusync_cuda as g, kernelio
from gpusync_cuda import _native
d = _native.Device(0)
print(kernelio.probe(g.C_API_CAPSULE, d.handle))
""", env={"GPUSYNC_LIBCUDA": str(fake_libcuda)})
    assert r.returncode == 0, r.stderr
    assert "kernelio probe failed at module load" in r.stdout and "CUDA_ERROR_NO_BINARY_FOR_GPU" in r.stdout
