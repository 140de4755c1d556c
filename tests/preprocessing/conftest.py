"""Dirty, vendor-style inputs built from the bundled MOSES sample, and ETL runs over them."""

from __future__ import annotations

import gzip
import os
import random

import pytest

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "molds", "sample_data", "moses_sample.csv.gz")

# (smiles field as written in the CSV, label) — each is a real failure mode of vendor dumps.
DIRTY_ROWS = [
    ("C1CC", "1.0"),  # unclosed ring
    ("C(C)(C)(C)(C)C", "2.0"),  # pentavalent carbon
    ("c1cccc1", "0.5"),  # cannot kekulize
    ("", "1"),  # empty field
    ("   ", ""),  # whitespace only
    ("CC O", "3"),  # embedded whitespace: RDKit would silently drop " O"
    ("  CCO  ", "NA"),  # padded but fine
    ('"CC(=O)O.[Na+]"', "7"),  # quoted, salt
    ("[2H]C([2H])([2H])C(=O)O", "1e-3"),  # isotopes
    ("OC(=O)[C@@H](N)C", "-2"),  # stereo
    ("N[C@@H](C)C(=O)O", "n/a"),  # same molecule written differently -> duplicate
    ("C(C)N", "not-a-number"),  # bad label
    ("C" * 600, "1"),  # longer than max_smiles_length
    ("C" * 200, "1"),  # too many heavy atoms
    ("[H][H]", "1"),  # hydrogen only: zero heavy atoms but a molecule
    ("Xx", "1"),  # not an element
    ("c1ccccc1Cl", "4"),
    ("Clc1ccccc1", "4"),  # duplicate of the line above in another form
    ("C1=CC=CC=C1Cl", "4"),  # and a Kekulé form of it
]


def randomized_smiles(smiles: str, rng: random.Random) -> str:
    from rdkit import Chem

    mol = Chem.MolFromSmiles(smiles)
    return Chem.MolToSmiles(mol, doRandom=True, canonical=False) if mol is not None else smiles


def sample_smiles(n: int, offset: int = 0) -> list[str]:
    with gzip.open(SAMPLE, "rt") as fh:
        next(fh)
        rows = [line.strip() for line in fh]
    return rows[offset:offset + n]


@pytest.fixture(scope="session")
def dirty_csv(tmp_path_factory):
    """A gzipped CSV with ids and one label column, CRLF line ends, bad bytes, wrong
    field counts, quoted commas, and molecules repeated in non-canonical forms.

    Returns (path, records, broken): records are the (id, smiles, label) of every
    well-formed row, as written; broken counts rows that are not well-formed.
    """
    rng = random.Random(7)
    base = sample_smiles(2500)
    records = [(f"M{i}", smi, f"{rng.uniform(-3, 5):.3f}") for i, smi in enumerate(base)]
    records += [(f"R{i}", randomized_smiles(smi, rng), "") for i, smi in enumerate(base[:300])]
    records += [(f"D{i}", smi.strip('"'), label) for i, (smi, label) in enumerate(DIRTY_ROWS)]
    records += [("Q1", "CCO", "1.5"), ("Q2", "CC,O", "1.5")]  # quoted; a comma inside a SMILES
    lines = [b"id,smiles,logp\r\n"]
    for cid, smi, label in records:
        field = f'"{smi}"' if ("," in smi or cid.startswith("Q")) else smi
        lines.append(f"{cid},{field},{label}\r\n".encode())
    broken = [b"B1,CCN,1,extra\r\n", b"B2,CCCN\r\n", b"B3,CC\xff\xfeO,1\r\n", b"B4,CCO,\x00\r\n"]
    lines[1000:1000] = broken  # in the middle of the file, not at the end
    path = tmp_path_factory.mktemp("raw") / "vendor.csv.gz"
    with gzip.open(path, "wb") as fh:
        fh.write(b"".join(lines))
    return str(path), records, len(broken)


def run_etl(output: str, inputs, **overrides) -> dict:
    import json

    from molds.preprocessing.config import PreprocessConfig
    from molds.preprocessing.pipeline import run

    options = dict(input=list(inputs), output=output, smiles_column="smiles", workers=2, progress=False,
                   shard_size_mb=0.05, partition_rows=700, chunk_rows=500)
    options.update(overrides)
    manifest = run(PreprocessConfig(**options))
    with open(manifest) as fh:
        return json.load(fh)


@pytest.fixture(scope="session")
def dirty_run(dirty_csv, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("etl") / "dirty")
    manifest = run_etl(out, [dirty_csv[0]], id_column="id", label_columns=["logp"])
    return out, manifest
