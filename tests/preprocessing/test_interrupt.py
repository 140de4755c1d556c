"""Ctrl-C and SIGTERM during ``molds-preprocess`` (the local engine with worker processes):
the run exits non-zero, the failure report accounts for every row read (canonicalized or
rejected, up to the line it names), and nothing is left behind: no ``OUT``, no
``OUT.tmp-*``, no worker process. Signalled as a user does (SIGINT to the command), as a
scheduler does (SIGTERM to the command, or to its whole process group)."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE = os.path.join(ROOT, "molds", "sample_data", "moses_sample.csv.gz")


@pytest.fixture(scope="module")
def big_input(tmp_path_factory):
    """The bundled sample four times over (80,000 rows: the map stage runs for seconds)."""
    lines = gzip.open(SAMPLE, "rt").read().splitlines()
    path = tmp_path_factory.mktemp("sig") / "big.csv"
    path.write_text("\n".join([lines[0]] + lines[1:] * 4) + "\n")
    return str(path), 4 * (len(lines) - 1)


def _interruptible() -> None:
    """In the ETL's process before it starts: SIGINT back to its default. A suite started in
    the background (``cmd &`` from a script, ``nohup``) runs with SIGINT ignored, which every
    child inherits, and Python then installs no Ctrl-C handler: the signal would be lost and
    the ETL run to its end. A user's terminal sends Ctrl-C to a foreground job, as here."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _etl_processes(marker: str) -> list:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.mark.parametrize("how", ["sigint", "sigterm", "sigterm_group"])
def test_an_interrupted_etl_accounts_for_every_row_read_and_leaves_nothing(big_input, tmp_path, how):
    path, total = big_input
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "molds.preprocessing.cli", "--input", path, "--smiles-column",
                             "SMILES", "--output", str(out), "--workers", "2", "--progress", "false"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_interruptible)
    work = tmp_path / f"out.tmp-{proc.pid}" / "_work"
    deadline = time.monotonic() + 60
    while not work.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the run has started: the map stage comes next, and reads for about 30 s here
    assert proc.poll() is None, proc.communicate()
    time.sleep(3.0)
    if how == "sigint":
        proc.send_signal(signal.SIGINT)
    elif how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGTERM)  # the driver and its workers, as a scheduler stops a job
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err and "accounted in" in err, err[-3000:]
    rep = json.load(open(tmp_path / "out.failed-report.json"))
    assert rep["rows_in"] == rep["canonicalized"] + sum(rep["rejected"].values())
    assert 0 < rep["rows_in"] < total
    # read up to line N of the CSV: rows 2..N, every one of them counted
    line = int(re.search(r"line/row (\d+)", rep["read_up_to"]).group(1))
    assert rep["read_up_to"].startswith(path) and rep["rows_in"] == line - 1, rep["read_up_to"]
    assert sorted(os.listdir(tmp_path)) == ["out.failed-report.json", "out.failed-report.md"]
    deadline = time.monotonic() + 10
    while _etl_processes(str(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _etl_processes(str(out)), "worker processes outlived the run"
