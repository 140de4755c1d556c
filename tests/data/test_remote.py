"""A manifest and its shards served over HTTP (fsspec's HTTP filesystem) train as the
local ones do: the same losses and manifest hash, every shard's sha256 checked as it is
read, and uris that leave the manifest's directory refused before anything is read."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from molds.errors import ManifestError
from tests.faults.common import argv, losses
from tests.http_server import serve_directory


def test_training_from_an_http_manifest_matches_the_local_one(dataset, tmp_path):
    from molds.train import main

    local = str(tmp_path / "local")
    main(argv(dataset, local, "ddp", 3))
    with serve_directory(dataset) as (url, requests):
        remote = str(tmp_path / "remote")
        main(argv(url, remote, "ddp", 3))
        shards = [r for r in requests if r.endswith(".parquet")]
    assert shards, "no shard was read over HTTP"
    assert losses(remote) == losses(local)
    a = json.load(open(os.path.join(local, "checkpoints", "step-00000003", "lineage.json")))
    b = json.load(open(os.path.join(remote, "checkpoints", "step-00000003", "lineage.json")))
    assert a["manifest_hash"] == b["manifest_hash"] and b["manifest"].startswith("http://")


def test_an_http_manifest_is_checked_as_a_local_one(dataset, tmp_path):
    from molds.data.manifest import Manifest

    served = tmp_path / "served"
    shutil.copytree(dataset, served / "data")
    (served / "secret.parquet").write_bytes(b"not yours")
    path = served / "data" / "manifest.json"
    m = json.load(open(path))
    good = json.dumps(m)
    m["splits"]["train"][0]["uri"] = "../secret.parquet"
    path.write_text(json.dumps(m))
    with serve_directory(str(served)) as (url, requests):
        with pytest.raises(ManifestError, match="leaves the manifest's directory; refused"):
            Manifest.load(f"{url}/data")
        assert not [r for r in requests if "secret" in r]
        # a shard whose bytes are not the ones the manifest lists: named when read
        m = json.loads(good)
        shard = m["splits"]["train"][0]
        with open(served / "data" / shard["uri"], "r+b") as fh:
            fh.seek(100)
            fh.write(b"\x00\x01\x02")
        path.write_text(good)
        remote = Manifest.load(f"{url}/data")
        with pytest.raises(ManifestError, match="sha256 .* does not match"):
            remote.verify_shard(remote.shards("train")[0])
