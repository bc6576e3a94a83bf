"""Each package installs on its own, by both routes a user takes, with no torch and no test extras.

1. sdist -> wheel built from that sdist -> platform-tagged wheel holding its library and headers
   -> installed alone into a fresh venv -> ci/smoke/<pkg>.py (ci/check_wheel.sh --build).
2. `pip install packages/<pkg>` from a copy of the package's git-tracked files (what a fresh
   clone has) into a fresh venv -> the same smoke test.

Our own dependencies (cpumoe-executor needs cpumoe-formats, also to build) come from the wheels
route 1 made, providers first; everything else from the package index. Slow: every package is
compiled from scratch twice.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.cpu]


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _providers_first() -> list[str]:
    """Package directory names, each after the packages of ours it needs to build or run."""
    needs = {}
    for p in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        t = tomllib.loads(p.read_text())
        reqs = t.get("build-system", {}).get("requires", []) + t.get("project", {}).get("dependencies", [])
        needs[p.parent.name] = {_name(r) for r in reqs}
    order: list[str] = []
    while len(order) < len(needs):
        ready = [n for n in needs if n not in order and not (needs[n] & set(needs)) - set(order)]
        assert ready, f"dependency cycle among {sorted(set(needs) - set(order))}"
        order += ready
    return order


PACKAGES = _providers_first()


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1800, **kw)
    what = " ".join(map(str, cmd))
    assert r.returncode == 0, f"{what} failed ({r.returncode}):\n{r.stdout[-8000:]}\n{r.stderr[-8000:]}"
    return r


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """One dist/ for the module: route 1 fills it providers first, route 2 finds our dependencies there."""
    return tmp_path_factory.mktemp("dist")


def _env(dist: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_FIND_LINKS"] = " ".join(filter(None, (env.get("PIP_FIND_LINKS"), str(dist))))
    return env


@pytest.mark.parametrize("pkg", PACKAGES)
def test_sdist_then_wheel_from_sdist(pkg, dist):
    r = _run(["bash", ROOT / "ci" / "check_wheel.sh", "--build", ROOT / "packages" / pkg, dist], env=_env(dist))
    assert "packaging OK" in r.stdout


def _tracked_copy(pkg: str, dest: Path) -> Path:
    """The package's git-tracked files (what a fresh clone holds), copied to dest."""
    src = ROOT / "packages" / pkg
    files = _run(["git", "ls-files", "-z", "--", "."], cwd=src).stdout.split("\0")
    for f in filter(None, files):
        if (src / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / f, dest / f)
    return dest


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
@pytest.mark.parametrize("pkg", PACKAGES)
def test_pip_install_package_directory(pkg, dist, tmp_path):
    src = _tracked_copy(pkg, tmp_path / pkg)
    _run([sys.executable, "-m", "venv", tmp_path / "venv"])
    py = tmp_path / "venv" / "bin" / "python"
    _run([py, "-m", "pip", "install", "--disable-pip-version-check", src], env=_env(dist))
    no_torch = _run([py, "-c", "import importlib.util as u; print(u.find_spec('torch') is None)"]).stdout
    assert no_torch.strip() == "True", "installing the package pulled in torch"
    smoke = ROOT / "ci" / "smoke" / f"{pkg}.py"
    if smoke.is_file():
        print(_run([py, smoke], cwd=tmp_path, env=_env(dist)).stdout)
