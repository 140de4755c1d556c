"""The "Guarantees" table (``docs/guarantees.md``, linked from the README) names, for every fault, the tests that prove it: each
named file exists, holds tests, and none of them is skipped where CI runs (a CPU machine:
only a test that needs a GPU may skip there, and says so). A promise whose proof CI never
runs is a promise nobody checks."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: a pytest plugin that reports, at collection, every test a skip / skipif mark skips here
PROBE = '''
from _pytest.skipping import evaluate_skip_marks


def pytest_collection_modifyitems(config, items):
    for item in items:
        skip = evaluate_skip_marks(item)
        print("COLLECTED", item.nodeid, "SKIPPED: " + skip.reason if skip else "RUNS", sep="\\t")
'''


def guarantee_rows() -> list[tuple[str, list[str]]]:
    """(fault, test files named in its last column) for every row of the table."""
    text = open(os.path.join(ROOT, "docs", "guarantees.md"), encoding="utf-8").read()
    table = text.split("# Guarantees", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[-1].startswith("`tests/"):
            continue
        rows.append((cells[0], re.findall(r"`(tests/[\w/.-]+\.py)(?:::\w+)?`", cells[-1])))
    return rows


def test_every_guarantee_names_tests_that_exist_and_run_in_ci(tmp_path):
    rows = guarantee_rows()
    assert len(rows) >= 15, rows  # the table was found and read
    files = sorted({f for _, named in rows for f in named})
    for fault, named in rows:
        assert named, f"the guarantee {fault!r} names no test file"
        for f in named:
            assert os.path.isfile(os.path.join(ROOT, f)), f"{fault!r}: {f} does not exist"
    (tmp_path / "guarantee_probe.py").write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "guarantee_probe",
                           "-p", "no:cacheprovider", *files], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = [line.split("\t")[1:] for line in proc.stdout.splitlines() if line.startswith("COLLECTED\t")]
    for f in files:
        assert any(node.startswith(f + "::") for node, _ in collected), f"{f} holds no test"
    skipped = [(node, how) for node, how in collected if how != "RUNS" and "GPU" not in how]
    assert not skipped, f"tests that prove a guarantee and are skipped here: {skipped}"
