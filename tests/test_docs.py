"""The documentation site: its reference pages are what the code says now (regenerated and
compared), and it builds with ``mkdocs build --strict`` (every page in the nav exists, every
link inside the site resolves)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_generated_reference_is_up_to_date():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "docs", "gen_reference.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_site_builds_strictly(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for page in ("index.html", "reference/recipe/index.html", "reference/commands/index.html"):
        assert os.path.isfile(tmp_path / "site" / page), page


def test_every_console_script_and_recipe_key_is_in_the_reference():
    import dataclasses

    from molds.recipe import Recipe

    sys.path.insert(0, os.path.join(ROOT, "docs"))
    try:
        from gen_reference import console_scripts
    finally:
        sys.path.pop(0)
    commands = open(os.path.join(ROOT, "docs", "reference", "commands.md")).read()
    scripts = console_scripts()
    assert len(scripts) >= 8
    for name, _ in scripts:
        assert f"## `{name}`" in commands, name
    recipe = open(os.path.join(ROOT, "docs", "reference", "recipe.md")).read()
    for section in dataclasses.fields(Recipe):
        for f in dataclasses.fields(type(getattr(Recipe(), section.name))):
            assert f"| `{section.name}.{f.name}` |" in recipe, f"{section.name}.{f.name}"
