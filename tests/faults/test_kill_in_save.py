"""Fault 2: SIGKILL at several points inside a save. The previous checkpoint stays
loadable, ``latest`` never names a partial one, and ``--resume auto`` continues with the
losses of an uninterrupted run."""

from __future__ import annotations

import os

import pytest
from torch.multiprocessing import ProcessExitedException

from tests.dist.spawn import run_ranks
from tests.faults.common import argv, died_by_sigkill_at, losses, train, train_with


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ref") / "run")
    run_ranks(train, 1, argv(dataset, out, "ddp", 6))
    return losses(out)


@pytest.mark.parametrize("point", ["after-model", "after-optimizer", "before-marker", "before-rename",
                                   "after-rename", "before-latest"])
def test_kill_inside_a_save(dataset, tmp_path, reference, point):
    from molds.checkpoint import read_lineage, resolve
    from molds.checkpoint.layout import incomplete_reason

    out = str(tmp_path / "run")
    with pytest.raises(ProcessExitedException) as died:  # the rank dies by SIGKILL in its second save (step 4)
        run_ranks(train_with, 1, argv(dataset, out, "ddp", 6), f"kill-{point}", 2)
    died_by_sigkill_at(died, out, f"{point} in save 2")
    root = os.path.join(out, "checkpoints")
    latest = open(os.path.join(root, "latest")).read().strip()
    assert incomplete_reason(os.path.join(root, latest)) is None  # latest names a complete checkpoint
    assert latest == "step-00000002"  # the pointer moves only after the new one is complete and in place
    found = resolve(out)
    assert read_lineage(found)["step"] in (2, 4)
    if point in ("after-rename", "before-latest"):
        assert incomplete_reason(os.path.join(root, "step-00000004")) is None  # in place, just not pointed at
    else:
        assert not os.path.exists(os.path.join(root, "step-00000004"))
    run_ranks(train, 1, argv(dataset, out, "ddp", 6, "--checkpoint.resume", "auto"))
    got = losses(out)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # no duplicated or stale rows
    for step in got:
        assert got[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step
    assert not [d for d in os.listdir(root) if d.endswith(".tmp")]
