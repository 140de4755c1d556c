"""Property heads that read molecule features beside the tokens (``model.molecule_features
rdkit2d``), checked from outside molds: the features are RDKit's own descriptors of the
canonical molecule (``Descriptors.CalcMolDescriptors`` called here), their scale is the
training split's (numpy on the shards' molecules), ``molds-eval``'s figures and
``molds-predict``'s values are those of the model run by hand on those features, and what
cannot be honoured is refused in one line (the export, a checkpoint whose features another
RDKit computed, a batch without them)."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.engines.test_property_metrics import _argv, _labelled


def _rdkit_features(smiles: list[str], names: list[str]) -> np.ndarray:
    """RDKit's descriptors of each molecule, in ``names``' order, non-finite as 0, each
    value as sign(v) log(1 + |v|): the documented transform, written out here."""
    from rdkit import Chem
    from rdkit.Chem import Descriptors

    rows = []
    for s in smiles:
        d = Descriptors.CalcMolDescriptors(Chem.MolFromSmiles(s))
        v = np.asarray([d[n] for n in names], dtype=np.float64)
        v[~np.isfinite(v)] = 0.0
        rows.append(np.sign(v) * np.log1p(np.abs(v)))
    return np.asarray(rows)


def _split_rows(manifest_dir: str, split: str):
    """(canonical SMILES, token ids, labels [N, T] with NaN) of a split, read from its shards."""
    m = json.load(open(os.path.join(manifest_dir, "manifest.json")))
    smiles, ids, labels = [], [], []
    for s in m["splits"][split]:
        t = pq.read_table(os.path.join(manifest_dir, s["uri"]))
        smiles += t.column("canonical_smiles").to_pylist()
        ids += t.column("token_ids").to_pylist()
        labels += [[np.nan if v is None else v for v in row] for row in t.column("labels").to_pylist()]
    return smiles, ids, np.asarray(labels, dtype=float)


def test_the_features_are_rdkits_descriptors_of_the_molecule():
    from rdkit.Chem import Descriptors

    from molds.chemistry.features import feature_moments, feature_names, molecule_features
    from molds.errors import MoldsError

    names = feature_names("rdkit2d")
    assert names == [n for n, _ in Descriptors._descList]  # every 2D descriptor RDKit lists, in its order
    smiles = ["CCO", "c1ccccc1C(=O)O", "C[N+](C)(C)C", "[Na+].[Cl-]", "OC1CCCCC1"]
    got = molecule_features(smiles, "rdkit2d")
    assert got.dtype == np.float32 and got.shape == (len(smiles), len(names))
    assert np.allclose(got, _rdkit_features(smiles, names), rtol=1e-6, atol=1e-6)
    assert np.isfinite(got).all()
    mean, std = feature_moments(got)
    x = got.astype(np.float64)
    sd = x.std(axis=0, ddof=1)
    assert np.allclose(mean, x.mean(axis=0), atol=1e-6)
    assert np.allclose(std, np.where(sd > 1e-6, sd, 1.0), atol=1e-6)  # a constant feature: scale 1
    with pytest.raises(MoldsError, match="not a feature set molds computes"):
        feature_names("maccs")


def _morgan_counts(smiles: list[str]) -> np.ndarray:
    """log(1 + count) of each of 2,048 folded radius-2 Morgan environments: RDKit's older
    hashed-fingerprint function, not the generator molds calls."""
    from rdkit import Chem, RDLogger
    from rdkit.Chem import rdMolDescriptors

    RDLogger.DisableLog("rdApp.warning")  # (the older function's deprecation line)
    try:
        rows = np.zeros((len(smiles), 2048))
        for i, s in enumerate(smiles):
            fp = rdMolDescriptors.GetHashedMorganFingerprint(Chem.MolFromSmiles(s), 2, nBits=2048)
            for bit, count in fp.GetNonzeroElements().items():
                rows[i, bit] = count
    finally:
        RDLogger.EnableLog("rdApp.warning")
    return np.log1p(rows)


def test_the_morgan_features_are_rdkits_count_fingerprint_read_as_they_are():
    from molds.chemistry.features import feature_moments, feature_names, molecule_features

    smiles = ["CCO", "c1ccccc1C(=O)O", "CCCCCCCCCCCCCCCCCC", "[Na+].[Cl-]", "OC1CCCCC1", "Cc1ccc2[nH]ccc2c1"]
    descriptors = feature_names("rdkit2d")
    assert feature_names("rdkit2d+morgan") == descriptors + feature_names("morgan") and len(feature_names("morgan")) == 2048
    morgan = molecule_features(smiles, "morgan")
    assert morgan.dtype == np.float32 and np.allclose(morgan, _morgan_counts(smiles), atol=1e-6)
    assert morgan.max() > np.log(3)  # counts, not bits (the chain's CH2 environments)
    both = molecule_features(smiles, "rdkit2d+morgan")
    assert np.allclose(both, np.hstack([_rdkit_features(smiles, descriptors), morgan]), rtol=1e-6, atol=1e-6)
    mean, std = feature_moments(both, "rdkit2d+morgan")
    d = len(descriptors)
    x = both.astype(np.float64)
    sd = x[:, :d].std(axis=0, ddof=1)
    assert np.allclose(mean[:d], x[:, :d].mean(axis=0), atol=1e-6)  # the descriptors standardized
    assert np.allclose(std[:d], np.where(sd > 1e-6, sd, 1.0), atol=1e-6)
    assert (mean[d:] == 0).all() and (std[d:] == 1).all()  # the counts as they are
    with pytest.raises(ValueError, match="2265 features given for morgan's 2048"):
        feature_moments(both, "morgan")


def test_heads_read_the_morgan_counts_unscaled_and_molds_predict_agrees(tmp_path, capfd):
    from molds.checkpoint import open_checkpoint
    from molds.chemistry.features import feature_names
    from molds.eval.properties import predict_properties
    from molds.train import main

    labelled = _labelled(tmp_path, ("logp", "tpsa"), n=160)
    run = str(tmp_path / "morgan")
    main(_argv(labelled, run, 2, "regression") + ["--model.molecule_features", "rdkit2d+morgan",
                                                   "--trainer.max_steps", "12"])
    d = len(feature_names("rdkit2d"))
    assert (f"model.molecule_features=rdkit2d+morgan: the property heads read {d + 2048} features of each "
            f"molecule beside its first token's state, {d} of them standardized" in capfd.readouterr().err)
    train_smiles, _, _ = _split_rows(labelled, "train")
    train_x = _rdkit_features(train_smiles, feature_names("rdkit2d"))
    loaded = open_checkpoint(run)
    model = loaded.model
    assert np.allclose(model.feature_mean[:d].numpy(), train_x.mean(axis=0), atol=1e-4)
    assert (model.feature_mean[d:] == 0).all() and (model.feature_std[d:] == 1).all()

    smiles, ids, _ = _split_rows(labelled, "test")
    x = torch.tensor(np.hstack([_rdkit_features(smiles, feature_names("rdkit2d")), _morgan_counts(smiles)]),
                     dtype=torch.float32)
    sp = loaded.specials
    with torch.no_grad():
        hand = np.stack([model(input_ids=torch.tensor([[sp.bos, *row, sp.eos]]), features=x[i:i + 1])
                         ["predictions"][0].numpy() for i, row in enumerate(ids)])
        row = torch.tensor([[sp.bos, *ids[0], sp.eos]])
        counts = x[:1].clone()
        counts[:, d:] = 0.0  # the same descriptors, no environment: the heads read the counts
        assert not np.allclose(model(input_ids=row, features=counts)["predictions"][0].numpy(), hand[0], atol=1e-4)
    found = predict_properties(loaded, smiles)
    assert np.allclose(np.stack([found.values[i] for i in range(len(smiles))]), hand, rtol=1e-4, atol=1e-3)


def test_heads_read_the_features_at_the_training_splits_scale_and_every_reader_agrees(tmp_path, capfd, monkeypatch):
    from molds.checkpoint import CheckpointError, open_checkpoint
    from molds.chemistry.features import feature_names
    from molds.errors import MoldsError
    from molds.eval.evaluate import evaluate_checkpoint
    from molds.eval.properties import predict_properties
    from molds.export import export
    from molds.train import main

    labelled = _labelled(tmp_path, ("logp", "tpsa"), n=240)
    run = str(tmp_path / "feat")
    result = main(_argv(labelled, run, 2, "regression") + ["--model.molecule_features", "rdkit2d",
                                                            "--model.pooling", "auto"])
    names = feature_names("rdkit2d")
    assert (f"model.molecule_features=rdkit2d: the property heads read {len(names)} features of each molecule "
            f"beside the mean of its tokens' states" in capfd.readouterr().err)  # auto: regression with features
    lineage = json.load(open(os.path.join(result["checkpoint"], "lineage.json")))
    assert lineage["molecule_features"]["names"] == names
    rdkit_version = lineage["molecule_features"]["rdkit"]

    # the scale: the training split's molecules, their descriptors from RDKit here
    train_smiles, _, _ = _split_rows(labelled, "train")
    train_x = _rdkit_features(train_smiles, names)
    sd = train_x.std(axis=0, ddof=1)
    loaded = open_checkpoint(run)
    model = loaded.model
    assert model.config.pooling == "mean"  # the checkpoint's auto, read back as trained
    assert np.allclose(model.feature_mean.numpy(), train_x.mean(axis=0), atol=1e-4)
    assert np.allclose(model.feature_std.numpy(), np.where(sd > 1e-6, sd, 1.0), rtol=1e-4, atol=1e-5)

    # the model run by hand on the test molecules and their descriptors
    smiles, ids, y = _split_rows(labelled, "test")
    x = torch.tensor(_rdkit_features(smiles, names), dtype=torch.float32)
    sp = loaded.specials
    with torch.no_grad():
        hand = np.stack([model(input_ids=torch.tensor([[sp.bos, *row, sp.eos]]), features=x[i:i + 1])
                         ["predictions"][0].numpy() for i, row in enumerate(ids)])
        # the heads read the features: other features, other predictions
        row = torch.tensor([[sp.bos, *ids[0], sp.eos]])
        moved = model(input_ids=row, features=x[:1] + 1.0)["predictions"][0].numpy()
        assert not np.allclose(moved, hand[0], atol=1e-4)
        with pytest.raises(ValueError, match=f"read {len(names)} molecule features"):
            model(input_ids=row)

    report = evaluate_checkpoint(run, split="test")
    for t, name in enumerate(["logp", "tpsa"]):
        seen = ~np.isnan(y[:, t])
        rmse = float(np.sqrt(np.mean((hand[seen, t] - y[seen, t]) ** 2)))
        assert report["property"]["per_task"][name]["rmse"] == pytest.approx(rmse, rel=1e-4), name
    found = predict_properties(loaded, smiles)  # molds-predict's function: features computed for its input
    assert np.allclose(np.stack([found.values[i] for i in range(len(smiles))]), hand, rtol=1e-4, atol=1e-3)
    # a caller scoring the same molecules with several checkpoints (the benchmark's choice of
    # one) keeps their features: the same predictions, RDKit called once per molecule
    from molds.chemistry import features as features_mod

    computed = []
    original = features_mod._compute
    monkeypatch.setattr(features_mod, "_CACHE", {})  # (molds-eval's pass above kept the test split's)
    monkeypatch.setattr(features_mod, "_compute", lambda s, k: computed.append(s) or original(s, k))
    for _ in range(2):
        again = predict_properties(loaded, smiles, cache_features=True)
        assert all(np.allclose(again.values[i], found.values[i], rtol=1e-6) for i in range(len(smiles)))
    assert sorted(computed) == sorted(set(found.canonical.values()))
    monkeypatch.undo()

    with pytest.raises(MoldsError, match="reads tokens alone") as exc:
        export(run, str(tmp_path / "hf"))
    assert "\n" not in str(exc.value)

    # where RDKit computes other descriptors than those the checkpoint was trained on (one more
    # at the front, as a release may add), it is refused in one line
    import rdkit

    from molds.chemistry import features

    monkeypatch.setitem(features._NAMES, "rdkit2d", ["NewDescriptor", *names])
    monkeypatch.setattr(rdkit, "__version__", "2099.03.1")
    with pytest.raises(CheckpointError, match=f"trained on {len(names)} rdkit2d features computed by RDKit "
                                              f"{rdkit_version}; RDKit 2099.03.1 here computes {len(names) + 1}") as exc:
        open_checkpoint(result["checkpoint"])
    assert "\n" not in str(exc.value) and "first difference at feature 0" in str(exc.value)
    # a checkpoint whose features another RDKit computed (its lineage names one fewer) is refused
    # the same way when a run resumes it or forks it with its heads (the same tasks)
    monkeypatch.undo()
    kept = os.path.join(result["checkpoint"], "lineage.json")
    forged = json.load(open(kept))
    forged["molecule_features"].update(names=names[1:], rdkit="2001.03.1")
    json.dump(forged, open(kept, "w"))
    marker = os.path.join(result["checkpoint"], "COMPLETE")  # the sizes it lists, as a checkpoint it wrote
    sealed = json.load(open(marker))
    sealed["files"]["lineage.json"] = os.path.getsize(kept)
    json.dump(sealed, open(marker, "w"))
    for more in (["--checkpoint.resume", "auto"],
                 ["--checkpoint.resume", run, "--checkpoint.fork", "true", "--run.output_dir", str(tmp_path / "f")]):
        with pytest.raises(CheckpointError, match=f"trained on {len(names) - 1} rdkit2d features computed by RDKit "
                                                  f"2001.03.1; RDKit {rdkit.__version__} here computes") as exc:
            main(_argv(labelled, run, 2, "regression") + ["--model.molecule_features", "rdkit2d", "--model.pooling",
                                                          "auto", "--trainer.max_steps", "30", *more])
        assert "\n" not in str(exc.value)


def test_molecule_features_are_for_property_heads_alone(tmp_path):
    from molds.errors import RecipeError
    from molds.recipe.parse import parse_recipe, validate

    base = ["--data.manifest", str(tmp_path), "--data.mode", "bucketed", "--data.mlm_probability", "0.15",
            "--model.family", "encoder", "--model.molecule_features", "rdkit2d"]
    with pytest.raises(RecipeError, match="needs model.family=encoder and model.num_tasks > 0"):
        validate(parse_recipe(base), 1)


def _features_on_a_rank(rank: int, world: int, argv: list[str]) -> dict:
    """One rank of a training run whose heads read features: the molecules this rank had
    RDKit describe, and the run's result."""
    from molds.chemistry import features as features_mod
    from molds.train import main

    computed = []
    original = features_mod._compute
    features_mod._compute = lambda s, k: computed.append(s) or original(s, k)
    result = main(argv)
    return {"computed": computed, "checkpoint": result["checkpoint"] if rank == 0 else None}


def test_the_ranks_share_the_training_splits_features(tmp_path):
    """On two ranks each describes half the training split and both hold all of it: no
    training molecule is computed twice, and the scale is numpy's over RDKit's descriptors
    of the whole split (as on one rank)."""
    from molds.chemistry.features import feature_names
    from molds.checkpoint import open_checkpoint
    from tests.dist.spawn import run_ranks

    labelled = _labelled(tmp_path, ("logp", "tpsa"), n=240)
    run = str(tmp_path / "two")
    argv = _argv(labelled, run, 2, "regression") + ["--model.molecule_features", "rdkit2d",
                                                     "--trainer.max_steps", "4"]
    got = run_ranks(_features_on_a_rank, 2, argv)
    train_smiles, _, _ = _split_rows(labelled, "train")
    train = set(train_smiles)
    per_rank = [[s for s in r["computed"] if s in train] for r in got]
    for mine in per_rank:
        assert len(mine) == len(set(mine)) <= (len(train_smiles) + 1) // 2  # each molecule once, half the split
    assert set(per_rank[0]) | set(per_rank[1]) == train and not set(per_rank[0]) & set(per_rank[1])
    names = feature_names("rdkit2d")
    train_x = _rdkit_features(train_smiles, names)
    sd = train_x.std(axis=0, ddof=1)
    model = open_checkpoint(run).model
    assert np.allclose(model.feature_mean.numpy(), train_x.mean(axis=0), atol=1e-4)
    assert np.allclose(model.feature_std.numpy(), np.where(sd > 1e-6, sd, 1.0), rtol=1e-4, atol=1e-5)
