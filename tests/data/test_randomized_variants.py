"""Randomized spellings written offline (``molds-preprocess --randomized_variants K``) and
read by the loader (``data.randomized_from``): the same molecules, K distinct spellings per
molecule before any repeats, and hostile shards refused by name (exact resume with stored
spellings: test_randomized_smiles.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rdkit import Chem

from .conftest import VARIANTS, make_loader
from .test_loader import collect
from .test_randomized_smiles import _canonical_by_gid, _molecules, _vocab, canon


def _decode(ids, id_to_token) -> str:
    return "".join(id_to_token[t] for t in ids)


def _shard_tables(dataset, split):
    from molds.data.manifest import Manifest

    return [(s, pq.read_table(s.path)) for s in Manifest.load(dataset).shards(split)]


def test_the_etl_stores_k_spellings_of_each_training_molecule(dataset_variants):
    manifest = json.load(open(os.path.join(dataset_variants, "manifest.json")))
    info = manifest["randomized"]
    assert info["variants"] == VARIANTS and info["splits"] == ["train"]
    assert "randomized_token_ids" in manifest["columns"]
    id_to_token = _vocab(dataset_variants)
    empty = rows = changed = 0
    for _, table in _shard_tables(dataset_variants, "train"):
        for smiles, variants in zip(table.column("canonical_smiles").to_pylist(),
                                    table.column("randomized_token_ids").to_pylist()):
            assert len(variants) == VARIANTS
            rows += 1
            for ids in variants:
                if not ids:
                    empty += 1
                    continue
                text = _decode(ids, id_to_token)
                assert canon(text) == smiles, (smiles, text)  # RDKit reads the same molecule back
                changed += text != smiles
    assert empty == info["failed"]
    assert changed > 0.7 * rows * VARIANTS
    for split in ("valid", "test"):  # evaluation reads canonical: nothing stored
        for _, table in _shard_tables(dataset_variants, split):
            assert all(v == [] for v in table.column("randomized_token_ids").to_pylist())


def test_stored_spellings_do_not_depend_on_row_order(dataset_variants):
    """Each molecule's atom orders come from (seed, its row hash): a partition in another
    order stores the same spellings for it (so any engine and partitioning agree)."""
    from molds.preprocessing.stages import hash64, randomized_variants
    from molds.preprocessing.tokenizer import RegexEncoder

    encoder = RegexEncoder({t: i for i, t in _vocab(dataset_variants).items()})
    smiles = _shard_tables(dataset_variants, "train")[0][1].column("canonical_smiles").to_pylist()[:150]
    hashes = hash64(smiles, 0)
    rows = np.arange(len(smiles))
    fwd, failed = randomized_variants(smiles, hashes, rows, 4, 0, encoder)
    assert failed == 0 and len(fwd) == len(smiles)
    order = rows[::-1]
    rev, _ = randomized_variants([smiles[i] for i in order], hashes[order], rows, 4, 0, encoder)
    assert fwd.to_pylist() == rev.to_pylist()[::-1]
    other_seed, _ = randomized_variants(smiles, hashes, rows, 4, 1, encoder)
    assert other_seed.to_pylist() != fwd.to_pylist()
    some, _ = randomized_variants(smiles, hashes, rows[::2], 4, 0, encoder)  # rows outside get none
    assert [v for i, v in enumerate(some.to_pylist()) if i % 2] == [[]] * (len(smiles) // 2)
    assert some.to_pylist()[::2] == fwd.to_pylist()[::2]


def test_the_loader_reads_each_molecule_in_k_distinct_stored_spellings(dataset_variants):
    ld = make_loader(dataset_variants, randomized_smiles=1.0, max_epochs=VARIANTS, micro_batch_size=2,
                     shuffle_window=50)
    assert ld.source.randomizer.stored == VARIANTS and "stores" in ld.randomized_note
    sp = ld.specials
    id_to_token = _vocab(dataset_variants)
    mols = _molecules(collect(ld), id_to_token, sp.bos, sp.sep)
    truth = _canonical_by_gid(ld)
    stored = []
    for _, table in _shard_tables(dataset_variants, "train"):
        stored += table.column("randomized_token_ids").to_pylist()
    seen = defaultdict(list)
    for gid, marked, text in mols:
        seen[gid].append(text)
        if not marked:  # only where the ETL stored an empty spelling: read canonical, counted
            assert text == truth[gid]
    assert ld.source.randomizer.fallbacks == sum(not m for _, m, _ in mols)
    assert sorted(seen) == list(range(len(truth)))
    for gid, texts in seen.items():
        assert len(texts) == VARIANTS
        spellings = {_decode(ids, id_to_token) for ids in stored[gid] if ids}
        assert set(texts) <= spellings | {truth[gid]}  # a spelling the ETL stored (or canonical if it stored none)
        if len(spellings) == VARIANTS:
            assert set(texts) == spellings  # all K before any repeats


def test_randomized_from_chooses_the_source(dataset, dataset_variants):
    from molds.errors import RecipeError

    with pytest.raises(RecipeError, match="randomized_from=manifest.*stores no randomized variants"):
        make_loader(dataset, randomized_smiles=0.5, randomized_from="manifest")
    assert make_loader(dataset, randomized_smiles=0.5).source.randomizer.stored == 0
    live = make_loader(dataset_variants, randomized_smiles=1.0, randomized_from="rdkit")
    assert live.source.randomizer.stored == 0 and "written with RDKit" in live.randomized_note
    sp = live.specials
    mols = _molecules(collect(live), _vocab(dataset_variants), sp.bos, sp.sep)
    truth = _canonical_by_gid(live)
    assert all(canon(t) == truth[g] for g, _, t in mols)
    # the validation split has no stored spellings: read there, auto writes them live
    assert make_loader(dataset_variants, split="valid", randomized_smiles=0.5).source.randomizer.stored == 0


def _rewrite_first_train_shard(src, dst, change):
    """A copy of ``src`` whose first training shard's variants column is ``change``d, with
    the manifest's checksum updated (a shard crafted by someone, not a corrupted one)."""
    shutil.copytree(src, dst)
    manifest = json.load(open(os.path.join(dst, "manifest.json")))
    entry = manifest["splits"]["train"][0]
    path = os.path.join(dst, entry["uri"])
    table = pq.read_table(path)
    rows = change(table.column("randomized_token_ids").to_pylist())
    i = table.column_names.index("randomized_token_ids")
    table = table.set_column(i, "randomized_token_ids", pa.array(rows, pa.list_(pa.list_(pa.uint16()))))
    pq.write_table(table, path, row_group_size=97)
    entry["sha256"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    json.dump(manifest, open(os.path.join(dst, "manifest.json"), "w"))
    return str(dst), entry["uri"]


def test_hostile_or_malformed_stored_spellings_are_refused_by_name(dataset_variants, tmp_path):
    from molds.errors import ManifestError

    def epoch(path, **kw):
        return collect(make_loader(path, randomized_smiles=1.0, **kw))

    big, uri = _rewrite_first_train_shard(dataset_variants, tmp_path / "big",
                                          lambda rows: [[[65000] * 3] + v[1:] for v in rows])
    with pytest.raises(ManifestError, match=f"{uri}.*token id 65000, outside"):
        epoch(big)
    short, uri = _rewrite_first_train_shard(dataset_variants, tmp_path / "short", lambda rows: [v[:-1] for v in rows])
    with pytest.raises(ManifestError, match=f"{uri}.*does not hold {VARIANTS} variants"):
        epoch(short)
    bad = tmp_path / "badk"
    shutil.copytree(dataset_variants, bad)
    manifest = json.load(open(bad / "manifest.json"))
    manifest["randomized"]["variants"] = "3"
    json.dump(manifest, open(bad / "manifest.json", "w"))
    with pytest.raises(ManifestError, match="randomized.variants must be an integer"):
        make_loader(str(bad), randomized_smiles=0.5)
    manifest["randomized"].update(variants=VARIANTS, splits="train")  # a string would match by substring
    json.dump(manifest, open(bad / "manifest.json", "w"))
    with pytest.raises(ManifestError, match="randomized.splits must be a list"):
        make_loader(str(bad), randomized_smiles=0.5)
    # spellings the ETL stored empty are read canonical, counted
    empty, _ = _rewrite_first_train_shard(dataset_variants, tmp_path / "empty",
                                          lambda rows: [[[]] * VARIANTS if i < 5 else v for i, v in enumerate(rows)])
    ld = make_loader(empty, randomized_smiles=1.0)
    collect(ld)
    assert ld.source.randomizer.fallbacks == 5


def test_the_fast_parse_writes_what_the_sanitized_parse_writes():
    """``randomized_smiles`` skips RDKit's full sanitization for canonical SMILES without
    stereo marks: the strings must equal those of the sanitized molecule."""
    from molds.data.randomize import randomized_smiles
    from tests.preprocessing.conftest import sample_smiles

    def sanitized(smiles, seed):
        mol = Chem.MolFromSmiles(smiles)
        order = np.random.default_rng(seed).permutation(mol.GetNumAtoms()).tolist()
        return Chem.MolToSmiles(Chem.RenumberAtoms(mol, order), canonical=False)

    tricky = ["[NH4+].[Cl-]", "C[C@H](N)C(=O)O", "F/C=C/F", "[13CH3]O", "c1ccc2[nH]ccc2c1", "[O-][n+]1ccccc1",
              "C[S@@](=O)c1ccccc1", "[Na+].[O-]C(=O)C", "B1OC(C)(C)C(C)(C)O1", "[2H]C([2H])([2H])Cl", "c1cc[se]c1",
              "[Fe+2]", "*C(=O)O", "[C@@H]12CC[C@H](C1)C2", "O=[N+]([O-])c1ccccc1", "C1CC2CCC1C2", "c1ccc2ccccc2c1"]
    smiles = [canon(s) for s in sample_smiles(1500) + tricky]
    smiles = [s for s in smiles if s]
    assert sum(randomized_smiles(s, i) != sanitized(s, i) for i, s in enumerate(smiles)) == 0


def test_spelling_a_salt_writes_nothing_on_the_log_and_leaves_rdkits_log_as_it_was(capfd):
    """A salt's lone [H+] (with stereo marks, so RDKit's full parser runs) made RDKit write a
    warning for each spelling, on every fine-tuning log; the spelling is still the molecule,
    and RDKit's log is not switched off for the rest of the process. (RDKit's warnings are
    switched on here, whatever an earlier test in this process left, and put back after.)"""
    from rdkit import rdBase

    from molds.data.randomize import randomized_smiles

    before = rdBase.LogStatus()
    rdBase.EnableLog("rdApp.warning")
    try:
        salt = canon("[H+].C[C@H](N)C(=O)[O-]")
        capfd.readouterr()
        spelled = [randomized_smiles(salt, seed) for seed in range(5)]
        assert capfd.readouterr().err == ""
        assert all(canon(s) == salt for s in spelled)
        Chem.MolFromSmiles(salt)  # RDKit itself, afterwards: its note as before
        assert "not removing hydrogen atom without neighbors" in capfd.readouterr().err
        assert "rdApp.warning:enabled" in rdBase.LogStatus()
    finally:
        for line in before.splitlines():
            name, state = line.split(":")
            (rdBase.EnableLog if state == "enabled" else rdBase.DisableLog)(name)
