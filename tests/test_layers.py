"""The import graph of molds: no cycles (module-level and function-level imports both
count), imports between packages run one way (``MAY_IMPORT``), the training side never
imports the ETL (molds.preprocessing), and no code of the repository imports a module by
the path it had before the packages were grouped (``molds.MOVED``)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _modules(root: str = ROOT) -> dict[str, str]:
    """module name -> file, for molds/ and preprocessing/ (installed as molds.preprocessing)."""
    out = {}
    for base, prefix in (("molds", "molds"), ("preprocessing", "molds.preprocessing")):
        for dirpath, _, files in os.walk(os.path.join(root, base)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(root, base))[:-3].replace(os.sep, ".")
                name = prefix if rel == "__init__" else f"{prefix}.{rel.removesuffix('.__init__')}"
                out[name] = os.path.join(dirpath, f)
    return out


def _targets(name: str, path: str):
    """(module, names imported from it) for every import statement of a file, at any depth,
    relative imports resolved (``import a.b``: ``("a.b", [])``)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    here = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, [a.name for a in node.names]


def _imports(name: str, path: str, known: set[str]) -> set[str]:
    found = set()
    for mod, names in _targets(name, path):
        for t in [mod] + [f"{mod}.{n}" for n in names]:
            while t and t not in known:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name:
                found.add(t)
    return found


def missing_modules(root: str = ROOT) -> list[str]:
    """Imports of a molds module that does not exist (an old path of ``molds.MOVED``, which
    would still import through its alias, or a typo): the graph would count them as imports
    of the root package."""
    mods = _modules(root)
    return [f"{name} imports {mod}, which is no module of molds" for name, path in sorted(mods.items())
            for mod, _ in _targets(name, path) if mod.split(".")[0] == "molds" and mod not in mods]


def graph(root: str = ROOT) -> dict[str, set[str]]:
    mods = _modules(root)
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


#: the packages of molds from the bottom up (``errors``, ``export`` and ``train`` are modules at
#: molds' top level): each may import those before it in this list, never one after it
STACK = ["errors", "runtime", "chemistry", "recipe", "data", "models", "kernels", "checkpoint", "engines", "scoring",
         "metrics", "eval", "goal", "export", "train", "cli"]

#: who may import whom: the stack, and the two packages that stand beside it. Every package
#: may also read the root package's ``__version__`` (``molds/__init__.py`` imports nothing of
#: molds). A new package gets a row; a row that runs back up makes the table cyclic, which
#: ``test_the_table_runs_one_way`` refuses.
MAY_IMPORT = {package: set(STACK[:i]) for i, package in enumerate(STACK)}
# the ETL: no torch, no recipe, no model; of the data plane, the manifest and the randomized spellings
MAY_IMPORT["preprocessing"] = {"errors", "runtime", "chemistry", "data"}
# the scripts that made the bundled sample files
MAY_IMPORT["sample_data"] = {"errors", "runtime", "chemistry", "eval"}


def package_of(module: str) -> str:
    """The row of ``MAY_IMPORT`` a module belongs to (``molds`` for the root package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "molds"


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    """Every import between two packages that ``MAY_IMPORT`` does not allow."""
    bad = []
    for module, deps in sorted(g.items()):
        here = package_of(module)
        if here == "molds":
            bad += [f"molds/__init__.py imports {d}" for d in sorted(deps)]
            continue
        if here not in MAY_IMPORT:
            bad.append(f"{module}: package {here!r} has no row in MAY_IMPORT")
            continue
        for d in sorted(deps):
            there = package_of(d)
            if there not in (here, "molds") and there not in MAY_IMPORT[here]:
                bad.append(f"{module} imports {d} ({here} may import {sorted(MAY_IMPORT[here]) or 'nothing of molds'})")
    return bad


def test_the_table_runs_one_way():
    seen, order = set(), []

    def visit(p, path):
        assert p not in path, "MAY_IMPORT runs back up: " + " -> ".join(path + [p])
        if p in seen:
            return
        for q in sorted(MAY_IMPORT[p]):
            assert q in MAY_IMPORT, f"{p} may import {q}, which has no row"
            visit(q, path + [p])
        seen.add(p)
        order.append(p)

    for p in MAY_IMPORT:
        visit(p, [])
    # every package of the tree has a row, and every row is a package of the tree
    assert {package_of(m) for m in graph()} - {"molds"} == set(MAY_IMPORT)


def test_imports_between_packages_run_one_way():
    bad = upward_imports(graph()) + missing_modules()
    assert not bad, "imports against MAY_IMPORT:\n" + "\n".join(bad)


def test_an_import_that_runs_back_up_is_caught(tmp_path):
    """The check itself, on a small tree: the recipe importing the goal run (the arrow this
    table was written against), relative and absolute, at module or function level."""
    def write(rel, text=""):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    for pkg in ("recipe", "goal", "chemistry"):
        write(f"molds/{pkg}/__init__.py")
    write("molds/__init__.py")
    write("molds/goal/loop.py", "from ..recipe.sections import X\n")
    write("molds/recipe/sections.py", "X = 1\n")
    write("molds/chemistry/tokens.py", "import os\n")
    assert upward_imports(graph(str(tmp_path))) == []
    write("molds/recipe/parse.py", "from ..goal.loop import run\n")
    write("molds/chemistry/tokens.py", "def f():\n    import molds.goal.loop\n")
    assert upward_imports(graph(str(tmp_path))) == [
        "molds.chemistry.tokens imports molds.goal.loop (chemistry may import ['errors', 'runtime'])",
        "molds.recipe.parse imports molds.goal.loop (recipe may import ['chemistry', 'errors', 'runtime'])"]
    write("molds/data/__init__.py", "")
    write("molds/data/loader.py", "from ..config import DataConfig\n")  # an old path, relative
    assert missing_modules(str(tmp_path)) == ["molds.data.loader imports molds.config, which is no module of molds"]
    write("molds/newpkg/__init__.py", "")
    assert "molds.newpkg: package 'newpkg' has no row in MAY_IMPORT" in upward_imports(graph(str(tmp_path)))


def _moved_paths() -> re.Pattern:
    import molds

    dotted = sorted(molds.MOVED, key=len, reverse=True)
    # (and the two old modules whose names are now packages)
    files = [m.replace(".", "/") + ".py" for m in dotted] + ["molds/recipe.py", "molds/runtime.py"]
    return re.compile("|".join([r"\b" + re.escape(m) + r"\b(?!\.py)" for m in dotted] +
                               [r"\b" + re.escape(f) for f in files]))


def _imports_a_moved_module(line: str) -> bool:
    """``from molds.preprocessing import sdf``: an old path the dotted pattern does not see."""
    import molds

    found = re.match(r"\s*from\s+([\w.]+)\s+import\s+([\w, ]+)", line)
    return bool(found) and any(f"{found.group(1)}.{name.strip()}" in molds.MOVED
                               for name in found.group(2).split(",") if name.strip())


def test_nothing_uses_a_path_that_moved():
    """Code, docstrings, scripts and user docs name modules where they are now (the old paths
    keep importing for users' own code; the changelog keeps the history)."""
    pattern = _moved_paths()
    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.json", "*.yml", ".ci/*"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    assert len(files) > 100
    hits = []
    for f in files:
        if f in ("CHANGELOG.md", "molds/__init__.py", "tests/test_layers.py") or not os.path.isfile(
                os.path.join(ROOT, f)):  # history, the aliases, this file; a file deleted but not yet committed
            continue
        for i, line in enumerate(open(os.path.join(ROOT, f), encoding="utf-8"), 1):
            if pattern.search(line) or _imports_a_moved_module(line):
                hits.append(f"{f}:{i}: {line.strip()}")
    assert not hits, "old module paths:\n" + "\n".join(hits)


def test_old_import_paths_still_import_the_moved_module():
    """Each old path of ``molds.MOVED`` imports, in a fresh interpreter, the very module it
    moved to, with one FutureWarning naming the new path; ``molds.recipe`` and
    ``molds.runtime`` (once modules, now packages) still hold the old modules' names."""
    code = """
import importlib, json, warnings
import molds
out = {}
for old, new in molds.MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    out[old] = [module is importlib.import_module(new), module.__name__, module.__spec__.name,
                [str(w.message) for w in caught if w.category is FutureWarning]]
from molds.recipe import parse_recipe, validate, deepspeed_config, Recipe
from molds.runtime import machine, code_version, seed_rank
import molds.recipe.parse as parse, molds.runtime.lifecycle as lifecycle
out["names"] = [parse_recipe is parse.parse_recipe, Recipe is parse.Recipe, machine is lifecycle.machine]
print(json.dumps(out))
"""
    import molds

    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("names") == [True, True, True]
    assert set(out) == set(molds.MOVED) and len(out) == 17
    for old, (same, name, spec, warned) in out.items():
        new = molds.MOVED[old]
        assert same and name == new and spec == new, (old, name, spec)
        assert warned == [f"{old} has moved to {new}: import it from there"], (old, warned)


def unexplained_function_imports(root: str = ROOT) -> list[str]:
    """Imports inside a function of molds/ whose line carries no comment: a function-level
    import stays only for an optional or heavy dependency on a path that must not load it,
    and its comment says which (CONTRIBUTING.md, "Imports")."""
    out = []
    for name, path in sorted(_modules(root).items()):
        if name.startswith("molds.preprocessing"):
            continue
        text = open(path, encoding="utf-8").read()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and "#" not in lines[node.lineno - 1]:
                    out.append(f"{os.path.relpath(path, root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(out))


def test_every_import_inside_a_function_says_why():
    bad = unexplained_function_imports()
    assert not bad, "imports inside a function without their reason (move them to the top, or say why):\n" + \
        "\n".join(bad)


def test_an_unexplained_import_inside_a_function_is_caught(tmp_path):
    (tmp_path / "molds").mkdir()
    (tmp_path / "molds" / "__init__.py").write_text("")
    (tmp_path / "molds" / "a.py").write_text("import os\n\n\ndef f():\n    import torch  # here: x loads no torch\n")
    assert unexplained_function_imports(str(tmp_path)) == []
    (tmp_path / "molds" / "a.py").write_text("def f():\n    from .b import g\n")
    assert unexplained_function_imports(str(tmp_path)) == ["molds/a.py:2: from .b import g"]


#: what each console script's --help may load of the heavy packages (the comments of the
#: function-level imports that keep them off these paths name them)
HELP_MAY_LOAD = {"molds-preprocess": set(), "molds-train": {"torch"}, "molds-export": set(), "molds-average": set(),
                 "molds-schedule": set(), "molds-sample": set(), "molds-predict": set(), "molds-eval": set(),
                 "molds-score": set()}
HEAVY = ("torch", "rdkit", "deepspeed", "transformers", "ray", "sklearn", "scipy", "matplotlib", "fcd_torch")


def _console_scripts() -> dict[str, str]:
    text = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    return dict(re.findall(r'"(molds-[a-z]+)=([\w.]+:\w+)"', text))


def test_every_help_stays_light():
    """``--help`` of each console script answers without importing torch, RDKit, DeepSpeed or
    transformers (molds-train's parses the recipe's sections, which need torch's dtypes)."""
    scripts = _console_scripts()
    assert set(scripts) == set(HELP_MAY_LOAD)
    code = ("import contextlib, io, json, sys\nmod, fn = sys.argv[2].split(':')\nsys.argv = [sys.argv[1], '--help']\n"
            "import importlib\nmain = getattr(importlib.import_module(mod), fn)\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    try:\n        main()\n    except SystemExit:\n"
            f"        pass\nprint(json.dumps([h for h in {HEAVY!r} if h in sys.modules]))")
    for script, entry in sorted(scripts.items()):
        proc = subprocess.run([sys.executable, "-c", code, script, entry], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]
        loaded = set(json.loads(proc.stdout.strip().splitlines()[-1]))
        assert loaded <= HELP_MAY_LOAD[script], (script, sorted(loaded - HELP_MAY_LOAD[script]))
