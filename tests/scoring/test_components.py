"""Scoring components against RDKit computed directly, the means, the refusals (each
naming its key), a molds property model as a component, a user's component from an
installed package, and molds-score's CSV."""

from __future__ import annotations

import csv
import json
import math
import os

import numpy as np
import pytest

from molds.errors import RecipeError
from molds.scoring import Scorer

MOLS = ["CC(=O)Oc1ccccc1C(=O)O", "c1ccccc1", "CCN(CC)CC", "O=[N+]([O-])c1ccccc1", "Clc1ccc(Cl)cc1CCl"]


def test_components_equal_rdkit_computed_directly():
    from rdkit import Chem, DataStructs
    from rdkit.Chem import QED, Crippen, Descriptors, rdFingerprintGenerator
    from rdkit.Contrib.SA_Score import sascorer

    mols = [Chem.MolFromSmiles(s) for s in MOLS]
    ident = {"kind": "step", "low": -1e9, "high": 1e9}
    s = Scorer({"aggregate": "arithmetic", "components": [
        {"kind": "qed", "name": "qed"},
        {"kind": "similarity", "name": "sim", "smiles": ["CC(=O)O", "c1ccccc1O"], "fingerprint": "ECFP6"},
        {"kind": "property", "name": "logp", "property": "logp", "transform": ident},
        {"kind": "property", "name": "mw", "property": "mw", "transform": ident},
        {"kind": "property", "name": "cl", "property": "atoms:Cl", "transform": ident},
        {"kind": "property", "name": "h", "property": "atoms:H", "transform": ident},
        {"kind": "sa_score", "name": "sa", "transform": ident},
        {"kind": "substructure", "name": "alerts", "smarts": ["[N+](=O)[O-]", "CCl"], "mode": "exclude"},
        {"kind": "substructure", "name": "both", "smarts": ["c", "C(=O)O"], "match": "all"},
    ]})(MOLS)
    gen = rdFingerprintGenerator.GetMorganGenerator(radius=3)
    targets = [gen.GetSparseCountFingerprint(Chem.MolFromSmiles(t)) for t in ("CC(=O)O", "c1ccccc1O")]
    for i, m in enumerate(mols):
        assert s.raw["qed"][i] == pytest.approx(QED.qed(m), abs=1e-12)
        fp = gen.GetSparseCountFingerprint(m)
        assert s.raw["sim"][i] == pytest.approx(max(DataStructs.TanimotoSimilarity(t, fp) for t in targets))
        assert s.raw["logp"][i] == pytest.approx(Crippen.MolLogP(m))
        assert s.raw["mw"][i] == pytest.approx(Descriptors.MolWt(m))
        assert s.raw["cl"][i] == sum(a.GetSymbol() == "Cl" for a in m.GetAtoms())
        assert s.raw["h"][i] == sum(a.GetTotalNumHs() for a in m.GetAtoms())
        assert s.raw["sa"][i] == pytest.approx(sascorer.calculateScore(m))  # the safely loaded table
    assert s.components["alerts"].tolist() == [1, 1, 1, 0, 0]
    assert s.components["both"].tolist() == [1, 0, 0, 0, 0]


def test_means_weights_invalid_molecules_and_isomers():
    comps = [{"kind": "qed", "name": "a", "weight": 3},
             {"kind": "substructure", "name": "b", "smarts": "N", "mode": "require", "weight": 1}]
    geo = Scorer({"aggregate": "geometric", "components": comps})
    ari = Scorer({"aggregate": "arithmetic", "components": comps})
    smiles = ["CCN", "CCO", "", "C1CC"]
    g, a = geo(smiles), ari(smiles)
    q = g.components["a"][0]
    assert g.total[0] == pytest.approx(q ** 0.75)  # (q^3 * 1)^(1/4)
    assert g.total[1] == 0.0  # a zero part zeroes a geometric mean
    assert a.total[1] == pytest.approx(3 * a.components["a"][1] / 4)
    assert g.reasons[2:] == ["empty", "invalid_smiles"] and g.total[2:].tolist() == [0, 0]
    assert not g.valid[2:].any() and np.isnan(g.raw["a"][2:]).all()
    # an exact isomer of C7H8N2O2 scores 1; one hydrogen short: exp(-1/2) and exp(-1/8) in the mean
    iso = Scorer({"components": [{"kind": "isomer", "formula": "C7H8N2O2"}]})
    exact, fewer = iso(["Nc1ccc([N+](=O)[O-])cc1C", "Nc1ccc([N+](=O)[O-])cc1"]).total  # C7H8N2O2, C6H6N2O2
    assert exact == pytest.approx(1.0)
    # C6H6N2O2 vs C7H8N2O2: C off by 1, H by 2, N and O exact, total 16 vs 19 atoms (sigma 2)
    want = math.exp((-0.5 - 2.0 + 0 + 0 - 0.5 * (3 / 2) ** 2) / 5)
    assert fewer == pytest.approx(want)


@pytest.mark.parametrize("definition,message", [
    ({"components": [{"kind": "substructure", "smarts": "C(("}]}, r"components\[0\].smarts\[0\]: RDKit cannot read"),
    ({"components": [{"kind": "similarity", "smiles": "C1CC"}]}, r"components\[0\].smiles\[0\]: RDKit cannot read"),
    ({"components": [{"kind": "qed"}, {"kind": "magic"}]}, r"components\[1\].kind: unknown component 'magic'"),
    ({"components": [{"kind": "property", "property": "mw"}]}, r"components\[0\].transform: .*give it a transform"),
    ({"components": [{"kind": "property", "property": "colour", "transform": {"kind": "step", "low": 0, "high": 1}}]},
     r"components\[0\].property: 'colour' is not one of"),
    ({"components": [{"kind": "qed", "transform": {"kind": "sigmoid", "low": 1, "high": 0}}]},
     r"components\[0\].transform: the sigmoid transform needs low < high"),
    ({"components": [{"kind": "qed", "weight": 0}]}, r"components\[0\].weight: a number > 0"),
    ({"components": [{"kind": "qed", "name": "x"}, {"kind": "qed", "name": "x"}]}, r"components\[1\].name: 'x' is taken"),
    ({"components": [{"kind": "qed", "colour": 1}]}, r"components\[0\]: unknown keys \['colour'\]"),
    ({"components": [{"kind": "similarity", "smiles": "CC", "fingerprint": "MACCS"}]}, r"fingerprint: 'MACCS'"),
    ({"components": [{"kind": "isomer", "formula": "C7H8Q"}]}, r"formula: 'C7H8Q' is not a molecular formula"),
    ({"aggregate": "median", "components": [{"kind": "qed"}]}, r"scoring.aggregate: geometric or arithmetic"),
    ({"components": []}, r"scoring.components: a non-empty list"),
    ({"components": [{"kind": "plugin", "entry_point": "nope"}]}, r"no installed package provides 'nope'"),
    ({"components": [{"kind": "property_model", "checkpoint": "/nonexistent"}]}, r"components\[0\].checkpoint:"),
])
def test_bad_definitions_are_refused_naming_the_key(definition, message):
    with pytest.raises(RecipeError, match=message):
        Scorer(definition)


def test_a_component_from_an_installed_package(tmp_path, monkeypatch):
    """A plugin: an entry point in the ``molds.scoring`` group of an installed package
    (here a dist-info written into a directory on sys.path) gives the component."""
    pkg = tmp_path / "site"
    (pkg / "myscores").mkdir(parents=True)
    (pkg / "myscores" / "__init__.py").write_text(
        "def ring_count(scale=1.0):\n"
        "    from rdkit import Chem\n"
        "    def score(smiles):\n"
        "        mols = [Chem.MolFromSmiles(s) for s in smiles]  # kept alive: RingInfo is a view\n"
        "        return [scale * m.GetRingInfo().NumRings() for m in mols]\n"
        "    return score\n")
    info = pkg / "myscores-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myscores\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[molds.scoring]\nrings = myscores:ring_count\n")
    monkeypatch.syspath_prepend(str(pkg))
    s = Scorer({"components": [{"kind": "plugin", "entry_point": "rings", "params": {"scale": 0.5},
                                "transform": {"kind": "thresholded", "threshold": 1}}]})(["c1ccccc1", "CCO", "C1CC1c1ccccc1"])
    assert s.raw["plugin_0"].tolist() == [0.5, 0.0, 1.0]
    assert s.total.tolist() == [0.5, 0.0, 1.0]


def test_a_molds_property_model_as_a_component(dataset, tmp_path):
    """A multitask encoder trained by molds (2 tasks) scores molecules as its own evaluation
    predicts them: the component equals the model's sigmoid output on the tokenized
    canonical SMILES."""
    import torch

    from molds.checkpoint import open_checkpoint
    from molds.train import main
    from tests.engines.test_encoder import _argv

    out = str(tmp_path / "enc")
    main(_argv(dataset, out, "ddp", 2) + ["--trainer.max_steps", "2"])
    smiles = ["CCOc1ccccc1", "CC(=O)Nc1ccc(O)cc1", "bad"]
    s = Scorer({"components": [{"kind": "property_model", "checkpoint": out, "task": 1}]})(smiles)
    loaded = open_checkpoint(out)
    enc = loaded.tokenizer(["CCOc1ccccc1", "CC(=O)Nc1ccc(O)cc1"], padding=True, return_tensors="pt")
    with torch.no_grad():
        want = torch.sigmoid(loaded.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
                             ["predictions"][:, 1]).numpy()
    np.testing.assert_allclose(s.raw["property_model_0"][:2], want, rtol=1e-6)
    assert np.isnan(s.raw["property_model_0"][2]) and s.total[2] == 0
    with pytest.raises(RecipeError, match=r"task: an index in \[0, 2\)"):
        Scorer({"components": [{"kind": "property_model", "checkpoint": out, "task": 5}]})


def test_a_property_model_that_reads_molecule_features_as_a_component(dataset, tmp_path):
    """Its heads also read RDKit's descriptors of each molecule (``model.molecule_features``):
    the component gives them the canonical molecule's, as RDKit computes them here."""
    import torch

    from molds.checkpoint import open_checkpoint
    from molds.chemistry.features import feature_names
    from molds.train import main
    from tests.engines.test_encoder import _argv
    from tests.engines.test_molecule_features import _rdkit_features

    out = str(tmp_path / "enc")
    main(_argv(dataset, out, "ddp", 2) + ["--trainer.max_steps", "2", "--model.molecule_features", "rdkit2d"])
    smiles = ["CCOc1ccccc1", "CC(=O)Nc1ccc(O)cc1"]
    s = Scorer({"components": [{"kind": "property_model", "checkpoint": out, "task": 0}]})(smiles + ["bad"])
    loaded = open_checkpoint(out)
    enc = loaded.tokenizer(smiles, padding=True, return_tensors="pt")
    x = torch.tensor(_rdkit_features(smiles, feature_names("rdkit2d")), dtype=torch.float32)
    with torch.no_grad():
        want = torch.sigmoid(loaded.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                          features=x)["predictions"][:, 0]).numpy()
    np.testing.assert_allclose(s.raw["property_model_0"][:2], want, rtol=1e-5)
    assert np.isnan(s.raw["property_model_0"][2])


def test_molds_score_writes_every_molecule_with_its_components(tmp_path, capsys):
    from molds.cli.score import main

    inp = tmp_path / "mols.csv"
    inp.write_text("id,SMILES\n1,CCO\n2,\n3,xyz\n4,CC(C)(C)NCC(O)c1ccc(O)c(CO)c1\n")
    out = tmp_path / "scored.csv"
    assert main(["--input", str(inp), "--smiles_column", "SMILES", "--oracle", "albuterol_similarity",
                 "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert [r["smiles"] for r in rows] == ["CCO", "", "xyz", "CC(C)(C)NCC(O)c1ccc(O)c(CO)c1"]
    assert [r["reason"] for r in rows] == ["", "empty", "invalid_smiles", ""]
    assert float(rows[3]["total"]) == 1.0 and float(rows[3]["albuterol_raw"]) == 1.0
    assert "4 molecules, 2 valid" in capsys.readouterr().err
    definition = tmp_path / "goal.json"
    definition.write_text(json.dumps({"components": [{"kind": "qed"}, {"kind": "substructure", "smarts": "[OH]"}]}))
    assert main(["--input", str(inp), "--smiles_column", "smiles", "--scoring", str(definition), "--out",
                 str(out)]) == 0
    assert list(csv.DictReader(open(out)))[0].keys() >= {"qed_0", "qed_0_raw", "substructure_1"}
    assert main(["--oracle", "median2", "--print", "true"]) == 0
    assert json.loads(capsys.readouterr().out)["components"][0]["smiles"].startswith("O=C1N(CC")
    definition.write_text(json.dumps({"components": [{"kind": "qed", "transform": {"kind": "step", "low": 1,
                                                                                   "high": 0}}]}))
    assert main(["--input", str(inp), "--scoring", str(definition)]) == 2
    assert "components[0].transform: the step transform needs low < high" in capsys.readouterr().err
    assert main(["--input", str(inp), "--oracle", "drd2"]) == 2
    assert not os.path.exists(tmp_path / "nothing.csv")


def test_molds_score_reads_what_molds_eval_reads(tmp_path, capsys):
    """One reader for both (``molds.eval.evaluate.smiles_cells``): a gzipped TSV by its
    named column, a .smi by each line's first field (a name may follow), and a column that
    is not there refused naming the file and the header."""
    import gzip

    from molds.cli.score import main, read_smiles

    tsv = tmp_path / "mols.tsv.gz"
    with gzip.open(tsv, "wt") as fh:
        fh.write("id\tSmiles\n1\tCCO\n2\tc1ccccc1O\n")
    assert read_smiles(str(tsv), "smiles") == ["CCO", "c1ccccc1O"]
    smi = tmp_path / "mols.smi"
    smi.write_text("CCO ethanol\n\nc1ccccc1O phenol\n")
    assert read_smiles(str(smi), "smiles") == ["CCO", "", "c1ccccc1O"]
    out = tmp_path / "scored.csv"
    assert main(["--input", str(tsv), "--oracle", "qed", "--out", str(out)]) == 0
    assert [r["smiles"] for r in csv.DictReader(open(out))] == ["CCO", "c1ccccc1O"]
    assert main(["--input", str(tsv), "--smiles_column", "canonical", "--oracle", "qed"]) == 2
    err = capsys.readouterr().err
    assert "mols.tsv.gz: no column 'canonical' (its header is ['id', 'Smiles']); give --smiles_column" in err
