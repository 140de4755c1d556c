"""A pytest plugin: every test that proves a guarantee (a file, or ``file::test``, named in the
last column of ``docs/guarantees.md``'s table) must pass where the suite runs. One that skips
(by a mark, in a fixture or inside its body), xfails or xpasses ends the session non-zero, its
node id and reason listed, whatever else passed; only a skip whose reason names a GPU is
allowed (CI runs on CPUs). ``tests/conftest.py`` registers it for every run of the suite (in
pytest-xdist's controller, which receives every worker's reports); ``MOLDS_GUARANTEES`` points
it at another table (its own test does)."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "docs", "guarantees.md")
NAMED = re.compile(r"`(tests/[\w/.-]+\.py)(?:::(\w+))?`")


def guarantee_rows(path: str = TABLE) -> list[tuple[str, list[tuple[str, str | None]]]]:
    """(fault, [(test file, test function or None)]) for every row of the table."""
    text = open(path, encoding="utf-8").read()
    table = text.split("# Guarantees", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[-1].startswith("`tests/"):
            continue
        rows.append((cells[0], [(f, fn or None) for f, fn in NAMED.findall(cells[-1])]))
    return rows


def proves(nodeid: str, named: set[tuple[str, str | None]]) -> bool:
    """Whether the test ``nodeid`` (``file::test[params]``, or ``file::Class::test``) is one a row names."""
    parts = nodeid.split("::")
    name = re.sub(r"\[.*\]$", "", parts[-1]) if len(parts) > 1 else None
    return (parts[0], None) in named or (parts[0], name) in named


class GuaranteeWatch:
    def __init__(self, table: str = TABLE):
        self.named = {n for _, row in guarantee_rows(table) for n in row}
        self.bad: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        if not proves(report.nodeid, self.named):
            return
        if hasattr(report, "wasxfail"):
            self.bad[report.nodeid] = ("xpassed" if report.passed else "xfailed") + f" ({report.wasxfail})"
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            if "GPU" not in reason:
                self.bad[report.nodeid] = f"skipped ({reason})"

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        if self.bad and exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.bad:
            terminalreporter.section("tests that prove a guarantee (docs/guarantees.md) and did not run to a pass")
            for nodeid, how in sorted(self.bad.items()):
                terminalreporter.line(f"{nodeid}: {how}")


def pytest_configure(config):
    """``-p tests.guarantee_check``: the plugin on its own, for the table ``MOLDS_GUARANTEES`` names."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(GuaranteeWatch(os.environ.get("MOLDS_GUARANTEES", TABLE)), "molds-guarantees")
