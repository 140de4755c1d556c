"""run_ranks forks its ranks from a server started once (tests/dist/spawn.py); each rank must
still see what a freshly spawned one sees: the caller's environment, directory and output
streams at the call, and a rank's own failure as the caller's."""

from __future__ import annotations

import os
import sys

import pytest

from tests.dist.spawn import run_ranks


def _report(rank, world, name):
    print(f"rank {rank} of {world} writes to the caller's stderr", file=sys.stderr, flush=True)
    return os.environ.get(name), os.getcwd(), os.environ["RANK"], os.environ["DS_ACCELERATOR"], os.getppid()


def _quiet(rank, world):
    return rank


def _raise(rank, world):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


def test_a_rank_sees_the_callers_environment_directory_and_streams(tmp_path, monkeypatch, capfd):
    with capfd.disabled():  # the server runs before the environment changes, on streams other than these
        run_ranks(_quiet, 1)
    monkeypatch.setenv("MOLDS_SPAWN_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    got = run_ranks(_report, 2, "MOLDS_SPAWN_PROBE")
    assert [g[0] for g in got] == ["set after the server started"] * 2
    assert {g[1] for g in got} == {str(tmp_path)} and [g[2] for g in got] == ["0", "1"]
    assert {g[3] for g in got} == {"cpu"}
    assert all(g[4] != os.getpid() for g in got)  # forked from the server, not from pytest
    err = capfd.readouterr().err
    assert "rank 0 of 2 writes to the caller's stderr" in err and "rank 1 of 2" in err
    monkeypatch.delenv("MOLDS_SPAWN_PROBE")
    assert [g[0] for g in run_ranks(_report, 1, "MOLDS_SPAWN_PROBE")] == [None]


def test_a_failing_rank_fails_the_call():
    with pytest.raises(Exception, match="rank 1 fails on purpose"):
        run_ranks(_raise, 2)
