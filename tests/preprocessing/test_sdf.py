"""SDF / MOL input: a hostile, vendor-style SD set is fully accounted, every good record
kept and equal to what RDKit reads from it directly; the record splitter is exact at any
block boundary; V2000, V3000, CRLF, gzip, the title line and SD tags as id and labels;
a gzip cut short either stops the run (the default) or keeps every record before the cut."""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import random

import pyarrow.parquet as pq
import pytest

from molds.preprocessing.readers import InputError

from .conftest import run_etl, sd_record
from .conftest import sd_record as _record


def _rows(out: str, manifest: dict) -> list[dict]:
    rows = []
    for shards in manifest["splits"].values():
        for s in shards:
            rows += pq.read_table(os.path.join(out, s["uri"])).to_pylist()
    return rows


def _rdkit_reads(paths) -> dict:
    """Title -> canonical SMILES of every record, read by RDKit's supplier one record at a
    time (over the whole file it loses the record after an empty one: it takes the next
    record's title line for the empty one's counts line and skips to the next $$$$)."""
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")
    got = {}
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as fh:
            text = fh.read().replace(b"\r\n", b"\n")
        for record in text.split(b"$$$$\n"):
            mol = next(Chem.ForwardSDMolSupplier(io.BytesIO(record)), None) if record.strip() else None
            if mol is not None and mol.GetNumAtoms():
                got[mol.GetProp("_Name")] = Chem.MolToSmiles(mol)
    return got


def test_hostile_sd_set_is_accounted_and_every_good_record_kept(hostile_sdf, tmp_path):
    paths, good, bad = hostile_sdf
    out = str(tmp_path / "out")
    m = run_etl(out, paths, id_column="_Name", label_columns=["pIC50"])
    stats = m["stats"]
    assert stats["rows_in"] == len(good) + len(bad)
    assert stats["rows_in"] == stats["rows_out"] + stats["duplicates"] + sum(stats["rejected"].values())
    expected = {}
    for reason in bad.values():
        expected[reason] = expected.get(reason, 0) + 1
    assert {k: v for k, v in stats["rejected"].items()} == expected
    rows = _rows(out, m)
    by_id = {r["compound_id"]: r for r in rows}
    reference = _rdkit_reads(paths)
    from rdkit import Chem

    for title, (smiles, label) in good.items():
        if title not in by_id:  # the only way to be absent: a duplicate of a kept molecule
            canonical = Chem.MolToSmiles(Chem.MolFromSmiles(smiles))
            assert any(r["canonical_smiles"] == canonical for r in rows), title
            continue
        row = by_id[title]
        assert row["canonical_smiles"] == reference[title] == Chem.MolToSmiles(Chem.MolFromSmiles(smiles)), title
        got = row["labels"][0]
        assert (math.isnan(got) and math.isnan(label)) or got == pytest.approx(label, rel=1e-6), title
    assert stats["rows_out"] + stats["duplicates"] == len(good)
    # every refused record is named by file, line and record number, with RDKit's own complaint
    report = json.load(open(os.path.join(out, "report.json")))["rejected_examples"]
    text_a = open(paths[0]).read()
    starts = [0] + [i + 5 for i in range(len(text_a)) if text_a.startswith("$$$$\n", i)]
    for (name, number), reason in bad.items():
        line = text_a[: starts[number - 1]].count("\n") + 1
        sources = [src for src, _ in report[reason]]
        assert f"{paths[0]}:{line} (record {number})" in sources, (reason, sources)
    broken = dict(report["sdf_parse_error"])
    assert any("Atom line too short" in (msg or "") or "on line" in (msg or "") for msg in broken.values()), broken


def test_sd_tags_as_id_and_the_default_id(hostile_sdf, tmp_path):
    paths, good, _ = hostile_sdf
    m = run_etl(str(tmp_path / "tag"), [paths[1]], id_column="VENDOR_ID")  # an SD tag, matched case-insensitively
    ids = {r["compound_id"] for r in _rows(str(tmp_path / "tag"), m)}
    assert ids and all(i.startswith("W") for i in ids)
    m = run_etl(str(tmp_path / "none"), [paths[1]])
    rows = _rows(str(tmp_path / "none"), m)
    assert all(r["compound_id"] == r["source"] and "(record " in r["source"] for r in rows)
    with pytest.raises(InputError, match=r"b.sdf.gz: no record has the SD tag\(s\) \['pKi'\].*pIC50"):
        run_etl(str(tmp_path / "typo"), [paths[1]], label_columns=["pKi"])


def test_sdf_gives_the_molecules_and_vocabulary_of_the_same_csv(hostile_sdf, tmp_path):
    paths, _, _ = hostile_sdf
    b = _rdkit_reads([paths[1]])
    csv = tmp_path / "b.csv"
    csv.write_text("smiles\n" + "\n".join(b.values()) + "\n")
    m_sdf = run_etl(str(tmp_path / "sdf"), [paths[1]])
    m_csv = run_etl(str(tmp_path / "csv"), [str(csv)])
    assert m_sdf["tokenizer"]["vocab_hash"] == m_csv["tokenizer"]["vocab_hash"]
    for split in ("train", "valid", "test"):
        got = {r["canonical_smiles"] for s in m_sdf["splits"][split]
               for r in pq.read_table(os.path.join(tmp_path / "sdf", s["uri"])).to_pylist()}
        want = {r["canonical_smiles"] for s in m_csv["splits"][split]
                for r in pq.read_table(os.path.join(tmp_path / "csv", s["uri"])).to_pylist()}
        assert got == want, split


@pytest.mark.parametrize("block", [7, 64, 1000])
def test_record_splitter_is_exact_at_every_block_boundary(hostile_sdf, monkeypatch, block):
    from molds.data import sdf

    paths, _, _ = hostile_sdf
    data = open(paths[0], "rb").read()
    whole = list(sdf.read_sd_records(io.BytesIO(data)))
    # the records put back together are the file (the splitter ends a last line that has no
    # line end: here the Ctrl-Z after the last record), and each starts on the line it names
    ended = data if data.endswith(b"\n") else data + b"\n"
    assert b"".join(t if t is not None else b"\n\n$$$$\n" for _, _, t, _ in whole) == ended
    assert [n for _, n, _, _ in whole] == list(range(1, len(whole) + 1))
    lines = ended.split(b"\n")
    for first, number, text, reason in whole:
        if text is not None:
            assert b"\n".join(lines[first - 1:]).startswith(text), number
    monkeypatch.setattr(sdf, "_BLOCK", block)
    assert list(sdf.read_sd_records(io.BytesIO(data))) == whole
    crlf = data.replace(b"\n", b"\r\n")
    assert [(f, n, r) for f, n, _, r in sdf.read_sd_records(io.BytesIO(crlf))] == [(f, n, r) for f, n, _, r in whole]


def test_a_record_without_its_separator_is_skipped_within_bounded_memory(monkeypatch, tmp_path):
    from molds.data import sdf

    monkeypatch.setattr(sdf, "MAX_RECORD_BYTES", 4096)
    monkeypatch.setattr(sdf, "_BLOCK", 1000)
    good = _record("CCO", "before", {}) + _record("CCN", "after", {})
    junk = "".join(f"junk line {i} without any separator\n" for i in range(400))  # ~15 kB, no $$$$
    path = tmp_path / "x.sdf"
    path.write_text(_record("CCC", "first", {}) + junk + "$$$$\n" + good)
    records = list(sdf.read_sd_records(open(path, "rb")))
    assert [(n, r) for _, n, _, r in records] == [(1, None), (2, "record_too_large"), (3, None), (4, None)]
    assert records[1][0] == _record("CCC", "first", {}).count("\n") + 1
    assert records[2][0] == _record("CCC", "first", {}).count("\n") + junk.count("\n") + 2
    m = run_etl(str(tmp_path / "out"), [str(path)], id_column="_Name")
    assert m["stats"]["rows_in"] == 4 and m["stats"]["rejected"] == {"record_too_large": 1}


def _cut_gzip(hostile_sdf, tmp_path):
    paths, good, bad = hostile_sdf
    blob = gzip.compress(open(paths[0], "rb").read())
    cut = tmp_path / "cut.sdf.gz"
    cut.write_bytes(blob[: len(blob) * 2 // 3])
    return str(cut)


def test_a_gzip_cut_short_stops_the_run_by_default(hostile_sdf, tmp_path):
    cut = _cut_gzip(hostile_sdf, tmp_path)
    with pytest.raises(InputError, match=r"cut.sdf.gz: the compressed stream ends before its end marker"):
        run_etl(str(tmp_path / "out"), [hostile_sdf[0][1], cut])
    rep = json.load(open(tmp_path / "out.failed-report.json"))
    assert rep["rejected"]["truncated_input"] == 1
    assert rep["rows_in"] == rep["canonicalized"] + sum(rep["rejected"].values())
    assert not os.path.exists(tmp_path / "out")


def test_on_truncated_keep_keeps_every_record_before_the_cut(hostile_sdf, tmp_path, capsys):
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")
    cut = _cut_gzip(hostile_sdf, tmp_path)
    m = run_etl(str(tmp_path / "out"), [cut], id_column="_Name", on_truncated="keep")
    # what a reader of the readable bytes gets: every complete record before the cut
    readable = b""
    with gzip.open(cut, "rb") as fh:
        try:
            while True:
                block = fh.read(1 << 12)
                if not block:
                    break
                readable += block
        except EOFError:
            pass
    complete = readable[: readable.rindex(b"$$$$\n") + 5]
    expected = [m for m in Chem.ForwardSDMolSupplier(io.BytesIO(complete))]
    titles = {x.GetProp("_Name") for x in expected if x is not None and x.GetNumAtoms()}
    kept = {r["compound_id"] for r in _rows(str(tmp_path / "out"), m)}
    stats = m["stats"]
    assert stats["rejected"]["truncated_input"] == 1
    assert stats["rows_in"] == complete.count(b"$$$$\n") + 1
    assert kept <= titles and len(kept) + stats["duplicates"] == len(titles)
    assert len(stats["truncated_inputs"]) == 1 and stats["truncated_inputs"][0].startswith(cut + ":")
    assert "cut short" in open(tmp_path / "out" / "report.md").read()
    assert "truncated_input" in capsys.readouterr().err


def test_a_mol_file_and_v3000_are_one_record_each(tmp_path):
    from rdkit import Chem

    smiles = "C[C@H](N)C(=O)O"
    mol = Chem.MolFromSmiles(smiles)
    (tmp_path / "alanine.mol").write_text(Chem.MolToMolBlock(mol))  # a molfile: no $$$$, no properties
    (tmp_path / "v3.sd").write_text(Chem.MolToV3KMolBlock(Chem.MolFromSmiles("c1ccccc1O")) + "$$$$\n")
    m = run_etl(str(tmp_path / "out"), [str(tmp_path / "alanine.mol"), str(tmp_path / "v3.sd")],
                split_fractions=[1.0, 0.0, 0.0])
    rows = {r["canonical_smiles"] for s in m["splits"]["train"]
            for r in pq.read_table(os.path.join(tmp_path / "out", s["uri"])).to_pylist()}
    assert rows == {Chem.MolToSmiles(mol), "Oc1ccccc1"}  # stereo from the molblock's wedges kept


def test_bytes_that_are_not_utf8_refuse_the_record_as_the_csv_path_does(tmp_path):
    """A Latin-1 byte in an id tag or a label tag refuses that record as ``non_utf8`` (the
    CSV path's reason, not ``bad_label``); one in the title line alone does not matter
    unless the title is the id. The report spells the bytes, and every other record is
    kept."""
    records = [
        sd_record("CCO", "ok-1", {"ID": "A1", "pIC50": "5.0"}),
        sd_record("CCN", "ok-2", {"ID": "A\xb52", "pIC50": "5.0"}),     # id tag not UTF-8
        sd_record("CCC", "ok-3", {"ID": "A3", "pIC50": "5\xb0"}),       # label tag not UTF-8
        sd_record("CCCl", "caf\xe9", {"ID": "A4", "pIC50": "6.0"}),     # title line not UTF-8
        sd_record("c1ccccc1", "ok-5", {"ID": "A5", "pIC50": "7.0"}),
    ]
    path = tmp_path / "latin1.sdf"
    path.write_bytes("".join(records).encode("latin-1"))
    m = run_etl(str(tmp_path / "tags"), [str(path)], id_column="ID", label_columns=["pIC50"],
                split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rejected"] == {"non_utf8": 2}
    ids = {r["compound_id"] for r in _rows(str(tmp_path / "tags"), m)}
    assert ids == {"A1", "A4", "A5"}
    examples = dict(json.load(open(tmp_path / "tags" / "report.json"))["rejected_examples"]["non_utf8"])
    assert sorted(examples.values()) == ["ok-2", "ok-3"]
    assert "ok-2" in open(tmp_path / "tags" / "report.md").read()

    m = run_etl(str(tmp_path / "title"), [str(path)], id_column="_Name", split_fractions=[1.0, 0.0, 0.0])
    assert m["stats"]["rejected"] == {"non_utf8": 1}  # the Latin-1 title as the id
    examples = dict(json.load(open(tmp_path / "title" / "report.json"))["rejected_examples"]["non_utf8"])
    assert list(examples.values()) == ["caf\\xe9"]  # the byte itself, escaped


def test_lone_cr_line_ends_read_like_lf(hostile_sdf, tmp_path):
    """A file written with classic Mac OS line ends (a lone CR) gives the records of the
    same file with LF ends, at every block boundary of the reader."""
    paths, _, _ = hostile_sdf
    records = [sd_record(s, f"m{i}", {"pIC50": str(i)}) for i, s in enumerate(["CCO", "c1ccccc1O", "CC(=O)N", "CCS"])]
    lf, cr = tmp_path / "lf.sdf", tmp_path / "cr.sdf"
    lf.write_text("".join(records))
    cr.write_bytes("".join(records).replace("\n", "\r").encode())
    got = {}
    for p in (lf, cr):
        m = run_etl(str(tmp_path / p.stem), [str(p)], id_column="_Name", label_columns=["pIC50"],
                    split_fractions=[1.0, 0.0, 0.0])
        assert m["stats"]["rejected"] == {}, p
        got[p.stem] = sorted((r["compound_id"], r["canonical_smiles"], r["labels"][0])
                             for r in _rows(str(tmp_path / p.stem), m))
    assert got["cr"] == got["lf"] and len(got["lf"]) == 4


def test_a_byte_order_mark_is_no_part_of_the_first_title(tmp_path):
    """A UTF-8 BOM (Windows tools) is dropped before the first record, gzipped or not, so the
    first title read as the id is the title; UTF-16 files (LE and BE, CRLF, non-ASCII
    property values) give the records of the same file in UTF-8."""
    records = [sd_record(s, f"m{i}", {"pIC50": str(i), "note": "café"}) for i, s in
               enumerate(["CCO", "c1ccccc1O", "CC(=O)N"])]
    text = "".join(records)
    files = {"plain.sdf": text.encode(), "bom.sdf": b"\xef\xbb\xbf" + text.encode(),
             "u16le.sdf": text.replace("\n", "\r\n").encode("utf-16"),  # BOM + little-endian
             "u16be.sdf": b"\xfe\xff" + text.encode("utf-16-be")}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    with gzip.open(tmp_path / "bom.sdf.gz", "wb") as fh:
        fh.write(files["bom.sdf"])
    got = {}
    for name in [*files, "bom.sdf.gz"]:
        out = tmp_path / ("out-" + name)
        m = run_etl(str(out), [str(tmp_path / name)], id_column="_Name", label_columns=["pIC50"],
                    split_fractions=[1.0, 0.0, 0.0])
        assert m["stats"]["rejected"] == {} and m["stats"]["rows_in"] == 3, name
        got[name] = sorted((r["compound_id"], r["canonical_smiles"], r["labels"][0]) for r in _rows(str(out), m))
    assert got["plain.sdf"] == [("m0", "CCO", 0.0), ("m1", "Oc1ccccc1", 1.0), ("m2", "CC(N)=O", 2.0)]
    assert all(v == got["plain.sdf"] for v in got.values()), got


def test_padded_sd_values_and_titles_are_stripped_as_csv_cells_are(tmp_path):
    """Fixed-width writers pad SD values and titles with spaces: the id (from a tag or the
    title) and the labels read as the CSV path reads its stripped cells."""
    path = tmp_path / "padded.sdf"
    path.write_text(sd_record("CCO", "  m1   ", {"ID": "  A1  ", "pIC50": " 5.5 "})
                    + sd_record("CCN", "m2\t", {"ID": "A2\t", "pIC50": "6"}))
    for column, want in (("ID", {"A1": 5.5, "A2": 6.0}), ("_Name", {"m1": 5.5, "m2": 6.0})):
        out = tmp_path / f"out-{column}"
        m = run_etl(str(out), [str(path)], id_column=column, label_columns=["pIC50"], split_fractions=[1.0, 0.0, 0.0])
        assert m["stats"]["rejected"] == {}
        assert {r["compound_id"]: r["labels"][0] for r in _rows(str(out), m)} == want


@pytest.mark.parametrize("block", [1, 3, 5, 64])
def test_lone_cr_splitting_at_small_blocks(monkeypatch, block):
    from molds.data import sdf

    text = "".join(sd_record(s, f"m{i}", {}) for i, s in enumerate(["CCO", "CCN", "CCC"]))
    monkeypatch.setattr(sdf, "_BLOCK", block)
    lf = [(line, n, data) for line, n, data, _ in sdf.read_sd_records(io.BytesIO(text.encode()))]
    cr = [(line, n, data) for line, n, data, _ in sdf.read_sd_records(io.BytesIO(text.replace("\n", "\r").encode()))]
    assert cr == lf and len(lf) == 3


def test_blank_lines_between_records_keep_every_record_and_are_counted(tmp_path):
    """Writers that put an empty line after each ``$$$$`` shift the next header by a line;
    those records are read without the blank lines (counted), while a record whose title
    line is blank on purpose reads as it is, and one still broken after the repair is
    refused with RDKit's message on the file's own line."""
    a = sd_record("CCO", "m1", {"ID": "A1", "pIC50": "5"})
    b = sd_record("CCN", "m2", {"ID": "A2", "pIC50": "6"})
    c = sd_record("CCC", "", {"ID": "A3", "pIC50": "7"})  # a blank title, valid as it is
    d = sd_record("CCCl", "m4", {"ID": "A4", "pIC50": "8"})
    broken = sd_record("CCBr", "m5", {"ID": "A5"}).split("\n")
    broken[3] = "  x"  # the counts line
    path = tmp_path / "gaps.sdf"
    path.write_text(a + "\n" + b + "\n\n" + c + d + "\n" + "\n".join(broken))
    out = tmp_path / "out"
    m = run_etl(str(out), [str(path)], id_column="ID", label_columns=["pIC50"], split_fractions=[1.0, 0.0, 0.0])
    got = {r["compound_id"]: (r["canonical_smiles"], r["labels"][0]) for r in _rows(str(out), m)}
    assert got == {"A1": ("CCO", 5.0), "A2": ("CCN", 6.0), "A3": ("CCC", 7.0), "A4": ("CCCl", 8.0)}
    assert m["stats"]["sdf_leading_blank_lines"] == 2  # b and d; c's blank title is no repair
    assert m["stats"]["rejected"] == {"sdf_parse_error": 1}
    assert "read without them: 2" in open(out / "report.md").read()
    (source, message), = json.load(open(out / "report.json"))["rejected_examples"]["sdf_parse_error"]
    text = path.read_text()
    first = text[: text.index("m5")].count("\n") + 1  # the blank line before m5's title opens its record
    assert source == f"{path}:{first - 1} (record 5)", source
    # no V2000 counts line to realign on: RDKit's read as it is, its line 4 (the comment line,
    # blank) named in the file's numbering
    assert f"Counts line too short: '' on line {first + 2}" in message, message


def test_a_batch_the_supplier_misreads_is_read_again_record_by_record_counting_once(hostile_sdf, tmp_path):
    """Molecules are canonicalized as the supplier reads them; a batch where it gave more or
    fewer molecules than records (an empty or three-line record swallows the next) is read
    again one record at a time, and the representation's counts (its notes) made from the
    misread batch are dropped, so every kept row is counted once."""
    from molds.chemistry.canonical import ChemOptions
    from molds.preprocessing import map_stage, stages
    from molds.preprocessing.readers import Columns, read_chunks

    class Counting:  # a representation that notes every molecule it writes
        name, notes = "counting", None

        def __init__(self):
            from collections import Counter

            self.notes = Counter()

        def encode(self, canonical):
            self.notes["written"] += 1
            return canonical, None

        def decode(self, text):
            return text

    paths, good, bad = hostile_sdf
    cols = Columns("smiles", "_Name", ("pIC50",))
    options = stages.StageOptions(chem=ChemOptions(), split="scaffold", seed=0, num_labels=1, check_regex=False,
                                  two_stage=False, columns=cols)
    kept = {}
    for batch in (64, 3, 1):  # one batch, several misread ones among good ones, one record per supplier
        stage = map_stage.MapStage(options, str(tmp_path), f"b{batch}")
        stage.represent = Counting()
        calls = []
        misread = stage._sd().read_each
        stage._sd().read_each = lambda *a, **k: calls.append(1) or misread(*a, **k)
        old, map_stage._SD_BATCH = map_stage._SD_BATCH, batch
        try:
            for chunk in read_chunks(0, paths[0], "sdf", cols, 4096):
                stage.process(chunk)
        finally:
            map_stage._SD_BATCH = old
        rows = len(stage._cols["order"])
        assert stage.stats.notes["written"] == rows, (batch, stage.stats.notes, rows)
        if batch > 1:
            assert calls, "no batch of the hostile file was misread: the fallback went untested"
        kept[batch] = (sorted(stage._cols["compound_id"]), dict(stage.stats.rejected), stage.stats.rows_in)
    assert kept[64] == kept[3] == kept[1]
