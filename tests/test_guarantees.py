"""The "Guarantees" table (``docs/guarantees.md``, linked from the README) names, for every fault, the tests that prove it: each
named file (and test, where a row names one as ``file::test``) exists, holds tests, and none
of them is skipped by a mark where CI runs (a CPU machine: only a test that needs a GPU may
skip there, and says so). What a mark cannot show, a skip inside a test's body or fixture or
an xfail, the plugin ``tests/guarantee_check.py`` catches in every run of the suite: such a
test fails the session. A promise whose proof CI never runs is a promise nobody checks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.guarantee_check import guarantee_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: a pytest plugin that reports, at collection, every test a skip / skipif mark skips here
PROBE = '''
from _pytest.skipping import evaluate_skip_marks


def pytest_collection_modifyitems(config, items):
    for item in items:
        skip = evaluate_skip_marks(item)
        print("COLLECTED", item.nodeid, "SKIPPED: " + skip.reason if skip else "RUNS", sep="\\t")
'''


def test_every_guarantee_names_tests_that_exist_and_run_in_ci(tmp_path):
    rows = guarantee_rows()
    assert len(rows) >= 15, rows  # the table was found and read
    files = sorted({f for _, named in rows for f, _ in named})
    for fault, named in rows:
        assert named, f"the guarantee {fault!r} names no test file"
        for f, _ in named:
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
    for fault, named in rows:
        for f, fn in named:
            assert fn is None or any(node.split("[")[0] == f"{f}::{fn}" for node, _ in collected), (
                f"{fault!r}: {f} has no test {fn}")
    skipped = [(node, how) for node, how in collected if how != "RUNS" and "GPU" not in how]
    assert not skipped, f"tests that prove a guarantee and are skipped here: {skipped}"


def test_a_guarantee_test_that_skips_or_xfails_fails_the_session(tmp_path):
    """The plugin (tests/guarantee_check.py) that every run of the suite carries: a named test
    skipped inside its body, in a fixture, or xfailed ends the session non-zero and is listed;
    one skipped for want of a GPU, a test no row names, and passing ones do not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guarantees.md").write_text(textwrap.dedent("""\
        # Guarantees

        | fault | what | proved by |
        |---|---|---|
        | one | a | `tests/test_a.py` |
        | two | b | `tests/test_b.py::test_named` |
        """))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(textwrap.dedent("""\
        import pytest

        @pytest.fixture
        def needs():
            pytest.skip("no data here")

        def test_passes():
            pass

        def test_skips_in_its_body():
            pytest.skip("not today")

        def test_skips_in_a_fixture(needs):
            pass

        @pytest.mark.xfail(reason="flaky")
        def test_xfails():
            assert False

        def test_wants_a_gpu():
            pytest.skip("needs a CUDA GPU")
        """))
    (tmp_path / "tests" / "test_b.py").write_text(textwrap.dedent("""\
        import pytest

        @pytest.mark.parametrize("x", [1, 2])
        def test_named(x):
            pass

        def test_not_named():
            pytest.skip("no row names me")
        """))
    env = dict(os.environ, MOLDS_GUARANTEES=str(tmp_path / "docs" / "guarantees.md"),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))

    def run(*paths):
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.guarantee_check", "-p", "no:cacheprovider",
                               "-rN", "--rootdir", str(tmp_path), *paths], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)

    proc = run("tests")
    assert proc.returncode == 1, proc.stdout[-3000:]
    listed = proc.stdout.split("did not run to a pass", 1)[1]
    for bad in ("test_a.py::test_skips_in_its_body: skipped", "test_a.py::test_skips_in_a_fixture: skipped",
                "test_a.py::test_xfails: xfailed"):
        assert bad in listed, proc.stdout[-3000:]
    assert "test_passes" not in listed and "gpu" not in listed.lower() and "test_b.py" not in listed
    proc = run("-n", "2", "tests/test_a.py")  # as .ci/run runs it: the reports reach xdist's controller
    assert proc.returncode == 1 and "test_a.py::test_xfails: xfailed" in proc.stdout, proc.stdout[-3000:]
    proc = run("tests/test_b.py", "tests/test_a.py::test_passes", "tests/test_a.py::test_wants_a_gpu")
    assert proc.returncode == 0 and "did not run to a pass" not in proc.stdout, proc.stdout[-3000:]
