"""``--conformers sd``: conformer units from the 3D coordinates SD records hold (docking
poses, a vendor's 3D library). Each kept unit is the record's heavy-atom geometry on the
row's canonical SMILES (checked with RDKit's symmetry-aware RMSD against the record as RDKit
reads it, not against the code's own atom map), hydrogens written in the file or not, atoms
in any order, V2000 or V3000; a salt stripped by ``--largest_fragment`` keeps its
fragment's coordinates; 2D records, coordinates not in Å and coordinates beyond any frame
are refused under their reasons; misused options and non-SD inputs are refused before any
row is kept."""

from __future__ import annotations

import os
import random

import pytest

from molds.chemistry.conformers import format_unit, parse_unit

from .conftest import placed, run_etl, sample_smiles, shard_rows


def _conformer(smiles: str, seed: int, rng: random.Random):
    """``smiles`` with hydrogens and one MMFF conformer, its atoms in a random order and its
    frame moved away from the origin."""
    from rdkit import Chem
    from rdkit.Chem import AllChem
    from rdkit.Geometry import Point3D

    mol = Chem.AddHs(Chem.MolFromSmiles(smiles))
    assert AllChem.EmbedMolecule(mol, randomSeed=seed) == 0
    AllChem.MMFFOptimizeMolecule(mol)
    order = list(range(mol.GetNumAtoms()))
    rng.shuffle(order)
    mol = Chem.RenumberAtoms(mol, order)
    conf = mol.GetConformer()
    for i, p in enumerate(conf.GetPositions().tolist()):
        conf.SetAtomPosition(i, Point3D(p[0] + 25.0, p[1] - 8.0, p[2] + 3.5))
    return mol


def _block(mol, name: str, v3000: bool = False, hydrogens: bool = True) -> str:
    from rdkit import Chem

    mol = Chem.Mol(mol) if hydrogens else Chem.RemoveHs(mol)
    mol.SetProp("_Name", name)
    return Chem.MolToMolBlock(mol, forceV3000=v3000) + "$$$$\n"


def _read(mol):
    """The record's molecule as RDKit reads it (hydrogens removed; stereo from the 3D coordinates)."""
    from rdkit import Chem

    return Chem.MolFromMolBlock(Chem.MolToMolBlock(mol))


def _scaled(mol, factor: float):
    from rdkit import Chem
    from rdkit.Geometry import Point3D

    mol = Chem.Mol(mol)
    conf = mol.GetConformer()
    for i, p in enumerate(conf.GetPositions().tolist()):
        conf.SetAtomPosition(i, Point3D(*(c * factor for c in p)))
    return mol


@pytest.fixture(scope="module")
def records():
    """Good records (V2000 and V3000, with and without their hydrogens), a salt, a second
    pose of the first molecule (a duplicate), and one record per refusal."""
    from rdkit import Chem
    from rdkit.Chem import AllChem

    rng = random.Random(5)
    good = {}
    for i, smiles in enumerate(sample_smiles(24, offset=1200)):
        good[f"G{i}"] = _conformer(smiles, i, rng)
    salt = _conformer("CCN(CC)Cc1ccccc1.Cl", 1, rng)  # the HCl salt of an amine, as vendors list it
    flat = Chem.MolFromSmiles("CC(=O)Nc1ccc(O)cc1")
    AllChem.Compute2DCoords(flat)
    probe = good["G0"]
    bad = {
        "sd_not_3d": flat,  # 2D depiction coordinates: no conformer
        "unit_geometry": _scaled(probe, 0.1),  # nm, not Å
        "unit_malformed": _scaled(probe, 1200.0),  # beyond 10,000 Å: no frame of one molecule
    }
    text = "".join(_block(mol, name, v3000=k % 3 == 0, hydrogens=k % 2 == 0)
                   for k, (name, mol) in enumerate(good.items()))
    text += _block(salt, "SALT") + _block(_conformer(Chem.MolToSmiles(probe), 7, rng), "DUP")
    text += "".join(_block(mol, reason) for reason, mol in bad.items())
    return good, salt, bad, text


@pytest.fixture(scope="module")
def etl(records, tmp_path_factory):
    *_, text = records
    d = tmp_path_factory.mktemp("sdunits")
    (d / "in.sdf").write_text(text)
    out = str(d / "out")
    m = run_etl(out, [str(d / "in.sdf")], conformers="sd", id_column="_Name", largest_fragment=True,
                split_fractions=[1.0, 0.0, 0.0])
    return out, m, {r["compound_id"]: r for r in shard_rows(out, m)}


def test_each_unit_is_the_records_geometry_on_the_canonical_smiles(records, etl):
    from rdkit import Chem
    from rdkit.Chem import rdMolAlign

    good, _, _, _ = records
    out, m, rows = etl
    assert m["representation"]["name"] == "conformer" and "--conformers sd" in m["representation"]["method"]
    assert set(good) <= set(rows)
    for name, mol in good.items():
        row = rows[name]
        heavy = _read(mol)
        smiles, coords = parse_unit(row["text"])
        assert smiles == row["canonical_smiles"] == Chem.MolToSmiles(heavy)
        assert format_unit(smiles, coords, 2) == row["text"]  # exact to its precision
        rms = rdMolAlign.GetBestRMS(placed(smiles, coords), heavy)
        assert rms < 0.006, (name, rms)  # 2 decimals: each coordinate within 0.005 Å
        center = [sum(c[k] for c in coords) / len(coords) for k in range(3)]
        assert max(map(abs, center)) < 0.01  # the canonical frame: centroid at the origin


def test_a_stripped_salt_keeps_its_fragments_coordinates(records, etl):
    from rdkit import Chem
    from rdkit.Chem import rdMolAlign

    _, salt, _, _ = records
    out, m, rows = etl
    smiles, coords = parse_unit(rows["SALT"]["text"])
    assert smiles == "CCN(CC)Cc1ccccc1"
    amine = max(Chem.GetMolFrags(_read(salt), asMols=True), key=lambda f: f.GetNumAtoms())
    assert rdMolAlign.GetBestRMS(placed(smiles, coords), amine) < 0.006


def test_every_record_is_accounted_and_each_refusal_counted_under_its_reason(records, etl):
    good, _, bad, _ = records
    out, m, rows = etl
    stats = m["stats"]
    assert stats["rejected"] == {reason: 1 for reason in bad}
    assert stats["rows_in"] == len(good) + 2 + len(bad)
    assert stats["rows_out"] == len(rows) == len(good) + 1
    assert stats["duplicates"] == 1 and "DUP" not in rows  # the first pose in input order is kept
    import json

    examples = json.load(open(os.path.join(out, "report.json")))["rejected_examples"]
    assert "2D" in examples["sd_not_3d"][0][1]
    assert "not in 0.9-3.2 A" in examples["unit_geometry"][0][1]
    assert "beyond 10,000 A" in examples["unit_malformed"][0][1]


def test_the_frame_as_given_keeps_each_atom_where_the_record_put_it(records, tmp_path):
    """A docking pose stays in its pocket: RMSD without superposition (RDKit's CalcRMS,
    symmetry-aware) to the record's own heavy atoms, below the rounding."""
    from rdkit import Chem
    from rdkit.Chem import rdMolAlign

    good, _, _, _ = records
    names = list(good)[:6]
    path = tmp_path / "in.sdf"
    path.write_text("".join(_block(good[n], n, v3000=i % 2 == 1) for i, n in enumerate(names)))
    out = str(tmp_path / "out")
    m = run_etl(out, [str(path)], conformers="sd", conformer_frame="as_given", conformer_decimals=3,
                id_column="_Name", split_fractions=[1.0, 0.0, 0.0])
    assert m["representation"]["frame"] == "as_given" and m["representation"]["decimals"] == 3
    kept = shard_rows(out, m)
    assert len(kept) == len(names)
    for row in kept:
        smiles, coords = parse_unit(row["text"])
        rms = rdMolAlign.CalcRMS(placed(smiles, coords), _read(good[row["compound_id"]]))
        assert rms < 0.0006, (row["compound_id"], rms)  # 3 decimals


@pytest.mark.parametrize("overrides, message", [
    (dict(conformers="sd", representation="safe"), r"--conformers sd .*--representation smiles"),
    (dict(conformers="sd", unit_template="{unit}"), r"--unit_template .*--conformers sd reads them from SD records"),
    (dict(conformers="sd", conformer_mmff=False), r"--conformer_mmff .*etkdg.*come from the input"),
    (dict(conformers="sd", conformer_timeout_s=5), r"--conformer_timeout_s .*etkdg"),
    (dict(conformers="sd", randomized_variants=2), r"--randomized_variants .*--conformers none"),
    (dict(conformer_frame="as_given"), r"--conformer_frame as_given .*--conformers sd"),
    (dict(conformer_decimals=3), r"--conformer_decimals .*needs --conformers"),
    (dict(conformer_mmff=False), r"--conformer_mmff .*no conformers are made"),
])
def test_misused_options_are_refused_by_name(records, tmp_path, overrides, message):
    *_, text = records
    (tmp_path / "in.sdf").write_text(text)
    with pytest.raises(ValueError, match=message):
        run_etl(str(tmp_path / "out"), [str(tmp_path / "in.sdf")], **overrides)
    assert not os.path.exists(tmp_path / "out")


def test_an_input_that_is_not_sd_is_refused_naming_the_file(records, tmp_path):
    from molds.preprocessing.readers import InputError

    *_, text = records
    (tmp_path / "in.sdf").write_text(text)
    (tmp_path / "in.csv").write_text("smiles\nCCO\n")
    with pytest.raises(InputError, match=r"--conformers sd reads .*SD records.*in.csv is csv"):
        run_etl(str(tmp_path / "out"), [str(tmp_path / "in.sdf"), str(tmp_path / "in.csv")], conformers="sd")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("smiles, detail", [
    ("CC(C)(C)OC(=O)c1ccccc1", "sp3, 4 heavy neighbours"),  # cannot be flat
    ("CCOC(=O)C", "bonds all 1.50 A"),  # can be flat, but not with C=O as long as C-C
])
def test_a_drawing_whose_header_says_3d_is_refused_as_2d(tmp_path, smiles, detail):
    """Some exports write 3D in the header of every record. RDKit then reads a drawing
    (every z 0) as 3D; the ETL refuses it as ``sd_not_3d`` and says why."""
    import json

    from rdkit import Chem
    from rdkit.Chem import AllChem

    drawn = Chem.MolFromSmiles(smiles)
    AllChem.Compute2DCoords(drawn)
    block = Chem.MolToMolBlock(drawn).replace("2D", "3D", 1)
    assert Chem.MolFromMolBlock(block).GetConformer().Is3D()  # RDKit takes it as 3D
    placed = _conformer("CCO", 1, random.Random(0))  # and one real conformer, so that a row is kept
    (tmp_path / "in.sdf").write_text(block + "$$$$\n" + _block(placed, "ethanol"))
    out = tmp_path / "out"
    m = run_etl(str(out), [str(tmp_path / "in.sdf")], conformers="sd", split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rows_out"] == 1 and m["stats"]["rejected"] == {"sd_not_3d": 1}
    example = json.load(open(out / "report.json"))["rejected_examples"]["sd_not_3d"][0][1]
    assert "every z 0" in example and detail in example


def test_a_flat_conformer_of_a_flat_molecule_is_kept(tmp_path):
    """A real conformer of a flat molecule lying in the xy plane (a canonical frame) is a
    geometry: its bonds have their several lengths."""
    from rdkit import Chem
    from rdkit.Chem import AllChem, rdMolTransforms
    from rdkit.Geometry import Point3D

    mol = Chem.AddHs(Chem.MolFromSmiles("O=Cc1ccccc1"))
    assert AllChem.EmbedMolecule(mol, randomSeed=3) == 0
    AllChem.MMFFOptimizeMolecule(mol)
    conf = mol.GetConformer()
    rdMolTransforms.CanonicalizeConformer(conf)
    for i, (x, y, _) in enumerate(conf.GetPositions().tolist()):
        conf.SetAtomPosition(i, Point3D(x, y, 0.0))  # flat to the molfile's precision
    (tmp_path / "in.sdf").write_text(Chem.MolToMolBlock(mol) + "$$$$\n")
    m = run_etl(str(tmp_path / "out"), [str(tmp_path / "in.sdf")], conformers="sd", split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rows_out"] == 1 and not m["stats"]["rejected"]
