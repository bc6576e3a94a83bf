"""Each package installs on its own, by both routes a user takes, with no test extras (and no torch but for
moe-engine-glue).

1. sdist -> wheel built from that sdist -> platform-tagged wheel holding its library and headers
   -> installed alone into a fresh venv -> ci/smoke/<pkg>.py (ci/check_wheel.sh --build). Our own
   dependencies come from the wheels this route made, providers first (PIP_FIND_LINKS).
2. Every `python -m pip install ...` line of every README, verbatim, in a fresh venv from a fresh
   copy of the checkout's tracked files, with nothing but the package index to help -> the smoke
   test of each package the line installed.

Slow: every package is compiled from scratch several times.
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


def _tracked_copy(dest: Path) -> Path:
    """The repo's git-tracked files (what a fresh clone holds), copied to dest."""
    files = _run(["git", "ls-files", "-z"], cwd=ROOT).stdout.split("\0")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    return dest


def _install_lines() -> list[tuple[str, str]]:
    """(README, line) for every `python -m pip install ...` line in a shell block of a README of this repo."""
    out = []
    for readme in [ROOT / "README.md", *sorted((ROOT / "packages").glob("*/README.md"))]:
        block = False
        for line in readme.read_text().splitlines():
            if line.strip().startswith("```"):
                block = not block
                continue
            cmd = line.split("#", 1)[0].strip()
            if block and cmd.startswith("python -m pip install") and "nox" not in cmd:
                out.append((readme.relative_to(ROOT).as_posix(), cmd))
    return out


INSTALL_LINES = _install_lines()


def test_every_package_readme_has_an_install_line():
    have = {r for r, _ in INSTALL_LINES}
    assert {f"packages/{p}/README.md" for p in PACKAGES} <= have, sorted(have)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
@pytest.mark.parametrize("readme, line", INSTALL_LINES, ids=[f"{r}: {c}" for r, c in INSTALL_LINES])
def test_readme_install_line_runs_verbatim(readme, line, tmp_path):
    """The line, as written, in a fresh venv from a fresh copy of the checkout (no dist/ to help: the index has none
    of our packages), then the smoke test of each package it installed."""
    repo = _tracked_copy(tmp_path / "repo")
    _run([sys.executable, "-m", "venv", tmp_path / "venv"])
    bindir = tmp_path / "venv" / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_FIND_LINKS", "VIRTUAL_ENV")}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    _run(["bash", "-c", line], cwd=repo, env=env)
    for pkg in re.findall(r"\./packages/([\w-]+)", line):
        smoke = ROOT / "ci" / "smoke" / f"{pkg}.py"
        if smoke.is_file():
            print(_run([bindir / "python", smoke], cwd=tmp_path, env=env).stdout)
