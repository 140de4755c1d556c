"""A small preprocessed dataset with many row groups (units) and shards."""

from __future__ import annotations

import csv
import os

import pytest

from tests.preprocessing.conftest import sample_smiles


def _build(d, **options) -> str:
    from molds.preprocessing.config import PreprocessConfig
    from molds.preprocessing.pipeline import run

    path = d / "mols.csv"
    smiles = sample_smiles(3000, offset=2000)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["smiles", "y1", "y2"])
        for i, s in enumerate(smiles):
            w.writerow([s, i % 2 if i % 3 else "", (i % 7) / 7.0])
    out = str(d / "data")
    run(PreprocessConfig(input=[str(path)], output=out, label_columns=["y1", "y2"], workers=2, progress=False,
                         split="random", row_group_rows=97, shard_size_mb=0.06, **options))
    return out


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> str:
    return _build(tmp_path_factory.mktemp("dp"))


#: randomized spellings per training molecule in ``dataset_variants``
VARIANTS = 3


@pytest.fixture(scope="session")
def dataset_variants(tmp_path_factory) -> str:
    """``dataset``'s molecules with VARIANTS stored randomized spellings each."""
    return _build(tmp_path_factory.mktemp("dpv"), randomized_variants=VARIANTS)


REACTIONS = os.path.join(os.path.dirname(__file__), "..", "..", "molds", "sample_data",
                         "moses_sample_reactions.csv.gz")


def pair_manifest(d, rows: int, task: str) -> str:
    """The first ``rows`` reactions of the bundled reaction sample, preprocessed as ``task``
    pairs into ``d`` (the default split: by product scaffold, 80/10/10)."""
    import gzip

    from molds.preprocessing.config import PreprocessConfig
    from molds.preprocessing.pipeline import run

    with gzip.open(REACTIONS, "rt") as fh:
        body = list(csv.reader(fh))[:rows + 1]
    with open(d / "reactions.csv", "w", newline="") as fh:
        csv.writer(fh).writerows(body)
    out = str(d / task)
    run(PreprocessConfig(input=[str(d / "reactions.csv")], output=out, smiles_column="reactants>reagents>production",
                         id_column="id", task=task, workers=1, progress=False))
    return out


def make_loader(dataset: str, rank: int = 0, world: int = 1, **overrides):
    from molds.data.loader import MoleculeLoader
    from molds.recipe.sections import DataConfig

    options = dict(manifest=dataset, seq_len=128, micro_batch_size=4, lookahead=64, shuffle_window=300,
                   max_epochs=1)
    options.update(overrides)
    return MoleculeLoader(DataConfig(**options), rank=rank, world_size=world)


def train_rows(dataset: str) -> int:
    import json

    with open(os.path.join(dataset, "manifest.json")) as fh:
        return json.load(fh)["stats"]["splits"]["train"]["rows"]
