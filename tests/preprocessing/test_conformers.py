"""Conformer units (``--conformers etkdg``): every ETL row's unit decodes to its canonical
SMILES and to one coordinate per heavy atom, exact to the stated precision (the text
written again from the parsed numbers is the same text), in the order RDKit reads the
atoms of that SMILES; the geometry is a real one (bond lengths of an MMFF geometry);
failures are counted by reason; the loader never splits a unit and truncates an
over-long one in place, counted; ``molds-eval --conformers`` tells good units from
broken ones."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from molds.chemistry.conformers import bond_check, conformer_metrics, format_unit, parse_unit

from .conftest import run_etl, sample_smiles

# molecules ETKDG cannot place, found by trying: an anti-Bredt bicycle (no embedding), and
# C60 (no embedding within one second)
NO_EMBEDDING = "C1=CC2=CC=C1C2"
TOO_SLOW = ("C12=C3C4=C5C6=C1C7=C8C9=C1C%10=C%11C(=C29)C3=C2C3=C4C4=C5C5=C9C6=C7C6=C7C8=C1C1=C8C%10=C%10C%11=C2C2="
            "C3C3=C4C4=C5C5=C%11C%12=C(C6=C95)C7=C1C1=C%12C5=C%11C4=C3C3=C5C(=C81)C%10=C23")
NO_MMFF = "OB(O)c1ccccc1"  # boron: MMFF94 has no parameters, the ETKDG geometry is kept


@pytest.fixture(scope="module")
def units(tmp_path_factory):
    d = tmp_path_factory.mktemp("conf")
    path = d / "in.csv"
    path.write_text("smiles\n" + "\n".join(sample_smiles(60, offset=700) + [NO_EMBEDDING, TOO_SLOW, NO_MMFF]) + "\n")
    out = str(d / "out")
    m = run_etl(out, [str(path)], conformers="etkdg", conformer_timeout_s=1, split_fractions=[1.0, 0.0, 0.0])
    rows = [r for s in m["splits"]["train"] for r in pq.read_table(os.path.join(out, s["uri"])).to_pylist()]
    return out, m, rows


def test_every_unit_round_trips_exactly_to_its_precision(units):
    from rdkit import Chem

    out, m, rows = units
    assert m["representation"]["name"] == "conformer" and m["representation"]["decimals"] == 2
    assert len(rows) == m["stats"]["rows_out"] == 61
    for r in rows:
        smiles, coords = parse_unit(r["text"])
        assert smiles == r["canonical_smiles"]
        mol = Chem.MolFromSmiles(smiles)
        assert len(coords) == mol.GetNumAtoms()  # one x,y,z per heavy atom
        assert format_unit(smiles, coords, 2) == r["text"]  # exact to 0.01 A: written again, the same text
        check = bond_check(r["text"])
        # atom i of the SMILES at coordinate i: bonds where an MMFF geometry has them (rounding: < 0.02 A)
        assert check["bonds_ok"], (smiles, check)
        center = [sum(c[k] for c in coords) / len(coords) for k in range(3)]
        assert max(abs(v) for v in center) < 0.01  # centroid at the origin


def test_failures_and_notes_are_counted(units):
    _, m, rows = units
    assert m["stats"]["rejected"] == {"conformer_error": 1, "conformer_timeout": 1}
    assert m["stats"]["representation"]["mmff_unparameterized"] == 1
    assert any(r["canonical_smiles"] == "OB(O)c1ccccc1" for r in rows)


def test_the_conformer_is_seeded(units, tmp_path):
    out, m, rows = units
    path = tmp_path / "in.csv"
    path.write_text("smiles\n" + "\n".join(r["canonical_smiles"] for r in rows[:8]) + "\n")
    again = run_etl(str(tmp_path / "again"), [str(path)], conformers="etkdg", workers=1, chunk_rows=3,
                    split_fractions=[1.0, 0.0, 0.0])
    texts = {r["text"] for s in again["splits"]["train"]
             for r in pq.read_table(os.path.join(tmp_path / "again", s["uri"])).to_pylist()}
    assert texts == {r["text"] for r in rows[:8]}  # other workers, other chunks: the same conformers


def test_eval_tells_good_units_from_broken_ones(units):
    _, _, rows = units
    good = rows[0]["text"]
    smiles, coords = parse_unit(good)
    stretched = format_unit(smiles, [[x * 1.3, y * 1.3, z * 1.3] for x, y, z in coords], 2)
    missing_atom = format_unit(smiles, coords[:-1], 2)
    metrics = conformer_metrics([good, stretched, missing_atom, "[SMILES]CCO[/SMILES][CONFORMER]1,2[/CONFORMER]",
                                 None])
    assert metrics["conformer_decodes"] == pytest.approx(2 / 5)
    assert metrics["conformer_bonds_ok"] == pytest.approx(1 / 5)


def test_the_loader_keeps_units_whole_and_truncates_in_place(units):
    from transformers import AutoTokenizer

    from tests.data.conftest import make_loader

    out, m, rows = units
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "tokenizer"), local_files_only=True)
    start = tok.convert_tokens_to_ids("[SMILES]")
    seq_len = 320  # shorter than some units (190-480 tokens with <bos> and <eos>)
    loader = make_loader(out, seq_len=seq_len, micro_batch_size=2, mode="packed", max_epochs=1)
    documents, stats = 0, {}
    for batch in loader:
        ids, docs = batch["input_ids"].tolist(), batch["document_ids"].tolist()
        for row, doc in zip(ids, docs):
            for d in sorted(set(doc) - {-1}):
                first = doc.index(d)
                assert row[first] == tok.bos_token_id and row[first + 1] == start  # a unit starts every document
                documents += 1
        stats = batch["stats"]
    over = sum(r["token_length"] + 2 > seq_len for r in rows)
    assert documents == len(rows) and over > 0
    assert stats["truncated"] == over  # each over-long unit cut in place, once, and counted


def test_the_budget_is_cpu_time_not_the_wall_clock(monkeypatch):
    # a loaded or paused machine (wall time passing while the worker does not run) refuses
    # the same molecules as an idle one: only the thread's CPU time counts toward the budget
    import itertools

    import molds.chemistry.conformers as conformers

    clock = itertools.count(0.0, 1000.0)  # every wall-clock read: 1,000 s later
    monkeypatch.setattr(conformers.time, "perf_counter", lambda: next(clock))
    unit, reason, _ = conformers.Embedder(timeout_s=1)("CC(=O)Nc1ccc(O)cc1")
    assert reason is None and parse_unit(unit)[0] == "CC(=O)Nc1ccc(O)cc1"
    burn = itertools.count(0.0, 1.5)  # every CPU-time read: 1.5 s of work later
    monkeypatch.setattr(conformers.time, "thread_time", lambda: next(burn))
    assert conformers.Embedder(timeout_s=1)("CC(=O)Nc1ccc(O)cc1")[1] == "conformer_timeout"
