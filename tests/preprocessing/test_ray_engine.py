"""The Ray Data engine on a local Ray cluster gives the local engine's manifest."""

from __future__ import annotations

import os

import pytest

from molds.data.manifest import Manifest, manifest_hash

from .conftest import run_etl

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_engine_manifest_identical_to_local(local_ray, dirty_csv, dirty_run, tmp_path):
    local_out, local = dirty_run
    out = str(tmp_path / "ray")
    remote = run_etl(out, [dirty_csv[0]], id_column="id", label_columns=["logp"], engine="ray")
    assert manifest_hash(remote) == manifest_hash(local)
    assert remote["splits"] == local["splits"]  # same shards, byte for byte (sha256)
    m = Manifest.load(out)
    for shard in m.shards("train"):
        m.verify_shard(shard)
    assert os.listdir(os.path.join(out, "tokenizer")) and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
