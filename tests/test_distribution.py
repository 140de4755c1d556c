"""The property diagnostics (``molds.metrics.distribution``) against RDKit and the
Wasserstein formula by hand, the training ranges, the histograms, and sampling's float32
softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from molds.metrics.distribution import COUNTS, PROPERTIES, PropertyReference, histogram, molecule_properties

# 8 molecules: 4 light (MW < 200) and 4 heavier
LIGHT = ["CCO", "c1ccccc1", "CC(=O)O", "CCN(CC)CC"]
HEAVY = ["CC(=O)Oc1ccccc1C(=O)O", "CN1C=NC2=C1C(=O)N(C(=O)N2C)C", "CC(C)Cc1ccc(cc1)C(C)C(=O)O",
         "O=C(O)c1ccccc1O"]


def _mols(smiles):
    from rdkit import Chem

    return [Chem.MolFromSmiles(s) for s in smiles]


def test_properties_are_rdkits():
    from rdkit.Chem import QED, Crippen, Descriptors, Lipinski

    for mol in _mols(LIGHT + HEAVY):
        p = molecule_properties(mol)
        assert set(p) == set(PROPERTIES)
        assert p["weight"] == Descriptors.MolWt(mol) and p["logp"] == Crippen.MolLogP(mol)
        assert p["qed"] == QED.qed(mol) and p["rotatable_bonds"] == Lipinski.NumRotatableBonds(mol)
        assert p["aromatic_fraction"] == pytest.approx(
            sum(a.GetIsAromatic() for a in mol.GetAtoms()) / mol.GetNumHeavyAtoms())
        assert 1 <= p["sa"] <= 10
    benzene = molecule_properties(_mols(["c1ccccc1"])[0])
    assert (benzene["rings"], benzene["aromatic_rings"], benzene["aromatic_fraction"], benzene["heavy_atoms"]) == (
        1, 1, 1.0, 6)


def test_wasserstein_equals_the_sorted_difference_of_equal_sets():
    """For two sets of the same size, W1 is the mean absolute difference of the sorted
    values (the quantile coupling): computed here by hand for every property."""
    ref = PropertyReference(LIGHT)
    scalars, _ = ref.scores(_mols(HEAVY))
    for name in PROPERTIES:
        a = np.sort([molecule_properties(m)[name] for m in _mols(HEAVY)])
        b = np.sort([molecule_properties(m)[name] for m in _mols(LIGHT)])
        assert scalars[f"w_{name}"] == pytest.approx(np.abs(a - b).mean(), rel=1e-9, abs=1e-12), name
    same, _ = ref.scores(_mols(LIGHT))
    assert all(same[f"w_{name}"] == 0 for name in PROPERTIES)
    assert scalars["w_weight"] > 50


def test_shares_outside_the_training_ranges():
    """The training split's ranges (here: the light molecules) bound the samples'; each
    heavy molecule outside the weight range counts once, in the property's share and in
    the overall one."""
    ref = PropertyReference(LIGHT + HEAVY, train_smiles=LIGHT)
    scalars, _ = ref.scores(_mols(LIGHT + HEAVY[:2]))
    max_light = max(molecule_properties(m)["weight"] for m in _mols(LIGHT))
    expected = sum(molecule_properties(m)["weight"] > max_light for m in _mols(LIGHT + HEAVY[:2])) / 6
    assert scalars["out_of_train_range_weight"] == pytest.approx(expected) == pytest.approx(2 / 6)
    assert scalars["out_of_train_range"] >= scalars["out_of_train_range_weight"]
    inside, _ = ref.scores(_mols(LIGHT))
    assert inside["out_of_train_range"] == 0
    assert "out_of_train_range" not in PropertyReference(LIGHT).scores(_mols(HEAVY))[0]  # no training set given


def test_histograms_share_their_bins():
    s, r = np.array([1.0, 2.0, 2.0, 5.0]), np.array([0.0, 2.0, 3.0])
    h = histogram(s, r, integer=True)
    assert h["edges"] == [-0.5, 0.5, 1.5, 2.5, 3.5, 4.5, 5.5]
    assert h["samples"] == [0, 0.25, 0.5, 0, 0, 0.25] and h["reference"] == pytest.approx([1 / 3, 0, 1 / 3, 1 / 3, 0, 0])
    c = histogram(np.array([0.1, 0.2]), np.array([0.3]))
    assert len(c["edges"]) == 41 and sum(c["samples"]) == pytest.approx(1) and c["edges"][0] == 0.1
    _, hists = PropertyReference(LIGHT).scores(_mols(HEAVY))
    assert set(hists) == set(PROPERTIES)
    for name in COUNTS:
        assert all(e % 1 == 0.5 for e in hists[name]["edges"]), name


def test_sampling_softmax_is_float32_whatever_the_models_precision(monkeypatch):
    """A bf16 model's logits are turned into probabilities in float32: the draws of a
    bf16 model equal those of the same logits handed over in float32."""
    from molds.eval import sampling

    class Fixed(torch.nn.Module):
        """Logits from a fixed table (bf16 or float32), whatever the cache."""

        def __init__(self, dtype):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.table = torch.randn(12, 12, generator=g).to(dtype)
            self.model = torch.nn.Module()
            self.model.layers = []
            self.p = torch.nn.Parameter(torch.zeros(1))

        def decode(self, ids, cache, start):
            return self.table[ids[:, -1]]

    seen = []
    real = torch.multinomial

    def spy(probs, *a, **k):
        seen.append(probs.dtype)
        return real(probs, *a, **k)

    monkeypatch.setattr(torch, "multinomial", spy)
    bf16 = Fixed(torch.bfloat16)
    got = sampling.sample_ids(bf16, 64, bos=0, eos=1, max_tokens=20, seed=3)
    assert seen and set(seen) == {torch.float32}
    upcast = Fixed(torch.float32)
    upcast.table = bf16.table.float()
    assert sampling.sample_ids(upcast, 64, bos=0, eos=1, max_tokens=20, seed=3) == got


def test_a_reference_draw_is_uniform_over_every_shard_of_the_split(dataset):
    """The FCD and property references and the training ranges are a draw of a split: a
    uniform one over all of its rows, not of the first shards (the ETL's shards are not in
    random order; a scaffold split's go by group size)."""
    import pyarrow.parquet as pq

    from molds.data.manifest import Manifest
    from molds.eval.evaluate import split_token_lengths
    from molds.metrics.generation import draw_rows, reference_smiles

    m = Manifest.load(dataset)
    shards = m.shards("train")
    every = [s for sh in shards for s in pq.read_table(sh.path, columns=["canonical_smiles"]).column(0).to_pylist()]
    lengths = [n for sh in shards for n in pq.read_table(sh.path, columns=["token_length"]).column(0).to_pylist()]
    assert len(shards) >= 8 and len(every) == len(set(every)) >= 2000
    position = {s: i for i, s in enumerate(every)}
    limit = len(every) // 10
    drawn = reference_smiles(m, "train", limit, seed=0)
    assert len(drawn) == len(set(drawn)) == limit and set(drawn) <= set(every)
    assert drawn == reference_smiles(m, "train", limit, seed=0) and drawn != reference_smiles(m, "train", limit, seed=1)
    # the draw's rows spread over the split as uniform ones do: each quarter of the rows holds
    # about a quarter of the draw (binomial sd about 0.024 here), the last shard among them
    quarters = np.bincount([4 * position[s] // len(every) for s in drawn], minlength=4) / limit
    assert np.all(np.abs(quarters - 0.25) < 0.1), quarters
    assert any(position[s] >= len(every) - shards[-1].num_rows for s in drawn)
    # another column, the same rows; a limit past the split: every row
    assert draw_rows(m, "train", "token_length", limit, seed=0) == [lengths[position[s]] for s in drawn]
    assert sorted(reference_smiles(m, "train", 10 * len(every))) == sorted(every)
    assert sorted(split_token_lengths(m, "train", limit)) == sorted(float(lengths[position[s]]) for s in drawn)


def test_property_tables_are_cached_between_processes_and_a_bad_entry_is_recomputed(tmp_path, monkeypatch, capsys):
    """A reference's table is RDKit's values (each molecule by hand here, an unparsable SMILES left
    out); a second PropertyReference on the same SMILES reads it back without scoring a molecule;
    other SMILES are another entry; a file that is not a table (a pickle) is never unpickled, but
    recomputed; MOLDS_CACHE_DIR empty writes nothing."""
    import molds.metrics.distribution as dist

    monkeypatch.setenv("MOLDS_CACHE_DIR", str(tmp_path))
    smiles = LIGHT + ["not a molecule"] + HEAVY
    first = PropertyReference(smiles, train_smiles=LIGHT)
    by_hand = [molecule_properties(m) for m in _mols(LIGHT + HEAVY)]
    for name in PROPERTIES:
        assert first.values[name].tolist() == [p[name] for p in by_hand], name
    files = sorted((tmp_path / "properties").glob("*.npz"))
    assert len(files) == 2  # the reference and the training molecules

    scored = []
    real = dist.molecule_properties
    monkeypatch.setattr(dist, "molecule_properties", lambda mol: scored.append(mol) or real(mol))
    again = PropertyReference(smiles, train_smiles=LIGHT)
    assert scored == []
    assert all(np.array_equal(again.values[k], first.values[k]) for k in PROPERTIES)
    assert again.ranges == first.ranges and again.size == first.size == 8
    PropertyReference(smiles[:-1])  # other molecules, another entry
    assert len(scored) == 7
    files = sorted((tmp_path / "properties").glob("*.npz"))
    assert len(files) == 3
    monkeypatch.undo()
    monkeypatch.setenv("MOLDS_CACHE_DIR", str(tmp_path))
    target = next(f for f in files if np.load(f)["weight"].shape == (8,))
    target.write_bytes(__import__("pickle").dumps({"weight": 1}))
    capsys.readouterr()
    fixed = PropertyReference(smiles)
    assert "computing it again" in capsys.readouterr().err
    assert all(np.array_equal(fixed.values[k], first.values[k]) for k in PROPERTIES)
    with np.load(target, allow_pickle=False) as z:
        assert sorted(z.files) == sorted(PROPERTIES)
    monkeypatch.setenv("MOLDS_CACHE_DIR", "")  # no cache: computed, nothing written
    assert PropertyReference(HEAVY[:2]).size == 2
    assert sorted((tmp_path / "properties").glob("*.npz")) == files
