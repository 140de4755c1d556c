"""A crash in the middle of a save leaves the previous checkpoint whole and `latest` on it."""

from __future__ import annotations

import os

import pytest

from molds.checkpoint import find_checkpoint, save_checkpoint
from molds.distributed import DistInfo
from molds.recipe import Recipe


class _Engine:
    name = "fake"

    def __init__(self, fail=False):
        self.fail = fail

    def save(self, directory):
        with open(os.path.join(directory, "model.bin"), "w") as fh:
            fh.write("half")
        if self.fail:
            raise OSError("disk full")


def test_crash_mid_save_keeps_previous(tmp_path):
    import torch

    recipe = Recipe()
    recipe.run.output_dir = str(tmp_path)
    recipe.checkpoint.resume = "auto"
    recipe.checkpoint.keep_last = 2
    dist = DistInfo(0, 1, 0, torch.device("cpu"), None)
    first = save_checkpoint(recipe, _Engine(), dist, 10, {"vranks": {}}, {"manifest_hash": "m"})
    assert find_checkpoint(recipe) == first
    with pytest.raises(OSError):
        save_checkpoint(recipe, _Engine(fail=True), dist, 20, {"vranks": {}}, {"manifest_hash": "m"})
    assert find_checkpoint(recipe) == first
    assert sorted(os.listdir(first)) == ["data_state.json", "lineage.json", "model.bin", "rng-rank00000.pt"]
    second = save_checkpoint(recipe, _Engine(), dist, 20, {"vranks": {}}, {"manifest_hash": "m"})
    third = save_checkpoint(recipe, _Engine(), dist, 30, {"vranks": {}}, {"manifest_hash": "m"})
    assert find_checkpoint(recipe) == third
    assert not os.path.exists(first) and os.path.exists(second)  # keep_last=2
