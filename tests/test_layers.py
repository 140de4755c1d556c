"""The import graph of molds: no cycles (module-level and function-level imports both
count), and the training side never imports the ETL (molds.preprocessing)."""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _modules() -> dict[str, str]:
    """module name -> file, for molds/ and preprocessing/ (installed as molds.preprocessing)."""
    out = {}
    for base, prefix in (("molds", "molds"), ("preprocessing", "molds.preprocessing")):
        for dirpath, _, files in os.walk(os.path.join(ROOT, base)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, base))[:-3].replace(os.sep, ".")
                name = prefix if rel == "__init__" else f"{prefix}.{rel.removesuffix('.__init__')}"
                out[name] = os.path.join(dirpath, f)
    return out


def _imports(name: str, path: str, known: set[str]) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    is_pkg = path.endswith("__init__.py")
    here = name if is_pkg else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_no_import_cycles():
    g = graph()
    assert len(g) > 40
    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_training_side_never_imports_the_etl():
    g = graph()
    offenders = {n: sorted(m for m in deps if m.startswith("molds.preprocessing"))
                 for n, deps in g.items() if not n.startswith("molds.preprocessing")}
    assert not {n: d for n, d in offenders.items() if d}
