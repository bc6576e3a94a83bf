"""Each package installs on its own, by both routes a user takes, with no torch and no test extras.

1. sdist -> wheel built from that sdist -> platform-tagged wheel holding its library and headers
   -> installed alone into a fresh venv -> ci/smoke/<pkg>.py (ci/check_wheel.sh --build).
2. `pip install packages/<pkg>` from a copy of the package's git-tracked files (what a fresh
   clone has) into a fresh venv -> the same smoke test.

Slow: each route compiles the package from scratch.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
pytestmark = [pytest.mark.slow, pytest.mark.cpu]


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1800, **kw)
    what = " ".join(map(str, cmd))
    assert r.returncode == 0, f"{what} failed ({r.returncode}):\n{r.stdout[-8000:]}\n{r.stderr[-8000:]}"
    return r


def _tracked_copy(pkg: str, dest: Path) -> Path:
    """The package's git-tracked files (what a fresh clone holds), copied to dest."""
    src = ROOT / "packages" / pkg
    files = _run(["git", "ls-files", "-z", "--", "."], cwd=src).stdout.split("\0")
    for f in filter(None, files):
        if (src / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / f, dest / f)
    return dest


@pytest.fixture
def venv(tmp_path) -> Path:
    _run([sys.executable, "-m", "venv", tmp_path / "venv"])
    return tmp_path / "venv" / "bin" / "python"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_sdist_then_wheel_from_sdist(pkg, tmp_path):
    r = _run(["bash", ROOT / "ci" / "check_wheel.sh", "--build", ROOT / "packages" / pkg, tmp_path / "dist"])
    assert "packaging OK" in r.stdout


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
@pytest.mark.parametrize("pkg", PACKAGES)
def test_pip_install_package_directory(pkg, tmp_path, venv):
    src = _tracked_copy(pkg, tmp_path / pkg)
    _run([venv, "-m", "pip", "install", "--disable-pip-version-check", src])
    no_torch = _run([venv, "-c", "import importlib.util as u; print(u.find_spec('torch') is None)"]).stdout
    assert no_torch.strip() == "True", "installing the package pulled in torch"
    smoke = ROOT / "ci" / "smoke" / f"{pkg}.py"
    if smoke.is_file():
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        print(_run([venv, smoke], cwd=tmp_path, env=env).stdout)
