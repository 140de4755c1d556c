"""``--unit_template``: conformer units from JSON-lines records that already hold a
conformer. Each kept unit is the row's canonical SMILES with the record's conformer moved
into that SMILES' atom order (checked against RDKit's symmetry-aware RMSD to the input
geometry, not against the code's own atom map), exact to its precision; every refused row
is counted under its reason, one test row per reason; a template that cannot spell a unit,
a misspelt key and a non-JSONL input are refused before any row is kept."""

from __future__ import annotations

import json
import os
import random

import pytest

from molds.chemistry.conformers import format_unit, parse_unit

from .conftest import placed, run_etl, sample_smiles, shard_rows

TEMPLATE = "[SMILES]{smiles}[/SMILES][CONFORMER]{xyz}[/CONFORMER]"


def _embedded(smiles: str, seed: int):
    """(the mol with hydrogens, its heavy-atom mol) of one MMFF conformer, atoms in the order of ``smiles``."""
    from rdkit import Chem
    from rdkit.Chem import AllChem

    mol = Chem.AddHs(Chem.MolFromSmiles(smiles))
    assert AllChem.EmbedMolecule(mol, randomSeed=seed) == 0
    AllChem.MMFFOptimizeMolecule(mol)
    return mol, Chem.RemoveHs(mol)


def _text(positions, digits: int = 4) -> str:
    return ";".join(",".join(f"{c:.{digits}f}" for c in row) for row in positions)


@pytest.fixture(scope="module")
def records():
    """Good records (SMILES in a random spelling, the conformer in that spelling's atom
    order, half as text with 4 decimals and half as a list of triples), one record per
    refusal reason, and a second conformer of the first molecule (a duplicate)."""
    from rdkit import Chem

    rng = random.Random(3)
    good = []
    for i, canonical in enumerate(sample_smiles(40, offset=900)):
        spelled = Chem.MolToSmiles(Chem.MolFromSmiles(canonical), doRandom=True, canonical=False)
        _, heavy = _embedded(spelled, seed=i)
        positions = heavy.GetConformer().GetPositions().tolist()
        shifted = [[x + 30.0, y - 12.5, z + 4.0] for x, y, z in positions]  # a frame away from the origin
        good.append({"smiles": spelled, "xyz": _text(shifted) if rng.random() < 0.5 else shifted, "id": f"G{i}"})
    first = good[0]["smiles"]
    _, again = _embedded(first, seed=99)
    duplicate = {"smiles": first, "xyz": again.GetConformer().GetPositions().tolist(), "id": "DUP"}
    with_h, heavy = _embedded("CCOC(=O)c1ccccc1", seed=1)
    pos = heavy.GetConformer().GetPositions().tolist()
    _, alanine = _embedded("N[C@@H](C)C(=O)O", seed=1)  # L-alanine
    bad = {
        "unit_missing_field": {"smiles": "CCOC(=O)c1ccccc1", "id": "B1"},  # no conformer at all
        "unit_malformed": {"smiles": "CCOC(=O)c1ccccc1", "xyz": _text(pos).replace(";", ",", 1), "id": "B2"},
        "unit_smiles_mismatch": {"smiles": "CCOC(=O)c1ccccc1.Cl", "xyz": pos + [[9.0, 9.0, 9.0]], "id": "B3"},
        "unit_atom_count": {"smiles": "CCOC(=O)c1ccccc1",  # hydrogens' coordinates too
                            "xyz": with_h.GetConformer().GetPositions().tolist(), "id": "B4"},
        "unit_geometry": {"smiles": "CCOC(=O)c1ccccc1", "xyz": [[x / 10, y / 10, z / 10] for x, y, z in pos],
                          "id": "B5"},  # nm, not Å
        "unit_stereo": {"smiles": "N[C@@H](C)C(=O)O", "id": "B6",  # its mirror image: D-alanine's geometry
                        "xyz": [[-x, y, z] for x, y, z in alanine.GetConformer().GetPositions().tolist()]},
    }
    return good, duplicate, bad


def _given(record) -> list:
    """A good record's conformer as numbers (it holds a list, or text with 4 decimals)."""
    xyz = record["xyz"]
    return xyz if isinstance(xyz, list) else [list(map(float, atom.split(","))) for atom in xyz.split(";")]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def etl(records, tmp_path_factory):
    good, duplicate, bad = records
    d = tmp_path_factory.mktemp("units")
    path = _write(d / "in.jsonl", good + [duplicate] + list(bad.values()))
    out = str(d / "out")
    m = run_etl(out, [path], unit_template=TEMPLATE, id_column="id", largest_fragment=True,
                split_fractions=[1.0, 0.0, 0.0])
    return out, m, shard_rows(out, m)


def test_each_unit_is_the_input_conformer_in_the_canonical_smiles_atom_order(records, etl):
    """RDKit's GetBestRMS (all symmetry-equivalent atom maps, optimal superposition) between
    the unit's geometry on its canonical SMILES and the record's own: below the rounding."""
    from rdkit import Chem
    from rdkit.Chem import rdMolAlign

    good, _, _ = records
    out, m, rows = etl
    assert m["representation"]["name"] == "conformer" and m["representation"]["template"] == TEMPLATE
    by_id = {r["compound_id"]: r for r in rows}
    assert set(by_id) == {g["id"] for g in good}

    for g in good:
        row = by_id[g["id"]]
        smiles, coords = parse_unit(row["text"])
        assert smiles == row["canonical_smiles"] == Chem.MolToSmiles(Chem.MolFromSmiles(g["smiles"]))
        assert format_unit(smiles, coords, 2) == row["text"]  # exact to its precision
        given = _given(g)
        rms = rdMolAlign.GetBestRMS(placed(smiles, coords), placed(g["smiles"], given))
        assert rms < 0.006, (g["id"], rms)  # 2 decimals: each coordinate within 0.005 Å
        center = [sum(c[k] for c in coords) / len(coords) for k in range(3)]
        assert max(map(abs, center)) < 0.01  # the canonical frame: centroid at the origin


def test_every_refusal_is_counted_under_its_reason_and_the_duplicate_under_duplicates(records, etl):
    good, _, bad = records
    out, m, rows = etl
    stats = m["stats"]
    assert stats["rejected"] == {reason: 1 for reason in bad}
    assert stats["rows_in"] == len(good) + 1 + len(bad)
    assert stats["rows_out"] == len(rows) == len(good)
    assert stats["duplicates"] == 1
    assert next(r for r in rows if r["compound_id"] == "G0")  # the first of the two conformers is the one kept
    examples = json.load(open(os.path.join(out, "report.json")))["rejected_examples"]
    assert "no value for 'xyz'" in examples["unit_missing_field"][0][1]
    assert "21 x,y,z for 11 heavy atoms" in examples["unit_atom_count"][0][1]
    assert "not in 0.9-3.2 A" in examples["unit_geometry"][0][1]


def test_the_frame_as_given_keeps_the_records_coordinates(records, tmp_path):
    from rdkit import Chem

    good, _, _ = records
    path = _write(tmp_path / "in.jsonl", good[:6])
    out = str(tmp_path / "out")
    m = run_etl(out, [path], unit_template=TEMPLATE, conformer_frame="as_given", conformer_decimals=3,
                split_fractions=[1.0, 0.0, 0.0])
    assert m["representation"]["frame"] == "as_given" and m["representation"]["decimals"] == 3
    for row in shard_rows(out, m):
        g = next(g for g in good if Chem.MolToSmiles(Chem.MolFromSmiles(g["smiles"])) == row["canonical_smiles"])
        given = _given(g)
        mol = Chem.MolFromSmiles(g["smiles"])
        Chem.MolToSmiles(mol)
        order = list(mol.GetPropsAsDict(True, True)["_smilesAtomOutputOrder"])
        smiles, coords = parse_unit(row["text"])
        # no symmetric choice to hide behind here: each atom exactly where the record put it
        assert coords == [[round(c, 3) + 0.0 for c in given[i]] for i in order]


def test_a_field_holding_whole_units_and_no_decimals(records, tmp_path):
    """``{unit}``: the record holds the unit itself (in any spelling and frame); with 0
    decimals the numbers are whole Å and the unit still reads back."""
    good, _, _ = records
    rows = [{"smiles": g["smiles"],
             "unit": f"[SMILES]{g['smiles']}[/SMILES][CONFORMER]"
                     f"{g['xyz'] if isinstance(g['xyz'], str) else _text(g['xyz'], 6)}[/CONFORMER]"}
            for g in good[:5]]
    out = str(tmp_path / "out")
    m = run_etl(out, [_write(tmp_path / "in.jsonl", rows)], unit_template="{unit}", conformer_decimals=0,
                split_fractions=[1.0, 0.0, 0.0])
    kept = shard_rows(out, m)
    assert len(kept) == 5 and not m["stats"]["rejected"]
    for row in kept:
        smiles, coords = parse_unit(row["text"])
        assert smiles == row["canonical_smiles"] and "." not in row["text"].split("[CONFORMER]")[1]
        assert format_unit(smiles, coords, 0) == row["text"]


def test_units_load_and_score_as_etkdg_units_do(etl):
    """The same tokenizer rule (tags whole, numbers digit by digit) and molds-eval's
    conformer metrics: the input's MMFF conformers pass the bond check."""
    from transformers import AutoTokenizer

    from molds.chemistry.conformers import conformer_metrics

    out, m, rows = etl
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "tokenizer"), local_files_only=True)
    ids = tok(rows[0]["text"], add_special_tokens=False)["input_ids"]
    assert ids == rows[0]["token_ids"][1:-1] or ids == rows[0]["token_ids"]
    assert tok.convert_ids_to_tokens(ids)[0] == "[SMILES]"
    metrics = conformer_metrics([r["text"] for r in rows[:10]])
    assert metrics["conformer_decodes"] == 1.0 and metrics["conformer_bonds_ok"] == 1.0

    from tests.data.conftest import make_loader

    seq_len = 400  # shorter than some units: each is cut in place once, and counted
    start = tok.convert_tokens_to_ids("[SMILES]")
    documents, stats = 0, {}
    for batch in make_loader(out, seq_len=seq_len, micro_batch_size=2, mode="packed", max_epochs=1):
        for row, doc in zip(batch["input_ids"].tolist(), batch["document_ids"].tolist()):
            for d in sorted(set(doc) - {-1}):
                first = doc.index(d)
                assert row[first] == tok.bos_token_id and row[first + 1] == start
                documents += 1
        stats = batch["stats"]
    over = sum(r["token_length"] + 2 > seq_len for r in rows)
    assert documents == len(rows) and 0 < over < len(rows) and stats["truncated"] == over


@pytest.mark.parametrize("overrides, message", [
    (dict(unit_template="[SMILES]{smiles} {xyz}"), r"--unit_template .*may only be the unit's tags"),
    (dict(unit_template="[SMILES]{smiles!r}[/SMILES]"), r"--unit_template .*plain \{key\}"),
    (dict(unit_template="[SMILES][/SMILES]"), r"--unit_template .*names no field"),
    (dict(unit_template=TEMPLATE, conformers="etkdg"), r"--unit_template .*--conformers etkdg.*one of the two"),
    (dict(unit_template=TEMPLATE, representation="selfies"), r"--unit_template .*--representation smiles"),
    (dict(conformers="etkdg", conformer_frame="as_given"), r"--conformer_frame as_given .*--unit_template"),
    (dict(unit_template=TEMPLATE, randomized_variants=2), r"--randomized_variants .*no --unit_template"),
])
def test_misused_options_are_refused_by_name(records, tmp_path, overrides, message):
    good, _, _ = records
    with pytest.raises(ValueError, match=message):
        run_etl(str(tmp_path / "out"), [_write(tmp_path / "in.jsonl", good[:3])], **overrides)
    assert not os.path.exists(tmp_path / "out")


def test_a_misspelt_key_or_another_input_format_is_refused_naming_the_file(records, tmp_path):
    from molds.preprocessing.readers import InputError

    good, _, _ = records
    path = _write(tmp_path / "in.jsonl", good[:3])
    with pytest.raises(InputError, match=r"in.jsonl: no record has a value for the key\(s\) \['coords'\].*'xyz'"):
        run_etl(str(tmp_path / "a"), [path], unit_template="[SMILES]{smiles}[/SMILES][CONFORMER]{coords}[/CONFORMER]")
    csv = tmp_path / "in.csv"
    csv.write_text("smiles,xyz\nCCO,1\n")
    with pytest.raises(InputError, match=r"--unit_template reads .*JSON-lines.*in.csv is csv"):
        run_etl(str(tmp_path / "b"), [path, str(csv)], unit_template=TEMPLATE)


@pytest.mark.parametrize("value, reason, detail", [
    (" 0, 0 ,0 ; 1.43e0,0,0;+2.1,1.2,.0 ", None, None),  # spaces, exponents, signs, no leading digit: read
    ([[0, 0, 0], [1.43, 0, 0], [2.1, 1.2, 0]], None, None),
    ("0,0,0;1.43,0,0;2.1,1.2", "unit_malformed", "atom 2 is '2.1,1.2', not x,y,z"),
    ("0,0,0;1.43,0,0;2.1,1.2,nan", "unit_malformed", "atom 2"),
    ([[0, 0, 0], [1.43, 0, 0], [2.1, 1.2, 10 ** 400]], "unit_malformed", "holds list"),  # beyond float64
    ([[0, 0, 0], [1.43, 0, 0], [2.1, 1.2, 2e4]], "unit_malformed", "beyond 10,000 A"),
    ([[0, 0, 0], [1.43, 0, 0], [2.1, 1.2]], "unit_malformed", "holds list"),
    ({"x": 1}, "unit_malformed", "holds dict"),
    ("0,0,0;1.43,0,0;2.1,1.2,0\u0000", "unit_malformed", "holds str"),
    ([[0, 0, 0], [1.43, 0, 0]], "unit_atom_count", "2 x,y,z for 3 heavy atoms"),
    ([[0, 0, 0], [1.43, 0, 0], [0.2, 0, 0]], "unit_geometry", "apart"),  # O and the C it is not bonded to
])
def test_what_a_field_may_hold(value, reason, detail):
    from molds.chemistry.conformers import UnitTemplate

    unit, got, example = UnitTemplate(TEMPLATE).build("CCO", {"smiles": "OCC", "xyz": value})
    assert got == reason and (detail is None or detail in example), example
    if reason is None:
        smiles, coords = parse_unit(unit)
        assert smiles == "CCO" and len(coords) == 3


def test_stereo_the_smiles_specifies_must_be_the_conformers():
    """A mirror image of a chiral molecule, or the cis geometry under a trans SMILES, is
    refused; stereo the SMILES leaves open, and E/Z under a mirror, is not."""
    from rdkit import Chem

    from molds.chemistry.conformers import UnitTemplate

    template = UnitTemplate(TEMPLATE)

    def positions(smiles):
        return _embedded(smiles, seed=2)[1].GetConformer().GetPositions().tolist()

    def build(smiles, xyz):
        return template.build(Chem.MolToSmiles(Chem.MolFromSmiles(smiles)), {"smiles": smiles, "xyz": xyz})

    chiral, trans, cis = positions("N[C@@H](C)C(=O)O"), positions("C/C=C/C(=O)O"), positions("C/C=C\\C(=O)O")
    mirror = [[-x, y, z] for x, y, z in chiral]
    assert build("N[C@@H](C)C(=O)O", chiral)[1] is None
    unit, reason, example = build("N[C@@H](C)C(=O)O", mirror)
    assert reason == "unit_stereo" and "is R in 3D, S in the SMILES" in example
    assert build("NC(C)C(=O)O", mirror)[1] is None  # no stereo written: either hand is the molecule
    assert build("C/C=C/C(=O)O", [[-x, y, z] for x, y, z in trans])[1] is None
    unit, reason, example = build("C/C=C/C(=O)O", cis)
    assert reason == "unit_stereo" and "is Z in 3D, E in the SMILES" in example


def test_a_unit_smiles_that_does_not_parse_or_is_too_long_is_a_mismatch():
    from molds.chemistry.conformers import UnitTemplate

    template = UnitTemplate("{unit}")
    assert template.build("CCO", {"unit": "[SMILES]C1CC[/SMILES][CONFORMER]0,0,0[/CONFORMER]"})[1] == (
        "unit_smiles_mismatch")
    assert template.build("CCO", {"unit": f"[SMILES]{'C' * 30000}[/SMILES][CONFORMER]0,0,0[/CONFORMER]"})[1] == (
        "unit_smiles_mismatch")


def test_without_stereo_an_isotope_labelled_molecule_keeps_its_label(tmp_path):
    """``--keep_stereo false`` drops stereo from the canonical SMILES and keeps isotopes
    (a 13C or deuterium label); the unit's SMILES is held to the same rule, so a labelled
    record is kept, stereo or not."""
    from rdkit import Chem

    rows = []
    for i, smiles in enumerate(["[13CH3]OC(=O)c1ccccc1", "[2H]C([2H])([2H])N[C@@H](C)C(=O)O", "C/C=C/C(=O)OC"]):
        mol, _ = _embedded(smiles, seed=i)
        heavy = Chem.RemoveHs(mol)  # the deuteriums stay: isotopes are no plain hydrogens
        rows.append({"smiles": smiles, "xyz": heavy.GetConformer().GetPositions().tolist()})
    out = str(tmp_path / "out")
    m = run_etl(out, [_write(tmp_path / "in.jsonl", rows)], unit_template=TEMPLATE, keep_stereo=False,
                split_fractions=[1.0, 0.0, 0.0])
    assert not m["stats"]["rejected"]
    assert sorted(parse_unit(r["text"])[0] for r in shard_rows(out, m)) == sorted(
        ["[13CH3]OC(=O)c1ccccc1", "[2H]C([2H])([2H])NC(C)C(=O)O", "CC=CC(=O)OC"])
