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


def shard_rows(output: str, manifest: dict, split: str = "train") -> list[dict]:
    """Every row of one split of an ETL output, shard by shard."""
    import pyarrow.parquet as pq

    return [r for s in manifest["splits"][split] for r in pq.read_table(os.path.join(output, s["uri"])).to_pylist()]


def placed(smiles: str, positions):
    """RDKit's molecule of ``smiles`` with one 3D conformer at ``positions`` (its atom order),
    built here and not by the code under test."""
    from rdkit import Chem
    from rdkit.Geometry import Point3D

    mol = Chem.MolFromSmiles(smiles)
    conf = Chem.Conformer(mol.GetNumAtoms())
    for i, p in enumerate(positions):
        conf.SetAtomPosition(i, Point3D(*p))
    conf.Set3D(True)
    mol.AddConformer(conf)
    return mol


@pytest.fixture(scope="session")
def dirty_run(dirty_csv, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("etl") / "dirty")
    manifest = run_etl(out, [dirty_csv[0]], id_column="id", label_columns=["logp"])
    return out, manifest


# ---------------------------------------------------------------- SD files

SDF_SMILES = sample_smiles(240, offset=9000)


def sd_record(smiles: str, title: str, props: dict, v3000: bool = False) -> str:
    from rdkit import Chem
    from rdkit.Chem import AllChem

    mol = Chem.MolFromSmiles(smiles)
    AllChem.Compute2DCoords(mol, sampleSeed=1)
    block = Chem.MolToV3KMolBlock(mol) if v3000 else Chem.MolToMolBlock(mol)
    lines = [title] + block.split("\n")[1:]
    text = "\n".join(lines).rstrip("\n") + "\n"
    for tag, value in props.items():
        text += f">  <{tag}>\n{value}\n\n"
    return text + "$$$$\n"


def _broken_atom_block(smiles: str) -> str:
    lines = sd_record(smiles, "broken-atoms", {"pIC50": "5"}).split("\n")
    lines[4] = lines[4][:20] + " garbage"  # the first atom line cut short
    return "\n".join(lines)


def _no_m_end(smiles: str) -> str:
    return sd_record(smiles, "no-m-end", {"pIC50": "5"}).replace("M  END\n", "")


def _pentavalent() -> str:
    text = sd_record("CC(C)(C)C", "pentavalent", {"pIC50": "1"})
    # one more bond on the central carbon: an impossible valence RDKit's sanitization refuses
    lines = text.split("\n")
    counts = lines[3]
    atoms, bonds = int(counts[:3]), int(counts[3:6])
    lines[3] = f"{atoms + 1:>3}{bonds + 1:>3}" + counts[6:]
    atom = "    1.0000    1.0000    0.0000 C   0  0  0  0  0  0  0  0  0  0  0  0"
    lines.insert(4 + atoms, atom)
    lines.insert(5 + atoms + bonds, f"{2:>3}{atoms + 1:>3}  1  0")
    return "\n".join(lines)


EMPTY_MOLECULE = ("empty\n     RDKit          2D\n\n  0  0  0  0  0  0  0  0  0  0999 V2000\nM  END\n"
                  ">  <pIC50>\n3\n\n$$$$\n")


@pytest.fixture(scope="session")
def hostile_sdf(tmp_path_factory):
    """Two SD files with every kind of record a vendor file has, and what each should give.

    Returns (paths, good, bad): ``good`` maps a record's title to (SMILES written, label or
    NaN); ``bad`` maps (file name, record number) to the expected reason.
    """
    d = tmp_path_factory.mktemp("sdf")
    rng = random.Random(11)
    good, bad = {}, {}
    parts_a, parts_b = [], []
    for i, smi in enumerate(SDF_SMILES[:120]):
        label = f"{rng.uniform(3, 9):.2f}"
        props = {"pIC50": label, "vendor_id": f"V{i}", "comment": "line one\nline two"}  # multi-line property
        if i % 7 == 0:
            props["pIC50"] = ""  # empty property: missing, NaN
            label = "nan"
        if i % 11 == 0:
            del props["pIC50"]  # no such tag in this record: missing, NaN
            label = "nan"
        parts_a.append(sd_record(smi, f"A{i}", props, v3000=i % 3 == 0))
        good[f"A{i}"] = (smi, float(label))
    bad_records = [("broken", _broken_atom_block(SDF_SMILES[0]), "sdf_parse_error"),
                   ("no M END", _no_m_end(SDF_SMILES[1]), "sdf_parse_error"),
                   ("empty molecule", EMPTY_MOLECULE, "empty_molecule"),
                   ("valence", _pentavalent(), "valence_error"),
                   ("bad label", sd_record("CCO", "bad-label", {"pIC50": "potent"}), "bad_label"),
                   ("empty record", "\n\n$$$$\n", "empty_record"),
                   # three lines and a $$$$: read with the next record, RDKit takes that record's title
                   # for this one's counts line and skips the next one entirely
                   ("short garbage", "garbage\nmore\n\n$$$$\n", "sdf_parse_error"),
                   # a block of NUL bytes where records were (a copy that did not finish writing them)
                   ("nul block", "\0" * 300 + "\n$$$$\n", "padding")]
    for k, (_, text, reason) in enumerate(bad_records):
        at = 10 + 17 * k
        parts_a.insert(at, text)
    for k, (_, text, reason) in enumerate(bad_records):
        bad[("a.sdf", parts_a.index(text) + 1)] = reason
    parts_a.append("\x1a")  # DOS's end-of-file mark after the last record
    bad[("a.sdf", len(parts_a))] = "padding"
    # file b: CRLF line ends, a V3000-only block, no $$$$ after its last record
    for i, smi in enumerate(SDF_SMILES[120:200]):
        parts_b.append(sd_record(smi, f"B{i}", {"pIC50": "7.5", "vendor_id": f"W{i}"}, v3000=i % 2 == 0))
        good[f"B{i}"] = (smi, 7.5)
    text_b = "".join(parts_b)
    text_b = text_b[: text_b.rindex("$$$$")]  # the last record has no separator
    (d / "a.sdf").write_bytes("".join(parts_a).encode())
    with gzip.open(d / "b.sdf.gz", "wb") as fh:
        fh.write(text_b.replace("\n", "\r\n").encode())
    return [str(d / "a.sdf"), str(d / "b.sdf.gz")], good, bad
