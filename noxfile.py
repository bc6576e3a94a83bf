"""Sessions for the monorepo: build, test, package checks, lint, bench.

    nox -s test-cpu          build every wheel, check packaging, run every package's CPU tests
    nox -s demo              the main job: build the wheels, run `moe-engine demo` (a synthetic model, verified)
    nox -s bench             build cpumoe-formats and run its benchmark (writes bench-formats.json)
    nox -s lint              ruff over the repo
    nox -s test-cuda         GPU tests (skip with a reason when there is no GPU; REQUIRE_GPU=1 makes that fail)
    nox -s test-rocm         ROCm: installs the distribution's HIP toolchain if missing, builds gpusync-hip and
                             kernelio for AMD targets and runs their CPU-side tests (fake HIP runtime included);
                             AMD-GPU tests skip with a reason (REQUIRE_GPU=1 makes a missing AMD GPU fail)
    nox -l                   everything, with descriptions

Tests always run against the wheel built into dist/ and installed into a fresh venv, never the
source tree: pytest runs from a scratch directory, with packages/<pkg>/tests as its argument.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import nox
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

nox.needs_version = ">=2024.4.15"  # default= and requires=
nox.options.default_venv_backend = "virtualenv"
nox.options.error_on_external_run = True

ROOT = Path(__file__).resolve().parent
DIST = ROOT / "dist"
BACKENDS = ("cpu", "cuda", "rocm")
GPU_BACKENDS = ("cuda", "rocm")
# GPU backends whose sessions run without the GPU too: their CPU-side tests (compile-only builds for the
# device, a fake runtime) run everywhere and only the tests marked for the device skip, each with a reason.
CPU_SIDE = ("rocm",)
TOOLCHAIN = {"rocm": "rocm-toolchain"}  # the session that provides a backend's compiler, run before its builds
RUFF = "ruff>=0.6,<1"
BUILD = "build>=1.2"


@dataclass(frozen=True)
class Pkg:
    backends: tuple[str, ...]  # which test-<pkg>-<backend> sessions exist
    deps: tuple[str, ...] = ()  # our own packages it needs (built first, installed from dist/)
    # backend -> our packages that backend's tests need besides deps (e.g. the backend's gpusync)
    test_deps: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # backend -> environment of a build-<pkg>-<backend> session (a wheel with that backend's device code)
    build_env: dict[str, dict[str, str]] = field(default_factory=dict)
    # CPU_SIDE backends whose CPU-side tests are the cpu session's own: without the GPU the session skips
    gpu_only: tuple[str, ...] = ()


# The package table, providers first: adding a package is one line. A package's sessions are
# registered once packages/<name>/pyproject.toml exists.
PLANNED = {
    "cpumoe-formats": Pkg(("cpu",)),
    "cpumoe-executor": Pkg(("cpu",), deps=("cpumoe-formats",)),
    # its kernel-path tests need kernelio (the [kernels] extra), which depends on it
    "gpusync-cuda": Pkg(("cpu", "cuda"), deps=("cpumoe-formats", "cpumoe-executor"), test_deps={"cuda": ("kernelio",)}),
    "gpusync-hip": Pkg(("rocm",), deps=("cpumoe-formats", "cpumoe-executor")),
    # its tests drive the kernels through a backend: gpusync-cuda (cpu, cuda), gpusync-hip (rocm)
    "kernelio": Pkg(("cpu", "cuda", "rocm"), deps=("cpumoe-formats", "cpumoe-executor"),
                    test_deps={"cpu": ("gpusync-cuda",), "cuda": ("gpusync-cuda",), "rocm": ("gpusync-hip",)},
                    # a HIP code-object bundle is required (not best-effort) in the rocm wheel
                    build_env={"rocm": {"KERNELIO_HIP": "1"}}),
    "moe-engine-glue": Pkg(("cpu", "cuda", "rocm"),
                           deps=("cpumoe-formats", "cpumoe-executor", "gpusync-cuda", "gpusync-hip", "kernelio"),
                           gpu_only=("rocm",)),
}
PACKAGES = {n: p for n, p in PLANNED.items() if (ROOT / "packages" / n / "pyproject.toml").is_file()}


def _load_ci(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "ci" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


detect_gpu = _load_ci("detect_gpu")


def _project(name: str) -> dict:
    return nox.project.load_toml(ROOT / "packages" / name / "pyproject.toml")["project"]


def _closure(name: str, backend: str | None = None) -> list[str]:
    """The package and every one of our packages it depends on (plus, with `backend`, what that backend's
    tests need), providers first."""
    out: list[str] = []

    def visit(n: str) -> None:
        for d in PACKAGES[n].deps if n in PACKAGES else ():
            visit(d)
        if n not in out and n in PACKAGES:
            out.append(n)

    if backend is not None and name in PACKAGES:
        for extra in PACKAGES[name].test_deps.get(backend, ()):
            visit(extra)
    visit(name)
    return out


def _ours(req: str) -> bool:
    return canonicalize_name(Requirement(req).name) in {canonicalize_name(n) for n in PLANNED}


def _third_party(names: list[str], extras: tuple[str, ...], main: str | None = None) -> list[str]:
    """Requirements of our packages (and the named extras of `main`, default the last) that come from PyPI."""
    reqs: list[str] = []
    for n in names:
        proj = _project(n)
        reqs += proj.get("dependencies", [])
        if n == (main or names[-1]):
            for e in extras:
                reqs += proj.get("optional-dependencies", {}).get(e, [])
    return [r for r in dict.fromkeys(reqs) if not _ours(r)]


def _install_wheels(session: nox.Session, name: str, extras: tuple[str, ...] = (), backend: str | None = None) -> None:
    """Third-party requirements from PyPI, then our wheels from dist/ only (never an sdist, never PyPI)."""
    names = _closure(name, backend)
    reqs = _third_party(names, extras, main=name)
    if reqs:
        session.install(*reqs)
    pins = [f"{n}=={_project(n)['version']}" if "version" in _project(n) else n for n in names]
    session.install("--no-index", "--find-links", str(DIST), "--only-binary", ":all:", *pins)


def _check_table() -> None:
    """The table's deps must cover what each pyproject.toml asks of our packages (to build or to run)."""
    for name, pkg in PACKAGES.items():
        toml = nox.project.load_toml(ROOT / "packages" / name / "pyproject.toml")
        reqs = toml.get("build-system", {}).get("requires", []) + toml["project"].get("dependencies", [])
        ours = {canonicalize_name(Requirement(r).name) for r in reqs if _ours(r)}
        missing = ours - {canonicalize_name(d) for d in pkg.deps}
        if missing:
            raise RuntimeError(f"noxfile.py: packages/{name}/pyproject.toml needs {sorted(missing)}; "
                               "add them to its deps in the package table")


def _runnable(backend: str) -> bool:
    """Will test-<pkg>-<backend> run here (rather than skip)? GPU sessions skip without building first."""
    return (backend == "cpu" or backend in CPU_SIDE or detect_gpu.missing(backend) is None
            or os.environ.get("REQUIRE_GPU") == "1")


def _gpu_gate(session: nox.Session, backend: str) -> None:
    """Skip (or, with REQUIRE_GPU=1, fail) when this machine cannot run `backend`. A CPU_SIDE backend
    runs anyway: its device tests skip one by one."""
    if backend not in GPU_BACKENDS:
        return
    missing = detect_gpu.missing(backend)
    if missing is None:
        return
    if os.environ.get("REQUIRE_GPU") == "1":
        session.error(f"REQUIRE_GPU=1 but {backend} is unavailable: {missing}")
    if backend in CPU_SIDE:
        session.log(f"{backend} device unavailable ({missing}): CPU-side tests only, device tests skip")
        return
    session.skip(f"{backend} unavailable: {missing} (set REQUIRE_GPU=1 to make this an error)")


def _dist_files(name: str) -> list[Path]:
    stem = canonicalize_name(name).replace("-", "_")
    return sorted(DIST.glob(f"{stem}-*.whl")) + sorted(DIST.glob(f"{stem}-*.tar.gz"))


def _source_hash(name: str, env: dict[str, str] | None) -> str:
    """What a build of `name` reads: its files (tracked or not, build outputs excluded), the build environment, and
    the hashes of the packages it builds against (a change below rebuilds above)."""
    import hashlib

    h = hashlib.sha256(repr(sorted((env or {}).items())).encode())
    root = ROOT / "packages" / name
    skip = {"build", "dist", "__pycache__", ".pytest_cache", ".hypothesis"}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root)
        if f.is_file() and not skip & set(rel.parts) and f.suffix not in (".so", ".o", ".pyc"):
            h.update(str(rel).encode() + b"\0" + f.read_bytes())
    for dep in _closure(name)[:-1]:
        h.update(_source_hash(dep, None).encode())
    return h.hexdigest()


def _make_build(name: str, env: dict[str, str] | None = None):
    def build(session: nox.Session) -> None:
        DIST.mkdir(exist_ok=True)
        stamp = DIST / f".{name}{'-' + '-'.join(env.values()) if env else ''}.stamp"
        digest = _source_hash(name, env)
        if stamp.is_file() and stamp.read_text() == digest and len(_dist_files(name)) == 2:
            # e.g. `nox -s demo` then `nox -s test-cpu`: the same sources give the same wheel (CI starts from an
            # empty dist/, so it always builds)
            session.log(f"up to date: {', '.join(f.name for f in _dist_files(name))} (sources unchanged)")
            return
        for old in DIST.glob(f".{name}*.stamp"):  # a build of another variant (build_env) replaces the wheel too
            old.unlink()
        for f in _dist_files(name):  # no stale artifact of this package may be picked up later
            f.unlink()
        session.install(BUILD)
        # No --sdist/--wheel: build makes the sdist, then the wheel FROM that sdist, so every
        # wheel we test also proves the sdist is complete. PIP_FIND_LINKS lets build isolation
        # find our own packages (build requirements of consumers) in dist/.
        session.run("python", "-m", "build", "--outdir", str(DIST), str(ROOT / "packages" / name),
                    env={"PIP_FIND_LINKS": " ".join(filter(None, (os.environ.get("PIP_FIND_LINKS"), str(DIST)))),
                         **(env or {})})
        session.log("built: " + ", ".join(f.name for f in _dist_files(name)))
        stamp.write_text(digest)

    build.__doc__ = f"Build the {name} sdist, then its wheel from that sdist, into dist/" + (
        f" (with {' '.join(f'{k}={v}' for k, v in env.items())})." if env else ".")
    return build


def _make_package_check(name: str):
    def package_check(session: nox.Session) -> None:
        session.run("bash", str(ROOT / "ci" / "check_wheel.sh"), str(ROOT / "packages" / name), str(DIST),
                    external=True)

    package_check.__doc__ = (f"Check the {name} sdist and wheel in dist/ (contents, platform tag) and smoke-test "
                             "the wheel alone in a fresh venv (no test extras, no torch).")
    return package_check


def _machine_stack(session: nox.Session) -> None:
    """GPU sessions use the machine's own torch / CUDA or ROCm Python stack, never a pip-installed copy:
    the site-packages of the `python3` on PATH (often itself a venv, which --system-site-packages would
    miss) go at the END of the session venv's sys.path, so the venv's own packages still win."""
    outer = shutil.which("python3") or shutil.which("python")
    if not outer:
        return
    sites = subprocess.run([outer, "-c", "import site, sys; print('\\n'.join(site.getsitepackages()))"],
                           capture_output=True, text=True).stdout.split()
    inner = session.run("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True)
    Path(inner.strip(), "_machine_stack.pth").write_text("".join(f"{d}\n" for d in sites if Path(d).is_dir()))
    session.log(f"machine stack from {outer}: {', '.join(sites)}")


def _make_test(name: str, backend: str):
    def test(session: nox.Session) -> None:
        if backend in PACKAGES[name].gpu_only and detect_gpu.missing(backend) and os.environ.get("REQUIRE_GPU") != "1":
            session.skip(f"{backend} unavailable ({detect_gpu.missing(backend)}); {name}'s CPU-side tests are its "
                         "cpu session's")
        _gpu_gate(session, backend)
        if backend in GPU_BACKENDS:
            _machine_stack(session)
        _install_wheels(session, name, extras=("test",), backend=backend)
        tests = ROOT / "packages" / name / "tests"
        marks = "not gpu" if backend == "cpu" else f"{backend} or not gpu"
        # From a scratch directory: only the installed wheel is importable; conftest.py is still
        # found (pytest puts tests/ on sys.path) and the root pyproject.toml still configures pytest.
        with session.chdir(session.create_tmp()):
            session.run("python", "-c", "import importlib, sys; m = importlib.import_module(sys.argv[1]); "
                        "print('testing', m.__name__, getattr(m, '__version__', '?'), 'from', m.__file__)",
                        _import_name(name))
            session.run("python", "-m", "pytest", str(tests), "-m", marks, "-p", "no:cacheprovider",
                        *session.posargs, env=_TEST_ENV.get(backend, {}))

    test.__doc__ = f"Run {name}'s tests ({backend}) against its wheel from dist/ in a fresh venv."
    return test


def _import_name(name: str) -> str:
    srcs = [p.parent.name for p in (ROOT / "packages" / name / "src").glob("*/__init__.py")]
    return srcs[0] if len(srcs) == 1 else canonicalize_name(name).replace("-", "_")


def _make_aggregate(backend: str, members: list[str]):
    def aggregate(session: nox.Session) -> None:
        if not members:
            session.skip(f"no package has a {backend} backend yet (packages: {', '.join(PACKAGES)})")
        missing = detect_gpu.missing(backend) if backend in GPU_BACKENDS else None
        if missing is not None and backend not in CPU_SIDE:
            session.skip(f"{backend} tests were skipped: {missing}")
        session.log(f"{backend}: passed " + ", ".join(members) +
                    (f" (CPU-side tests; device tests skipped: {missing})" if missing else ""))

    aggregate.__doc__ = f"Every package's {backend} tests" + (" and packaging checks." if backend == "cpu" else ".")
    return aggregate


def _build_session(name: str, backend: str) -> str:
    """The build a backend's tests use: build-<pkg>-<backend> where the package has one, else build-<pkg>."""
    return f"build-{name}-{backend}" if backend in PACKAGES[name].build_env else f"build-{name}"


def _register() -> None:
    for name, pkg in PACKAGES.items():
        nox.session(name=f"build-{name}", venv_backend="virtualenv", tags=["build", name],
                    requires=[f"build-{d}" for d in _closure(name)[:-1]])(_make_build(name))
        for backend, env in pkg.build_env.items():
            nox.session(name=f"build-{name}-{backend}", venv_backend="virtualenv", tags=["build", name, backend],
                        default=False, requires=[*(TOOLCHAIN.get(backend, ()) and [TOOLCHAIN[backend]]),
                                                 *(f"build-{d}" for d in _closure(name)[:-1])])(_make_build(name, env))
        nox.session(name=f"package-check-{name}", tags=["package-check", "cpu", name],
                    requires=[f"build-{name}"])(_make_package_check(name))
        for backend in pkg.backends:
            builds = []
            if _runnable(backend) and not (backend in pkg.gpu_only and detect_gpu.missing(backend)):  # else it skips
                builds = [*(TOOLCHAIN.get(backend, ()) and [TOOLCHAIN[backend]]),
                          *(_build_session(n, backend) if n == name else f"build-{n}" for n in _closure(name, backend))]
            nox.session(name=f"test-{name}-{backend}", tags=["test", backend, name], default=backend == "cpu",
                        requires=builds)(_make_test(name, backend))
    for backend in BACKENDS:
        members = [f"test-{n}-{backend}" for n, p in PACKAGES.items() if backend in p.backends]
        if backend == "cpu":
            members = [f"package-check-{n}" for n in PACKAGES] + members
        elif backend == "cuda":
            members += ["integration-cuda", "test-hip-on-cuda"]
        nox.session(name=f"test-{backend}", venv_backend="none", tags=[backend], default=backend == "cpu",
                    requires=members)(_make_aggregate(backend, members))


# test-<pkg>-rocm: a wheel without its HIP image is a failure there, not a skip
_TEST_ENV = {"rocm": {"KERNELIO_EXPECT_HIP": "1"}}
ROCM_APT = ("hipcc", "libamdhip64-dev")  # Debian/Ubuntu: hipcc (clang + device libraries) and the HIP headers


def _hipcc() -> str | None:
    for c in (os.environ.get("HIPCC"), *(os.environ.get(v) and f"{os.environ[v]}/bin/hipcc" for v in
                                         ("ROCM_PATH", "HIP_PATH")), "/opt/rocm/bin/hipcc", shutil.which("hipcc")):
        if c and os.access(c, os.X_OK):
            return c
    return None


@nox.session(name="rocm-toolchain", venv_backend="none", default=False, tags=["rocm"])
def rocm_toolchain(session: nox.Session) -> None:
    """Make sure a HIP toolchain is here: hipcc on PATH / $ROCM_PATH / /opt/rocm, else the distribution's
    (apt-get install hipcc libamdhip64-dev, as root or with passwordless sudo), else fail saying what to install."""
    found = _hipcc()
    if found:
        session.log(f"HIP toolchain: {found}")
        return
    sudo: list[str] = []
    if os.geteuid() != 0:
        ok = shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0
        sudo = ["sudo", "-n"] if ok else []
    if not shutil.which("apt-get") or (os.geteuid() != 0 and not sudo):
        session.error("no HIP toolchain: install ROCm (https://rocm.docs.amd.com) or, on Debian/Ubuntu, "
                      f"`sudo apt-get install {' '.join(ROCM_APT)}`; or point HIPCC / ROCM_PATH at an installed hipcc")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run(*sudo, "apt-get", "update", "-q", external=True, env=env)
    session.run(*sudo, "apt-get", "install", "-y", "-q", *ROCM_APT, external=True, env=env)
    if not _hipcc():
        session.error(f"apt-get installed {' '.join(ROCM_APT)} but no hipcc is on PATH")
    session.log(f"HIP toolchain: {_hipcc()}")


_check_table()
_register()


@nox.session(name="integration-cpu", default=False, requires=[f"build-{n}" for n in PACKAGES])
def integration_cpu(session: nox.Session) -> None:
    """tests-integration/ on the CPU (slow: rebuilds each package from a fresh sdist)."""
    for name in PACKAGES:
        _install_wheels(session, name)
    session.install("pytest>=7")
    session.run("python", "-m", "pytest", str(ROOT / "tests-integration"), "-m", "not gpu", "-p", "no:cacheprovider",
                *session.posargs)


@nox.session(name="integration-cuda", default=False,
             requires=[f"build-{n}" for n in PACKAGES] if _runnable("cuda") else [])
def integration_cuda(session: nox.Session) -> None:
    """tests-integration/ GPU composition tests (executor + gpusync-cuda + kernelio: eager, 1,000 graph
    replays per path, loading checks) against the wheels in dist/ and the machine's torch."""
    _gpu_gate(session, "cuda")
    _machine_stack(session)
    for name in ("cpumoe-executor", "gpusync-cuda", "kernelio"):
        _install_wheels(session, name)
    session.install("pytest>=7")
    with session.chdir(session.create_tmp()):
        session.run("python", "-m", "pytest", str(ROOT / "tests-integration"), "-m", "cuda", "-p", "no:cacheprovider",
                    *session.posargs)


@nox.session(name="test-hip-on-cuda", default=False, tags=["cuda"],
             requires=[f"build-{n}" for n in ("cpumoe-formats", "cpumoe-executor", "gpusync-cuda", "gpusync-hip",
                                              "kernelio") if n in PACKAGES])
def test_hip_on_cuda(session: nox.Session) -> None:
    """gpusync-hip on an NVIDIA GPU through the HIP-on-CUDA shim (packages/gpusync-hip/tests/cuda_shim):
    4 layers x 1,000 graph replays per path. GPU tests skip without an NVIDIA GPU (REQUIRE_GPU=1: fail)."""
    if "gpusync-hip" not in PACKAGES:
        session.skip("packages/gpusync-hip is not in this checkout")
    if not glob.glob("/dev/nvidia[0-9]*") and os.environ.get("REQUIRE_GPU") == "1":
        session.error("REQUIRE_GPU=1 but there is no NVIDIA GPU (/dev/nvidia<N> absent)")
    _install_wheels(session, "gpusync-hip", extras=("test",))
    _install_wheels(session, "kernelio")
    with session.chdir(session.create_tmp()):
        session.run("python", "-m", "pytest", str(ROOT / "packages" / "gpusync-hip" / "tests" / "test_hip_on_cuda.py"),
                    "-m", "cuda or not gpu", "-p", "no:cacheprovider", "-rs", *session.posargs)


@nox.session(name="demo", default=False, requires=[f"build-{n}" for n in _closure("moe-engine-glue")])
def demo(session: nox.Session) -> None:
    """The main job: build the wheels, install moe-engine-glue and run `moe-engine demo` (posargs go to it, e.g.
    -- --format fp8_block --layers 8). With a GPU the machine's own torch is used (hybrid under CUDA graphs)."""
    if detect_gpu.missing("cuda") is None or detect_gpu.missing("rocm") is None:
        _machine_stack(session)
    _install_wheels(session, "moe-engine-glue")
    with session.chdir(session.create_tmp()):
        session.run("moe-engine", "demo", *session.posargs)


@nox.session(name="bench", default=False, requires=["build-cpumoe-formats"])
def bench(session: nox.Session) -> None:
    """Benchmark every format's kernels from the installed wheel; writes bench-formats.json."""
    _install_wheels(session, "cpumoe-formats", extras=("bench",))
    out = ROOT / "bench-formats.json"
    with session.chdir(session.create_tmp()):
        session.run("python", "-c", "import importlib.util as u, sys; u.find_spec('cpumoe_formats.bench') or "
                    "sys.exit('cpumoe_formats.bench is not in this build of cpumoe-formats')")
        session.run("python", "-m", "cpumoe_formats.bench", "--json", str(out), *session.posargs)
    session.log(f"results: {out}")


@nox.session(name="lint")
def lint(session: nox.Session) -> None:
    """ruff check over the whole repo (config in the root pyproject.toml), and ci/check_imports.py: no import cycle in
    any package, every import of another distribution declared, nothing private of another package (its self-test
    first: each kind of violation planted in a scratch tree must be caught)."""
    session.install(RUFF, "packaging>=23", "tomli>=2; python_version < '3.11'")
    session.run("ruff", "check", str(ROOT), *session.posargs)
    session.run("python", str(ROOT / "ci" / "check_imports.py"), "--self-test")
    session.run("python", str(ROOT / "ci" / "check_imports.py"))



@nox.session(name="sanitize", default=False)
def sanitize(session: nox.Session) -> None:
    """AddressSanitizer+UBSan, then ThreadSanitizer builds of cpumoe-formats and cpumoe-executor, each
    running both test suites (ci/sanitize.sh; posargs go to pytest). Not in test-cpu: ~15 min on 2 cores."""
    session.install("pybind11>=2.12", "numpy>=1.23", "ml_dtypes>=0.5", "pytest>=7", "hypothesis>=6")
    for mode in ("asan", "tsan"):
        session.run("bash", str(ROOT / "ci" / "sanitize.sh"), mode, *session.posargs, external=True)
