"""Self-contained build of kernelio (hatchling hook and script).

Two products, neither needing a GPU on the build machine:
  * kernels/kernelio.cu -> src/kernelio/kernels/kernelio.fatbin by nvcc: SASS for
    each of KERNELIO_CUDA_ARCHS that this nvcc accepts plus compute_75 PTX, and
    build.json recording what was built (and what this nvcc refused). It is
    package data, loaded at run time with cuModuleLoadData through gpusync-cuda.
  * csrc/*.cpp -> kernelio._native (host launchers) by the C++ compiler; it
    includes gpusync/abi.h and links no GPU library.

Environment:
  NVCC                 nvcc to use (default: $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc, PATH)
  KERNELIO_CUDA_ARCHS  comma list, default "sm_75,sm_80,sm_90,sm_100,sm_120,compute_75";
                       e.g. "compute_75" builds a PTX-only image (the JIT-fallback tests use it)
  KERNELIO_FATBIN_OUT  write the fatbin elsewhere (tests build variants)
  KERNELIO_SKIP_FATBIN=1  build without nvcc (CPU-only CI): the package imports, its kernel
                       path reports "no kernel image" and gpusync-cuda decodes with copies
  CXX, CPUMOE_DEBUG=1, CPUMOE_BUILD_JOBS
Run `python hatch_build.py` for an in-place build.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
KERNELS = HERE / "kernels"
PKG = HERE / "src" / "kernelio"
DEFAULT_ARCHS = "sm_75,sm_80,sm_90,sm_100,sm_120,compute_75"


def _include_of(module: str, sibling: str, header: str) -> str:
    try:
        return __import__(module).get_include()
    except ImportError:
        p = HERE.parent / sibling / "src" / module / "include"
        if (p / header).is_file():
            return str(p)
        raise RuntimeError(f"kernelio needs {header} from {sibling}: install {sibling} first or build from the "
                           "monorepo") from None


def find_nvcc() -> str:
    for c in (os.environ.get("NVCC"), os.environ.get("CUDA_HOME") and f"{os.environ['CUDA_HOME']}/bin/nvcc",
              "/usr/local/cuda/bin/nvcc", shutil.which("nvcc")):
        if c and Path(c).is_file():
            return c
    raise RuntimeError("kernelio: nvcc not found (set NVCC or CUDA_HOME); it is needed to build the CUDA kernels")


def _nvcc_lists(nvcc: str) -> tuple[set[str], set[str], str]:
    code = set(subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True).stdout.split())
    arch = set(subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout.split())
    ver = re.findall(r"release [\d.]+, V([\d.]+)", subprocess.run([nvcc, "--version"], capture_output=True,
                                                                    text=True).stdout)
    return code, arch, ver[0] if ver else "?"


def build_fatbin(out: Path | None = None, archs: str | None = None) -> Path:
    nvcc = find_nvcc()
    out = Path(out or os.environ.get("KERNELIO_FATBIN_OUT") or PKG / "kernels" / "kernelio.fatbin")
    out.parent.mkdir(parents=True, exist_ok=True)
    wanted = [a.strip() for a in (archs or os.environ.get("KERNELIO_CUDA_ARCHS") or DEFAULT_ARCHS).split(",")
              if a.strip()]
    code, arch, version = _nvcc_lists(nvcc)
    sass = [a for a in wanted if a.startswith("sm_") and a in code and f"compute_{a[3:]}" in arch]
    ptx = [a for a in wanted if a.startswith("compute_") and a in arch]
    refused = [a for a in wanted if a not in sass + ptx]
    if not sass and not ptx:
        raise RuntimeError(f"kernelio: nvcc {version} accepts none of {wanted}")
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in sass] + \
              [f"-gencode=arch={a},code={a}" for a in ptx]
    cmd = [nvcc, "-fatbin", "-std=c++17", "-O3", f"-I{KERNELS}", f"-I{PKG / 'include'}", *gencode,
           str(KERNELS / "kernelio.cu"), "-o", str(out)]
    print(f"[kernelio] nvcc {version}: SASS {sass}, PTX {ptx}" + (f", refused {refused}" if refused else ""),
          file=sys.stderr)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"nvcc failed: {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    meta = {"sass": sass, "ptx": ptx, "requested": wanted, "refused_by_nvcc": refused, "nvcc": version,
            "source": "kernels/kernelio.cu"}
    out.with_name(out.stem + ".json").write_text(json.dumps(meta, indent=1) + "\n")
    return out


def build_ext(out_dir: Path = PKG) -> Path:
    import pybind11

    cxx = shlex.split(os.environ.get("CXX", "c++"))
    debug = os.environ.get("CPUMOE_DEBUG") == "1"
    inc = [CSRC, PKG / "include", _include_of("gpusync_cuda", "gpusync-cuda", "gpusync/abi.h"),
           _include_of("cpumoe_executor", "cpumoe-executor", "cpumoe_executor/abi.h"), pybind11.get_include(),
           sysconfig.get_paths()["include"]]
    flags = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-O1" if debug else "-O2",
             "-g" if debug else "-g0"] + [f"-I{p}" for p in inc]
    obj_dir = HERE / "build" / "obj"
    obj_dir.mkdir(parents=True, exist_ok=True)
    def compile_one(src: Path) -> str:
        obj = obj_dir / f"{src.stem}.o"
        cmd = cxx + flags + ["-c", str(src), "-o", str(obj)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{r.stdout}{r.stderr}")
        return str(obj)

    with ThreadPoolExecutor(int(os.environ.get("CPUMOE_BUILD_JOBS", "0")) or os.cpu_count() or 2) as ex:
        objs = list(ex.map(compile_one, sorted(CSRC.glob("*.cpp"))))
    target = out_dir / f"_native{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    r = subprocess.run(cxx + ["-shared", "-o", str(target)] + objs, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"link failed\n{r.stdout}{r.stderr}")
    return target


def build() -> list[Path | None]:
    skip = os.environ.get("KERNELIO_SKIP_FATBIN") == "1"
    if skip:
        print("[kernelio] KERNELIO_SKIP_FATBIN=1: no kernel image in this build", file=sys.stderr)
    return [None if skip else build_fatbin(), build_ext()]


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:
    BuildHookInterface = object  # type: ignore[assignment,misc]


class CustomBuildHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    PLUGIN_NAME = "custom"

    def initialize(self, version, build_data):
        if self.target_name != "wheel":
            return
        fatbin, so = build()
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        build_data["force_include"][str(so)] = f"kernelio/{so.name}"
        if fatbin is not None:
            build_data["force_include"][str(fatbin)] = f"kernelio/kernels/{fatbin.name}"
            meta = fatbin.with_name(fatbin.stem + ".json")
            build_data["force_include"][str(meta)] = f"kernelio/kernels/{meta.name}"


if __name__ == "__main__":
    for p in build():
        print(p or "(no fatbin)")
