"""The regex tokenizer, its fast batch encoder, and the saved HF tokenizers."""

from __future__ import annotations

import numpy as np
import pytest

from molds.preprocessing.tokenizer import (RegexEncoder, build_regex_tokenizer, count_tokens, regex_covers,
                                            respelling_tokens, save_tokenizer, split_smiles, token_codes,
                                            train_bpe_tokenizer, vocab_from_counts)

from .conftest import sample_smiles


def test_regex_tokens():
    assert split_smiles("C[C@@H](Cl)c1ccc(Br)cc1%10") == [
        "C", "[C@@H]", "(", "Cl", ")", "c", "1", "c", "c", "c", "(", "Br", ")", "c", "c", "1", "%10"]
    assert split_smiles("[Na+].[O-]C(=O)/C=C\\C#N") == [
        "[Na+]", ".", "[O-]", "C", "(", "=", "O", ")", "/", "C", "=", "C", "\\", "C", "#", "N"]
    assert split_smiles("C%(123)C") == ["C", "%(123)", "C"]
    assert regex_covers("c1ccccc1") and not regex_covers("CC\u00e9")


def _decoded(tc):
    """Per-row token strings of a ``token_codes`` batch."""
    toks = [chr(c) if c < 0xF0000 else tc.multi[c - 0xF0000] for c in tc.codes.tolist()]
    bounds = np.concatenate([[0], np.cumsum(tc.lengths)])
    return [toks[bounds[i]:bounds[i + 1]] for i in range(len(tc.lengths))]


def _fuzz_texts(rng, n):
    """SMILES-like strings with every edge the batch tokenizer has: bracket atoms (unclosed,
    empty, nested '['), %nn / %(n) closures (short, unclosed), Br / Cl and lone r / l,
    characters no token covers (ASCII, accented, private-use, a lone surrogate as the readers'
    surrogateescape leaves an undecodable byte), spaces, empty rows."""
    pieces = ["C", "c", "N", "O", "(", ")", "=", "#", "1", "2", "9", "Br", "Cl", "B", "r", "l", "[", "]",
              "[nH]", "[C@@H]", "[Na+]", "[[C]", "[]", "%", "%1", "%12", "%(123)", "%(", "%(1", ")",
              "\\", "/", ".", "*", "$", "&", "X", "\u00e9", "\U000F0001", "\udc80", " ", "\t"]
    texts = []
    for _ in range(n):
        k = int(rng.integers(0, 12))
        texts.append("".join(pieces[i] for i in rng.integers(0, len(pieces), k)))
    return texts


def test_batch_tokens_equal_findall_on_every_edge():
    rng = np.random.default_rng(0)
    smiles = sample_smiles(2000)
    fuzz = _fuzz_texts(rng, 3000)
    clean = [t for t in fuzz if " " not in t and "\U000F0001" not in t]  # the fast path's batches
    for texts in (smiles, fuzz, clean, [""], ["", "C", ""], []):
        tc = token_codes(texts)
        assert _decoded(tc) == [split_smiles(t) for t in texts]
        assert tc.covered.tolist() == ["".join(split_smiles(t)) == t for t in texts]
        assert count_tokens(texts) == __import__("collections").Counter(t for s in texts for t in split_smiles(s))
    assert not token_codes(["CC\u00e9", "[C"]).covered.any() and not regex_covers("[C")


def test_batch_encoder_equals_hf_tokenizer(tmp_path):
    smiles = sample_smiles(3000)
    vocab = vocab_from_counts(count_tokens(smiles[:2000]))  # the rest may hold unknown tokens
    tok = build_regex_tokenizer(vocab)
    enc = RegexEncoder(vocab)
    flat, lengths = enc.encode_batch(smiles)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    hf = tok.encode_batch(smiles, add_special_tokens=False)
    for i, e in enumerate(hf):
        assert flat[bounds[i]:bounds[i + 1]].tolist() == e.ids
    ok = enc.roundtrip_ok(flat, lengths, smiles)
    has_unk = [enc.unk_id in e.ids for e in hf]
    assert ok.tolist() == [not u for u in has_unk]


def test_roundtrip_check_finds_the_bad_row():
    vocab = vocab_from_counts(count_tokens(["CCO", "c1ccccc1"]))
    enc = RegexEncoder(vocab)
    texts = ["CCO", "c1ccccc1", "CCN"]
    flat, lengths = enc.encode_batch(texts)
    assert enc.roundtrip_ok(flat, lengths, texts).tolist() == [True, True, False]


def test_saved_tokenizers_load_with_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    smiles = sample_smiles(1000)
    save_tokenizer(build_regex_tokenizer(vocab_from_counts(count_tokens(smiles))), str(tmp_path / "regex"))
    save_tokenizer(train_bpe_tokenizer(iter(smiles), 200), str(tmp_path / "bpe"))
    for kind in ("regex", "bpe"):
        tok = AutoTokenizer.from_pretrained(str(tmp_path / kind))
        assert [tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.mask_token_id,
                tok.sep_token_id] == [0, 1, 2, 3, 4, 5]
        for smi in smiles[:200]:
            ids = tok(smi)["input_ids"]
            assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
            assert tok.decode(ids, skip_special_tokens=True) == smi
    bpe = AutoTokenizer.from_pretrained(str(tmp_path / "bpe"))
    assert np.mean([len(bpe(s, add_special_tokens=False)["input_ids"]) for s in smiles[:200]]) < np.mean(
        [len(split_smiles(s)) for s in smiles[:200]])


def test_vocab_too_big_for_uint16():
    from collections import Counter

    with pytest.raises(ValueError, match="uint16"):
        vocab_from_counts(Counter({f"[X{i}]": 1 for i in range(70000)}))


# canonical forms that write only "/", one tetrahedral tag per bracket atom, and few ring numbers
STEREO = ["O=C(/C=C/c1ccccc1)/C=C/c1ccccc1", "C/C=C/C(=O)O", "CC[C@@H](C)O",
          "N[C@@H](Cc1ccccc1)C(=O)O", "C12C3C4C1C5C2C3C45", "c1ccc2cc3cc4ccccc4cc3cc2c1"]


def test_the_vocabulary_covers_the_other_spellings_of_its_molecules():
    """A vocabulary of the canonical tokens and ``respelling_tokens`` of them holds every token
    of RDKit's randomized spellings and of its spellings rooted at each atom, which the
    canonical tokens alone do not (the bond direction and tetrahedral tag canonical SMILES never
    wrote)."""
    from rdkit import Chem

    from molds.data.randomize import restricted_variants

    canonical = [Chem.MolToSmiles(Chem.MolFromSmiles(s)) for s in STEREO]
    counts = count_tokens(canonical)
    vocab = vocab_from_counts(counts, respelling_tokens(counts))
    assert list(vocab)[:len(vocab) - len(respelling_tokens(counts))] == list(vocab_from_counts(counts))  # ids kept
    other = set()
    for i, smiles in enumerate(canonical):
        mol = Chem.MolFromSmiles(smiles)
        for text in restricted_variants(smiles, rng=np.random.default_rng(i), count=32):
            other |= set(split_smiles(text))
        for atom in range(mol.GetNumAtoms()):
            other |= set(split_smiles(Chem.MolToSmiles(mol, rootedAtAtom=atom)))
    missed = other - set(counts)  # else nothing is tested: a bond direction, a tag, a ring number
    assert {"\\", "[C@H]"} <= missed and any(t.isdigit() for t in missed), missed
    assert other <= set(vocab), other - set(vocab)
    assert respelling_tokens(count_tokens(["CCO", "[C@TH1](F)(Cl)(Br)I"])) == set()  # nothing to mirror


def test_map_stage_rejects_what_the_regex_cannot_cover(tmp_path):
    from molds.chemistry.canonical import ChemOptions, Molecule
    from molds.preprocessing.map_stage import MapStage
    from molds.preprocessing.stages import StageOptions

    opts = StageOptions(chem=ChemOptions(), split="scaffold", seed=0, num_labels=0, check_regex=True,
                        two_stage=False)
    stage = MapStage(opts, str(tmp_path), "t")
    rows = [(i, s, Molecule(s, "", s), f"id{i}", f"f:{i}", None, None)
            for i, s in enumerate(["CCO", "CC\u00e9O", "c1ccccc1"])]
    kept = stage._check_regex(rows)
    assert [r[1] for r in kept] == ["CCO", "c1ccccc1"]
    assert stage.stats.rejected == {"tokenizer_roundtrip": 1}
    assert stage.tokens == count_tokens(["CCO", "c1ccccc1"])


def test_batch_with_more_multi_character_tokens_than_placeholders():
    # one batch, 131,080 distinct bracket atoms: more than the private-use code points
    texts = [f"C[X{i}]Cl" for i in range(131_080)] + ["Br%12", "[C"]
    tc = token_codes(texts)
    assert len(tc.multi) == 131_080 + 3
    assert _decoded(tc)[-3:] == [split_smiles(t) for t in texts[-3:]]
    assert _decoded(tc)[131_000] == ["C", "[X131000]", "Cl"]
    assert tc.covered.tolist() == [True] * 131_081 + [False]
