"""Fault 4: corrupt, truncated or deleted shards, wrong row counts, a manifest edited
after the start. Each is detected, naming the shard (or the manifest), before it can
feed a step; a resume refuses a changed manifest unless the run is forked."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.dist.spawn import run_ranks
from tests.faults.common import argv, train_with


def _copy(dataset, tmp_path):
    dst = str(tmp_path / "data")
    shutil.copytree(dataset, dst)
    return dst


def _victim(data):
    m = json.load(open(os.path.join(data, "manifest.json")))
    return m, m["splits"]["train"][2]


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete", "row-count"])
@pytest.mark.parametrize("verify", ["eager", "lazy"])
def test_damaged_shard_is_named(dataset, tmp_path, damage, verify):
    from molds.errors import ManifestError
    from molds.train import main

    data = _copy(dataset, tmp_path)
    m, shard = _victim(data)
    path = os.path.join(data, shard["uri"])
    if damage == "corrupt":
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) // 2)
            fh.write(b"\xff\x00\xff\x00")
    elif damage == "truncate":
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) // 2)
    elif damage == "delete":
        os.remove(path)
    else:
        shard["num_rows"] += 1
        json.dump(m, open(os.path.join(data, "manifest.json"), "w"))
    with pytest.raises(ManifestError, match=shard["uri"]):
        main(argv(data, str(tmp_path / "run"), "ddp", 200, "--data.verify", verify, "--checkpoint.interval_steps", "0"))


def test_a_skipped_shard_is_logged_to_the_metrics_and_tensorboard(dataset, tmp_path, capsys):
    """``data.on_bad_shard: skip``: the run goes on without the shard, and says so where its
    figures are read: ``data/skipped_shards`` and ``data/skipped_rows`` in metrics.jsonl and
    TensorBoard (the shard's rows from the manifest), the reason as TensorBoard text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from molds.train import main

    data = _copy(dataset, tmp_path)
    m, shard = _victim(data)
    with open(os.path.join(data, shard["uri"]), "r+b") as fh:
        fh.seek(100)
        fh.write(b"\xff\x00\xff\x00")
    out = str(tmp_path / "run")
    main(argv(data, out, "ddp", 3, "--data.on_bad_shard", "skip", "--data.max_skipped_fraction", "0.2"))
    assert f"{shard['uri']}" in capsys.readouterr().err
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    logged = [r for r in rows if "data/skipped_shards" in r]
    assert logged and logged[0]["data/skipped_shards"] == 1 and logged[0]["data/skipped_rows"] == shard["num_rows"]
    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [e.value for e in acc.Scalars("data/skipped_shards")] == [1]
    assert [e.value for e in acc.Scalars("data/skipped_rows")] == [shard["num_rows"]]
    text = [t for t in acc.Tags()["tensors"] if t.startswith("data/skipped_shards")]
    assert text and shard["uri"] in acc.Tensors(text[0])[0].tensor_proto.string_val[0].decode()


def test_shard_changed_on_disk_after_the_start_is_refused(dataset, tmp_path):
    from molds.data.loader import MoleculeLoader
    from molds.errors import ManifestError
    from molds.recipe.sections import DataConfig

    data = _copy(dataset, tmp_path)
    loader = MoleculeLoader(DataConfig(manifest=data, seq_len=128, micro_batch_size=2, shuffle=False, max_epochs=1))
    m, shard = _victim(data)
    path = os.path.join(data, shard["uri"])
    os.utime(path, ns=(0, 12345))  # a rewrite (new mtime) after the run checked it
    with pytest.raises(ManifestError, match=f"{shard['uri']}.*changed on disk after the run checked it"):
        list(loader)


def test_manifest_edited_after_the_start_stops_before_saving(dataset, tmp_path):
    data = _copy(dataset, tmp_path)
    out = str(tmp_path / "run")
    with pytest.raises(Exception, match=r"ManifestError: .*manifest.json changed after the run started"):
        run_ranks(train_with, 1, argv(data, out, "ddp", 6), "edit-manifest", 3)
    latest = open(os.path.join(out, "checkpoints", "latest")).read()
    assert latest == "step-00000002"  # the checkpoint before the edit; nothing saved after it
    from molds.errors import CheckpointError
    from molds.train import main

    with pytest.raises(CheckpointError, match="another manifest"):  # and resume refuses the edited manifest
        main(argv(data, out, "ddp", 6, "--checkpoint.resume", "auto"))
    result = main(argv(data, str(tmp_path / "fork"), "ddp", 2, "--checkpoint.resume", out,
                       "--checkpoint.fork", "true"))
    assert result["step"] == 2
