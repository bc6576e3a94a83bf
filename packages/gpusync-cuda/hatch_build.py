"""Self-contained build of gpusync_cuda._native (hatchling hook and script).

Plain C++17 with pybind11: no CUDA toolkit is needed and nothing links libcuda
or cudart (the driver is dlopen'd at run time). When the build machine has a
cuda.h (CUDA_HOME, /usr/local/cuda), csrc/cuda_check.cpp pins our local copies
of the driver constants to it with static_asserts.

Needs the cpumoe-executor C ABI headers (cpumoe_executor/abi.h and the backend-neutral
gpusync/abi.h): from the installed cpumoe_executor (get_include()), else from the
monorepo checkout beside this package.
Environment: CXX, CUDA_HOME, CPUMOE_SANITIZE, CPUMOE_DEBUG=1, CPUMOE_BUILD_JOBS.
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
PKG = HERE / "src" / "gpusync_cuda"


SIBLING = HERE.parent / "cpumoe-executor" / "src" / "cpumoe_executor" / "include"


def executor_include() -> str:
    try:
        import cpumoe_executor

        return cpumoe_executor.get_include()
    except ImportError:
        if (SIBLING / "gpusync" / "abi.h").is_file():
            return str(SIBLING)
        raise RuntimeError("gpusync-cuda needs cpumoe-executor's C ABI headers: install cpumoe-executor first "
                           "(pip install packages/cpumoe-executor) or build from the monorepo") from None


def cuda_include() -> str | None:
    """A CUDA toolkit's include dir, only for the compile-time constant check."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda.h").is_file():
            return str(Path(root) / "include")
    return None


def build(out_dir: Path = PKG) -> Path:
    import pybind11

    cxx = shlex.split(os.environ.get("CXX", "c++"))
    debug = os.environ.get("CPUMOE_DEBUG") == "1"
    san = os.environ.get("CPUMOE_SANITIZE", "")
    flags = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-O1" if debug else "-O2",
             "-g" if (debug or san) else "-g0", "-pthread", f"-I{CSRC}",
             f"-I{executor_include()}", f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]
    if san:
        flags += [f"-fsanitize={san}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
    cc = subprocess.run(cxx + ["--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    cuda_inc = cuda_include()
    info = f"gpusync-cuda cxx={cc[0] if cc else '?'} cuda.h-check={'yes' if cuda_inc else 'no'}"
    flags.append(f'-DGPUSYNC_BUILD_INFO="{info}"')
    obj_dir = HERE / "build" / ("obj-" + (san or "rel").replace(",", "-"))
    obj_dir.mkdir(parents=True, exist_ok=True)
    headers = list(CSRC.glob("*.h")) + list((PKG / "include").rglob("*.h")) + \
        list(Path(executor_include()).rglob("*.h"))
    # objects are reused by content key (flags, source, headers), not mtime: a tree that arrives by copy can carry
    # files older than the objects they replace
    hkey = hashlib.sha256((" ".join(flags) + f"|{cuda_inc}").encode())
    for h in sorted(headers):
        hkey.update(h.name.encode() + h.read_bytes())

    def compile_one(src: Path) -> Path | None:
        extra: list[str] = []
        if src.name == "cuda_check.cpp":
            if not cuda_inc:
                return None  # no cuda.h here: nothing to check against
            extra = ["-DGPUSYNC_HAVE_CUDA_H", f"-I{cuda_inc}"]
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
    print(f"[gpusync-cuda] compiling {len(srcs)} sources ({info})", file=sys.stderr)
    with ThreadPoolExecutor(int(os.environ.get("CPUMOE_BUILD_JOBS", "0")) or os.cpu_count() or 2) as ex:
        objs = [o for o in ex.map(compile_one, srcs) if o is not None]
    target = out_dir / f"_native{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    # -ldl for dlopen (part of libc on glibc >= 2.34, harmless before); no -lcuda, no -lcudart.
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
        build_data["force_include"][str(so)] = f"gpusync_cuda/{so.name}"


if __name__ == "__main__":
    print(build())
