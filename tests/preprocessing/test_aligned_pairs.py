"""Root-aligned spellings of pairs (R-SMILES): ``molds.chemistry.pairs.aligned_spellings``, the ETL's
``--randomized-variants K`` with ``--task``, and the loader reading them for both families."""

from __future__ import annotations

import csv
import gzip
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from rdkit import Chem

from tests.data.conftest import REACTIONS

K = 3


def _canon_side(text: str) -> str:
    return ".".join(sorted(Chem.MolToSmiles(Chem.MolFromSmiles(x)) for x in text.split(".")))


def _distance(a: str, b: str) -> int:
    """Levenshtein distance of two strings (characters)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _reaction_file(folder, n: int) -> str:
    """The first ``n`` bundled reactions, in USPTO-50k's layout, as a CSV file in ``folder``."""
    with gzip.open(REACTIONS, "rt") as fh:
        body = list(csv.reader(fh))[:n + 1]  # the header and n rows
    path = os.path.join(str(folder), "reactions.csv")
    with open(path, "w", newline="") as fh:
        csv.writer(fh).writerows(body)
    return path


def _reactions(n: int):
    with gzip.open(REACTIONS, "rt") as fh:
        rows = list(csv.DictReader(fh))[:n]
    out = []
    for r in rows:
        reactants, _, product = r["reactants>reagents>production"].split(">")
        out.append((_canon_side(product), _canon_side(reactants)))  # retro: product -> reactants
    return out


def test_aligned_spellings_spell_the_same_molecules_and_start_alike():
    """Each spelling is the pair's molecules (RDKit canonicalizes them back); the anchor side
    is rooted at another atom (of another symmetry class) each time; and aligned pairs are closer strings than the same
    pairs spelled at random (R-SMILES's point: the target mostly copies the source's order)."""
    from molds.chemistry.pairs import aligned_spellings
    from molds.data.randomize import randomized_smiles

    rng = np.random.default_rng(0)
    aligned = randomized = 0.0
    for src, tgt in _reactions(60):
        found = aligned_spellings(src, tgt, rng=rng, count=K)
        assert found is not None and len(found) == K
        classes = len(set(Chem.CanonicalRankAtoms(Chem.MolFromSmiles(src), breakTies=False)))
        assert len({s for s, _ in found}) == min(K, classes)  # a root per class of symmetric atoms
        for s, t in found:
            assert _canon_side(s) == src and _canon_side(t) == tgt
            aligned += _distance(s, t) / max(len(s), len(t))
        s = randomized_smiles(src, int(rng.integers(1 << 30)))
        t = ".".join(randomized_smiles(x, int(rng.integers(1 << 30))) for x in tgt.split("."))
        randomized += K * _distance(s, t) / max(len(s), len(t))
    assert aligned < 0.75 * randomized, (aligned, randomized)


def test_a_source_of_several_molecules_is_spelled_as_a_user_may_write_it():
    """Forward: the reactants are the source. They are drawn as ``rooted_spellings`` draws a
    source at test time, any molecule first and rooted at any atom, leaving atoms included
    (an amide coupling's OH, which the product does not hold), so that the canonical source
    molds-eval gives is one of the spellings the model read; the product still starts where
    the source starts and differs little from it."""
    from molds.chemistry.pairs import aligned_spellings
    from molds.data.randomize import randomized_smiles

    acid, amine = "CC(=O)O", "NCc1ccccc1"
    source, product = ".".join(sorted([acid, amine])), "CC(=O)NCc1ccccc1"
    firsts = set()
    for s, t in aligned_spellings(source, product, rng=np.random.default_rng(0), count=400):
        assert _canon_side(s) == source and _canon_side(t) == product
        first = Chem.MolFromSmiles(s.split(".")[0])
        ranks = list(Chem.CanonicalRankAtoms(first, breakTies=False))
        firsts.add((Chem.MolToSmiles(first), ranks[0]))  # the first molecule and its first atom's class
    every = {(Chem.MolToSmiles(m), c) for m in map(Chem.MolFromSmiles, (acid, amine))
             for c in Chem.CanonicalRankAtoms(m, breakTies=False)}
    assert firsts == every, sorted(every - firsts)

    rng = np.random.default_rng(0)
    aligned = randomized = 0.0
    for product, reactants in _reactions(60):
        found = aligned_spellings(reactants, product, rng=rng, count=K)
        assert found is not None and len(found) == K
        for s, t in found:
            assert _canon_side(s) == reactants and _canon_side(t) == product
            aligned += _distance(s, t) / max(len(s), len(t))
        s = ".".join(randomized_smiles(x, int(rng.integers(1 << 30))) for x in reactants.split("."))
        t = randomized_smiles(product, int(rng.integers(1 << 30)))
        randomized += K * _distance(s, t) / max(len(s), len(t))
    assert aligned < 0.75 * randomized, (aligned, randomized)


def test_canonical_first_writes_the_canonical_source_first_with_its_target_aligned():
    """``canonical_first``: the first spelling's source is what RDKit writes for each source
    molecule in canonical order (the spelling molds-eval scores from), in both directions; its
    target is the pair's and starts with the molecule holding the source's first atom; a
    one-molecule source's other spellings start from the other classes of atoms."""
    from molds.chemistry.pairs import aligned_spellings

    pairs = _reactions(60)
    checked = firsts = 0
    for src, tgt in pairs + [(r, p) for p, r in pairs]:  # retro, then forward
        found = aligned_spellings(src, tgt, rng=np.random.default_rng(checked), count=K, canonical_first=True)
        assert found is not None and len(found) == K
        rdkit = ".".join(Chem.MolToSmiles(Chem.MolFromSmiles(x)) for x in src.split("."))
        assert found[0][0] == rdkit, (src, found[0][0])
        for s, t in found:
            assert _canon_side(s) == src and _canon_side(t) == tgt
        if len(src.split(".")) == 1:
            classes = len(set(Chem.CanonicalRankAtoms(Chem.MolFromSmiles(src), breakTies=False)))
            assert len({s for s, _ in found}) == min(K, classes)
        first_target = found[0][1].split(".")[0]
        firsts += Chem.MolFromSmiles(first_target).GetAtomWithIdx(0).GetSymbol() == \
            Chem.MolFromSmiles(found[0][0].split(".")[0]).GetAtomWithIdx(0).GetSymbol()
        checked += 1
    assert firsts > 0.8 * checked, (firsts, checked)  # aligned: target and source start at the same element


def test_a_side_rdkit_cannot_read_gives_none():
    from molds.chemistry.pairs import aligned_spellings

    assert aligned_spellings("C1CC", "CCO", rng=np.random.default_rng(0), count=2) is None


@pytest.fixture(scope="module")
def aligned_manifest(tmp_path_factory):
    from molds.preprocessing.config import PreprocessConfig
    from molds.preprocessing.pipeline import run

    d = tmp_path_factory.mktemp("aligned")
    out = str(d / "retro")
    run(PreprocessConfig(input=[_reaction_file(d, 300)], output=out, smiles_column="reactants>reagents>production",
                         id_column="id", task="retro", workers=1, progress=False, randomized_variants=K))
    return out


def _sides(out: str, ids) -> tuple[str, str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out, "tokenizer", "tokenizer.json"))
    text = "".join(tok.id_to_token(i) for i in ids)
    src, _, tgt = text.partition("<sep>")
    return src, tgt


def test_the_etl_stores_k_aligned_spellings_of_each_training_pair(aligned_manifest):
    import json

    m = json.load(open(os.path.join(aligned_manifest, "manifest.json")))
    assert m["randomized"]["variants"] == K and "root-aligned" in m["randomized"]["form"]
    assert m["randomized"]["canonical_first"] is False
    empty = 0
    for split, shards in m["splits"].items():
        for s in shards:
            for row in pq.read_table(os.path.join(aligned_manifest, s["uri"])).to_pylist():
                variants = row["randomized_token_ids"]
                if split != "train":
                    assert not variants
                    continue
                assert len(variants) == K
                for ids in variants:
                    if not ids:
                        empty += 1
                        continue
                    src, tgt = _sides(aligned_manifest, ids)
                    assert _canon_side(src) == row["source_smiles"] and _canon_side(tgt) == row["target_smiles"]
    assert empty == m["randomized"]["failed"]


def test_the_etl_stores_the_canonical_source_first_when_asked(tmp_path):
    """``--canonical_first`` on a forward task: each training pair's first stored spelling reads
    back as the canonical source the shard holds, written as RDKit writes each molecule, with
    its product; the others are still the pair's; the manifest says so."""
    import json

    from molds.preprocessing.config import PreprocessConfig
    from molds.preprocessing.pipeline import run

    out = str(tmp_path / "forward")
    run(PreprocessConfig(input=[_reaction_file(tmp_path, 120)], output=out,
                         smiles_column="reactants>reagents>production", id_column="id", task="forward", workers=1,
                         progress=False, randomized_variants=K, canonical_first=True))
    m = json.load(open(os.path.join(out, "manifest.json")))
    assert m["randomized"]["canonical_first"] is True
    assert "the first spelling writes the source canonically" in m["randomized"]["form"]
    rows = [r for s in m["splits"]["train"] for r in pq.read_table(os.path.join(out, s["uri"])).to_pylist()]
    assert len(rows) > 50 and all(len(r["randomized_token_ids"]) == K for r in rows)
    several = 0
    for row in rows:
        src, tgt = _sides(out, row["randomized_token_ids"][0])
        assert src == ".".join(Chem.MolToSmiles(Chem.MolFromSmiles(x)) for x in row["source_smiles"].split("."))
        assert _canon_side(tgt) == row["target_smiles"]
        several += "." in src
        for ids in row["randomized_token_ids"][1:]:
            src, tgt = _sides(out, ids)
            assert _canon_side(src) == row["source_smiles"] and _canon_side(tgt) == row["target_smiles"]
    assert several > 0  # sources of several molecules are in canonical order too


@pytest.mark.parametrize("mode", ["packed", "bucketed"])
def test_the_loader_reads_pairs_in_their_stored_spellings(aligned_manifest, mode):
    """``data.randomized_smiles: 1.0`` on an aligned manifest: every pair a batch holds is one of
    its row's stored spellings, split at its own sep (the decoder scores only the target and
    EOS; the encoder-decoder encodes the source and writes the target), and over three epochs
    a pair meets more than one of them."""
    from molds.chemistry.tokens import IGNORE_INDEX
    from molds.data.loader import MoleculeLoader
    from molds.recipe.sections import DataConfig

    m_rows = [r for s in sorted(os.listdir(os.path.join(aligned_manifest, "train")))
              for r in pq.read_table(os.path.join(aligned_manifest, "train", s)).to_pylist()]
    stored = {i: {tuple(v) for v in r["randomized_token_ids"] if v} for i, r in enumerate(m_rows)}
    extra = (dict(seq_len=256, micro_batch_size=4, lookahead=32) if mode == "packed" else
             dict(max_length=256, max_tokens_per_batch=1024, bucket_pool=32))
    ld = MoleculeLoader(DataConfig(manifest=aligned_manifest, mode=mode, too_long="reject", randomized_smiles=1.0,
                                   max_epochs=3, shuffle_window=0, **extra))
    sp = ld.specials
    seen: dict[int, set] = {}
    for b in ld:
        if mode == "bucketed":
            for i, gid in enumerate(b["gids"].tolist()):
                src = b["input_ids"][i][b["attention_mask"][i] == 1].tolist()[1:-1]
                tgt = [t for t in b["labels"][i].tolist() if t != IGNORE_INDEX][:-1]
                got = tuple(src + [sp.sep] + tgt)
                assert got in stored[gid], gid
                seen.setdefault(gid, set()).add(got)
        else:
            ids, labels, docs = b["input_ids"], b["labels"], b["document_ids"]
            for r in range(ids.shape[0]):
                for d in sorted(set(docs[r].tolist()) - {-1}):
                    pos = (docs[r] == d).nonzero().flatten()
                    toks, labs = ids[r, pos].tolist(), labels[r, pos].tolist()
                    body = toks[1:-1]  # source <sep> target
                    cut = body.index(sp.sep) + 2  # BOS source SEP: no loss there
                    assert all(x == IGNORE_INDEX for x in labs[:cut]) and labs[cut:] == toks[cut:]
                    assert any(tuple(body) in v for v in stored.values())
    if mode == "bucketed":
        assert sum(len(v) > 1 for v in seen.values()) > len(seen) // 2


def test_aligned_spellings_the_canonical_forms_never_wrote_are_stored(tmp_path):
    """Pairs whose canonical forms write only ``/`` and ``[C@@H]``, whose rooted spellings need
    ``\\`` and ``[C@H]`` (the reagent dba of a Buchwald coupling, say): every spelling is
    stored and reads back as the pair, none is counted failed."""
    from molds.preprocessing.config import PreprocessConfig
    from molds.preprocessing.pipeline import run
    from tests.preprocessing.test_tokenizer import STEREO

    with open(tmp_path / "pairs.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["src", "tgt", "fold"])
        for i, a in enumerate(STEREO):
            for b in STEREO[i + 1:]:
                w.writerow([a, f"{b}.{a}", "train"])
        w.writerow(["CCO", "CC=O", "valid"])
        w.writerow(["CCN", "CC=N", "test"])
    out = str(tmp_path / "out")
    run(PreprocessConfig(input=[str(tmp_path / "pairs.csv")], output=out, smiles_column="src", target_column="tgt",
                         task="mol2mol", split="given", split_column="fold", workers=1, progress=False,
                         randomized_variants=8))
    import json

    m = json.load(open(os.path.join(out, "manifest.json")))
    assert m["randomized"]["failed"] == 0
    spelled = set()
    for s in m["splits"]["train"]:
        for row in pq.read_table(os.path.join(out, s["uri"])).to_pylist():
            assert len(row["randomized_token_ids"]) == 8
            for ids in row["randomized_token_ids"]:
                src, tgt = _sides(out, ids)
                assert _canon_side(src) == _canon_side(row["source_smiles"])
                assert _canon_side(tgt) == _canon_side(row["target_smiles"])
                spelled.add(src + ">" + tgt)
    assert "\\" in "".join(spelled) and "[C@H]" in "".join(spelled)  # else nothing is tested


def test_a_forward_manifest_of_the_old_alignment_rule_is_named_on_the_start_line(aligned_manifest, tmp_path):
    """A forward manifest whose spellings were drawn with the product as the anchor (before
    2026-12-05) still trains, and the loader's start line says to rebuild it; a manifest of
    today's rule says nothing of the kind."""
    import json
    import shutil

    from molds.data.loader import MoleculeLoader
    from molds.recipe.sections import DataConfig

    def note(path):
        return MoleculeLoader(DataConfig(manifest=path, mode="packed", seq_len=256, micro_batch_size=4, lookahead=32,
                                         too_long="reject", randomized_smiles=1.0)).randomized_note

    assert "root-aligned" in note(aligned_manifest) and "WARNING" not in note(aligned_manifest)
    old = str(tmp_path / "old")
    shutil.copytree(aligned_manifest, old)
    m = json.load(open(os.path.join(old, "manifest.json")))
    m["pairs"]["task"] = "forward"
    m["randomized"]["form"] = ("root-aligned pairs (R-SMILES): source <sep> target, the anchor side rooted at a random "
                               "atom, the other side's molecules rooted at corresponding atoms "
                               "(molds.chemistry.pairs.aligned_spellings)")  # as the ETL wrote it then
    json.dump(m, open(os.path.join(old, "manifest.json"), "w"))
    assert "WARNING: drawn by the rule before 2026-12-05" in note(old) and "rebuild the manifest" in note(old)
