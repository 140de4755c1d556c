"""data.randomized_smiles: the molecules stay the manifest's, only their spelling changes;
the choice is per (seed, epoch, molecule), so resume is exact; scoring and sampling stay canonical."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from rdkit import Chem

from molds.data.randomize import randomized_smiles

from .conftest import make_loader
from .test_loader import assert_same_batches, collect


def canon(smiles: str) -> str | None:
    mol = Chem.MolFromSmiles(smiles)
    return None if mol is None else Chem.MolToSmiles(mol)


def test_randomized_smiles_is_the_same_molecule_in_another_spelling():
    from tests.preprocessing.conftest import sample_smiles

    smiles = [canon(s) for s in sample_smiles(300)]
    smiles = [s for s in smiles if s]
    changed = 0
    for i, s in enumerate(smiles):
        r = randomized_smiles(s, seed=i)
        assert r == randomized_smiles(s, seed=i)  # a pure function of (molecule, seed)
        assert canon(r) == s, (s, r)  # RDKit reads it back as the same molecule, stereo included
        changed += r != s
    assert changed > 0.8 * len(smiles)
    assert len({randomized_smiles(smiles[0], seed=k) for k in range(20)}) > 3
    assert randomized_smiles("not a smiles", 0) is None


def _vocab(dataset):
    with open(os.path.join(dataset, "tokenizer", "tokenizer.json")) as fh:
        vocab = json.load(fh)["model"]["vocab"]
    return {i: t for t, i in vocab.items()}


def _molecules(batches, id_to_token, bos, sep):
    """(gid, marked, text) of every molecule in packed batches, in batch order."""
    out = []
    for b in batches:
        ids, docs, gids = b["input_ids"].numpy(), b["document_ids"].numpy(), b["gids"].numpy()
        pieces = []
        for r in range(ids.shape[0]):
            for d in np.unique(docs[r][docs[r] >= 0]).tolist():
                pieces.append(ids[r][docs[r] == d].tolist())
        assert len(pieces) == len(gids)
        for gid, toks in zip(gids.tolist(), pieces):
            assert toks[0] == bos
            marked = len(toks) > 1 and toks[1] == sep
            body = toks[2 if marked else 1:-1]
            out.append((gid, marked, "".join(id_to_token[t] for t in body)))
    return out


def _canonical_by_gid(ld):
    col = []
    for shard in ld.manifest.shards("train"):
        col += pq.read_table(shard.path, columns=["canonical_smiles"]).column(0).to_pylist()
    return col


@pytest.mark.parametrize("probability", [0.5, 1.0])
def test_every_molecule_read_once_in_a_canonical_or_randomized_form(dataset, probability):
    ld = make_loader(dataset, randomized_smiles=probability, max_epochs=2, micro_batch_size=2, shuffle_window=50)
    sp = ld.specials
    id_to_token = _vocab(dataset)
    batches = collect(ld)
    mols = _molecules(batches, id_to_token, sp.bos, sp.sep)
    truth = _canonical_by_gid(ld)
    n = len(truth)
    assert len(mols) == 2 * n and Counter(g for g, _, _ in mols) == Counter({g: 2 for g in range(n)})
    by_epoch = [{}, {}]
    for i, (gid, marked, text) in enumerate(mols):
        epoch = 0 if i < n else 1
        by_epoch[epoch][gid] = (marked, text)
        if marked:  # read back by RDKit as the manifest's molecule
            assert canon(text) == truth[gid], (gid, text, truth[gid])
        else:  # the manifest's own tokens
            assert text == truth[gid]
    for epoch in range(2):
        marked = sum(m for m, _ in by_epoch[epoch].values())
        if probability == 1.0:
            assert marked == n
        else:
            assert abs(marked / n - probability) < 4 * np.sqrt(probability * (1 - probability) / n)
    # every epoch draws anew: which molecules, and their spellings
    both = [g for g in range(n) if by_epoch[0][g][0] and by_epoch[1][g][0]]
    differ = sum(by_epoch[0][g][1] != by_epoch[1][g][1] for g in both)
    assert differ > 0.5 * len(both) > 0
    assert ld.source.randomizer.fallbacks == 0


def test_unmarked_randomized_rows_and_the_stream_without_augmentation(dataset):
    plain = collect(make_loader(dataset))
    assert_same_batches(collect(make_loader(dataset, randomized_smiles=0.0)), plain)
    ld = make_loader(dataset, randomized_smiles=1.0, randomized_marker="none")
    mols = _molecules(collect(ld), _vocab(dataset), ld.specials.bos, ld.specials.sep)
    assert not any(m for _, m, _ in mols)
    truth = _canonical_by_gid(ld)
    assert sum(t != truth[g] for g, _, t in mols) > 0.8 * len(mols)
    assert all(canon(t) == truth[g] for g, _, t in mols)


@pytest.mark.parametrize("data", ["dataset", "dataset_variants"])  # spellings written live, or stored by the ETL
@pytest.mark.parametrize("overrides", [dict(), dict(num_workers=2)])
def test_resume_with_randomized_smiles_gives_the_uninterrupted_stream(data, overrides, request):
    dataset = request.getfixturevalue(data)
    opts = dict(randomized_smiles=0.5, max_epochs=2, **overrides)
    full = collect(make_loader(dataset, **opts))
    for stop in (3, len(full) // 2 + 5):  # inside the first epoch and inside the second
        first = make_loader(dataset, **opts)
        head = collect(first, stop)
        state = json.loads(json.dumps(first.state_dict()))
        resumed = make_loader(dataset, **opts)
        resumed.load_state_dict(state)
        assert_same_batches(head + collect(resumed), full)


def test_scoring_reads_canonical_and_sampling_never_draws_the_marker(dataset):
    from molds.eval.sampling import forbidden_tokens, sample_ids
    from molds.eval.scoring import split_data_config

    cfg = split_data_config({"randomized_smiles": 0.7, "seq_len": 64}, dataset, "valid")
    assert cfg.randomized_smiles == 0.0
    ld = make_loader(dataset)
    sp = ld.specials
    assert forbidden_tokens({"data": {"randomized_smiles": 0.5}}, sp) == (sp.sep,)
    assert forbidden_tokens({"data": {"randomized_smiles": 0.5, "randomized_marker": "none"}}, sp) == ()
    assert forbidden_tokens({"data": {}}, sp) == ()

    class Favours(torch.nn.Module):
        """A decoder whose every next-token distribution puts almost all mass on one token."""

        def __init__(self, favourite, eos, vocab):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.favourite, self.eos, self.vocab = favourite, eos, vocab
            self.model = type("M", (), {"layers": [None]})()

        def decode(self, ids, cache, pos):
            logits = torch.zeros(ids.shape[0], self.vocab)
            logits[:, self.favourite] = 20.0
            logits[:, self.eos] = 0.0 if pos < 3 else 30.0
            return logits

    model = Favours(sp.sep, sp.eos, sp.vocab_size)
    kw = dict(bos=sp.bos, eos=sp.eos, max_tokens=8, seed=0)
    assert any(sp.sep in s for s in sample_ids(model, 20, **kw) if s)  # the test can fail
    drawn = sample_ids(model, 200, forbid=(sp.sep,), **kw)
    assert all(s is not None and sp.sep not in s for s in drawn)


def test_marker_needs_the_tokenizer_sep_token(dataset, tmp_path):
    import shutil

    from molds.errors import RecipeError

    copy = tmp_path / "data"
    shutil.copytree(dataset, copy)
    path = copy / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["tokenizer"]["special_tokens"]["sep_token"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(RecipeError, match="randomized_marker"):
        make_loader(str(copy), randomized_smiles=0.5)
    make_loader(str(copy), randomized_smiles=0.5, randomized_marker="none")


def test_molecules_the_randomizer_cannot_take_are_counted_kept_and_bounded(dataset):
    from molds.data.plan import Unit
    from molds.data.randomize import MAX_FALLBACKS, Randomizer
    from molds.errors import ManifestError
    from tests.preprocessing.conftest import sample_smiles

    vocab = {t: i for i, t in _vocab(dataset).items()}
    bos, eos, sep = vocab["<bos>"], vocab["<eos>"], vocab["<sep>"]
    good = [s for s in (canon(x) for x in sample_smiles(400)) if s][:300]

    def run(canonical):
        r = Randomizer(1.0, 0, os.path.join(dataset, "tokenizer"), bos_id=bos, eos_id=eos, unk_id=vocab.get("<unk>"),
                       marker_id=sep)
        rows = [[bos, 7 + i % 5, eos] for i in range(len(canonical))]  # stand-ins for the ETL's ids
        tokens = np.concatenate(rows).astype(np.int32)
        offsets = np.concatenate([[0], np.cumsum([len(x) for x in rows])])
        unit = Unit(shard=3, row_group=0, first_row=1000, num_rows=len(canonical), first_gid=0)
        return r, rows, r.rewrite(unit, 0, tokens, offsets, canonical)

    bad = {5, 77, 200}
    canonical = ["C1CC(" if i in bad else s for i, s in enumerate(good)]
    r, rows, (tokens, offsets) = run(canonical)
    assert (r.fallbacks, r.rewritten) == (len(bad), len(good) - len(bad))
    for i in range(len(good)):
        piece = tokens[offsets[i]:offsets[i + 1]].tolist()
        if i in bad:
            assert piece == rows[i]  # kept as it was read, not dropped
        else:
            assert piece[:2] == [bos, sep] and piece[-1] == eos

    # a few failures in one large unit are within the bound, wherever they fall in it
    few = ["C1CC(" if i < MAX_FALLBACKS + 1 else good[i % len(good)] for i in range(12000)]
    r, _, _ = run(few)
    assert r.fallbacks == MAX_FALLBACKS + 1

    many = ["C1CC(" if i % 2 else s for i, s in enumerate(good)]  # half of them: more than 1 % and > MAX_FALLBACKS
    assert sum(1 for s in many if s == "C1CC(") > MAX_FALLBACKS
    with pytest.raises(ManifestError, match=r"randomized_smiles: \d+ of the \d+ molecules.*shard #3"):
        run(many)
