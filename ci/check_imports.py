# Called by: nox -s lint (noxfile.py), which also runs its --self-test.
"""Imports that keep the packages apart, for every package under packages/*/src:

1. no import cycle inside a package: every `import` / `from ... import` of a module of the same package (at module
   level or inside a function, relative or absolute) is an edge;
2. every import of another distribution is declared in that package's pyproject.toml (dependencies or an extra),
   whether it is one of ours or third-party (the standard library excepted; IMPLIED names what comes with another);
3. nothing private of another package: no `_`-prefixed module (`import cpumoe_executor._native`), no `_`-prefixed
   name imported from it (`from cpumoe_formats._arrays import x`, `from x import _y`), and no `_`-prefixed attribute
   read from a module of another package (`cf._native`).

    python ci/check_imports.py [PACKAGES_DIR]
    python ci/check_imports.py --self-test      plants each kind of violation in a scratch tree and checks it is caught
"""
from __future__ import annotations

import ast
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# import name -> distribution, where they differ or the package is not one of ours
DIST_OF = {"yaml": "pyyaml", "PIL": "pillow", "google": "protobuf"}
# distributions that arrive with another one and are imported without being declared, and why
IMPLIED = {"triton": "torch"}  # torch's CUDA / ROCm wheels ship triton; only the GPU experts import it
# the caller's library, imported inside a function only when the caller passed one of its objects (a torch tensor to
# a native package, which never depends on torch: docs/architecture.md rule 1); at module level it must be declared
CALLERS = {"torch"}


def modules(src: Path) -> dict[str, Path]:
    """dotted name -> file, for every .py under src/<pkg>/."""
    out = {}
    for f in src.rglob("*.py"):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _absolute(node: ast.ImportFrom, pkg: str) -> str:
    base = node.module or ""
    if node.level:
        up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
        base = ".".join(up + ([base] if base else []))
    return base


def imports(name: str, path: Path) -> list[tuple[int, str, list[str], bool]]:
    """(line, absolute module, names imported from it, at module level) for every import in the file."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def visit(node, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, [], not in_function) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, _absolute(node, pkg), [a.name for a in node.names], not in_function))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


def edges(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    out = set()
    for _line, base, names, _top in imports(name, path):
        for t in [base] + [f"{base}.{n}" for n in names]:
            while t and t not in known:
                t = t.rpartition(".")[0]
            # a package's __init__ importing its own submodules is how packages are built, not a cycle
            if t and t != name and not (path.name == "__init__.py" and t.startswith(name + ".")):
                out.add(t)
    return out


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def declared(pyproject: Path) -> set[str]:
    """Every distribution the package asks for, at run time or in an extra."""
    proj = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(proj.get("dependencies", []))
    for extra in proj.get("optional-dependencies", {}).values():
        reqs += extra
    return {canonicalize_name(Requirement(r).name) for r in reqs}


def _private(parts: list[str]) -> str | None:
    return next((p for p in parts if p.startswith("_") and not (p.startswith("__") and p.endswith("__"))), None)


def foreign(name: str, path: Path, own: str, ours: dict[str, str], deps: set[str]) -> list[str]:
    """Problems of one file with other distributions: undeclared imports, private modules, names and attributes."""
    problems = []
    bound: dict[str, str] = {}  # local name -> the other package's module it is bound to
    where = f"{path}"
    for line, base, names, module_level in imports(name, path):
        top = base.split(".")[0]
        if not top or top == own or top in sys.stdlib_module_names or top == "__future__":
            continue
        if top in CALLERS and not module_level:
            continue
        dist = canonicalize_name(ours.get(top, DIST_OF.get(top, top)))
        if dist not in deps and not (top in IMPLIED and canonicalize_name(IMPLIED[top]) in deps):
            problems.append(f"{where}:{line}: imports {base!r} from {dist}, which "
                            f"{path.parts[path.parts.index('src') - 1]}'s pyproject.toml does not declare")
        if top not in ours:
            continue
        p = _private(base.split(".")[1:]) or _private(names)
        if p:
            problems.append(f"{where}:{line}: imports the private {p!r} of {ours[top]} ({base}"
                            f"{' import ' + ', '.join(names) if names else ''}); use its public API")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ours and a.name.split(".")[0] != own:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            top = node.module.split(".")[0]
            if top in ours and top != own:
                for a in node.names:
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            if _private([node.attr]):
                problems.append(f"{where}:{node.lineno}: reads the private {node.attr!r} of {bound[node.value.id]} "
                                f"({ours[bound[node.value.id].split('.')[0]]}); use its public API")
    return problems


def check(root: Path) -> int:
    pkgs = {}
    for src in sorted(root.glob("*/src")):
        for init in src.glob("*/__init__.py"):
            pkgs[init.parent.name] = (src.parent, src)
    ours = {imp: tomllib.loads((d / "pyproject.toml").read_text())["project"]["name"] for imp, (d, _) in pkgs.items()}
    bad = 0
    for imp, (pdir, src) in pkgs.items():
        known = modules(src)
        graph = {n: edges(n, p, known) for n, p in known.items()}
        c = cycle(graph)
        deps = declared(pdir / "pyproject.toml")
        problems = [p for n, f in sorted(known.items()) for p in foreign(n, f, imp, ours, deps)]
        print(f"{pdir.name}: {len(known)} modules, {sum(map(len, graph.values()))} internal imports, "
              + ("cycle: " + " -> ".join(c) if c else "no cycle")
              + f", {len(problems)} import problem(s)")
        for p in problems:
            print("  " + p)
        bad += (c is not None) + len(problems)
    return 1 if bad else 0


def self_test() -> int:
    """Two toy packages; each kind of violation planted alone must fail the check, the clean tree must pass."""
    def tree(t: Path, a_src: str, a_deps: list[str]) -> Path:
        for name, imp, deps, body in (("pkg-a", "pkg_a", a_deps, a_src),
                                      ("pkg-b", "pkg_b", ["numpy"], "import numpy\n_hidden = 1\nshown = 2\n")):
            d = t / name
            (d / "src" / imp).mkdir(parents=True)
            (d / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "0"\ndependencies = {deps!r}\n')
            (d / "src" / imp / "__init__.py").write_text(body)
            (d / "src" / imp / "_impl.py").write_text("x = 1\n")
        return t

    clean = "import os\nimport pkg_b\nfrom pkg_b import shown\n\n\ndef f():\n    return pkg_b.shown, shown, os.sep\n"
    planted = {
        "undeclared ours": ("import pkg_b\n", []),
        "undeclared third-party": ("import pkg_b\nimport scipy\n", ["pkg-b"]),
        "private module": ("import pkg_b._impl\n", ["pkg-b"]),
        "private module from": ("from pkg_b._impl import x\n", ["pkg-b"]),
        "private name": ("from pkg_b import _hidden\n", ["pkg-b"]),
        "private attribute": ("import pkg_b as b\n\n\ndef f():\n    return b._hidden\n", ["pkg-b"]),
        "cycle": ("import pkg_b\n", ["pkg-b"]),
    }
    failures = []
    with tempfile.TemporaryDirectory() as d:
        root = tree(Path(d) / "clean", clean, ["pkg-b"])
        if check(root) != 0:
            failures.append("the clean tree failed")
        for kind, (src, deps) in planted.items():
            root = tree(Path(d) / kind.replace(" ", "_"), src, deps)
            if kind == "cycle":
                (root / "pkg-a" / "src" / "pkg_a" / "m1.py").write_text("from . import m2\n")
                (root / "pkg-a" / "src" / "pkg_a" / "m2.py").write_text("from .m1 import x\n")
            if check(root) == 0:
                failures.append(f"planted {kind} was not caught")
    print("self-test: " + ("; ".join(failures) if failures else f"{len(planted)} planted violations caught, the "
                           "clean tree passes"))
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    if argv[1:] == ["--self-test"]:
        return self_test()
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "packages"
    return check(root)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
