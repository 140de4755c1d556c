"""The Ray Data engine on a local Ray cluster gives the local engine's manifest."""

from __future__ import annotations

import os

import pytest

from molds.data.manifest import Manifest, manifest_hash

from .conftest import run_etl, sd_record

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


def test_ray_engine_reads_sd_files_as_the_local_one_does(local_ray, hostile_sdf, tmp_path):
    """SD records through Ray Data's reader and actors: the same manifest, the same rejected
    records named by file, line and record, and a cut-short SD archive kept up to its cut."""
    import gzip
    import json

    paths, _, _ = hostile_sdf
    blob = gzip.compress(open(paths[0], "rb").read())
    cut = tmp_path / "cut.sdf.gz"
    cut.write_bytes(blob[: len(blob) // 2])
    gaps = tmp_path / "gaps.sdf"  # an empty line after each $$$$: the second record is read repaired
    gaps.write_text(sd_record("CCOC", "G1", {"pIC50": "5"}) + "\n" + sd_record("CCSC", "G2", {"pIC50": "6"}))
    inputs = [*paths, str(cut), str(gaps)]
    options = dict(id_column="_Name", label_columns=["pIC50"], on_truncated="keep")
    local = run_etl(str(tmp_path / "local"), inputs, **options)
    remote = run_etl(str(tmp_path / "ray"), inputs, engine="ray", **options)
    assert manifest_hash(remote) == manifest_hash(local)
    assert remote["splits"] == local["splits"]
    assert remote["stats"]["sdf_leading_blank_lines"] == local["stats"]["sdf_leading_blank_lines"] == 1
    assert remote["stats"]["rejected"]["truncated_input"] == 1 and remote["stats"]["truncated_inputs"][0].startswith(
        str(cut))
    examples = [json.load(open(tmp_path / name / "report.json"))["rejected_examples"] for name in ("local", "ray")]
    assert {k: sorted(map(tuple, v)) for k, v in examples[0].items()} == {
        k: sorted(map(tuple, v)) for k, v in examples[1].items()}


def test_ray_engine_reports_a_cut_short_input_as_the_local_one_does(local_ray, tmp_path):
    """A gzip cut short (``--on_truncated fail``): the Ray engine, like the local one,
    writes nothing but ``OUT.failed-report.*``, accounting for every row it read (the whole
    good file and the readable part of the cut one), and names the file; a file without
    the SMILES column is refused by name."""
    import gzip
    import json

    from molds.preprocessing.readers import InputError

    from .conftest import sample_smiles

    smiles = sample_smiles(300, offset=7000)
    good = tmp_path / "a.csv"
    good.write_text("smiles\n" + "\n".join(smiles) + "\n")
    bad = tmp_path / "b.csv.gz"
    blob = gzip.compress(("smiles\n" + "\n".join(smiles) + "\n").encode())
    bad.write_bytes(blob[: len(blob) // 2])
    reports = {}
    for engine in ("local", "ray"):
        out = tmp_path / engine
        with pytest.raises(InputError, match=r"b.csv.gz.*rows were read \(up to .*b.csv.gz line/row \d+\)"):
            run_etl(str(out), [str(good), str(bad)], engine=engine)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(engine)) == [
            f"{engine}.failed-report.json", f"{engine}.failed-report.md"]
        reports[engine] = json.load(open(tmp_path / f"{engine}.failed-report.json"))
    for key in ("rows_in", "canonicalized", "rejected", "read_up_to"):
        assert reports["ray"][key] == reports["local"][key], key
    rep = reports["ray"]
    assert len(smiles) < rep["rows_in"] < 2 * len(smiles)
    assert rep["rows_in"] == rep["canonicalized"] + sum(rep["rejected"].values())
    wrong = tmp_path / "c.csv"
    wrong.write_text("SMILE,id\nCCO,1\n")
    with pytest.raises(InputError, match=r"c.csv.*\['SMILE', 'id'\]"):
        run_etl(str(tmp_path / "cols"), [str(wrong)], engine="ray")


def test_ray_engine_stores_the_local_engines_randomized_spellings(local_ray, dirty_csv, tmp_path):
    """--randomized_variants: each molecule's atom orders come from its row hash, so Ray's
    partitioning writes the local engine's shards byte for byte."""
    options = dict(id_column="id", label_columns=["logp"], randomized_variants=2)
    local = run_etl(str(tmp_path / "local"), [dirty_csv[0]], **options)
    remote = run_etl(str(tmp_path / "ray"), [dirty_csv[0]], engine="ray", **options)
    assert local["randomized"]["variants"] == 2 and remote["randomized"] == local["randomized"]
    assert remote["splits"] == local["splits"]


def test_ray_engine_builds_the_local_engines_conformer_units_from_jsonl_fields(local_ray, tmp_path):
    """--unit_template: the records' fields travel through Ray Data's reader to the actors,
    so the units, the refusals and the shards are the local engine's."""
    import json

    from rdkit import Chem
    from rdkit.Chem import AllChem

    from .conftest import sample_smiles
    from .test_unit_template import TEMPLATE

    rows = []
    for i, smiles in enumerate(sample_smiles(12, offset=3000)):
        mol = Chem.AddHs(Chem.MolFromSmiles(smiles))
        AllChem.EmbedMolecule(mol, randomSeed=i)
        rows.append({"smiles": smiles, "xyz": Chem.RemoveHs(mol).GetConformer().GetPositions().tolist()})
    rows.append({"smiles": "CCO"})  # unit_missing_field
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    local = run_etl(str(tmp_path / "local"), [str(path)], unit_template=TEMPLATE)
    remote = run_etl(str(tmp_path / "ray"), [str(path)], unit_template=TEMPLATE, engine="ray")
    assert local["stats"]["rejected"] == {"unit_missing_field": 1} and local["stats"]["rows_out"] == 12
    assert manifest_hash(remote) == manifest_hash(local)
    assert remote["splits"] == local["splits"]


def test_ray_engine_builds_the_local_engines_conformer_units_from_sd_coordinates(local_ray, tmp_path):
    """--conformers sd: the SD records' bytes carry their coordinates to the actors, so the
    units, the 2D refusal and the shards are the local engine's."""
    import random

    from rdkit import Chem
    from rdkit.Chem import AllChem

    from .conftest import sample_smiles
    from .test_sd_conformers import _block, _conformer

    rng = random.Random(1)
    text = "".join(_block(_conformer(s, i, rng), f"M{i}") for i, s in enumerate(sample_smiles(12, offset=3100)))
    flat = Chem.MolFromSmiles("CCOC(=O)c1ccccc1")
    AllChem.Compute2DCoords(flat)
    path = tmp_path / "in.sdf"
    path.write_text(text + _block(flat, "flat"))
    local = run_etl(str(tmp_path / "local"), [str(path)], conformers="sd", id_column="_Name")
    remote = run_etl(str(tmp_path / "ray"), [str(path)], conformers="sd", id_column="_Name", engine="ray")
    assert local["stats"]["rejected"] == {"sd_not_3d": 1} and local["stats"]["rows_out"] == 12
    assert manifest_hash(remote) == manifest_hash(local)
    assert remote["splits"] == local["splits"]


@pytest.mark.parametrize("fmt", ["sdf", "jsonl"])
def test_ray_engine_keeps_the_local_engines_ranked_conformers(local_ray, tmp_path, fmt):
    """--conformers_per_molecule with --conformer_rank_by: the rank (an SD tag, or a JSONL key
    read beside the template's fields) travels to the actors and the reduce tasks keep the
    local engine's conformers."""
    import json
    import random

    from rdkit import Chem

    from .conftest import sample_smiles
    from .test_conformer_sets import _moved
    from .test_sd_conformers import _conformer, _read
    from .test_unit_template import TEMPLATE, _embedded

    rng = random.Random(8)
    blocks, records = [], []
    for i, smiles in enumerate(sample_smiles(4, offset=3300)):
        isomer = Chem.MolToSmiles(_read(_conformer(smiles, i, rng)))
        for k in range(3):
            mol = _moved(_conformer(isomer, 10 * i + k, rng), 4.0 * k)
            energy = f"{rng.uniform(0, 9):.2f}"
            blocks.append(Chem.MolToMolBlock(mol) + f">  <energy>\n{energy}\n\n$$$$\n")
            _, heavy = _embedded(isomer, seed=10 * i + k)  # atoms in the SMILES' own order
            records.append({"smiles": isomer, "energy": float(energy),
                            "xyz": [[x + 4.0 * k, y, z] for x, y, z in heavy.GetConformer().GetPositions().tolist()]})
    path = tmp_path / f"confs.{fmt}"
    path.write_text("".join(blocks) if fmt == "sdf" else "".join(json.dumps(r) + "\n" for r in records))
    options = dict(conformers_per_molecule=2, conformer_rank_by="energy", conformer_frame="as_given",
                   **(dict(conformers="sd") if fmt == "sdf" else dict(unit_template=TEMPLATE)))
    local = run_etl(str(tmp_path / "local"), [str(path)], **options)
    remote = run_etl(str(tmp_path / "ray"), [str(path)], engine="ray", **options)
    assert local["stats"]["rows_out"] == 8 and local["stats"]["duplicates"] == 4
    assert manifest_hash(remote) == manifest_hash(local)
    assert remote["splits"] == local["splits"]
