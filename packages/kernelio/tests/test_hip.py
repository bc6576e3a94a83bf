"""kernelio for HIP without an AMD GPU: the code-object bundle was built from the
same source and holds what kernelio.hipfb.json says (read from the bundle's
entry table, and by clang-offload-bundler where installed), the kernel source
spells nothing CUDA-only, the build's target selection, and the run-time choice
of image by the backend capsule (mock capsules whose module_load records what
it was given)."""

import ctypes
import glob
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import kernelio
from kernelio import _native

PKG_DIR = Path(__file__).resolve().parent.parent  # packages/kernelio in a monorepo checkout
DEFAULT_TARGETS = ["gfx942", "gfx1100", "gfx1201"]
FALLBACK_TARGETS = ["gfx90a", "gfx1030"]
# test-rocm sets this: there, a wheel without the HIP image is a failure, not a skip.
EXPECT_HIP = os.environ.get("KERNELIO_EXPECT_HIP") == "1"


def hip_image() -> bytes:
    if not kernelio.image_path("hip").is_file() and not EXPECT_HIP:
        pytest.skip("built without a HIP toolchain (no hipcc): no HIP image; nox -s test-rocm builds one")
    return kernelio.image("hip")


def bundler() -> str | None:
    cands = [
        shutil.which("clang-offload-bundler"),
        *sorted(glob.glob("/usr/bin/clang-offload-bundler-*")),
        "/opt/rocm/llvm/bin/clang-offload-bundler",
    ]
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def bundle_entries(data: bytes) -> dict[str, bytes]:
    """triple -> the entry's bytes (clang offload bundle layout: magic, u64 count, {u64 offset, size, len, triple})."""
    import struct

    (n,) = struct.unpack_from("<Q", data, 24)
    out, off = {}, 32
    for _ in range(n):
        o, size, tlen = struct.unpack_from("<QQQ", data, off)
        out[data[off + 24 : off + 24 + tlen].decode()] = data[o : o + size]
        off += 24 + tlen
    return out


def test_hip_image_is_package_data_with_the_expected_targets():
    data = hip_image()
    info = kernelio.build_info("hip")
    targets = kernelio.hip_bundle_targets(data)
    assert sorted(targets) == sorted(info["targets"]) and targets, (targets, info)
    # Every target tried is built or recorded as refused by this hipcc; the fallback group
    # (gfx90a, gfx1030) is only tried when the toolchain takes none of the defaults.
    tried = info["tried"]
    assert sorted(info["targets"] + list(info["refused_by_hipcc"])) == sorted(tried)
    override = os.environ.get("KERNELIO_HIP_ARCHS") or os.environ.get("PYTORCH_ROCM_ARCH")
    if not override:
        assert tried[:3] == DEFAULT_TARGETS
        if set(DEFAULT_TARGETS) & set(targets):
            assert not set(FALLBACK_TARGETS) & set(targets)
        else:
            assert tried == DEFAULT_TARGETS + FALLBACK_TARGETS
    assert kernelio.image_kind(data) == "hip"


def test_each_code_object_is_amdgpu_and_holds_both_kernels():
    data = hip_image()
    entries = {t: b for t, b in bundle_entries(data).items() if "amdgcn" in t}
    assert sorted(t.rsplit("--", 1)[-1] for t in entries) == sorted(kernelio.build_info("hip")["targets"])
    for triple, co in entries.items():
        assert co[:4] == b"\x7fELF" and int.from_bytes(co[18:20], "little") == 224, f"{triple}: not an AMDGPU ELF"
        assert kernelio.image_kind(co) == "hip"
        for sym in (b"kernelio_publish", b"kernelio_combine"):
            assert sym in co, f"{triple} lacks {sym!r}"


def test_clang_offload_bundler_agrees(tmp_path):
    data = hip_image()
    tool = bundler()
    if tool is None:
        pytest.skip(
            "clang-offload-bundler is not installed here (Debian's hipcc package brings clang-offload-bundler-15)"
        )
    f = tmp_path / "k.hipfb"
    f.write_bytes(data)
    r = subprocess.run([tool, "--list", "--type=o", f"--input={f}"], capture_output=True, text=True, check=True)
    listed = [ln.rsplit("--", 1)[-1] for ln in r.stdout.split() if "amdgcn" in ln]
    assert sorted(listed) == sorted(kernelio.hip_bundle_targets(data)), r.stdout


def objdump() -> str | None:
    # the newest LLVM first: an older default llvm-objdump may not decode newer targets
    cands = [
        "/opt/rocm/llvm/bin/llvm-objdump",
        *sorted(
            glob.glob("/usr/lib/llvm-*/bin/llvm-objdump"), key=lambda p: int(re.sub(r"\D", "", p) or 0), reverse=True
        ),
        shutil.which("llvm-objdump"),
    ]
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


# What vendor.h's system-scope operations must become (AMDGPU memory model), per target family.
ISA = {
    "gfx90a": {"release": "buffer_wbl2", "uncached": ("glc",)},
    "gfx1030": {"release": "buffer_gl1_inv", "uncached": ("glc", "dlc")},
}


def test_system_scope_operations_in_the_isa(tmp_path):
    """The doorbell's system-scope release (gfx90a: L2 write-back) and combine's reads of y that no stale
    cache line can answer (gfx90a: glc; gfx10: glc dlc), checked in the disassembly of each code object."""
    data = hip_image()
    tool = objdump()
    if tool is None:
        pytest.skip("llvm-objdump is not installed here (Debian's hipcc package brings llvm-15)")
    checked = 0
    for triple, co in bundle_entries(data).items():
        target = triple.rsplit("--", 1)[-1]
        if target not in ISA:
            continue
        f = tmp_path / f"{target}.co"
        f.write_bytes(co)
        asm = subprocess.run(
            [tool, "-d", f"--mcpu={target}", str(f)], capture_output=True, text=True, check=True
        ).stdout
        assert ISA[target]["release"] in asm, f"{target}: no {ISA[target]['release']} (system-scope release)"
        bypass = [
            ln
            for ln in asm.splitlines()
            if re.search(r"load_(dword|ushort)\s", ln) and all(b in ln.split() for b in ISA[target]["uncached"])
        ]
        # y in combine: 4 dword loads (16-byte path) and a ushort load (2-byte path), all bypassing
        assert len(bypass) >= 5 and any("load_ushort" in ln for ln in bypass), (target, bypass)
        checked += 1
    if not checked:
        pytest.skip(f"no code object for {sorted(ISA)} in this image")


def test_bundle_parser_rejects_other_data():
    with pytest.raises(ValueError, match="not a clang offload bundle"):
        kernelio.hip_bundle_targets(b"\x7fELF" + bytes(64))
    assert kernelio.image_kind(b"// PTX text") is None


# ---- the kernel source: one file for both vendors ---------------------------------------------
# Spellings that exist only in CUDA (or only as NVIDIA PTX): each must go through a kio_* name in vendor.h.
CUDA_ONLY = [
    r"__ldcv",
    r"__ldcg",
    r"__ldca",
    r"__ldlu",
    r"__ldg",
    r"__stcg",
    r"__stcs",
    r"__stwt",
    r"__shfl\w*_sync",
    r"__ballot_sync",
    r"__activemask",
    r"__nanosleep",
    r"\basm\b",
    r"%laneid",
    r"\bcuda[A-Z_]\w*",
    r"\bcu[A-Z]\w+\(",
    r"cooperative_groups",
    r"__CUDA_ARCH__",
    r"\bwarpSize\b",
    r"\b__threadfence_system\b",
    r"\batomicAdd_system\b",
    r"#include\s*<cuda",
]


def _code(path: Path) -> str:
    """The source with comments removed (they may name CUDA functions)."""
    s = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
    return re.sub(r"//[^\n]*", "", s)


def kernel_source() -> Path:
    p = PKG_DIR / "kernels" / "kernelio.cu"
    if not p.is_file():
        pytest.skip("needs the monorepo checkout (kernels/kernelio.cu is not in the wheel)")
    return p


def test_kernel_source_has_no_cuda_only_spellings():
    code = _code(kernel_source())
    hits = [pat for pat in CUDA_ONLY if re.search(pat, code)]
    assert not hits, f"kernelio.cu uses CUDA-only spellings {hits}: add a kio_* name to vendor.h for each"
    assert '#include "vendor.h"' in code
    for name in ("kio_fence_system", "kio_store_system", "kio_load_uncached"):
        assert name in code


def test_cuda_only_spellings_live_in_vendor_h_cuda_branch_only():
    vendor = _code(kernel_source().with_name("vendor.h"))
    hip, cuda = vendor.split("#else", 1)
    assert "__HIP__" in hip and "__hip_atomic_store" in hip and "__HIP_MEMORY_SCOPE_SYSTEM" in hip
    assert "__ldcv" in cuda and "__ldcv" not in hip


# ---- build: which targets, from where ------------------------------------------------------------
def hatch_build():
    p = PKG_DIR / "hatch_build.py"
    if not p.is_file():
        pytest.skip("needs the monorepo checkout (hatch_build.py)")
    spec = importlib.util.spec_from_file_location("kernelio_hatch_build", p)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_target_list_overrides(monkeypatch):
    hb = hatch_build()
    monkeypatch.delenv("KERNELIO_HIP_ARCHS", raising=False)
    monkeypatch.delenv("PYTORCH_ROCM_ARCH", raising=False)
    assert hb.hip_archs_from_env() is None
    monkeypatch.setenv("PYTORCH_ROCM_ARCH", "gfx90a;gfx942 ")  # PyTorch's spelling
    assert hb.hip_archs_from_env() == (["gfx90a", "gfx942"], "PYTORCH_ROCM_ARCH")
    monkeypatch.setenv("KERNELIO_HIP_ARCHS", "gfx1030,gfx90a:xnack+")  # ours wins
    assert hb.hip_archs_from_env() == (["gfx1030", "gfx90a:xnack+"], "KERNELIO_HIP_ARCHS")


def test_fallback_targets_only_when_no_default_is_accepted():
    hb = hatch_build()
    groups = [list(hb.HIP_DEFAULT_ARCHS), list(hb.HIP_FALLBACK_ARCHS)]
    assert groups == [DEFAULT_TARGETS, FALLBACK_TARGETS]
    tried = []

    def probe(takes):
        return lambda a: tried.append(a) or (None if a in takes else f"no {a}")

    # A ROCm 6.0-like toolchain: gfx942 and gfx1100 but no gfx1201; the fallback is not even tried.
    assert hb.choose_hip_targets(groups, probe({"gfx942", "gfx1100", "gfx90a"})) == (
        ["gfx942", "gfx1100"],
        {"gfx1201": "no gfx1201"},
    )
    assert tried == DEFAULT_TARGETS
    # Debian's hipcc 5.2: none of the defaults, so the fallback group.
    accepted, refused = hb.choose_hip_targets(groups, probe({"gfx90a", "gfx1030"}))
    assert accepted == FALLBACK_TARGETS and sorted(refused) == sorted(DEFAULT_TARGETS)
    assert hb.choose_hip_targets(groups, probe(set()))[0] == []


def _need_hipcc(hb):
    if hb.find_hipcc() is None:
        pytest.skip("no hipcc here (apt-get install hipcc libamdhip64-dev)")


def test_explicit_target_builds_exactly_that(monkeypatch, tmp_path):
    hb = hatch_build()
    _need_hipcc(hb)
    monkeypatch.setenv("PYTORCH_ROCM_ARCH", "gfx90a")
    monkeypatch.delenv("KERNELIO_HIP_ARCHS", raising=False)
    out = hb.build_hip_bundle(out=tmp_path / "k.hipfb")
    assert kernelio.hip_bundle_targets(out.read_bytes()) == ["gfx90a"]


def test_no_accepted_target_is_a_clear_error(monkeypatch, tmp_path):
    hb = hatch_build()
    _need_hipcc(hb)
    monkeypatch.setenv("KERNELIO_HIP_ARCHS", "gfx_not_a_target")
    monkeypatch.setenv("KERNELIO_HIP_OUT", str(tmp_path / "k.hipfb"))
    with pytest.raises(RuntimeError, match=r"accepts none of the AMD targets.*gfx_not_a_target.*KERNELIO_SKIP_HIP"):
        hb.maybe_build_hip()  # an explicit list means HIP was requested: no silent skip
    monkeypatch.setenv("KERNELIO_SKIP_HIP", "1")
    assert hb.maybe_build_hip() is None


# ---- run time: the capsule picks the image ---------------------------------------------------------
ERR = b"mock module_load refused"
LastError = ctypes.CFUNCTYPE(ctypes.c_char_p)
ModuleLoad = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))
_SLOTS_BEFORE_MODULE_LOAD = 13  # device_open .. stream_sync (gpusync/abi.h order)
_SLOTS_AFTER_MODULE_LOAD = 8  # module_unload .. memcpy_async


class MockApi(ctypes.Structure):
    _fields_ = (
        [
            ("abi_major", ctypes.c_uint32),
            ("abi_minor", ctypes.c_uint32),
            ("struct_size", ctypes.c_uint32),
            ("protocol_version", ctypes.c_uint32),
            ("build_info", ctypes.c_char_p),
            ("backend", ctypes.c_char_p),
            ("last_error", LastError),
        ]
        + [(f"s{i}", ctypes.c_void_p) for i in range(_SLOTS_BEFORE_MODULE_LOAD)]
        + [("module_load", ModuleLoad)]
        + [(f"t{i}", ctypes.c_void_p) for i in range(_SLOTS_AFTER_MODULE_LOAD)]
    )


def _gpusync():
    """Whichever gpusync backend this session installed (both speak the one gpusync/abi.h), for its versions."""
    for name in ("gpusync_hip", "gpusync_cuda"):
        try:
            return __import__(name)
        except ImportError:
            pass
    pytest.skip("neither gpusync-hip nor gpusync-cuda is installed")


class MockBackend:
    """A gpusync capsule named `name` whose module_load records the image's first bytes and fails."""

    def __init__(self, name: bytes, backend: bytes):
        self.seen: list[bytes] = []
        self._name = ctypes.create_string_buffer(name)  # must outlive the capsule
        self._last_error = LastError(lambda: ERR)
        self._load = ModuleLoad(self._module_load)
        gs = _gpusync()
        abi, proto = gs.ABI_VERSION, gs.PROTOCOL_VERSION
        self.api = MockApi(abi[0], abi[1], ctypes.sizeof(MockApi), proto, b"mock", backend, self._last_error)
        self.api.module_load = self._load
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.capsule = new(ctypes.addressof(self.api), ctypes.addressof(self._name), None)

    def _module_load(self, dev, image, module):
        self.seen.append(ctypes.string_at(image, 24))
        return 1


HIP_CAPSULE = b"gpusync_hip._native._C_API_v1"
CUDA_CAPSULE = b"gpusync_cuda._native._C_API_v1"
IO = dict(x=0, ids=0, w=0, y=0, ready=0, done=0, H=64, K=2, max_tokens=4)


def test_mock_api_layout_matches_the_header():
    _gpusync()
    # struct_size must be what gpusync/abi.h's gpusync_api is, or the ABI check refuses the mock.
    fields = 4 * 4 + 2 * 8 + 8 * (1 + _SLOTS_BEFORE_MODULE_LOAD + 1 + _SLOTS_AFTER_MODULE_LOAD)
    assert ctypes.sizeof(MockApi) == fields


def test_backend_of_reads_the_capsule_name():
    _gpusync()
    assert kernelio.backend_of(MockBackend(HIP_CAPSULE, b"hip").capsule) == "hip"
    assert kernelio.backend_of(MockBackend(CUDA_CAPSULE, b"cuda").capsule) == "cuda"
    with pytest.raises(_native.KernelIOError, match="expected a gpusync backend capsule"):
        kernelio.backend_of(MockBackend(b"someone_else._C_API_v1", b"hip").capsule)
    with pytest.raises(ValueError, match="backend='rocm'"):
        kernelio.image_path("rocm")


def test_hip_capsule_loads_the_hip_bundle_and_cuda_capsule_the_fatbin():
    _gpusync()
    hip_image()
    for name, backend, magic in (
        (HIP_CAPSULE, b"hip", b"__CLANG_OFFLOAD_BUNDLE__"),
        (CUDA_CAPSULE, b"cuda", b"\x50\xed\x55\xba"),
    ):
        if backend == b"cuda" and not kernelio.image_path("cuda").is_file():
            continue  # built without nvcc
        mock = MockBackend(name, backend)
        with pytest.raises(_native.KernelIOError, match=f"loading the kernel image: {ERR.decode()}"):
            kernelio.open_kernels(mock.capsule, 0, IO)
        assert len(mock.seen) == 1 and mock.seen[0].startswith(magic), (backend, mock.seen)


def test_missing_hip_image_is_a_clear_error_and_a_probe_report(monkeypatch, tmp_path):
    _gpusync()
    monkeypatch.setenv("KERNELIO_HIP_IMAGE", str(tmp_path / "absent.hipfb"))
    mock = MockBackend(HIP_CAPSULE, b"hip")
    with pytest.raises(FileNotFoundError, match=r"no HIP kernel image .*hipcc"):
        kernelio.open_kernels(mock.capsule, 0, IO)
    msg = kernelio.probe(mock.capsule, 0)
    assert msg.startswith("kernelio probe failed") and "no HIP kernel image" in msg, msg
    assert mock.seen == []  # nothing reached module_load


def test_an_image_for_the_other_vendor_is_refused_by_name():
    _gpusync()
    if not kernelio.image_path("cuda").is_file():
        pytest.skip("built without nvcc: no CUDA image to misuse")
    mock = MockBackend(HIP_CAPSULE, b"hip")
    with pytest.raises(ValueError, match="a CUDA kernel image was given to the hip backend"):
        kernelio.open_kernels(mock.capsule, 0, IO, data=kernelio.image("cuda"))
    assert "a CUDA kernel image was given to the hip backend" in kernelio.probe(mock.capsule, 0, kernelio.image())
    assert mock.seen == []
