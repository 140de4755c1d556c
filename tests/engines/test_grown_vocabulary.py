"""A fine-tuning set with tokens the pretraining vocabulary lacks (salts, metals, charges,
stereo) is scored whole: ``molds-preprocess --tokenizer PRETRAINING/tokenizer`` adds the
tokens after the vocabulary's own, whose ids stay, and refuses no molecule for them (checked
against RDKit's canonical SMILES read directly); a fork of a checkpoint of that vocabulary
grows its rows per token (the checkpoint's rows kept, the new ones at their mean; with
``checkpoint.new_token_rows element`` a new bracket atom's rows are those of the checkpoint's
token of its element, as RDKit reads the atom, the other new ones at the mean), trains,
and every test molecule gets a prediction; a fork the other way keeps the first rows. ``--grow_vocab false`` keeps the old behaviour
(a molecule with an unknown token refused), and a fork onto a vocabulary that is not grown
from the checkpoint's stays refused."""

from __future__ import annotations

import csv
import json
import os

import pyarrow.parquet as pq
import pytest
import torch

from tests.dist.spawn import run_ranks
from tests.preprocessing.conftest import sample_smiles

#: tokens MOSES never writes: charges, metals, salts (the dot), stereo, iodine, phosphorus
OUTSIDE = ["CC(=O)[O-].[Na+]", "C[N+](C)(C)CCO", "O=[N+]([O-])c1ccc(O)cc1", "[Cu+2].[O-]S(=O)(=O)[O-]",
           "C[C@H](N)C(=O)O", "C/C=C/C(=O)O", "Ic1ccc(CCN)cc1", "OP(=O)(O)OCC(O)CO", "[Li+].[Cl-]",
           "C[C@@H](O)c1ccc(Br)cc1", "[NH3+]CC(=O)[O-]", "CCOP(=S)(OCC)Oc1ccc([N+](=O)[O-])cc1",
           "c1ccc2c(c1)[nH]c1ccccc12.Cl", "F[B-](F)(F)F.CC[n+]1ccccc1", "[K+].[I-]", "CC[Se]CC"]


def _write(path, rows):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["smiles", "y"])
        for i, s in enumerate(rows):
            w.writerow([s, i % 2])


def _etl(inp, out, **options):
    from molds.preprocessing.config import PreprocessConfig
    from molds.preprocessing.pipeline import run

    return run(PreprocessConfig(input=[str(inp)], output=str(out), workers=1, progress=False, split="random",
                                **options))


def _rdkit_tokens(smiles: str) -> list[str]:
    """The regex tokens of RDKit's canonical SMILES of ``smiles``, RDKit called directly."""
    from rdkit import Chem

    from molds.preprocessing.tokenizer import split_smiles

    return split_smiles(Chem.MolToSmiles(Chem.MolFromSmiles(smiles)))


def _rows(manifest_dir):
    m = json.load(open(os.path.join(manifest_dir, "manifest.json")))
    out = {}
    for split, shards in m["splits"].items():
        out[split] = [r for s in shards for r in pq.read_table(os.path.join(manifest_dir, s["uri"])).to_pylist()]
    return m, out


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """(pretraining manifest, the labelled set grown from its tokenizer, that set's input rows)."""
    d = tmp_path_factory.mktemp("grow")
    _write(d / "pre.csv", sample_smiles(400, offset=5000))
    pre = d / "pre"
    _etl(d / "pre.csv", pre)
    labelled = sample_smiles(120, offset=9000) + OUTSIDE * 2  # each outside molecule twice: a duplicate
    _write(d / "labelled.csv", labelled)
    grown = d / "grown"
    _etl(d / "labelled.csv", grown, label_columns=["y"], tokenizer=str(pre / "tokenizer"))
    return str(pre), str(grown), labelled, d


def test_the_etl_adds_the_tokens_the_vocabulary_lacks_and_keeps_every_molecule(sets):
    from rdkit import Chem
    from tokenizers import Tokenizer

    pre, grown, labelled, d = sets
    old = Tokenizer.from_file(os.path.join(pre, "tokenizer", "tokenizer.json")).get_vocab()
    new = Tokenizer.from_file(os.path.join(grown, "tokenizer", "tokenizer.json")).get_vocab()
    assert {t: i for t, i in new.items() if i < len(old)} == old  # the old tokens keep their ids
    needed = {t for s in labelled for t in _rdkit_tokens(s)}
    assert set(new) - set(old) == needed - set(old) and len(needed - set(old)) >= 10
    m, rows = _rows(grown)
    st = m["stats"]
    distinct = {Chem.MolToSmiles(Chem.MolFromSmiles(s)) for s in labelled}
    assert st["rejected"] == {} and st["rows_out"] == len(distinct)
    assert st["rows_in"] == len(labelled) == st["rows_out"] + st["duplicates"]
    ext = m["tokenizer"]["extends"]
    assert ext["vocab_size"] == len(old) and m["tokenizer"]["vocab_size"] == len(new)
    assert ext["added_tokens"] == sorted(set(new) - set(old), key=new.get)
    for split, got in rows.items():
        for r in got:
            assert Tokenizer.from_file(os.path.join(grown, "tokenizer", "tokenizer.json")).decode(
                r["token_ids"], skip_special_tokens=False).replace(" ", "") == r["canonical_smiles"]
        with_added = sum(any(t not in old for t in _rdkit_tokens(r["canonical_smiles"])) for r in got)
        assert st["splits"][split]["rows_with_added_tokens"] == with_added, split
    assert sum(st["splits"][s]["rows_with_added_tokens"] for s in rows) == len(
        {s for s in distinct if any(t not in old for t in _rdkit_tokens(s))})
    assert "vocabulary grown" in open(os.path.join(grown, "report.md")).read()


def test_a_fixed_vocabulary_still_refuses_what_it_lacks(sets):
    from rdkit import Chem
    from tokenizers import Tokenizer

    pre, grown, labelled, d = sets
    old = Tokenizer.from_file(os.path.join(pre, "tokenizer", "tokenizer.json")).get_vocab()
    fixed = d / "fixed"
    _etl(d / "labelled.csv", fixed, label_columns=["y"], tokenizer=os.path.join(pre, "tokenizer"), grow_vocab=False)
    m, _ = _rows(fixed)
    lacking = {Chem.MolToSmiles(Chem.MolFromSmiles(s)) for s in labelled
               if any(t not in old for t in _rdkit_tokens(s))}
    assert m["stats"]["rejected"] == {"tokenizer_roundtrip": len(lacking)} and "extends" not in m["tokenizer"]


def _argv(manifest, out, steps, tasks, extra=()):
    return ["--data.manifest", manifest, "--data.mode", "bucketed", "--data.max_tokens_per_batch", "1024",
            "--data.bucket_pool", "200", "--data.max_length", "96", "--data.mlm_probability", "0.15",
            "--data.with_labels", "true" if tasks else "false", "--model.family", "encoder",
            "--model.hidden_size", "32", "--model.num_layers", "1", "--model.num_heads", "4",
            "--model.max_position_embeddings", "128", "--model.dropout", "0.0", "--model.num_tasks", str(tasks),
            "--parallel.engine", "ddp", "--optim.lr", "1e-3", "--optim.warmup_steps", "1",
            "--trainer.max_steps", str(steps), "--trainer.precision", "fp32", "--logging.progress", "false",
            "--eval.interval_steps", "0", "--run.output_dir", out, *extra]


def _vocab(manifest_dir) -> dict:
    return json.load(open(os.path.join(manifest_dir, "tokenizer", "tokenizer.json")))["model"]["vocab"]


def _element_of(token: str, known: dict) -> str | None:
    """The reference: RDKit reads the bracket atom alone; its symbol, lower-case where aromatic,
    if the checkpoint's vocabulary writes it alone (else None: the new rows start at the mean)."""
    from rdkit import Chem

    if not token.startswith("["):
        return None
    mol = Chem.MolFromSmiles(token, sanitize=False)
    if mol is None or mol.GetNumAtoms() != 1:
        return None
    atom = mol.GetAtomWithIdx(0)
    symbol = atom.GetSymbol().lower() if atom.GetIsAromatic() else atom.GetSymbol()
    return next((t for t in (symbol, f"[{symbol}]") if t != token and t in known), None)


def _forked(rank, world, argv):
    """The weights a fork starts from (the run set up, the checkpoint restored), and its lineage."""
    from molds.checkpoint.state import canonical_state
    from molds.recipe.parse import parse_recipe
    from molds.train import setup

    run = setup(parse_recipe(argv))
    run.log.close()
    return canonical_state(run.engine.model), run.lineage


def test_a_fork_grows_its_rows_trains_and_scores_every_test_molecule(sets, tmp_path, capfd):
    from molds.checkpoint import resolve
    from molds.checkpoint.state import read_model
    from molds.errors import CheckpointError, RecipeError
    from molds.eval.evaluate import evaluate_checkpoint
    from molds.train import main

    pre, grown, _, d = sets
    main(_argv(pre, str(tmp_path / "pre"), 2, 0))
    parent = read_model(resolve(str(tmp_path / "pre")))
    capfd.readouterr()
    fork = ["--checkpoint.resume", str(tmp_path / "pre"), "--checkpoint.fork", "true"]
    restored, lineage = run_ranks(_forked, 1, _argv(grown, str(tmp_path / "ft0"), 1, 1, fork))[0]
    m, rows = _rows(grown)
    old, new = m["tokenizer"]["extends"]["vocab_size"], m["tokenizer"]["vocab_size"]
    rowed = {k for k, v in parent.items() if v.shape[0] == old}
    assert rowed >= {"mlm.roberta.embeddings.word_embeddings.weight", "mlm.lm_head.bias"}
    for k, v in parent.items():
        if k in rowed:
            assert restored[k].shape[0] == new and torch.equal(restored[k][:old], v), k
            assert torch.allclose(restored[k][old:], v.mean(0, keepdim=True).expand_as(restored[k][old:])), k
        else:
            assert torch.equal(restored[k], v), k
    assert lineage["vocabulary_resized"] == {"from": old, "to": new, "tensors": sorted(rowed), "new_token_rows": "mean",
                                             "started_from": {t: None for t, i in sorted(_vocab(grown).items(),
                                                                                          key=lambda x: x[1]) if i >= old}}
    # checkpoint.new_token_rows element: a new bracket atom's rows those of its element's token
    restored, lineage = run_ranks(_forked, 1, _argv(grown, str(tmp_path / "ft-element"), 1, 1, fork + [
        "--checkpoint.new_token_rows", "element"]))[0]
    vocab = _vocab(grown)
    known = {t: i for t, i in vocab.items() if i < old}
    added = sorted((i, t) for t, i in vocab.items() if i >= old)
    want = {t: _element_of(t, known) for _, t in added}
    # both kinds among OUTSIDE's tokens: [C@H], [O-], [N+], [nH]... start as their element; [Na+], [Cu+2], / at the mean
    assert {"[C@H]", "[O-]", "[N+]"} <= {t for t, e in want.items() if e} and {"[Na+]", "/"} <= {
        t for t, e in want.items() if e is None}, want
    for k, v in parent.items():
        if k in rowed:
            assert restored[k].shape[0] == new and torch.equal(restored[k][:old], v), k
            for i, t in added:
                ref = v[known[want[t]]] if want[t] else v.mean(0)
                assert torch.allclose(restored[k][i], ref), (k, t, want[t])
        else:
            assert torch.equal(restored[k], v), k
    assert lineage["vocabulary_resized"] == {"from": old, "to": new, "tensors": sorted(rowed),
                                             "new_token_rows": "element", "started_from": want}
    # it trains, says so, and every test molecule is scored, those with added tokens among them
    result = main(_argv(grown, str(tmp_path / "ft"), 3, 1, fork))
    err = capfd.readouterr().err
    assert f"the vocabulary grows from {old} to {new} tokens" in err
    assert "take their new rows at the mean of the checkpoint's (checkpoint.new_token_rows mean)" in err
    saved = json.load(open(os.path.join(result["checkpoint"], "lineage.json")))
    assert saved["vocab_size"] == new and saved["vocabulary_resized"]["to"] == new
    assert saved["vocab_extends"] == {k: m["tokenizer"]["extends"][k] for k in ("vocab_hash", "vocab_size")}
    report = evaluate_checkpoint(str(tmp_path / "ft"), split="test")
    assert report["property"]["per_task"]["y"]["n"] == len(rows["test"]) > 0
    assert m["stats"]["splits"]["test"]["rows_with_added_tokens"] > 0 or m["stats"]["splits"]["valid"][
        "rows_with_added_tokens"] > 0
    # and back: a model of the grown vocabulary forked onto the one it grew from keeps its first rows
    tuned = read_model(result["checkpoint"])
    back, lineage = run_ranks(_forked, 1, _argv(pre, str(tmp_path / "back"), 1, 0, [
        "--checkpoint.resume", str(tmp_path / "ft"), "--checkpoint.fork", "true"]))[0]
    assert lineage["vocabulary_resized"] == {"from": new, "to": old, "tensors": sorted(rowed),
                                             "new_token_rows": "mean", "started_from": {}}
    for k in rowed:
        assert torch.equal(back[k], tuned[k][:old]), k
    with pytest.raises(RecipeError, match="the vocabulary changes"):
        main(_argv(grown, str(tmp_path / "ft2"), 1, 0, fork + ["--checkpoint.fork_optimizer", "true"]))
    # a vocabulary not grown from the checkpoint's: refused, naming the way out
    other = tmp_path / "other"
    _etl(d / "labelled.csv", other, label_columns=["y"])
    with pytest.raises(CheckpointError, match="nor one grown from it or it from"):
        main(_argv(str(other), str(tmp_path / "ft3"), 1, 1, fork))


def _fine_tuned(rank, world, argv):
    from molds.checkpoint import resolve
    from molds.checkpoint.state import read_model
    from molds.train import main

    main(argv)
    return read_model(resolve(argv[argv.index("--run.output_dir") + 1]))


def test_a_fine_tune_without_masking_trains_on_two_ddp_ranks(sets, tmp_path):
    """Labels alone (``data.mlm_probability 0``) under DDP on two ranks, its static graph on:
    the MLM head is out of the graph on every step, so it trains (DDP refused it when the head's
    logits were computed and never used) and the head keeps the pretrained weights."""
    from molds.checkpoint import resolve
    from molds.checkpoint.state import read_model
    from molds.train import main

    pre, grown, _, _ = sets
    main(_argv(pre, str(tmp_path / "pre"), 2, 0))
    parent = read_model(resolve(str(tmp_path / "pre")))
    argv = _argv(grown, str(tmp_path / "ft"), 4, 1, ["--checkpoint.resume", str(tmp_path / "pre"),
                                                    "--checkpoint.fork", "true"])
    argv[argv.index("--data.mlm_probability") + 1] = "0.0"
    tuned = run_ranks(_fine_tuned, 2, argv)[0]
    assert torch.equal(tuned["mlm.lm_head.dense.weight"], parent["mlm.lm_head.dense.weight"])
    moved = tuned["mlm.roberta.encoder.layer.0.attention.self.query.weight"]
    assert not torch.equal(moved, parent["mlm.roberta.encoder.layer.0.attention.self.query.weight"])
