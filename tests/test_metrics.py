"""Evaluation metrics against scikit-learn, the published formulas and hand-made cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from molds.metrics.property import (bedroc, classification_metrics, enrichment_factor, mean_std,
                                    regression_metrics)


def _bedroc_formula(scores, labels, alpha):
    """Truchon & Bayly (2007), eqs. 18-20 and 36: RIE, its extremes, BEDROC = rescaled RIE."""
    order = np.argsort(-np.asarray(scores), kind="stable")
    ranks = np.nonzero(np.asarray(labels)[order])[0] + 1  # 1-based ranks of the actives
    n, big_n = len(ranks), len(scores)
    ra = n / big_n
    rie = (np.exp(-alpha * ranks / big_n).sum() / n) / ((1 / big_n) * (1 - math.exp(-alpha))
                                                          / (math.exp(alpha / big_n) - 1))
    rie_max = (1 - math.exp(-alpha * ra)) / (ra * (1 - math.exp(-alpha)))
    rie_min = (1 - math.exp(alpha * ra)) / (ra * (1 - math.exp(alpha)))
    return (rie - rie_min) / (rie_max - rie_min)


def test_bedroc_matches_the_formula_and_its_extremes():
    rng = np.random.default_rng(0)
    for _ in range(5):
        labels = (rng.random(300) < 0.1).astype(float)
        scores = rng.random(300) + labels * rng.random() * 2
        assert bedroc(scores, labels, 20.0) == pytest.approx(_bedroc_formula(scores, labels, 20.0), abs=1e-3)
    labels = np.r_[np.ones(5), np.zeros(95)]
    assert bedroc(-np.arange(100.0), labels) == pytest.approx(1.0, abs=1e-3)  # actives ranked first
    assert bedroc(np.arange(100.0), labels) == pytest.approx(0.0, abs=1e-3)  # actives ranked last


def test_enrichment_factor_at_one_percent_by_hand():
    labels = np.zeros(200)
    labels[[0, 1, 50, 120]] = 1  # 4 actives among 200; the top 1 % is 2 molecules
    scores = -np.arange(200.0)  # molecule 0 scores best
    assert enrichment_factor(scores, labels, 0.01) == pytest.approx((2 / 2) / (4 / 200))  # both actives: 50
    scores[1] = -1000.0  # now the top 2 are molecules 0 and 2: one active
    assert enrichment_factor(scores, labels, 0.01) == pytest.approx((1 / 2) / (4 / 200))


def test_classification_matches_sklearn_with_missing_labels_masked():
    from sklearn.metrics import average_precision_score, roc_auc_score

    rng = np.random.default_rng(1)
    y = (rng.random((400, 3)) < 0.3).astype(float)
    s = rng.normal(size=(400, 3)) + y
    y[rng.random((400, 3)) < 0.25] = np.nan  # sparse labels
    y[:, 2] = np.where(np.isnan(y[:, 2]), np.nan, 0.0)  # task 2 has one class only: no ranking metric
    got = classification_metrics(y, s, ["a", "b", "c"])
    for t, name in enumerate("ab"):
        seen = ~np.isnan(y[:, t])
        assert got["per_task"][name]["n"] == seen.sum()
        assert got["per_task"][name]["auroc"] == pytest.approx(roc_auc_score(y[seen, t], s[seen, t]))
        assert got["per_task"][name]["auprc"] == pytest.approx(average_precision_score(y[seen, t], s[seen, t]))
    assert got["per_task"]["c"]["auroc"] is None
    assert got["macro"]["auroc_tasks"] == 2
    assert got["macro"]["auroc"] == pytest.approx((got["per_task"]["a"]["auroc"] + got["per_task"]["b"]["auroc"]) / 2)


def test_roc_curves_only_where_the_metrics_have_an_auroc():
    """A classification model given labels that are not 0/1 (a recipe misused on descriptors)
    gets no curve for that task, as the metrics give it no AUROC, instead of a crash."""
    from sklearn.metrics import roc_curve

    from molds.eval.plots import property_figure, roc_points

    rng = np.random.default_rng(2)
    y = np.c_[(rng.random(60) < 0.4).astype(float), rng.random(60), np.zeros(60)]
    s = rng.normal(size=(60, 3))
    got = roc_points(y, s, ["binary", "continuous", "one_class"])
    assert list(got) == ["binary"]
    fpr, tpr, _ = roc_curve(y[:, 0], s[:, 0])
    assert got["binary"]["fpr"] == pytest.approx(fpr, abs=1e-6) and got["binary"]["tpr"] == pytest.approx(tpr, abs=1e-6)
    assert set(got) == {k for k, v in classification_metrics(y, s, ["binary", "continuous", "one_class"])["per_task"].items()
                        if v["auroc"] is not None}
    assert property_figure(y[:, 1:], s[:, 1:], ["continuous", "one_class"], "classification") is None


def test_regression_by_hand():
    y = np.array([[1.0, np.nan], [2.0, 5.0], [3.0, 7.0], [np.nan, 9.0]])
    p = np.array([[1.5, 0.0], [2.0, 6.0], [2.5, 6.0], [0.0, 10.0]])
    got = regression_metrics(y, p)["per_task"]
    assert got["task0"]["rmse"] == pytest.approx(math.sqrt((0.25 + 0 + 0.25) / 3))
    assert got["task0"]["mae"] == pytest.approx(1 / 3)
    assert got["task0"]["spearman"] == pytest.approx(1.0)
    assert got["task1"]["mae"] == pytest.approx(1.0)
    # Pearson of the ranks (1, 2, 3) and (1.5, 1.5, 3): 1.5 / sqrt(2 * 1.5)
    assert got["task1"]["spearman"] == pytest.approx(1.5 / math.sqrt(3))


def test_mean_std_over_seeds():
    out = mean_std([{"a": 1.0, "b": None}, {"a": 3.0, "b": 2.0}])
    assert out["a"]["mean"] == 2.0 and out["a"]["std"] == pytest.approx(math.sqrt(2))
    assert "b" not in out  # a metric missing for a seed is not averaged


def test_generation_metrics_by_hand(dataset):
    import pyarrow.parquet as pq
    from rdkit import Chem, DataStructs
    from rdkit.Chem import rdFingerprintGenerator

    from molds.data.manifest import Manifest
    from molds.metrics.generation import BasicFilters, generation_metrics, internal_diversity

    m = Manifest.load(dataset)
    train = pq.read_table(m.shards("train")[0].path, columns=["canonical_smiles"]).column(0).to_pylist()[:3]
    # raw spellings of two training molecules (RDKit round trip through a random atom order)
    seen = [Chem.MolToSmiles(Chem.MolFromSmiles(s), doRandom=True, canonical=False) for s in train[:2]]
    new = ["C1CC2(CCO1)CCNCC2", "OCC(F)(F)F"]  # not in a drug-like sample
    samples = seen + new + [new[0], "C1CC(", None, "c1ccccc1[N+](=O)[O-]"]
    got = generation_metrics(samples, m)
    assert got["samples"] == 8 and got["valid"] == 6
    assert got["validity"] == pytest.approx(6 / 8)
    assert got["unique"] == pytest.approx(5 / 6)  # new[0] twice
    distinct_new = {Chem.CanonSmiles(s) for s in new + ["c1ccccc1[N+](=O)[O-]"]}
    train_all = set()
    for shard in m.shards("train"):
        train_all.update(pq.read_table(shard.path, columns=["canonical_smiles"]).column(0).to_pylist())
    assert not distinct_new & train_all
    assert got["novelty"] == pytest.approx(3 / 5)  # 5 distinct valid, 2 from training
    assert got["novelty_all_splits"] == pytest.approx(3 / 5)
    held_out = pq.read_table(m.shards("test")[0].path, columns=["canonical_smiles"]).column(0).to_pylist()[0]
    more = generation_metrics(samples + [held_out], m)  # a held-out molecule: new to the model, not to the source
    assert more["novelty"] == pytest.approx(4 / 6) and more["novelty_all_splits"] == pytest.approx(3 / 6)
    assert got["filters"] == pytest.approx(5 / 6)  # the nitro group is charged
    f = BasicFilters()
    assert not f.passes(Chem.MolFromSmiles("O=C1C(=Cc2ccccc2)SC(=S)N1"))  # a PAINS rhodanine
    assert not f.passes(Chem.MolFromSmiles("C1CCCCCCCCC1"))  # a 10-membered ring
    assert not f.passes(Chem.MolFromSmiles("CCP(C)C"))  # phosphorus
    assert f.passes(Chem.MolFromSmiles("CCOC(=O)c1ccccc1"))
    a, b = Chem.MolFromSmiles("CCO"), Chem.MolFromSmiles("c1ccccc1O")
    gen = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=1024)
    sim = DataStructs.TanimotoSimilarity(gen.GetFingerprint(a), gen.GetFingerprint(b))
    assert internal_diversity([a, b]) == pytest.approx(1 - (2 + 2 * sim) / 4)
    assert internal_diversity([a, a]) == pytest.approx(0.0)


def test_fcd_is_computed_offline_and_ranks_sets():
    from molds.metrics.generation import fcd_score

    ref = ["CCO", "CCN", "CCC", "CCOC", "CC(C)O", "CCCN", "OCCO", "CC(=O)O"] * 4
    near = ["CCCO", "CCNC", "CCCC", "COC", "CC(C)N", "CCCCN", "OCCN", "CC(=O)N"] * 4
    far = ["c1ccc2ccccc2c1", "c1ccc(-c2ccccc2)cc1", "O=c1cc[nH]c(=O)[nH]1", "c1ccncc1"] * 8
    assert fcd_score(near, ref) < fcd_score(far, ref)


def test_fcd_leaves_out_a_canonical_smiles_that_does_not_read_back(capsys):
    """RDKit writes some aromatic systems as canonical SMILES it cannot read again; fcd_torch
    raised on the first such sample and no FCD came out at all. It is left out, counted."""
    import numpy as np
    from rdkit import Chem

    from molds.metrics.generation import chemnet_stats, fcd_score

    sample = "CCCs1C(=O)NC(=O)c2nc(C(C)(C)C)cc2c1"  # a model's sample: RDKit reads it...
    canonical = Chem.MolToSmiles(Chem.MolFromSmiles(sample))
    assert Chem.MolFromSmiles(canonical) is None  # ...and cannot read its own canonical form
    good = ["CCO", "CCN", "CCC", "CCOC", "CC(C)O", "CCCN", "OCCO", "CC(=O)O"]
    with_it = chemnet_stats(good + [canonical])
    assert "1 of 9 SMILES left out" in capsys.readouterr().err
    alone = chemnet_stats(good)
    assert np.array_equal(with_it["mu"], alone["mu"]) and np.array_equal(with_it["sigma"], alone["sigma"])
    assert fcd_score(good + [canonical], good * 2) is not None


def test_a_report_shows_descriptions_beside_figures():
    from molds.eval.report import markdown

    text = markdown({"samples_file": "s.smi", "split": "test", "manifest": "m", "metrics": {
        "fcd": 1.5, "fcd_reference": "test (2000 molecules)", "valid": 3, "x": None}})
    assert "| fcd_reference | test (2000 molecules) |" in text and "| x | n/a |" in text


def test_moses_similarities_against_rdkit_by_hand():
    """SNN, Frag and Scaf as MOSES defines them, checked against RDKit calls made here."""
    from collections import Counter

    from rdkit import Chem, DataStructs
    from rdkit.Chem import AllChem, rdFingerprintGenerator
    from rdkit.Chem.Scaffolds import MurckoScaffold

    from molds.metrics.generation import ReferenceSet, generation_metrics

    ref = ["c1ccc2ccccc2c1CCO", "CC(=O)Nc1ccc(O)cc1", "O=C(O)c1ccccc1OC(C)=O", "c1ccc(-c2ccncc2)cc1", "CCN(CC)CC"]
    gen = ["c1ccc2ccccc2c1CCN", "CC(=O)Nc1ccc(O)cc1", "c1ccc(-c2ccccn2)cc1", "not a smiles", None]
    reference = ReferenceSet(ref)
    m = generation_metrics(gen, None, moses_reference=reference)
    mols_g = [Chem.MolFromSmiles(s) for s in gen[:3]]
    mols_r = [Chem.MolFromSmiles(s) for s in ref]
    fpgen = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=1024)
    fr = [fpgen.GetFingerprint(x) for x in mols_r]
    snn = sum(max(DataStructs.BulkTanimotoSimilarity(fpgen.GetFingerprint(x), fr)) for x in mols_g) / 3
    assert m["snn"] == pytest.approx(snn) and 0 < m["snn"] < 1

    def frags(mols):
        c = Counter()
        for x in mols:
            c.update(Chem.MolToSmiles(AllChem.FragmentOnBRICSBonds(x)).split("."))
        return c

    def scafs(mols):
        c = Counter()
        for x in mols:
            s = MurckoScaffold.GetScaffoldForMol(x)
            if s.GetRingInfo().NumRings() >= 2:
                c[Chem.MolToSmiles(s)] += 1
        return c

    def cos(a, b):
        keys = set(a) | set(b)
        dot = sum(a[k] * b[k] for k in keys)
        return dot / (sum(v * v for v in a.values()) ** 0.5 * sum(v * v for v in b.values()) ** 0.5)

    assert m["frag"] == pytest.approx(cos(frags(mols_g), frags(mols_r)))
    assert m["scaf"] == pytest.approx(cos(scafs(mols_g), scafs(mols_r)))
    same = generation_metrics(ref, None, moses_reference=reference)
    assert same["snn"] == pytest.approx(1.0) and same["frag"] == pytest.approx(1.0) and same["scaf"] == pytest.approx(1.0)
    assert m["moses_reference_molecules"] == 5


def test_reference_files_as_moses_ships_them(tmp_path):
    """molds-eval --reference reads MOSES's test.csv.gz (gzip, a SMILES header), a plain CSV
    and a .smi file alike; a damaged file is refused with its path."""
    import gzip

    from molds.errors import MoldsError
    from molds.eval.evaluate import read_smiles_file

    smiles = ["CCO", "c1ccccc1", "CC(=O)O"]
    with gzip.open(tmp_path / "test.csv.gz", "wt") as fh:
        fh.write("SMILES\n" + "\n".join(smiles) + "\n")
    (tmp_path / "ref.csv").write_text("id,smiles\n" + "".join(f"{i},{s}\n" for i, s in enumerate(smiles)))
    (tmp_path / "ref.smi").write_text("".join(f"{s} name{i}\n" for i, s in enumerate(smiles)))
    for name in ("test.csv.gz", "ref.csv", "ref.smi"):
        assert read_smiles_file(str(tmp_path / name)) == smiles, name
    (tmp_path / "bad.csv.gz").write_bytes(b"not gzip at all")
    with pytest.raises(MoldsError, match="bad.csv.gz"):
        read_smiles_file(str(tmp_path / "bad.csv.gz"))


def test_reference_chemnet_statistics_are_cached_safely(tmp_path, monkeypatch, capsys):
    import numpy as np
    from fcd_torch import FCD

    from molds.metrics.generation import chemnet_stats, reference_chemnet_stats

    monkeypatch.setenv("MOLDS_CACHE_DIR", str(tmp_path))
    ref = ["CCO", "c1ccccc1O", "CC(=O)Nc1ccc(O)cc1", "CCN(CC)CC", "O=C(O)c1ccccc1", "CC(C)Cc1ccc(C)cc1"] * 3
    first = reference_chemnet_stats(ref)
    direct = chemnet_stats(ref)
    assert np.allclose(first["mu"], direct["mu"]) and np.allclose(first["sigma"], direct["sigma"])
    files = list((tmp_path / "chemnet").glob("*.npz"))
    assert len(files) == 1

    def no_chemnet(*a, **k):
        raise AssertionError("ChemNet ran: the cache was not used")

    monkeypatch.setattr(FCD, "get_predictions", no_chemnet)
    again = reference_chemnet_stats(ref)  # a hit: equal, and ChemNet never runs
    assert np.array_equal(again["mu"], first["mu"]) and np.array_equal(again["sigma"], first["sigma"])
    with pytest.raises(AssertionError, match="ChemNet ran"):
        reference_chemnet_stats(ref[:-1])  # other molecules, another key
    monkeypatch.undo()
    monkeypatch.setenv("MOLDS_CACHE_DIR", str(tmp_path))
    # a file that is no statistics (a pickle, wrong shapes) is never unpickled: recomputed, rewritten
    files[0].write_bytes(__import__("pickle").dumps({"mu": 1}))
    capsys.readouterr()
    fixed = reference_chemnet_stats(ref)
    assert "computing it again" in capsys.readouterr().err
    assert np.allclose(fixed["mu"], first["mu"])
    with np.load(files[0], allow_pickle=False) as z:
        assert z["sigma"].shape == (512, 512)
    monkeypatch.setenv("MOLDS_CACHE_DIR", "")  # no cache: computed, nothing written
    assert reference_chemnet_stats(ref[:4])
    assert list((tmp_path / "chemnet").glob("*.npz")) == files
