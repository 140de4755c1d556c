"""Fault 3: the disk fills up during a run. The save that does not fit fails with one
clear error naming the directory; its partial directory is removed; the checkpoints
before it stay complete and ``latest`` names one of them; resuming works."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest

from tests.dist.spawn import run_ranks
from tests.faults.common import argv, train, train_with


@contextlib.contextmanager
def small_filesystem(path, size_kb: int):
    """A tmpfs of ``size_kb`` at ``path``, or None where mounting is not allowed."""
    os.makedirs(path)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", path],
                        capture_output=True).returncode == 0
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", path], capture_output=True)


def _check_after(out):
    from molds.checkpoint import read_lineage, resolve
    from molds.checkpoint.layout import incomplete_reason

    root = os.path.join(out, "checkpoints")
    assert not [d for d in os.listdir(root) if d.endswith(".tmp")]
    latest = open(os.path.join(root, "latest")).read().strip()
    assert incomplete_reason(os.path.join(root, latest)) is None
    return read_lineage(resolve(out))["step"]


@pytest.mark.slow
def test_disk_full_during_a_save(dataset, tmp_path):
    out = str(tmp_path / "small" / "run")
    with small_filesystem(str(tmp_path / "small"), 2048) as mounted:
        if mounted:  # a real full filesystem (tmpfs of 2 MiB): the third checkpoint does not fit
            with pytest.raises(Exception) as err:
                run_ranks(train, 1, argv(dataset, out, "ddp", 12, "--logging.tensorboard", "false"))
        else:  # no permission to mount: files over 150 kB fail with EFBIG, as on a full disk
            with pytest.raises(Exception) as err:
                run_ranks(train_with, 1, argv(dataset, out, "ddp", 12, "--logging.tensorboard", "false"),
                          "fsize", 150_000)
        text = str(err.value)
        assert "CheckpointError" in text and os.path.join(out, "checkpoints") in text
        assert ("MiB free, the checkpoint needs about" in text or "no space left" in text), text
        assert "previous checkpoint is intact" in text
        step = _check_after(out) if mounted else None
    if mounted:
        assert step >= 2
    else:  # the model file itself did not fit: nothing was ever saved, and nothing partial stays
        assert not [d for d in os.listdir(os.path.join(out, "checkpoints")) if d.startswith("step-")]
