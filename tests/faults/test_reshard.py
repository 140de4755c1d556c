"""Fault 7: resume on another world size. A 2-rank ZeRO-2 run stopped mid-epoch resumes
on 1 rank (same global batch): every training molecule of the epoch is trained exactly
once over the two runs, and the model and optimizer state were resharded exactly
(``tests/engines/test_resume.py`` checks the state to the bit across engines, stages
and world sizes)."""

from __future__ import annotations

import glob
import json
import os

import pytest

from tests.dist.spawn import run_ranks
from tests.faults.common import argv, train_with


@pytest.mark.slow
def test_world_size_change_keeps_exactly_once(dataset, tmp_path):
    out = str(tmp_path / "run")
    epoch = ["--data.max_epochs", "1"]
    run_ranks(train_with, 2, argv(dataset, out, "zero", 5, *epoch, accum=1), "record-gids")
    first = sorted(glob.glob(out + ".gids-rank*"))
    assert len(first) == 2
    seen_before = [int(g) for f in first for line in open(f) for g in line.split()]
    for f in first:
        os.rename(f, f + ".first")
    # one rank, twice the accumulation: the same 4 sequences per step; run to the end of the epoch
    run_ranks(train_with, 1, argv(dataset, out, "zero", 100000, *epoch, "--checkpoint.resume", "auto", accum=2),
              "record-gids")
    seen_after = [int(g) for line in open(out + ".gids-rank0") for g in line.split()]
    total = json.load(open(os.path.join(dataset, "manifest.json")))["stats"]["splits"]["train"]["rows"]
    everything = seen_before + seen_after
    assert len(everything) == len(set(everything)) == total  # none twice, none skipped
    lineage = json.load(open(os.path.join(out, "checkpoints", open(os.path.join(out, "checkpoints",
                                                                                 "latest")).read(), "lineage.json")))
    assert lineage["world_topology"]["world_size"] == 1 and lineage["resume_changes"][0]["at_step"] == 5
