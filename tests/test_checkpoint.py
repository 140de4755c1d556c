"""A crash in the middle of a save leaves the previous checkpoint whole and `latest` on it;
references resolve the same everywhere; a missing `latest` falls back to the newest
complete checkpoint."""

from __future__ import annotations

import os

import pytest

from molds.checkpoint import resolve, save_checkpoint
from molds.errors import CheckpointError
from molds.runtime.distributed import DistInfo


class _Engine:
    name = "fake"

    def __init__(self, fail=False):
        self.fail = fail

    def save(self, directory):
        with open(os.path.join(directory, "model.safetensors"), "w") as fh:
            fh.write("half")
        if self.fail:
            raise OSError(28, "No space left on device")


def _save(tmp_path, step, fail=False):
    import torch

    dist = DistInfo(0, 1, 0, torch.device("cpu"), None)
    return save_checkpoint(str(tmp_path), _Engine(fail), dist, step, {"vranks": {}}, {"manifest_hash": "m"},
                           keep_last=2)


def test_crash_mid_save_keeps_previous(tmp_path):
    first = _save(tmp_path, 10)
    assert resolve(str(tmp_path)) == first
    with pytest.raises(CheckpointError, match="no space left .* previous checkpoint is intact"):
        _save(tmp_path, 20, fail=True)
    assert resolve(str(tmp_path)) == first
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints", "step-00000020.tmp"))
    assert sorted(os.listdir(first)) == ["COMPLETE", "data_state.json", "lineage.json", "model.safetensors",
                                         "rng-rank00000.json"]
    second = _save(tmp_path, 20)
    third = _save(tmp_path, 30)
    assert resolve(str(tmp_path)) == third
    assert not os.path.exists(first) and os.path.exists(second)  # keep_last=2


def test_references_resolve_the_same_way(tmp_path):
    a = _save(tmp_path, 1)
    b = _save(tmp_path, 2)
    root = os.path.join(tmp_path, "checkpoints")
    for ref in (str(tmp_path), root, os.path.join(root, "latest"), b):
        assert resolve(ref) == b
    assert resolve(a) == a
    os.remove(os.path.join(root, "latest"))  # a missing pointer: the newest complete checkpoint
    assert resolve(str(tmp_path)) == b
    with open(os.path.join(b, "model.safetensors"), "a") as fh:  # b is now not what was written
        fh.write("x")
    assert resolve(str(tmp_path)) == a
    with pytest.raises(CheckpointError, match="model.safetensors has 5 bytes, 4 were written"):
        resolve(b)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        resolve(str(tmp_path / "nope"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        resolve(str(tmp_path / "empty"))
