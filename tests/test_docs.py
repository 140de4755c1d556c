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

    from molds.recipe.parse import Recipe

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


def _nav_pages() -> set[str]:
    import re

    text = open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8").read()
    return set(re.findall(r":\s*([\w/.-]+\.md)\s*$", text.split("nav:", 1)[1], re.M))


def test_every_page_is_in_the_nav_and_every_shipped_recipe_is_documented():
    pages = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        pages |= {os.path.relpath(os.path.join(folder, f), os.path.join(ROOT, "docs")) for f in files if f.endswith(".md")}
    assert pages - _nav_pages() == set(), "pages the site's navigation does not reach"
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    text += "".join(open(os.path.join(ROOT, "docs", p), encoding="utf-8").read() for p in sorted(pages))
    recipes = []
    for folder in ("recipes", os.path.join("recipes", "smoke")):
        recipes += [os.path.join(folder, f) for f in sorted(os.listdir(os.path.join(ROOT, folder))) if f.endswith(".json")]
    assert len(recipes) >= 20
    full = [r for r in recipes if os.sep + "smoke" + os.sep not in r]
    # a full-size recipe is named in the README's table (by path, or by name after its folder's first entry)
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    missing = [r for r in full if r not in readme and f"`{os.path.basename(r)}`" not in readme]
    assert not missing, f"full-size recipes the README's recipe table does not name: {missing}"
    missing = [r for r in recipes if r.replace(os.sep, "/") not in text]
    assert not missing, f"shipped recipes no page names: {missing}"


def test_the_readme_is_short_and_is_the_package_description():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert len(readme.splitlines()) <= 250
    setup = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    assert 'long_description=open("README.md"' in setup
    for page in ("docs/getting-started.md", "docs/status.md", "docs/guarantees.md", "docs/benchmarks/index.md",
                 "CHANGELOG.md", "CONTRIBUTING.md", "LICENSE"):
        assert page in readme, f"the README does not link {page}"


def test_the_citation_file_names_the_package_as_setup_py_does():
    """CITATION.cff (what GitHub's "Cite this repository" reads) parses as CFF 1.2.0 and
    carries setup.py's version and licence; the README points at it."""
    import re

    import yaml

    cff = yaml.safe_load(open(os.path.join(ROOT, "CITATION.cff"), encoding="utf-8"))
    setup = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    for key in ("message", "title", "authors"):
        assert cff.get(key), f"CITATION.cff lacks {key}"
    assert all(a.get("name") or a.get("family-names") for a in cff["authors"])
    assert str(cff["version"]) == re.search(r'version="([^"]+)"', setup).group(1)
    assert cff["license"] == re.search(r'license="([^"]+)"', setup).group(1)
    assert "CITATION.cff" in open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
