"""SELFIES and SAFE in the ETL: on the bundled sample every kept row's string decodes
(through the package itself, not molds) to its canonical SMILES, the failures are
counted by reason (a test per reason), the tokenizers are the stated ones and load with
AutoTokenizer, and the manifest names the representation with its package version."""

from __future__ import annotations

import gzip
import importlib.metadata
import os

import pyarrow.parquet as pq
import pytest

from molds.preprocessing.readers import InputError

from .conftest import SAMPLE, run_etl

# Rows each representation refuses, and why (found on real inputs, not stubbed):
# a dummy atom ("*", an R group left in a vendor file) has no SELFIES symbol, and SAFE reads
# it as one of its own attachment points, so it decodes without it; hypervalent iodine
# (iodyl) is beyond SELFIES' valence constraint for I (1).
REFUSED = {"selfies": {"*c1ccccc1": "selfies_encode_error", "O=I(=O)c1ccccc1": "selfies_encode_error"},
           "safe": {"*c1ccccc1": "safe_roundtrip"}}


@pytest.fixture(scope="module", params=["selfies", pytest.param("safe", marks=pytest.mark.slow)])
def sample_run(request, tmp_path_factory):
    """The whole bundled sample (20,000 MOSES molecules) and the refused rows, preprocessed."""
    rep = request.param
    d = tmp_path_factory.mktemp(rep)
    with gzip.open(SAMPLE, "rt") as fh:
        rows = fh.read().splitlines()[1:]
    path = d / "in.csv"
    path.write_text("smiles\n" + "\n".join(rows + list(REFUSED["selfies"]) + ["CCO"]) + "\n")
    out = str(d / "out")
    return rep, out, run_etl(out, [str(path)], representation=rep, shard_size_mb=4, partition_rows=20_000,
                             chunk_rows=2000), len(rows) + len(REFUSED["selfies"]) + 1


def _rows(out, manifest):
    return [r for shards in manifest["splits"].values() for s in shards
            for r in pq.read_table(os.path.join(out, s["uri"])).to_pylist()]


def test_every_kept_row_decodes_to_its_canonical_smiles(sample_run):
    from rdkit import Chem

    rep, out, m, rows_in = sample_run
    rows = _rows(out, m)
    if rep == "selfies":
        import selfies

        decode = selfies.decoder
    else:
        import safe

        decode = safe.decode
    assert rows and all(Chem.MolToSmiles(Chem.MolFromSmiles(decode(r["text"]))) == r["canonical_smiles"]
                        for r in rows)
    stats = m["stats"]
    assert stats["rows_in"] == rows_in == stats["rows_out"] + stats["duplicates"] + sum(stats["rejected"].values())
    # the failure counts on the bundled sample: none of its 20,000 molecules is refused by either
    expected = {}
    for reason in REFUSED[rep].values():
        expected[reason] = expected.get(reason, 0) + 1
    assert stats["rejected"] == expected
    block = m["representation"]
    package = {"selfies": "selfies", "safe": "safe-mol"}[rep]
    assert block["name"] == rep and block["version"] == importlib.metadata.version(package)
    if rep == "safe":  # the no-cut rule: molecules without a BRICS bond stay one fragment, counted
        single = sum("." not in r["text"] for r in rows)
        assert stats["representation"]["single_fragment"] == single and single > 0
        assert any(r["canonical_smiles"] == "CCO" and r["text"] == "CCO" for r in rows)


def test_each_refusal_names_its_row(sample_run):
    import json

    rep, out, m, rows_in = sample_run
    examples = json.load(open(os.path.join(out, "report.json")))["rejected_examples"]
    for smiles, reason in REFUSED[rep].items():
        assert any(raw == smiles or raw.replace("[*]", "*") == smiles for _, raw in examples[reason]), (reason, examples)
        assert all(source.rsplit(":", 1)[-1].isdigit() for source, _ in examples[reason])


def test_the_tokenizer_is_the_stated_one_and_loads_with_autotokenizer(sample_run):
    import re

    from transformers import AutoTokenizer

    rep, out, m, _ = sample_run
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "tokenizer"), local_files_only=True)
    rows = _rows(out, m)[:500]
    for r in rows:
        ids = tok(r["text"], add_special_tokens=False)["input_ids"]
        assert ids == r["token_ids"] and tok.decode(ids) == r["text"]
        pieces = tok.convert_ids_to_tokens(ids)
        if rep == "selfies":  # one token per bracket symbol
            assert pieces == re.findall(r"\[[^\]]+\]|\.", r["text"])
        else:  # the SMILES regex: atoms, bonds, and the ring-closure digits that are SAFE's attachment points
            assert "".join(pieces) == r["text"] and all(len(p) == 1 or p.startswith(("[", "%")) or p in ("Br", "Cl")
                                                        for p in pieces)
    assert m["tokenizer"]["grammar"] == rep


@pytest.mark.parametrize("rep, reason", [("selfies", "selfies_roundtrip"), ("safe", "safe_encode_error")])
def test_reasons_no_sample_row_meets_are_counted_too(rep, reason, tmp_path, monkeypatch):
    """No molecule found so far makes SELFIES decode to another molecule or SAFE's encoder
    raise; the two reasons are counted all the same (the package stubbed to do so on one row)."""
    from molds.chemistry import representation

    if rep == "selfies":
        real = representation.Selfies.decode
        monkeypatch.setattr(representation.Selfies, "decode",
                            lambda self, text: "CCN" if text == "[C][C][O]" else real(self, text))
    else:
        real = representation.Safe.encode
        monkeypatch.setattr(representation.Safe, "encode",
                            lambda self, s: (None, "safe_encode_error") if s == "CCO" else real(self, s))
    path = tmp_path / "in.csv"
    path.write_text("smiles\nCCO\nc1ccccc1O\nCC(=O)Nc1ccc(O)cc1\nCCCC\n")
    m = run_etl(str(tmp_path / "out"), [str(path)], representation=rep, workers=1, split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rejected"] == {reason: 1} and m["stats"]["rows_out"] == 3


def test_a_missing_package_is_asked_for_by_name(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "selfies", None)  # import selfies now raises ImportError
    path = tmp_path / "in.csv"
    path.write_text("smiles\nCCO\n")
    with pytest.raises(InputError, match=r"--representation selfies: .*pip install selfies"):
        run_etl(str(tmp_path / "out"), [str(path)], representation="selfies")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("options, match", [
    (dict(representation="selfies", randomized_variants=2), "needs --representation smiles"),
    (dict(conformers="etkdg", randomized_variants=2), "needs --representation smiles, --conformers none"),
    (dict(randomized_variants=65), r"--randomized_variants must be in \[0, 64\]"),
    (dict(randomized_variants=-1), r"--randomized_variants must be in \[0, 64\]"),
    (dict(canonical_first=True), "--canonical_first .*needs --task and --randomized_variants"),
    (dict(canonical_first=True, randomized_variants=2), "--canonical_first .*needs --task and --randomized_variants"),
])
def test_stored_randomized_spellings_are_smiles_only(options, match, tmp_path):
    """Randomized spellings are SMILES: refused, before anything is written, on another
    representation, on conformer units and outside [0, 64]."""
    from molds.preprocessing.config import PreprocessConfig
    from molds.preprocessing.pipeline import run

    src = tmp_path / "in.csv"
    src.write_text("smiles\nCCO\n")
    with pytest.raises(ValueError, match=match):
        run(PreprocessConfig(input=[str(src)], output=str(tmp_path / "out"), progress=False, **options))
    assert not (tmp_path / "out").exists()


def test_safe_leaves_the_callers_loguru_logging_as_it_was():
    """Making and using molds' SAFE representation does not switch off the "safe" package's
    loguru logger for the whole process (it once did): a message the package logs afterwards
    (sent from a module of that name) still reaches the caller's sink."""
    pytest.importorskip("safe")
    from loguru import logger

    from molds.chemistry.representation import Safe

    seen = []
    sink = logger.add(seen.append, level="INFO", format="{name}: {message}")
    try:
        rep = Safe()
        text, reason = rep.encode("CC(=O)Nc1ccc(O)cc1")
        assert reason is None and rep.decode(text)
        exec("logger.info('from the package')", {"__name__": "safe.utils", "logger": logger})
    finally:
        logger.remove(sink)
    assert [str(m).strip() for m in seen] == ["safe.utils: from the package"]
