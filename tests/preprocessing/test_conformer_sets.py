"""``--conformers_per_molecule``: sets that hold several conformers of one molecule (GEOM's
ensembles as JSON lines, a conformer generator's SD output). The first K distinct units of
each molecule in input order are kept as rows of their own (0: all), identical units once,
the rest counted as duplicates; a molecule's conformers never straddle splits; the output
does not depend on the worker count."""

from __future__ import annotations

import json
import os
import random

import pytest

from molds.chemistry.conformers import parse_unit
from molds.data.manifest import manifest_hash

from .conftest import run_etl, sample_smiles, shard_rows
from .test_unit_template import TEMPLATE, _embedded


@pytest.fixture(scope="module")
def ensembles(tmp_path_factory):
    """JSON lines: 30 molecules with 1-4 seeded conformers each, the records shuffled (a
    molecule's conformers need not be adjacent), and one conformer repeated exactly."""
    rng = random.Random(2)
    records, counts = [], {}
    for i, smiles in enumerate(sample_smiles(30, offset=2100)):
        n = 1 + i % 4
        counts[smiles] = n
        for k in range(n):
            _, heavy = _embedded(smiles, seed=100 * i + k)
            records.append({"smiles": smiles, "xyz": heavy.GetConformer().GetPositions().tolist(),
                            "id": f"M{i}-c{k}"})
    repeated = dict(records[5], id="REPEAT")
    rng.shuffle(records)
    records.append(repeated)
    path = tmp_path_factory.mktemp("sets") / "ensembles.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path), records, counts


def _moved(mol, dx: float):
    """``mol`` shifted by ``dx`` along x: two embeddings that relax to one minimum (a rigid
    molecule) stay two units in the as_given frame."""
    from rdkit.Geometry import Point3D

    conf = mol.GetConformer()
    for i, (x, y, z) in enumerate(conf.GetPositions().tolist()):
        conf.SetAtomPosition(i, Point3D(x + dx, y, z))
    return mol


def _rows(out, m):
    return {split: shard_rows(out, m, split) for split in m["splits"]}


@pytest.mark.parametrize("per_molecule", [0, 2])
@pytest.mark.parametrize("split", ["scaffold", "random"])
def test_the_first_k_conformers_of_each_molecule_are_kept_in_one_split(ensembles, tmp_path, per_molecule, split):
    from rdkit import Chem

    path, records, counts = ensembles
    out = str(tmp_path / "out")
    # as_given: two embeddings that relax to one minimum stay two units (their frames differ)
    m = run_etl(out, [path], unit_template=TEMPLATE, id_column="id", conformers_per_molecule=per_molecule,
                split=split, split_fractions=[0.6, 0.2, 0.2], conformer_frame="as_given")
    rows = _rows(out, m)
    kept = [r for split_rows in rows.values() for r in split_rows]
    want = {s: (n if per_molecule == 0 else min(n, per_molecule)) for s, n in counts.items()}
    assert m["stats"]["rows_out"] == len(kept) == sum(want.values())
    assert m["stats"]["duplicates"] == len(records) - len(kept)  # the repeat, and those past K
    assert m["dedupe"]["conformers_per_molecule"] == per_molecule
    assert f"- conformers kept a molecule: {per_molecule or 'all'} (its distinct units, first occurrence in input " \
        "order)" in open(os.path.join(out, "report.md")).read()
    by_molecule = {}
    for name, split_rows in rows.items():
        for r in split_rows:
            by_molecule.setdefault(r["canonical_smiles"], []).append((name, r))
    for smiles, got in by_molecule.items():
        assert len({name for name, _ in got}) == 1, smiles  # all in one split
        assert len(got) == want[Chem.MolToSmiles(Chem.MolFromSmiles(smiles))]
        assert len({r["text"] for _, r in got}) == len(got)  # distinct units
        # the first ones in input order: the records that came first for this molecule
        order = [r["id"] for r in records if Chem.MolToSmiles(Chem.MolFromSmiles(r["smiles"])) == smiles]
        expected = [i for i in order if i != "REPEAT"][:len(got)]
        assert sorted(r["compound_id"] for _, r in got) == sorted(expected)
        for _, r in got:
            assert parse_unit(r["text"])[0] == smiles


def test_one_conformer_a_molecule_is_the_default_and_the_output_does_not_depend_on_workers(ensembles, tmp_path):
    path, records, counts = ensembles
    one = run_etl(str(tmp_path / "one"), [path], unit_template=TEMPLATE, id_column="id")
    assert one["stats"]["rows_out"] == len(counts) and "conformers_per_molecule" not in one["dedupe"]
    a = run_etl(str(tmp_path / "a"), [path], unit_template=TEMPLATE, id_column="id", conformers_per_molecule=0,
                workers=1, partition_rows=50, conformer_frame="as_given")
    b = run_etl(str(tmp_path / "b"), [path], unit_template=TEMPLATE, id_column="id", conformers_per_molecule=0,
                workers=2, partition_rows=700, conformer_frame="as_given")
    assert a["stats"]["rows_out"] == len(records) - 1
    assert manifest_hash(a) == manifest_hash(b) and a["splits"] == b["splits"]


def test_an_sd_file_of_ensembles_and_inchikey_dedupe(tmp_path):
    """A conformer generator's SD output (each molecule's conformers one after another, one
    stereoisomer each), with InChIKey as the molecule's key: two stages, the same rule."""
    from .test_sd_conformers import _block, _conformer, _read

    from rdkit import Chem

    rng = random.Random(4)
    parts = []
    for i, smiles in enumerate(sample_smiles(8, offset=2500)):
        isomer = Chem.MolToSmiles(_read(_conformer(smiles, 10 * i, rng)))  # the stereo the first embedding took
        parts += [_block(_moved(_conformer(isomer, 10 * i + k, rng), 5.0 * k), f"M{i}-c{k}") for k in range(3)]
    (tmp_path / "omega.sdf").write_text("".join(parts))
    m = run_etl(str(tmp_path / "out"), [str(tmp_path / "omega.sdf")], conformers="sd", id_column="_Name",
                conformers_per_molecule=2, dedupe_key="inchikey", split_fractions=[1.0, 0.0, 0.0],
                conformer_frame="as_given")
    ids = sorted(r["compound_id"] for r in _rows(str(tmp_path / "out"), m)["train"])
    assert ids == sorted(f"M{i}-c{k}" for i in range(8) for k in range(2))
    assert m["stats"]["duplicates"] == 8


@pytest.mark.parametrize("overrides, message", [
    (dict(conformers_per_molecule=3), r"--conformers_per_molecule .*needs --unit_template or --conformers sd"),
    (dict(conformers="etkdg", conformers_per_molecule=0), r"--conformers_per_molecule .*ETKDG makes one"),
    (dict(unit_template=TEMPLATE, conformers_per_molecule=-1), r"--conformers_per_molecule must be 0"),
])
def test_misused_options_are_refused_by_name(ensembles, tmp_path, overrides, message):
    path, _, _ = ensembles
    with pytest.raises(ValueError, match=message):
        run_etl(str(tmp_path / "out"), [path], **overrides)
    assert not os.path.exists(tmp_path / "out")


def test_ranked_by_an_energy_each_molecule_keeps_its_lowest_conformers(ensembles, tmp_path):
    """``--conformer_rank_by energy``: the K lowest energies of each molecule (ties in input
    order), not the first K; a record without a number there is refused under its reason."""
    from rdkit import Chem

    _, records, counts = ensembles
    rng = random.Random(9)
    ranked = []
    for r in records:
        r = dict(r, energy=round(rng.uniform(-50.0, 50.0), 1) if r["id"] != "REPEAT" else 99.0)
        ranked.append(r)
    ranked[3]["energy"] = ranked[7]["energy"] = -1000.0  # ties: input order decides
    ranked[10].pop("energy")  # missing: refused
    ranked[11]["energy"] = "n/a"  # a missing-value marker: refused too
    ranked[12]["energy"] = "-12.5"  # a number as text: read
    refused = {ranked[10]["id"], ranked[11]["id"]}
    path = tmp_path / "ranked.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ranked))
    out = str(tmp_path / "out")
    m = run_etl(out, [str(path)], unit_template=TEMPLATE, id_column="id", conformers_per_molecule=2,
                conformer_rank_by="energy", conformer_frame="as_given", split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rejected"] == {"bad_conformer_rank": 2}
    assert m["dedupe"]["conformers_ranked_by"] == "energy" and "the lowest energy first" in m["dedupe"]["keeps"]
    report = open(os.path.join(out, "report.md")).read()
    assert ("- conformers kept a molecule: 2 (its distinct units, the lowest energy first, ties in input order); "
            "the molecule's other conformers are among the duplicates") in report
    examples = json.load(open(os.path.join(out, "report.json")))["rejected_examples"]["bad_conformer_rank"]
    assert {e[1] for e in examples} == {"energy = None", "energy = 'n/a'"}
    kept = {r["compound_id"] for r in shard_rows(out, m)}
    for smiles in counts:
        canonical = Chem.MolToSmiles(Chem.MolFromSmiles(smiles))
        mine = [(float(r["energy"]), i, r["id"]) for i, r in enumerate(ranked)
                if Chem.MolToSmiles(Chem.MolFromSmiles(r["smiles"])) == canonical and r["id"] not in refused
                and r["id"] != "REPEAT"]
        assert {name for _, _, name in sorted(mine)[:2]} == {name for _, _, name in mine} & kept, smiles


def test_an_sd_tag_ranks_and_one_conformer_a_molecule_is_the_lowest(tmp_path):
    import math

    from rdkit import Chem

    from .test_sd_conformers import _conformer, _read

    rng = random.Random(6)
    blocks, lowest = [], {}
    for i, smiles in enumerate(sample_smiles(6, offset=2700)):
        isomer = Chem.MolToSmiles(_read(_conformer(smiles, 10 * i, rng)))
        for k in range(3):
            mol = _moved(_conformer(isomer, 10 * i + k, rng), 5.0 * k)
            energy = rng.uniform(0, 10)
            mol.SetProp("_Name", f"M{i}-c{k}")
            mol.SetProp("E_total", f"{energy:.3f}")
            if (i, k) == (5, 2):
                mol.ClearProp("E_total")  # a conformer without the tag: refused
                energy = math.inf
            if energy < lowest.get(i, (math.inf, ""))[0]:
                lowest[i] = (energy, f"M{i}-c{k}")
            blocks.append(Chem.MolToMolBlock(mol) + "".join(
                f">  <{p}>\n{mol.GetProp(p)}\n\n" for p in mol.GetPropNames()) + "$$$$\n")
    (tmp_path / "confs.sdf").write_text("".join(blocks))
    m = run_etl(str(tmp_path / "out"), [str(tmp_path / "confs.sdf")], conformers="sd", id_column="_Name",
                conformer_rank_by="e_total", split_fractions=[1.0, 0.0, 0.0])  # the tag matched but for case
    assert m["stats"]["rejected"] == {"bad_conformer_rank": 1} and m["stats"]["duplicates"] == 18 - 1 - 6
    assert sorted(r["compound_id"] for r in shard_rows(str(tmp_path / "out"), m)) == sorted(
        name for _, name in lowest.values())
    from molds.preprocessing.readers import InputError

    with pytest.raises(InputError, match=r"confs.sdf: no record has the SD tag\(s\) \['energy'\].*E_total"):
        run_etl(str(tmp_path / "bad"), [str(tmp_path / "confs.sdf")], conformers="sd", conformer_rank_by="energy")


@pytest.mark.parametrize("overrides, message", [
    (dict(conformer_rank_by="energy"), r"--conformer_rank_by .*needs --unit_template or --conformers sd"),
    (dict(unit_template=TEMPLATE, conformer_rank_by="energy", conformers_per_molecule=0),
     r"--conformer_rank_by .*other than 0"),
])
def test_a_rank_without_a_choice_to_make_is_refused(ensembles, tmp_path, overrides, message):
    path, _, _ = ensembles
    with pytest.raises(ValueError, match=message):
        run_etl(str(tmp_path / "out"), [path], **overrides)


def test_a_rank_key_no_record_has_is_refused_naming_the_file(ensembles, tmp_path):
    from molds.preprocessing.readers import InputError

    path, _, _ = ensembles
    with pytest.raises(InputError, match=r"ensembles.jsonl: no record has a value for the key\(s\) \['energy'\]"):
        run_etl(str(tmp_path / "out"), [path], unit_template=TEMPLATE, conformer_rank_by="energy")
