# Called by: nox -s lint (noxfile.py).
"""No import cycles inside any package: every `import` / `from ... import` of a module of the same package (at module
level or inside a function, relative or absolute) is an edge; a cycle among a package's modules fails.

    python ci/check_imports.py [PACKAGES_DIR]
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path


def modules(src: Path) -> dict[str, Path]:
    """dotted name -> file, for every .py under src/<pkg>/."""
    out = {}
    for f in src.rglob("*.py"):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def edges(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
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


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "packages"
    bad = 0
    for src in sorted(root.glob("*/src")):
        known = modules(src)
        graph = {n: edges(n, p, known) for n, p in known.items()}
        c = cycle(graph)
        print(f"{src.parent.name}: {len(known)} modules, {sum(map(len, graph.values()))} internal imports, "
              + ("cycle: " + " -> ".join(c) if c else "no cycle"))
        bad += c is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
