"""Self-contained build of gpusync_hip._native (hatchling hook and script).

Plain C++17 with pybind11: no HIP headers or ROCm toolchain are needed and
nothing links libamdhip64 (the runtime is dlopen'd and every entry point
resolved by name at run time; csrc/hip_types.h declares what is used). When the
build machine has <hip/hip_runtime_api.h> (ROCM_PATH, /opt/rocm, /usr), the
object csrc/hip_check.cpp static_asserts those declarations against it.

Headers it needs, never copied into this package: cpumoe_executor/abi.h and the
backend-neutral gpusync/abi.h that gpusync-cuda implements too, both shipped by
cpumoe-executor (cpumoe_executor.get_include()): from the installed package, else
from the monorepo checkout beside this one.
Environment: CXX, ROCM_PATH, CPUMOE_SANITIZE, CPUMOE_DEBUG=1, CPUMOE_BUILD_JOBS.
Run `python hatch_build.py` for an in-place build.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
PKG = HERE / "src" / "gpusync_hip"


SIBLING = HERE.parent / "cpumoe-executor" / "src" / "cpumoe_executor" / "include"


def executor_include() -> str:
    try:
        import cpumoe_executor

        return cpumoe_executor.get_include()
    except ImportError as e:
        if (SIBLING / "gpusync" / "abi.h").is_file():
            return str(SIBLING)
        raise RuntimeError(
            "gpusync-hip needs cpumoe_executor/abi.h and gpusync/abi.h from cpumoe-executor: install it first "
            f"(pip install ./packages/cpumoe-formats ./packages/cpumoe-executor) or build from the monorepo ({e})"
        ) from None


def hip_include() -> str | None:
    """A HIP SDK's include dir, only for the compile-time declaration check."""
    for root in (os.environ.get("ROCM_PATH"), os.environ.get("HIP_PATH"), "/opt/rocm", "/usr"):
        if root and (Path(root) / "include" / "hip" / "hip_runtime_api.h").is_file():
            return str(Path(root) / "include")
    return None


def build(out_dir: Path = PKG) -> Path:
    import pybind11

    cxx = shlex.split(os.environ.get("CXX", "c++"))
    debug = os.environ.get("CPUMOE_DEBUG") == "1"
    san = os.environ.get("CPUMOE_SANITIZE", "")
    ex_inc = executor_include()
    flags = [
        "-std=c++17",
        "-fPIC",
        "-fvisibility=hidden",
        "-Wall",
        "-Wextra",
        "-O1" if debug else "-O2",
        "-g" if (debug or san) else "-g0",
        "-pthread",
        f"-I{CSRC}",
        f"-I{ex_inc}",
        f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}",
    ]
    if san:
        flags += [f"-fsanitize={san}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
    cc = subprocess.run(cxx + ["--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    hip_inc = hip_include()
    info = f"gpusync-hip cxx={cc[0] if cc else '?'} hip-header-check={hip_inc or 'no'}"
    flags.append(f'-DGPUSYNC_BUILD_INFO="{info}"')
    obj_dir = HERE / "build" / ("obj-" + (san or "rel").replace(",", "-"))
    obj_dir.mkdir(parents=True, exist_ok=True)
    headers = list(CSRC.glob("*.h")) + list(Path(ex_inc).rglob("*.h"))
    # objects are reused by content key (flags, source, headers), not mtime: a tree that arrives by copy can carry
    # files older than the objects they replace
    hkey = hashlib.sha256((" ".join(flags) + f"|{hip_inc}").encode())
    for h in sorted(headers):
        hkey.update(h.name.encode() + h.read_bytes())

    def compile_one(src: Path) -> Path | None:
        extra: list[str] = []
        if src.name == "hip_check.cpp":
            if not hip_inc:
                return None  # no HIP header here: nothing to check against
            extra = ["-DGPUSYNC_HIP_CHECK", f"-I{hip_inc}"]
        obj = obj_dir / f"{src.stem}.o"
        stamp = obj_dir / f"{src.stem}.key"
        key = hashlib.sha256(hkey.digest() + " ".join(extra).encode() + src.read_bytes()).hexdigest()
        if obj.exists() and stamp.exists() and stamp.read_text() == key:
            return obj
        cmd = cxx + flags + extra + ["-c", str(src), "-o", str(obj)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{r.stdout}{r.stderr}")
        stamp.write_text(key)
        return obj

    srcs = sorted(CSRC.glob("*.cpp"))
    print(f"[gpusync-hip] compiling {len(srcs)} sources ({info})", file=sys.stderr)
    with ThreadPoolExecutor(int(os.environ.get("CPUMOE_BUILD_JOBS", "0")) or os.cpu_count() or 2) as ex:
        objs = [o for o in ex.map(compile_one, srcs) if o is not None]
    target = out_dir / f"_native{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    # -ldl for dlopen/dlinfo (part of libc on glibc >= 2.34, harmless before); no -lamdhip64.
    link = cxx + ["-shared", "-pthread", "-o", str(target)] + [str(o) for o in objs] + ["-ldl"]
    if san:
        link.append(f"-fsanitize={san}")
    r = subprocess.run(link, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"link failed: {' '.join(link)}\n{r.stdout}{r.stderr}")
    return target


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:
    BuildHookInterface = object  # type: ignore[assignment,misc]


class CustomBuildHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    PLUGIN_NAME = "custom"

    def dependencies(self):
        # Our providers come from the checkout beside this package when it is there (`pip install
        # ./packages/...`: the index has none of them); an unpacked sdist asks for them (nox finds them in dist/).
        return [] if (SIBLING / "gpusync" / "abi.h").is_file() else ["cpumoe-executor>=0.3,<0.5"]

    def initialize(self, version, build_data):
        if self.target_name != "wheel":
            return
        so = build()
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        build_data["force_include"][str(so)] = f"gpusync_hip/{so.name}"


if __name__ == "__main__":
    print(build())
