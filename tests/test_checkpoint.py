"""A crash in the middle of a save leaves the previous checkpoint whole and `latest` on it;
references resolve the same everywhere; a missing `latest` falls back to the newest
complete checkpoint."""

from __future__ import annotations

import json
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


def _manifest(directory, note: str) -> str:
    """A minimal manifest (what ``Manifest.load`` checks) whose content hash depends on ``note``."""
    from molds.data.manifest import FORMAT_VERSION

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "manifest.json"), "w") as fh:
        json.dump({"format_version": FORMAT_VERSION, "created": "now", "canonicalization": {"note": note},
                   "tokenizer": {"path": "tokenizer"}, "splits": {}, "stats": {}}, fh)
    return str(directory)


def _lineage(given: str, manifest_hash: str, absolute: str | None = None) -> dict:
    return {"recipe": {"data": {"manifest": given}}, "manifest_hash": manifest_hash,
            **({"manifest_dir": absolute} if absolute else {})}


def test_a_checkpoint_finds_its_manifest_from_any_directory(tmp_path, monkeypatch):
    """Training records the manifest's path as given (relative to where it ran) and, now, made
    absolute: a checkpoint opened from another directory finds its manifest either way. An
    older lineage (the relative path alone) is found under a directory above the checkpoint,
    only where the content hash is the lineage's; where none is, one line says --manifest."""
    from molds.checkpoint import trained_manifest
    from molds.data.manifest import Manifest

    project = tmp_path / "project"
    right = _manifest(project / "data" / "set", "right")
    decoy = _manifest(project / "runs" / "data" / "set", "decoy")  # nearer the checkpoint, another content
    checkpoint = project / "runs" / "r" / "checkpoints" / "step-00000010"
    os.makedirs(checkpoint)
    want = Manifest.load(right)
    elsewhere = tmp_path / "elsewhere"
    os.makedirs(elsewhere)
    monkeypatch.chdir(elsewhere)
    # a lineage written now: the absolute path
    got = trained_manifest(str(checkpoint), _lineage("data/set", want.hash, os.path.abspath(right)))
    assert got.hash == want.hash
    # an older lineage: the relative path under the checkpoint's parents, the decoy passed over
    got = trained_manifest(str(checkpoint), _lineage("data/set", want.hash))
    assert os.path.samefile(got.path, os.path.join(right, "manifest.json"))
    assert Manifest.load(decoy).hash != want.hash
    # from the directory training ran in, the path as given, as before
    monkeypatch.chdir(project)
    assert trained_manifest(str(checkpoint), _lineage("data/set", "another")).path == "data/set/manifest.json"
    # nowhere: one line that names the path and the way out
    monkeypatch.chdir(elsewhere)
    with pytest.raises(CheckpointError, match=r"trained on the manifest data/set, .*give its directory with "
                                              r"--manifest"):
        trained_manifest(str(checkpoint), _lineage("data/set", "another"))
    for damaged in ({"recipe": {}}, {"recipe": []}, {"recipe": {"data": "x"}}, {"recipe": {"data": {"manifest": 3}}}):
        with pytest.raises(CheckpointError, match="names no data.manifest"):
            trained_manifest(str(checkpoint), damaged)
