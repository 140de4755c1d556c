"""Input formats, option modes, and failures that must leave nothing half-written."""

from __future__ import annotations

import gzip
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from molds.data.manifest import manifest_hash
from molds.preprocessing.readers import InputError

from .conftest import run_etl, sample_smiles

SMILES = sample_smiles(300, offset=5000)


def canon_set(out: str, manifest: dict) -> set[str]:
    got = set()
    for shards in manifest["splits"].values():
        for s in shards:
            got.update(pq.read_table(os.path.join(out, s["uri"]), columns=["canonical_smiles"]).column(0).to_pylist())
    return got


def rdkit_canon(smiles) -> set[str]:
    from rdkit import Chem

    return {Chem.MolToSmiles(Chem.MolFromSmiles(s)) for s in smiles}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    path = d / "mols.csv"
    path.write_text("smiles\n" + "\n".join(SMILES) + "\n")
    m = run_etl(str(d / "out"), [str(path)])
    return str(d / "out"), m


def split_sets(out: str, manifest: dict) -> dict:
    return {split: {r for s in shards for r in pq.read_table(os.path.join(out, s["uri"]),
                                                                columns=["canonical_smiles"]).column(0).to_pylist()}
            for split, shards in manifest["splits"].items()}


def _same_content(out: str, m: dict, ref: tuple):
    """Same molecules in the same splits with the same vocabulary as the reference run."""
    ref_out, ref_m = ref
    assert m["stats"]["rows_out"] == ref_m["stats"]["rows_out"]
    assert m["tokenizer"]["vocab_hash"] == ref_m["tokenizer"]["vocab_hash"]
    assert split_sets(out, m) == split_sets(ref_out, ref_m)


def test_every_format_gives_the_same_molecules(tmp_path, reference):
    half = len(SMILES) // 2
    (tmp_path / "a.tsv").write_text("name\tSmiles\n" + "".join(f"m{i}\t{s}\n" for i, s in enumerate(SMILES[:half])))
    with gzip.open(tmp_path / "b.smi.gz", "wt") as fh:
        fh.write("".join(f"{s} mol{i}\n" for i, s in enumerate(SMILES[half:])))
    pq.write_table(pa.table({"SMILES": SMILES, "x": list(range(len(SMILES)))}), tmp_path / "c.parquet",
                   row_group_size=50)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"smiles": s, "id": i}) + "\n" for i, s in enumerate(SMILES)))
    import datasets

    datasets.Dataset.from_dict({"smiles": SMILES}).save_to_disk(str(tmp_path / "e_hf"))
    runs = {
        "tsv+smi": [str(tmp_path / "a.tsv"), str(tmp_path / "b.smi.gz")],
        "parquet": [str(tmp_path / "c.parquet")],
        "jsonl": [str(tmp_path / "d.jsonl")],
        "hf": [str(tmp_path / "e_hf")],
    }
    for name, inputs in runs.items():
        m = run_etl(str(tmp_path / f"out-{name}"), inputs)
        assert canon_set(str(tmp_path / f"out-{name}"), m) == rdkit_canon(SMILES), name
        assert m["stats"]["rows_in"] == len(SMILES)
    # a glob over several files: every molecule once, duplicates counted across files
    m = run_etl(str(tmp_path / "out-glob"), [str(tmp_path / "*.parquet"), str(tmp_path / "d.jsonl")])
    assert m["stats"]["rows_in"] == 2 * len(SMILES)
    assert m["stats"]["duplicates"] == len(SMILES)
    _same_content(str(tmp_path / "out-glob"), m, reference)


def test_fsspec_uri_input(tmp_path, reference):
    import fsspec

    with fsspec.open("memory://bucket/mols.csv.gz", "wb", compression="gzip") as fh:
        fh.write(("smiles\n" + "\n".join(SMILES) + "\n").encode())
    m = run_etl(str(tmp_path / "out"), ["memory://bucket/*.csv.gz"])
    assert canon_set(str(tmp_path / "out"), m) == rdkit_canon(SMILES)
    _same_content(str(tmp_path / "out"), m, reference)


def test_missing_column_names_file_and_columns(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("SMILE,id\nCCO,1\n")
    with pytest.raises(InputError) as err:
        run_etl(str(tmp_path / "out"), [str(path)], smiles_column="smiles_col")
    assert "x.csv" in str(err.value) and "['SMILE', 'id']" in str(err.value)
    assert not os.path.exists(tmp_path / "out")
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]


def test_jsonl_keys_match_as_csv_columns_do_and_a_missing_key_is_refused(tmp_path):
    """JSON-lines keys match but for case, as CSV columns do; a SMILES value that is no
    string is a malformed row; a file with no record holding the key is refused with the
    keys it has (and every row accounted in the failure report); a Parquet SMILES column of
    numbers is refused by its type."""
    (tmp_path / "k.jsonl").write_text('{"SMILES": "CCO", "ID": 5, "Y": "1.5"}\n{"SMILES": 123}\n{"smiles": "CCN"}\n'
                                      '[1]\n{"other": "x"}\n')
    out = tmp_path / "k"
    m = run_etl(str(out), [str(tmp_path / "k.jsonl")], id_column="id", label_columns=["y"],
                split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rows_in"] == 5 and m["stats"]["rejected"] == {"malformed_row": 2, "missing_field": 1}
    rows = {r["canonical_smiles"]: r for r in pq.read_table(os.path.join(out, m["splits"]["train"][0]["uri"])).to_pylist()}
    assert rows["CCO"]["compound_id"] == "5" and rows["CCO"]["labels"] == [1.5] and set(rows) == {"CCO", "CCN"}
    (tmp_path / "k2.jsonl").write_text('{"smi": "CCO"}\n{"smi": "CCN"}\n')
    with pytest.raises(InputError, match=r"k2.jsonl: no record has a value for the SMILES key 'smiles'; its records have \['smi'\]"):
        run_etl(str(tmp_path / "k2"), [str(tmp_path / "k2.jsonl")])
    assert json.load(open(str(tmp_path / "k2") + ".failed-report.json"))["rows_in"] == 2
    (tmp_path / "k3.jsonl").write_text('{"Smiles": "CCO", "SMILES": "CCN"}\n')  # two keys match but for case
    with pytest.raises(InputError, match=r"k3.jsonl line 1: 2 columns match 'smiles'"):
        run_etl(str(tmp_path / "k3"), [str(tmp_path / "k3.jsonl")])
    pq.write_table(pa.table({"smiles": [1, 2]}), tmp_path / "int.parquet")
    with pytest.raises(InputError, match=r"int.parquet: its SMILES column 'smiles' holds int64, not strings"):
        run_etl(str(tmp_path / "int"), [str(tmp_path / "int.parquet")])


def test_a_column_name_two_columns_share_is_refused(tmp_path):
    """Two columns that match the name asked for (the same, or the same but for case) are
    refused by name, not read from the first; an exact name picks one of two that differ in case."""
    (tmp_path / "dup.csv").write_text("SMILES,SMILES,id\nCCO,CCN,1\n")
    (tmp_path / "case.csv").write_text("SMILES,smiles\nCCO,CCN\n")
    with pytest.raises(InputError, match=r"dup.csv: 2 columns match 'SMILES' \(columns 1, 2 of"):
        run_etl(str(tmp_path / "a"), [str(tmp_path / "dup.csv")], smiles_column="SMILES")
    with pytest.raises(InputError, match=r"case.csv: 2 columns match 'Smiles'"):
        run_etl(str(tmp_path / "b"), [str(tmp_path / "case.csv")], smiles_column="Smiles")
    m = run_etl(str(tmp_path / "c"), [str(tmp_path / "case.csv")], smiles_column="smiles", split_fractions=[1.0, 0.0, 0.0])
    assert canon_set(str(tmp_path / "c"), m) == {"CCN"}


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be-bom", "utf-32", "utf-8-sig"])
def test_unicode_exports_with_a_bom_read_as_utf8(tmp_path, reference, encoding):
    """Excel's "Unicode text" export (UTF-16 with its BOM, tabs), and UTF-32 or UTF-8 with a
    BOM, give the molecules of the plain UTF-8 file; a gzipped one too."""
    text = "name\tsmiles\n" + "".join(f"m{i}\t{s}\n" for i, s in enumerate(SMILES))
    data = b"\xfe\xff" + text.encode("utf-16-be") if encoding == "utf-16-be-bom" else text.encode(encoding)
    (tmp_path / "u.tsv").write_bytes(data)
    with gzip.open(tmp_path / "v.tsv.gz", "wb") as fh:
        fh.write(data)
    for name in ("u.tsv", "v.tsv.gz"):
        m = run_etl(str(tmp_path / f"out-{name}"), [str(tmp_path / name)])
        assert m["stats"]["rejected"] == {} and m["stats"]["rows_in"] == len(SMILES), name
        _same_content(str(tmp_path / f"out-{name}"), m, reference)


def test_a_header_split_by_another_character_says_which(tmp_path):
    (tmp_path / "semi.csv").write_text("id;SMILES\n1;CCO\n")
    with pytest.raises(InputError, match=r"semi.csv: no SMILES column 'smiles'.*split by ';': pass --delimiter ';'"):
        run_etl(str(tmp_path / "out"), [str(tmp_path / "semi.csv")])
    m = run_etl(str(tmp_path / "out"), [str(tmp_path / "semi.csv")], delimiter=";", split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rows_out"] == 1


@pytest.mark.parametrize("sep", [";", "\t"])
def test_excels_sep_line_sets_the_delimiter_and_keeps_line_numbers(tmp_path, sep):
    """Excel's ``sep=;`` first line (European exports) is read as the delimiter and skipped;
    the rows keep their line numbers in the file; a --delimiter that disagrees is refused."""
    rows = ["id;SMILES;pIC50", "a1;CCO;5.5", "a2;C1CC1;x", "a3;c1ccccc1O;7"]
    (tmp_path / "x.csv").write_text(f"sep={sep}\n" + "".join(r.replace(";", sep) + "\n" for r in rows))
    out = tmp_path / "out"
    m = run_etl(str(out), [str(tmp_path / "x.csv")], id_column="id", label_columns=["pIC50"],
                split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rows_in"] == 3 and m["stats"]["rejected"] == {"bad_label": 1}
    assert json.load(open(out / "report.json"))["rejected_examples"]["bad_label"][0][0] == f"{tmp_path / 'x.csv'}:4"
    rows = pq.read_table(os.path.join(out, m["splits"]["train"][0]["uri"])).to_pylist()
    assert sorted((r["compound_id"], r["source"]) for r in rows) == [("a1", f"{tmp_path / 'x.csv'}:3"),
                                                                     ("a3", f"{tmp_path / 'x.csv'}:5")]
    with pytest.raises(InputError, match=r"x.csv: its first line 'sep=.*but --delimiter is ','"):
        run_etl(str(tmp_path / "out2"), [str(tmp_path / "x.csv")], delimiter=",")


def test_decimal_commas_and_infinite_labels(tmp_path):
    """A European export's ``5,2`` is a bad label whose report says how to read it, and
    ``--decimal ,`` reads it (a value with a ``.`` then refused); a label float32 cannot hold
    (``inf``, ``1e999``, ``-1e39``) is refused either way, a missing one is NaN."""
    import math

    (tmp_path / "eu.csv").write_text("sep=;\nSMILES;y\nCCO;5,2\nCCN;-0,75\nCCC;1e999\nCCCl;inf\nCCBr;NA\nCCI;1.5\n"
                                     "CCF;-1e39\n")
    out = tmp_path / "dot"
    m = run_etl(str(out), [str(tmp_path / "eu.csv")], label_columns=["y"], split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rejected"] == {"bad_label": 5} and m["labels"]["decimal"] == "."
    assert "`--decimal ,` reads them" in open(out / "report.md").read()
    out = tmp_path / "comma"
    m = run_etl(str(out), [str(tmp_path / "eu.csv")], label_columns=["y"], decimal=",",
                split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rejected"] == {"bad_label": 4} and m["labels"]["decimal"] == ","
    assert "--decimal" not in open(out / "report.md").read()
    got = {r["canonical_smiles"]: r["labels"][0] for r in
           pq.read_table(os.path.join(out, m["splits"]["train"][0]["uri"])).to_pylist()}
    assert got["CCO"] == pytest.approx(5.2) and got["CCN"] == -0.75 and math.isnan(got["CCBr"])
    assert set(got) == {"CCO", "CCN", "CCBr"}
    # Parquet floats: inf refused, NaN kept as missing
    pq.write_table(pa.table({"smiles": ["CCO", "CCN", "CCC"], "y": [1.0, float("inf"), float("nan")]}),
                   tmp_path / "f.parquet")
    m = run_etl(str(tmp_path / "pq"), [str(tmp_path / "f.parquet")], label_columns=["y"],
                split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rejected"] == {"bad_label": 1} and m["stats"]["rows_out"] == 2


def test_cxsmiles_are_read_with_their_extension_and_counted(tmp_path):
    """``SMILES |extension|`` (ChemAxon's CXSMILES, as Enamine and PubChem export) is read by
    RDKit's CXSMILES reader, in CSV cells and .smi lines (the name after it is the id), and
    counted in the manifest and the report; an extension RDKit refuses is ``cxsmiles_error``;
    text after a space that is no extension stays a ``parse_error``."""
    from rdkit import Chem

    cells = {"r1": "C[C@H](N)C(=O)O |&1:1|", "r2": "[CH2]CO |^1:0|", "r3": "c1ccccc1Cl", "r4": "CC |SgD:0:x|",
             "r5": "CCO ethanol", "r6": "CC(C |&1:1|"}
    (tmp_path / "cx.csv").write_text("id,smiles\n" + "".join(f"{k},{v}\n" for k, v in cells.items()))
    (tmp_path / "cx.smi").write_text("C[C@H](N)C(=O)O |&1:1| alanine\nCCN\n")
    out = tmp_path / "out"
    m = run_etl(str(out), [str(tmp_path / "cx.csv")], id_column="id", split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rejected"] == {"cxsmiles_error": 1, "parse_error": 2}
    assert m["stats"]["cxsmiles_rows"] == 2
    assert "CXSMILES extension" in open(out / "report.md").read()
    rows = {r["compound_id"]: r for r in pq.read_table(os.path.join(out, m["splits"]["train"][0]["uri"])).to_pylist()}
    assert {k: r["canonical_smiles"] for k, r in rows.items()} == {
        "r1": "C[C@H](N)C(=O)O", "r2": Chem.MolToSmiles(Chem.MolFromSmiles("[CH2]CO |^1:0|")), "r3": "Clc1ccccc1"}
    assert rows["r2"]["canonical_smiles"] == "[CH2]CO" and rows["r1"]["raw_smiles"] == cells["r1"]
    m = run_etl(str(tmp_path / "smi"), [str(tmp_path / "cx.smi")], split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rejected"] == {} and m["stats"]["cxsmiles_rows"] == 1
    rows = pq.read_table(os.path.join(tmp_path / "smi", m["splits"]["train"][0]["uri"])).to_pylist()
    assert {r["compound_id"] for r in rows} == {"alanine", f"{tmp_path / 'cx.smi'}:2"}


def test_unreadable_file_leaves_no_output_and_accounts_for_what_was_read(tmp_path):
    import json

    good = tmp_path / "a.csv"
    good.write_text("smiles\n" + "\n".join(SMILES) + "\n")
    bad = tmp_path / "b.csv.gz"
    blob = gzip.compress(("smiles\n" + "\n".join(SMILES) + "\n").encode())
    bad.write_bytes(blob[: len(blob) // 2])  # truncated gzip
    with pytest.raises(InputError, match=r"b.csv.gz.*rows were read \(up to .*b.csv.gz line/row \d+\)"):
        run_etl(str(tmp_path / "out"), [str(good), str(bad)])
    # no output, no temporary directory: only the failure report
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("out")) == ["out.failed-report.json",
                                                                             "out.failed-report.md"]
    rep = json.load(open(tmp_path / "out.failed-report.json"))
    assert len(SMILES) < rep["rows_in"] < 2 * len(SMILES)  # all of a.csv and the readable part of b.csv.gz
    assert rep["rows_in"] == rep["canonicalized"] + sum(rep["rejected"].values())


def test_existing_output_is_kept_unless_overwrite(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("smiles\n" + "\n".join(SMILES[:50]) + "\n")
    out = str(tmp_path / "out")
    first = run_etl(out, [str(path)])
    with pytest.raises(FileExistsError):
        run_etl(out, [str(path)])
    second = run_etl(out, [str(path)], overwrite=True, seed=3)
    assert json.load(open(os.path.join(out, "manifest.json")))["split"]["seed"] == 3
    assert first["split"]["seed"] == 0 and second["split"]["seed"] == 3


def test_inchikey_dedupe_merges_tautomers_without_scaffold_leakage(tmp_path):
    extra = ["Oc1ccccn1", "O=c1cccc[nH]1", "Oc1ccc(C)cn1", "O=c1ccc(C)c[nH]1"]
    path = tmp_path / "a.csv"
    path.write_text("smiles\n" + "\n".join(SMILES + extra) + "\n")
    canonical = run_etl(str(tmp_path / "canon"), [str(path)])
    inchi = run_etl(str(tmp_path / "inchi"), [str(path)], dedupe_key="inchikey")
    assert inchi["stats"]["duplicates"] == canonical["stats"]["duplicates"] + 2
    rows = {}
    for split, shards in inchi["splits"].items():
        for s in shards:
            t = pq.read_table(os.path.join(tmp_path / "inchi", s["uri"]))
            rows[split] = set(t.column("scaffold").to_pylist()) | rows.get(split, set())
    assert not (rows["train"] & rows["valid"]) and not (rows["train"] & rows["test"])


@pytest.mark.parametrize("split", ["random", "scaffold_random"])
def test_random_splits_are_seeded_and_leak_free(tmp_path, split):
    path = tmp_path / "a.csv"
    path.write_text("smiles\n" + "\n".join(SMILES) + "\n")
    a = run_etl(str(tmp_path / "a"), [str(path)], split=split, seed=1)
    b = run_etl(str(tmp_path / "b"), [str(path)], split=split, seed=1, workers=1)
    c = run_etl(str(tmp_path / "c"), [str(path)], split=split, seed=2)
    assert manifest_hash(a) == manifest_hash(b)
    assert a["splits"] != c["splits"]
    sets = {}
    for split_name, shards in a["splits"].items():
        for s in shards:
            t = pq.read_table(os.path.join(tmp_path / "a", s["uri"]))
            key = "canonical_smiles" if split == "random" else "scaffold"
            sets.setdefault(split_name, set()).update(t.column(key).to_pylist())
    assert not (sets["train"] & sets["valid"]) and not (sets["train"] & sets["test"])
    assert abs(a["stats"]["splits"]["train"]["rows"] / a["stats"]["rows_out"] - 0.8) < 0.05


def test_vocab_from_train_counts_unknown_tokens(tmp_path):
    path = tmp_path / "a.csv"
    rare = ["C[Se]C", "[Te]1C=CC=C1", "CC[Si](C)(C)C"]
    path.write_text("smiles\n" + "\n".join(SMILES + rare) + "\n")
    m = run_etl(str(tmp_path / "out"), [str(path)], vocab_from="train", split="random", seed=3)
    tok = json.load(open(tmp_path / "out" / "tokenizer" / "tokenizer.json"))["model"]["vocab"]
    assert m["stats"]["rows_out"] == len(SMILES) + len(rare)
    # the rows of valid / test holding a token the train-built vocabulary lacks, counted here with
    # the published atom-level regex (Schwaller et al. 2019) over the shards' canonical SMILES
    pattern = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|"
                         r"%[0-9]{2}|[0-9])")
    expected, rare_held_out = 0, 0
    for split in ("valid", "test"):
        for shard in m["splits"][split]:
            for smi in pq.read_table(os.path.join(tmp_path / "out", shard["uri"])).column("canonical_smiles").to_pylist():
                expected += any(t not in tok for t in pattern.findall(smi))
                rare_held_out += any(el in smi for el in ("Se", "Te", "Si"))
    assert rare_held_out >= 1  # this seed puts some of the rare molecules outside train (else nothing is tested)
    unknown = sum(m["stats"]["splits"][s]["rows_with_unknown_tokens"] for s in ("valid", "test"))
    assert unknown == expected >= 1, (unknown, expected)
    assert m["stats"]["splits"]["train"]["rows_with_unknown_tokens"] == 0
    assert m["stats"]["splits"]["train"]["rows_with_unknown_tokens"] == 0


def test_bpe_and_external_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "a.csv"
    path.write_text("smiles\n" + "\n".join(SMILES) + "\n")
    bpe = run_etl(str(tmp_path / "bpe"), [str(path)], tokenizer="bpe", bpe_vocab_size=120)
    assert bpe["tokenizer"]["kind"] == "bpe" and bpe["tokenizer"]["vocab_size"] <= 120
    ext = run_etl(str(tmp_path / "ext"), [str(path)], tokenizer=str(tmp_path / "bpe" / "tokenizer"))
    assert ext["tokenizer"]["vocab_hash"] == bpe["tokenizer"]["vocab_hash"]
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "ext" / "tokenizer"))
    for shards in ext["splits"].values():
        for s in shards:
            for r in pq.read_table(os.path.join(tmp_path / "ext", s["uri"])).to_pylist():
                assert tok.decode(r["token_ids"]) == r["canonical_smiles"]
    assert ext["stats"]["rows_out"] == len(rdkit_canon(SMILES))


def test_cli_with_dashes_json_config_and_print_config(tmp_path, capsys):
    from molds.preprocessing.cli import main, parse

    path = tmp_path / "a.csv"
    path.write_text("smiles\n" + "\n".join(SMILES[:40]) + "\n")
    cfg = parse(["--input", str(path), str(path), "--output", "o", "--split-fractions", "0.8,0.1,0.1",
                 "--label-columns", "a,b", "--smiles-column", "smiles"])
    assert cfg.input == [str(path), str(path)] and cfg.split_fractions == [0.8, 0.1, 0.1]
    assert cfg.label_columns == ["a", "b"]
    conf = tmp_path / "pre.json"
    conf.write_text(json.dumps({"input": [str(path)], "output": str(tmp_path / "out"), "workers": 1,
                                "progress": False}))
    assert main(["--config", str(conf)]) == 0
    assert os.path.exists(tmp_path / "out" / "manifest.json")
    with pytest.raises(SystemExit):
        main(["--config", str(conf), "--print_config"])
    printed = capsys.readouterr().out
    assert "smiles_column" in printed and str(path) in printed
    from molds.errors import InputError

    with pytest.raises(InputError, match="no_such_option"):
        parse(["--input", str(path), "--output", "o", "--no_such_option", "1"])


@pytest.mark.parametrize("fmt", ["csv", "smi", "jsonl"])
def test_report_locations_are_line_numbers(tmp_path, fmt):
    """file:line in the report points at the line an editor shows (header and blank lines counted)."""
    import json

    good = ["CCO", "c1ccccc1", "CC(=O)O"]
    if fmt == "csv":
        text = "smiles,id\n" + "CCO,a\n\nc1ccccc1,b\nC1CC,c\nCC(=O)O,d\n"  # the bad molecule is on line 5
    elif fmt == "smi":
        text = "CCO a\n\nc1ccccc1 b\nC1CC c\nCC(=O)O d\n"  # line 4
    else:
        text = '{"smiles": "CCO"}\n\n{"smiles": "c1ccccc1"}\n{"smiles": "C1CC"}\n{"smiles": "CC(=O)O"}\n'  # line 4
    path = tmp_path / f"in.{fmt}"
    path.write_text(text)
    out = str(tmp_path / "out")
    run_etl(out, [str(path)])
    line = 5 if fmt == "csv" else 4
    assert f"`{path}:{line}`: `C1CC`" in open(os.path.join(out, "report.md")).read()
    assert json.load(open(os.path.join(out, "report.json")))["rejected_examples"]["parse_error"][0][0] == \
        f"{path}:{line}"
    assert len(good) == json.load(open(os.path.join(out, "manifest.json")))["stats"]["rows_out"]


def test_a_reader_stopped_early_closes_cleanly(tmp_path):
    """A consumer that stops reading (an error elsewhere, a row limit) closes the reader:
    it must not try to hand on its partial chunk then (Python: 'generator ignored
    GeneratorExit'), only when reading itself fails."""
    from molds.preprocessing.readers import Columns, read_chunks

    path = tmp_path / "in.csv"
    path.write_text("SMILES\n" + "CCO\n" * 25)
    gen = read_chunks(0, str(path), "csv", Columns("SMILES"), 10)
    first = next(gen)
    assert len(first) == 10
    gen.close()  # raised RuntimeError before the fix


def test_http_input_gives_the_local_shards(tmp_path, reference):
    """``molds-preprocess --input https://...`` reads over fsspec's HTTP filesystem: the
    same rows in the same splits and order as from the local file, column for column, but
    ``source`` and the default ``compound_id``, which name the URL instead of the path."""
    from tests.http_server import serve_directory

    ref_out, ref_m = reference
    served = tmp_path / "served"
    served.mkdir()
    with gzip.open(served / "mols.csv.gz", "wt") as fh:
        fh.write("smiles\n" + "\n".join(SMILES) + "\n")
    with serve_directory(str(served)) as (url, requests):
        m = run_etl(str(tmp_path / "out"), [f"{url}/mols.csv.gz"])
        assert any(r.endswith("/mols.csv.gz") for r in requests)
    local = run_etl(str(tmp_path / "local"), [str(served / "mols.csv.gz")])
    assert m["stats"] == local["stats"] and m["tokenizer"]["vocab_hash"] == local["tokenizer"]["vocab_hash"]

    def rows(out, manifest, split):  # shards are cut by size, and the URL makes ``source`` longer
        return pa.concat_tables([pq.read_table(os.path.join(out, s["uri"])) for s in manifest["splits"][split]])

    assert m["splits"].keys() == local["splits"].keys()
    for split in m["splits"]:
        a, b = rows(str(tmp_path / "out"), m, split), rows(str(tmp_path / "local"), local, split)
        assert a.column_names == b.column_names
        for col in a.column_names:
            if col in ("source", "compound_id"):  # (no id column: the id is where the row came from)
                assert [x.replace(f"{url}/", "") for x in a.column(col).to_pylist()] == \
                    [x.replace(f"{served}/", "") for x in b.column(col).to_pylist()]
                assert a.column(col)[0].as_py().startswith(url)
            else:
                assert a.column(col).equals(b.column(col)), (split, col)
    _same_content(str(tmp_path / "out"), m, reference)


@pytest.mark.parametrize("name, text", [
    ("dos.csv", "smiles,id\nCCO,1\nCCN,2\n\x1a"),  # DOS's end-of-file mark
    ("zeroed.csv", "smiles,id\nCCO,1\n" + "\0" * 400 + "\nCCN,2\n"),  # a block of NUL bytes where rows were
    ("dos.smi", "CCO one\nCCN two\n\x1a\r\n"),
    ("zeroed.jsonl", '{"smiles": "CCO"}\n' + "\0" * 64 + '\n{"smiles": "CCN"}\n'),
], ids=["csv-ctrl-z", "csv-nul", "smi-ctrl-z", "jsonl-nul"])
def test_nul_bytes_and_ctrl_z_are_counted_as_padding_by_line(tmp_path, name, text):
    """A line of nothing but NUL bytes or Ctrl-Z is no record and no bad molecule: it is
    counted under ``padding``, named by file and line, and the rows around it are read."""
    path = tmp_path / name
    path.write_bytes(text.encode())
    out = tmp_path / "out"
    m = run_etl(str(out), [str(path)], split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rows_in"] == 3 and m["stats"]["rows_out"] == 2
    assert m["stats"]["rejected"] == {"padding": 1}
    line = text[: text.index("\0" if "\0" in text else "\x1a")].count("\n") + 1
    examples = json.load(open(out / "report.json"))["rejected_examples"]["padding"]
    assert [source for source, _ in examples] == [f"{path}:{line}"]


@pytest.mark.parametrize("name,data", [
    ("in.csv", "ID,SMILES\n1,CCO\n2,c1ccccc1\n3,CC(=O)O\n".encode("utf-8-sig")),  # Excel's UTF-8 mark; capitals
    ("in.tsv.gz", gzip.compress("smiles\tname\nCCO\ta\nc1ccccc1\tb\n".encode("utf-16"))),  # "Unicode text", tabs
    ("in.csv", b'sep=;\nid;Smiles\n1;CCO\n2;"C\nC"\n3;CCN\n'),  # Excel's delimiter line; a quoted newline
    ("in.txt", "CCO first\n\nc1ccccc1 second\nCCN\n".encode("utf-8-sig")),  # one a line, a blank line, a mark
    ("in.csv", b"smiles,y\nCCO,1\nc1cc\xffcc1,0\n\0\0\0\nCCN,1\n"),  # a byte that is no UTF-8; NUL padding
    ("in.smi", b"CCO a\nc1cc\xffcc1 b\n\x1a\x1a\nCCN\n"),  # the same, one a line; Ctrl-Z padding
], ids=["bom-capitals", "utf16-tsv-gz", "excel-sep", "lines-bom", "bad-byte-csv", "bad-byte-smi"])
def test_molds_predict_reads_a_file_as_the_etl_reads_it(tmp_path, name, data):
    """``molds-predict``'s sources are the ETL's records of the same file, row for row: the
    same lines, the same SMILES, a line of padding no source (a byte that is no UTF-8 as
    U+FFFD, which RDKit refuses, where the ETL refuses the row as non_utf8); before,
    molds-predict read a CSV with ``csv.reader`` on UTF-8 alone: a byte-order mark hid the
    column, UTF-16 and TSV did not read."""
    from molds.cli.predict import read_sources
    from molds.data.inputs import detect_format
    from molds.preprocessing.readers import Columns, read_chunks

    path = tmp_path / name
    path.write_bytes(data)
    fmt = detect_format(str(path))
    etl = [(row, smiles, chunk.reasons.get(i)) for chunk in read_chunks(0, str(path), fmt, Columns("smiles"), 100)
           for i, (row, smiles) in enumerate(zip(chunk.rows, chunk.smiles))]
    ours = [(row, s) for row, s, note in read_sources(str(path), None) if note is None]
    assert [(row, s) for row, s in ours if "\ufffd" not in s] == [(row, s) for row, s, why in etl if why is None]
    assert [row for row, s in ours if "\ufffd" in s] == [row for row, _, why in etl if why == "non_utf8"]
    assert {why for _, _, why in etl} <= {None, "non_utf8", "padding"} and len(ours) == sum(
        why != "padding" for _, _, why in etl)


def test_molds_predict_says_in_one_line_what_it_cannot_read(tmp_path):
    """A CSV without a smiles column (SMILES one a line, no header), one split by semicolons,
    and a file of a kind molds-predict does not read: each refused with what to do, in
    molds-predict's own options (the ETL's line named --input_format)."""
    from molds.cli.predict import read_sources
    from molds.errors import MoldsError

    for name, text, want in (("h.csv", "CCO\nCCN\n", r"no SMILES column 'smiles'.*--column.*name the file \.smi"),
                             ("s.csv", "id;smiles\n1;CCO\n", r"split by ';': pass --delimiter ';'"),
                             ("m.parquet", "x\n", r"read as parquet by its name; molds-predict reads")):
        (tmp_path / name).write_text(text)
        with pytest.raises(MoldsError, match=want) as exc:
            read_sources(str(tmp_path / name), None)
        assert "\n" not in str(exc.value) and "--input_format" not in str(exc.value)
    assert read_sources(str(tmp_path / "s.csv"), None, ";") == [(2, "CCO", None)]


def test_molds_predict_reads_an_sd_file_record_for_record(tmp_path):
    """An SD file (gzipped, a UTF-8 byte-order mark as Windows tools write it, a record RDKit
    refuses): molds-predict's sources are RDKit's own supplier's molecules, record for record,
    at the line each record starts on; the refused record is a source with no text and the
    ETL's reason, not dropped and not the end of the file."""
    from rdkit import Chem

    from molds.cli.predict import read_sources

    smiles = ["CCO", "c1ccccc1C(=O)O", "C[C@H](N)C(=O)O", "CN1CCC[C@H]1c1cccnc1", "O=C([O-])CC.[Na+]"]
    blocks = [Chem.MolToMolBlock(Chem.MolFromSmiles(s)) + f">  <name>\nm{i}\n\n$$$$\n" for i, s in enumerate(smiles)]
    five = Chem.RWMol()
    for _ in range(6):
        five.AddAtom(Chem.Atom(6))
    for i in range(1, 6):
        five.AddBond(0, i, Chem.BondType.SINGLE)
    blocks.insert(2, Chem.MolToMolBlock(five, kekulize=False) + "$$$$\n")  # a carbon of five bonds: RDKit refuses it
    text = "".join(blocks)
    path = tmp_path / "vendor.sdf.gz"
    path.write_bytes(gzip.compress(b"\xef\xbb\xbf" + text.encode()))
    starts = [1] + [i + 2 for i, line in enumerate(text.splitlines()) if line == "$$$$"][:-1]
    want = []
    for start, mol in zip(starts, Chem.ForwardSDMolSupplier(gzip.open(path))):
        want.append((start, Chem.MolToSmiles(mol) if mol is not None else ""))
    got = read_sources(str(path), None)
    assert [(row, text) for row, text, _ in got] == want and len(got) == 6
    assert [note for _, _, note in got] == [None, None, "valence_error", None, None, None]
    assert [Chem.CanonSmiles(t) for _, t, n in got if n is None] == [Chem.CanonSmiles(s) for s in smiles]


def test_molds_predict_carries_each_rows_id_as_the_etl_names_it(tmp_path):
    """``--id_column``: a CSV column found as the ETL finds it (a byte-order mark, other case),
    an SD tag (other case) or the title line (``_Name``), each source's value read back by the
    csv module and RDKit's own supplier; a row without one has '' (not dropped); a tag no
    record has, or an id for SMILES one a line, refused in one line."""
    import csv as csvmod

    from rdkit import Chem

    from molds.cli.predict import read_sources
    from molds.errors import MoldsError

    path = tmp_path / "ids.csv"
    path.write_bytes(b"\xef\xbb\xbfCompound_ID,SMILES\r\nZ-1,CCO\r\n,CCN\r\nZ-3,c1ccccc1\r\n")
    want = [(n, r["SMILES"], r["Compound_ID"]) for n, r in enumerate(
        csvmod.DictReader(open(path, encoding="utf-8-sig", newline="")), 2)]
    assert [(row, s, cid) for row, s, _, cid in read_sources(str(path), None, None, "compound_id")] == want

    smiles = ["CCO", "c1ccccc1C(=O)O", "CN"]
    blocks = [Chem.MolToMolBlock(Chem.MolFromSmiles(s)).replace("\n", f"title-{i}\n", 1)
              + (f">  <Vendor_ID>\nV{i}\n\n" if i != 1 else "") + "$$$$\n" for i, s in enumerate(smiles)]
    sd = tmp_path / "v.sdf"
    sd.write_text("".join(blocks))
    supplied = list(Chem.SDMolSupplier(str(sd)))
    tags = [m.GetProp("Vendor_ID") if m.HasProp("Vendor_ID") else "" for m in supplied]
    assert [cid for *_, cid in read_sources(str(sd), None, None, "vendor_id")] == tags == ["V0", "", "V2"]
    assert [cid for *_, cid in read_sources(str(sd), None, None, "_Name")] == [m.GetProp("_Name") for m in supplied]
    for source, column, want in ((sd, "catalog", r"no record has the SD tag 'catalog'.*Vendor_ID"),
                                 (path, "catalog", r"no id column 'catalog'"),
                                 (tmp_path / "l.smi", "name", r"--id_column names a CSV / TSV column or an SD tag")):
        if source.suffix == ".smi":
            source.write_text("CCO ethanol\n")
        with pytest.raises(MoldsError, match=want) as exc:
            read_sources(str(source), None, None, column)
        assert "\n" not in str(exc.value)
