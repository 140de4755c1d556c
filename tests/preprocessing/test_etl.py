"""End-to-end ETL on dirty input, checked against RDKit directly."""

from __future__ import annotations

import json
import math
import os

import pyarrow.parquet as pq
import pytest

from molds.data.manifest import Manifest, manifest_hash

from .conftest import run_etl, shard_rows

NA = {"", "na", "nan", "n/a", "null", "none", "-", "?"}


def expected_molecule(smiles: str, label: str):
    """What the ETL must do with one well-formed row, computed with RDKit directly."""
    from rdkit import Chem

    s = smiles.strip()
    if not s or len(s) > 500 or any(c.isspace() for c in s):
        return None
    if label.strip().lower() not in NA:
        try:
            float(label)
        except ValueError:
            return None
    mol = Chem.MolFromSmiles(s)
    if mol is None or mol.GetNumHeavyAtoms() > 150:
        return None
    return Chem.MolToSmiles(mol)


def read_all(out: str, manifest: dict):
    rows = {}
    for split, shards in manifest["splits"].items():
        rows[split] = []
        for shard in shards:
            rows[split].extend(pq.read_table(os.path.join(out, shard["uri"])).to_pylist())
    return rows


def test_row_accounting_and_rdkit_agreement(dirty_run, dirty_csv):
    out, manifest = dirty_run
    _, records, broken = dirty_csv
    stats = manifest["stats"]
    assert stats["rows_in"] == len(records) + broken
    assert stats["rows_in"] == stats["rows_out"] + stats["duplicates"] + sum(stats["rejected"].values())

    expected = {}
    for cid, smi, label in records:
        can = expected_molecule(smi, label)
        if can is not None:
            expected.setdefault(can, cid)  # the first occurrence is the one kept
    rows = read_all(out, manifest)
    written = [r for split in rows.values() for r in split]
    canon = [r["canonical_smiles"] for r in written]
    assert len(canon) == len(set(canon)), "duplicates in the output"
    assert set(canon) == set(expected), "output molecules differ from what RDKit finds valid"
    assert stats["rows_out"] == len(expected)

    from rdkit import Chem
    from rdkit.Chem.Scaffolds import MurckoScaffold

    for r in written:
        mol = Chem.MolFromSmiles(r["raw_smiles"].strip())
        assert Chem.MolToSmiles(mol) == r["canonical_smiles"]
        assert Chem.MolToSmiles(MurckoScaffold.GetScaffoldForMol(mol), isomericSmiles=False) == r["scaffold"]
        assert r["compound_id"] == expected[r["canonical_smiles"]]

    assert stats["rejected"]["malformed_row"] == 2
    assert stats["rejected"]["non_utf8"] == 2  # invalid bytes and a NUL byte
    for reason in ("parse_error", "valence_error", "kekulize_error", "empty", "too_long",
                   "too_many_heavy_atoms", "bad_label"):
        assert stats["rejected"].get(reason, 0) >= 1, reason


def test_labels_keep_missing_values_as_nan(dirty_run, dirty_csv):
    out, manifest = dirty_run
    _, records, _ = dirty_csv
    by_id = {cid: label for cid, _, label in records}
    for split_rows in read_all(out, manifest).values():
        for r in split_rows:
            raw = by_id[r["compound_id"]]
            (value,) = r["labels"]
            if raw.strip().lower() in NA:
                assert math.isnan(value)
            else:
                assert value == pytest.approx(float(raw), rel=1e-6, abs=1e-6)


def test_no_split_leakage_and_fractions(dirty_run):
    out, manifest = dirty_run
    rows = read_all(out, manifest)
    mols = {s: {r["canonical_smiles"] for r in rs} for s, rs in rows.items()}
    scaf = {s: {r["scaffold"] for r in rs} for s, rs in rows.items()}
    for a, b in (("train", "valid"), ("train", "test"), ("valid", "test")):
        assert not mols[a] & mols[b]
        assert not scaf[a] & scaf[b]
    n = sum(len(v) for v in mols.values())
    assert abs(len(mols["train"]) / n - 0.8) < 0.02
    assert abs(len(mols["valid"]) / n - 0.1) < 0.02
    # MoleculeNet convention: the biggest scaffold groups are in train
    from collections import Counter

    sizes = Counter(r["scaffold"] for rs in rows.values() for r in rs)
    biggest = [s for s, _ in sizes.most_common(5)]
    assert all(s in scaf["train"] for s in biggest)


def test_shards_match_manifest_and_load_with_pyarrow_and_datasets(dirty_run):
    out, manifest = dirty_run
    m = Manifest.load(out)
    total = 0
    for split in ("train", "valid", "test"):
        for shard in m.shards(split):
            m.verify_shard(shard)
            table = pq.read_table(shard.path)
            assert table.num_rows == shard.num_rows
            assert sum(table.column("token_length").to_pylist()) == shard.token_count
            lengths = table.column("token_length").to_pylist()
            bounds = [0] + manifest["length_buckets"]["boundaries"] + [10**9]
            lb = shard.length_bucket
            assert all(bounds[lb] < n <= bounds[lb + 1] for n in lengths)
            total += shard.num_rows
    assert total == manifest["stats"]["rows_out"]
    assert len(m.shards("train")) > 1  # small shard size: several shards per split

    import datasets

    files = [s.path for s in m.shards("train")]
    ds = datasets.load_dataset("parquet", data_files=files, split="train")
    assert len(ds) == manifest["stats"]["splits"]["train"]["rows"]
    assert isinstance(ds[0]["token_ids"], list)


def test_tokenizer_roundtrip_with_autotokenizer(dirty_run):
    from transformers import AutoTokenizer

    out, manifest = dirty_run
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "tokenizer"))
    assert len(tok) == manifest["tokenizer"]["vocab_size"]
    for split_rows in read_all(out, manifest).values():
        for r in split_rows:
            assert tok.decode(r["token_ids"]) == r["canonical_smiles"]
            assert tok(r["canonical_smiles"], add_special_tokens=False)["input_ids"] == r["token_ids"]
            assert r["token_length"] == len(r["token_ids"])
    enc = tok("CCO")["input_ids"]
    assert enc[0] == tok.bos_token_id and enc[-1] == tok.eos_token_id
    assert tok.decode(enc, skip_special_tokens=True) == "CCO"


def test_output_independent_of_workers_and_partitioning(dirty_csv, dirty_run, tmp_path):
    _, manifest = dirty_run
    other = run_etl(str(tmp_path / "one"), [dirty_csv[0]], id_column="id", label_columns=["logp"], workers=1,
                    partition_rows=100_000, chunk_rows=97)
    assert manifest_hash(other) == manifest_hash(manifest)
    assert other["splits"] == manifest["splits"]


def test_one_file_preprocessed_from_two_places_is_cut_and_ordered_alike(dirty_csv, tmp_path):
    """The default compound ids and the ``source`` column name the input's path; the shards'
    layout (their rows, in order) and so the training order do not depend on it."""
    import shutil

    near = tmp_path / "a" / "vendor.csv.gz"
    far = tmp_path / ("a-directory-whose-name-is-much-longer-than-the-other-one-" * 3) / "vendor.csv.gz"
    for path in (near, far):
        path.parent.mkdir(parents=True)
        shutil.copy(dirty_csv[0], path)
    layouts = []
    for path in (near, far):
        out = str(path.parent / "out")
        manifest = run_etl(out, [str(path)], label_columns=["logp"], shard_size_mb=0.02)
        assert str(path) in shard_rows(out, manifest)[0]["compound_id"]
        layouts.append({split: [(s["uri"], s["num_rows"], [r["canonical_smiles"] for r in pq.read_table(
            os.path.join(out, s["uri"])).to_pylist()]) for s in manifest["splits"][split]]
            for split in ("train", "valid", "test")})
    assert len(layouts[0]["train"]) > 3  # several shards, each cut where the plan says
    assert layouts[0] == layouts[1]


def test_report_lists_reasons_with_examples(dirty_run):
    out, manifest = dirty_run
    report = open(os.path.join(out, "report.md"), encoding="utf-8").read()
    for reason in manifest["stats"]["rejected"]:
        assert f"**{reason}**" in report
    assert "vendor.csv.gz:" in report  # examples name the file and row
    assert json.load(open(os.path.join(out, "manifest.json")))["format_version"] == 1


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's malloc tunables")
def test_the_command_runs_with_glibcs_larger_malloc_cache_unless_the_user_set_one(tmp_path):
    """molds-preprocess re-runs itself once with tcache_count=256 added to GLIBC_TUNABLES (its
    forked workers inherit it); a tcache_count the user set, or MOLDS_SYSTEM_ALLOCATOR=1,
    stands; report.json says what ran."""
    import json
    import subprocess
    import sys

    src = tmp_path / "in.csv"
    src.write_text("smiles\nCCO\nc1ccccc1O\nCC(=O)Nc1ccccc1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MOLDS_SYSTEM_ALLOCATOR")}
    for n, (given, system, want) in enumerate((
            (None, "0", "glibc.malloc.tcache_count=256"),
            ("glibc.malloc.mxfast=64", "0", "glibc.malloc.mxfast=64:glibc.malloc.tcache_count=256"),
            ("glibc.malloc.tcache_count=9", "0", "glibc.malloc.tcache_count=9"),
            (None, "1", None))):  # MOLDS_SYSTEM_ALLOCATOR=1: the C library's defaults
        out = tmp_path / f"out{n}"
        run_env = dict(env, MOLDS_SYSTEM_ALLOCATOR=system, **({"GLIBC_TUNABLES": given} if given else {}))
        proc = subprocess.run([sys.executable, "-m", "molds.preprocessing.cli", "--input", str(src), "--output",
                               str(out), "--workers", "1", "--progress", "false"], env=run_env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip().endswith("manifest.json"), proc.stdout  # printed once: one run, not two
        assert proc.stdout.count("manifest.json") == 1, proc.stdout
        assert json.load(open(out / "report.json"))["glibc_tunables"] == want


@pytest.mark.parametrize("dedupe_key", ["canonical", "inchikey"])
def test_duplicates_with_other_labels_are_counted(tmp_path, dedupe_key):
    """The rule for a molecule that comes twice: the first row in input order is kept with its
    labels, the later ones go with theirs; those whose labels differ (a missing label equals
    only a missing one) are counted, as an independent count over RDKit's canonical SMILES
    and the raw cells finds them."""
    import csv

    from rdkit import Chem

    rows = [("CCO", "1", "0.5"), ("OCC", "1", "0.5"), ("C(O)C", "0", "0.5"),  # one conflict
            ("c1ccccc1", "1", ""), ("C1=CC=CC=C1", "1", ""), ("c1ccccc1", "1", "2"),  # one conflict (missing vs 2)
            ("CC(=O)O", "", "3"), ("OC(C)=O", "", "3.0"), ("CCN", "0", "1"), ("NCC", "0", "1.5")]  # 3.0 == 3; one
    path = tmp_path / "dups.csv"
    with open(path, "w", newline="") as fh:
        csv.writer(fh).writerows([("smiles", "a", "b"), *rows])
    m = run_etl(str(tmp_path / "out"), [str(path)], label_columns=["a", "b"], dedupe_key=dedupe_key, split="random")
    first, conflicts = {}, 0
    for smiles, a, b in rows:
        key = Chem.MolToSmiles(Chem.MolFromSmiles(smiles))
        cells = tuple(float(v) if v else None for v in (a, b))
        if key in first:
            conflicts += first[key] != cells
        else:
            first[key] = cells
    assert conflicts == 3
    assert m["stats"]["duplicates"] == len(rows) - len(first)
    assert m["stats"]["duplicates_with_other_labels"] == conflicts
    assert "other_labels" not in json.dumps(run_etl(str(tmp_path / "plain"), [str(path)])["stats"])
