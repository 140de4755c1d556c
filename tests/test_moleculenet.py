"""``benchmarks/moleculenet.py``: the peers read exactly molds' split (the file they are given,
read back with the csv module, against the shards read with pyarrow), and the whole procedure
scores every test molecule of a set whose salts and metals the pretraining vocabulary lacks."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gzip
import json
import math
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.benchmark_scripts import benchmark_script
from tests.dist.spawn import free_port
from tests.preprocessing.conftest import sample_smiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: molecules whose tokens (ions, metals) no MOSES molecule has
SALTS = ["[Na+].O=C([O-])c1ccccc1", "[K+].CC(=O)[O-]", "Cl[Pt](Cl)(N)N", "[Li+].[Cl-]", "CC[Hg]Cl",
         "[Na+].[Na+].O=S(=O)([O-])c1ccc(N)cc1.[O-]S(=O)(=O)c1ccccc1", "OB(O)c1ccccc1[N+](=O)[O-]",
         "[Cl-].C[N+](C)(C)Cc1ccccc1"]
#: a label's name as SIDER's are written ("Injury, poisoning and procedural complications")
POLAR = "polar, by TPSA"


def _write_set(path, n: int = 240) -> dict:
    """A labelled CSV: two labels (logP > 2.5; TPSA > 60, missing for every fifth row, its name
    holding a comma and a space as SIDER's do), the salts, a duplicate with other labels and one
    row RDKit refuses. Returns what it holds."""
    from rdkit import Chem
    from rdkit.Chem import Crippen, rdMolDescriptors

    # the salts, and molecules of their own scaffolds as sodium and potassium salts, so that
    # ions reach every split
    smiles = sample_smiles(n, offset=3000) + SALTS + [f"{m}.[{'Na' if i % 2 else 'K'}+].[Br-]"
                                                      for i, m in enumerate(sample_smiles(40, offset=9000))]
    rows = []
    for i, s in enumerate(smiles):
        mol = Chem.MolFromSmiles(s)
        logp, tpsa = Crippen.MolLogP(mol), rdMolDescriptors.CalcTPSA(mol)
        rows.append([s, int(logp > 2.5), "" if i % 5 == 0 else int(tpsa > 60)])
    rows.append([rows[3][0], 1 - rows[3][1], rows[3][2]])  # the same molecule, the other class
    rows.append(["C1CC(N", 1, 0])  # RDKit refuses it
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["SMILES", "lipophilic", POLAR])
        w.writerows(rows)
    return {"rows": len(rows), "smiles": smiles}


def _shard_rows(manifest_dir: str) -> dict:
    """Each split's (canonical SMILES, labels with None for missing) straight from its shards."""
    m = json.load(open(os.path.join(manifest_dir, "manifest.json")))
    out = {}
    for split, shards in m["splits"].items():
        rows = []
        for s in shards:
            t = pq.read_table(os.path.join(manifest_dir, s["uri"]))
            rows += [(c, [None if v is None or math.isnan(v) else v for v in ls])
                     for c, ls in zip(t.column("canonical_smiles").to_pylist(), t.column("labels").to_pylist())]
        out[split] = rows
    return out


@pytest.mark.parametrize("split,seed", [("scaffold", 0), ("scaffold_random", 1)])
def test_the_peers_read_exactly_molds_split(tmp_path, split, seed):
    from molds.data.manifest import Manifest
    from molds.preprocessing.cli import parse
    from molds.preprocessing.pipeline import run

    bench = benchmark_script("moleculenet")
    src = tmp_path / "set.csv"
    held = _write_set(src)
    big = "C" + "C(C)" * 130  # 261 heavy atoms in 521 characters: over both of the ETL's default caps
    with open(src, "a", newline="") as fh:
        csv.writer(fh).writerow([big, 1, 0])
    held["rows"] += 1
    s = bench.describe_set("set", str(src), "SMILES", None, None)
    assert s["labels"] == ["lipophilic", POLAR] and s["task_type"] == "classification"
    manifest = str(tmp_path / "data")
    # the ETL as the benchmark calls it, through molds-preprocess's command line
    cfg = parse([*bench.etl_args(s, split, seed), "--output", manifest, "--workers", "1", "--progress", "false"])
    run(cfg)
    assert Manifest.load(manifest).label_columns == s["labels"]
    peers = str(tmp_path / "peers.csv")
    sizes = bench.write_peers(manifest, s["labels"], peers)

    shards = _shard_rows(manifest)
    with open(peers, newline="") as fh:
        read = list(csv.DictReader(fh))
    assert set(read[0]) == {"smiles", "lipophilic", POLAR, "split"}
    names = {"train": "train", "valid": "val", "test": "test"}  # Chemprop's --splits-column values
    for name in ("train", "valid", "test"):
        mine = [(r["smiles"], [None if r[c] == "" else float(r[c]) for c in s["labels"]])
                for r in read if r["split"] == names[name]]
        assert mine == shards[name], name
        assert sizes[name] == len(shards[name]) > 0
    # every input row is in one split, a duplicate or refused; the refused one is in no split
    m = json.load(open(os.path.join(manifest, "manifest.json")))
    assert m["stats"]["rows_in"] == held["rows"]
    assert m["stats"]["rows_out"] == len(read) == held["rows"] - 2
    assert all("C1CC(N" != r["smiles"] for r in read)
    from rdkit import Chem

    assert Chem.CanonSmiles(big) in [r["smiles"] for r in read]  # scored, whatever its size
    assert "C1CC(N" in open(os.path.join(manifest, "report.md")).read()
    assert m["stats"]["duplicates_with_other_labels"] == 1
    # what the random forest and the scores read is the same file
    data = bench.read_peers(peers, s["labels"])
    for name in ("train", "valid", "test"):
        assert data[name][0] == [c for c, _ in shards[name]]
        got = [[None if math.isnan(v) else v for v in row] for row in data[name][1].tolist()]
        assert got == [ls for _, ls in shards[name]]


def test_a_finished_chemprop_run_is_reused_and_a_cut_one_started_again(tmp_path, monkeypatch):
    """Chemprop's CLI stood in for (its train writes ``best.pt``, its predict a column per label):
    a second call into the same directory runs nothing and returns the first one's predictions
    and seconds; a directory a killed run left (no ``finished.json``) is cleared and run again."""
    import argparse

    bench = benchmark_script("moleculenet")
    calls = []

    def fake_run(cmd, log, threads=1):
        calls.append(cmd[cmd.index("-c") + 2])
        out = cmd[cmd.index("--output-dir") + 1] if "--output-dir" in cmd else None
        if calls[-1] == "train":
            os.makedirs(os.path.join(out, "model_0"), exist_ok=True)
            open(os.path.join(out, "model_0", "best.pt"), "w").close()
        else:
            smiles = [r["smiles"] for r in csv.DictReader(open(cmd[cmd.index("--test-path") + 1]))]
            with open(cmd[cmd.index("--preds-path") + 1], "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(["smiles", "a", "b"])
                w.writerows([s, i / 10, 1 - i / 10] for i, s in enumerate(smiles))

    monkeypatch.setattr(bench, "_quiet_run", fake_run)
    args = argparse.Namespace(chemprop_python=sys.executable, nproc=1)
    data = {"test": (["CCO", "c1ccccc1", "CC(=O)O"], None)}
    out = str(tmp_path / "chemprop-0")
    os.makedirs(os.path.join(out, "model_0", "checkpoints"))  # what a killed run leaves
    open(os.path.join(out, "model_0", "checkpoints", "last.ckpt"), "w").close()
    first = bench.chemprop(args, "peers.csv", data, ["a", "b"], "regression", 0, out)
    assert calls == ["train", "predict"] and not os.path.exists(os.path.join(out, "model_0", "checkpoints"))
    again = bench.chemprop(args, "peers.csv", data, ["a", "b"], "regression", 0, out)
    assert calls == ["train", "predict"]  # nothing run the second time
    assert again[0].tolist() == first[0].tolist() == [[0.0, 1.0], [0.1, 0.9], [0.2, 0.8]]
    assert again[1:] == pytest.approx(first[1:])


def test_the_model_kept_is_the_best_on_validation_or_the_last_checkpoint_where_none_is_scored(capsys):
    """The benchmark's choice of checkpoints to average: the K best by the validation score
    (in step order; fewer where fewer are scored); where no checkpoint has a score (no task
    with both classes in the split), the newest, said on stderr."""
    from molds.eval.choose import Choice

    bench = benchmark_script("moleculenet")
    auc = Choice(metric="roc_auc", split="valid").ranked([("r/step-00000010", 0.61), ("r/step-00000020", 0.74),
                                                          ("r/step-00000030", 0.70), ("r/step-00000040", None)])
    assert bench.kept_checkpoints(auc, 2, "r") == ["r/step-00000020", "r/step-00000030"]
    assert bench.kept_checkpoints(auc, 5, "r") == ["r/step-00000010", "r/step-00000020", "r/step-00000030"]
    assert "no checkpoint" not in capsys.readouterr().err
    rmse = Choice(metric="rmse", split="valid").ranked([("r/step-00000010", 0.9), ("r/step-00000020", 0.7)])
    assert bench.kept_checkpoints(rmse, 1, "r") == ["r/step-00000020"]  # lower is better
    none = Choice(metric="roc_auc", split="valid").ranked([("r/step-00000020", None), ("r/step-00000030", None),
                                                           ("r/step-00000100", None)])
    assert bench.kept_checkpoints(none, 3, "r") == ["r/step-00000100"]
    assert "r: no checkpoint has a validation score" in capsys.readouterr().err


def test_counts_out_of_range_are_refused_in_one_line(tmp_path, capsys):
    bench = benchmark_script("moleculenet")
    for flag, value, said in (("--min-steps", "-1", "--min-steps must be 0 or more, got -1"),
                              ("--epochs", "0", "--epochs must be at least 1, got 0"),
                              ("--augment", "0", "--augment must be at least 1, got 0"),
                              ("--pretrain-steps", "0", "--pretrain-steps must be at least 1, got 0")):
        with pytest.raises(SystemExit):
            bench.main(["--data-dir", str(tmp_path), flag, value, "--output-dir", str(tmp_path / "out")])
        assert said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_label_names_with_commas_are_taken_and_names_the_peers_file_uses_are_refused(tmp_path):
    """``--label-columns`` takes a JSON list where a name holds a comma (SIDER's do); a label
    named like a column of ``peers.csv``, or twice, is refused in one line naming it, and so
    are labels other than 0 and 1 called classes."""
    bench = benchmark_script("moleculenet")
    assert bench.label_columns("a,b") == ["a", "b"]
    assert bench.label_columns('["Injury, poisoning", "Eye disorders"]') == ["Injury, poisoning", "Eye disorders"]
    assert bench.label_columns(None) is None
    with pytest.raises(SystemExit, match="JSON list"):
        bench.label_columns('["a", 3]')
    src = tmp_path / "set.csv"
    with open(src, "w", newline="") as fh:
        csv.writer(fh).writerows([["mol", "Injury, poisoning", "split"], ["CCO", 1, 0], ["CCN", 0, 1]])
    s = bench.describe_set("set", str(src), "mol", ["Injury, poisoning"], None)
    assert s["labels"] == ["Injury, poisoning"] and s["task_type"] == "classification"
    for labels in (None, ["split"], ["Injury, poisoning", "Injury, poisoning"]):
        with pytest.raises(SystemExit, match="rename it"):
            bench.describe_set("set", str(src), "mol", labels, None)
    with open(src, "w", newline="") as fh:  # pIC50 values are no classes
        csv.writer(fh).writerows([["mol", "pIC50"], ["CCO", 7.2], ["CCN", 5.1], ["CCC", ""]])
    assert bench.describe_set("set", str(src), "mol", None, None)["task_type"] == "regression"
    with pytest.raises(SystemExit, match=r"--task-type classification, but the labels \['pIC50'\] hold"):
        bench.describe_set("set", str(src), "mol", None, "classification")


@pytest.mark.parametrize("name", ["set.dat", "set.smi", "set.txt.gz", "set.parquet"])
def test_a_file_the_etl_would_not_read_as_csv_or_tsv_is_refused_in_one_line(tmp_path, name):
    """The benchmark reads a set (and the corpus) as CSV or TSV, and hands it to the ETL, which
    tells formats by the name: a name the ETL reads otherwise, or not at all, is refused before
    anything runs, in the benchmark's words (the ETL's own line named an option the benchmark
    does not take)."""
    bench = benchmark_script("moleculenet")
    src = tmp_path / name
    src.write_text("smiles,y\nCCO,1\nCCN,0\n")
    for read in (lambda: bench.describe_set("set", str(src), "smiles", None, None),
                 lambda: bench.read_column(str(src), "smiles")):
        with pytest.raises(SystemExit, match=r"reads a CSV or TSV file") as exc:
            read()
        assert str(src) in str(exc.value) and "--input_format" not in str(exc.value)


@pytest.mark.parametrize("name,encoding,text", [
    ("set.csv", "utf-8-sig", "smiles,active\nCCO,1\nCCN,0\nCCC,?\n"),  # Excel's UTF-8 mark; '?' is missing
    ("set.csv", "utf-16", "smiles,active\nCCO,1\nCCN,0\n"),  # "Unicode text"
    ("set.tsv", "utf-8", "SMILES \tActive\nCCO\t1\nCCN\t0\n"),  # tabs; other case, a stray space
    ("set.csv", "utf-8", "sep=;\nsmiles;active\nCCO;1\nCCN;0\n"),  # Excel's delimiter line
])
def test_a_vendor_file_is_read_as_the_etl_reads_it(tmp_path, name, encoding, text):
    """What the benchmark reads of a set's file (its columns, the task type, the SMILES for the
    pretraining's exclusion) is what the ETL reads: compression and byte-order marks, TSV,
    Excel's ``sep=`` line, a column name but for case, the ETL's missing-label spellings; and
    the ETL, given the names the benchmark passes, reads every row."""
    from molds.data.manifest import Manifest
    from molds.preprocessing.cli import parse
    from molds.preprocessing.pipeline import run

    bench = benchmark_script("moleculenet")
    src = tmp_path / (name + ".gz")
    with gzip.open(src, "wt", encoding=encoding, newline="") as fh:
        fh.write(text)
    s = bench.describe_set("set", str(src), "smiles", None, None)
    assert s["labels"] in (["active"], ["Active"]) and s["task_type"] == "classification"
    assert bench.read_column(str(src), "smiles") == ["CCO", "CCN", "CCC"][:text.count("\n") - 1 - text.startswith("sep")]
    out = str(tmp_path / "data")
    run(parse([*bench.etl_args(s, "random", 0), "--output", out, "--workers", "1", "--progress", "false"]))
    m = Manifest.load(out)
    assert m.data["stats"]["rows_in"] == len(bench.read_column(str(src), "smiles"))
    assert m.label_columns == s["labels"]


def test_a_sets_molecules_in_the_pretraining_corpus_are_counted(tmp_path):
    """A set run against an encoder pretrained without it: its molecules that the corpus holds
    are counted as the exclusion compares them (a salt of a set molecule is that molecule),
    from the keys the pretraining keeps, or computed once for a corpus written before them."""
    bench = benchmark_script("moleculenet")
    src = tmp_path / "set.csv"
    mine = ["CC(=O)Oc1ccccc1C(=O)O", "c1ccc2[nH]ccc2c1", "CCN(CC)CC", "O=C(O)c1ccccc1", "CCCCCCO"]
    with open(src, "w", newline="") as fh:
        csv.writer(fh).writerows([["smiles", "y"], *([m, i % 2] for i, m in enumerate(mine))])
    s = bench.describe_set("set", str(src), "smiles", None, None)
    pretrain = tmp_path / "pretrain"
    (pretrain / "run").mkdir(parents=True)
    corpus = ["c1ccc2[nH]ccc2c1", "CC(=O)Oc1ccccc1C(=O)O", "[Na+].O=C([O-])c1ccccc1",  # three of the set's
              "CCOC(=O)c1ccccc1", "c1ccncc1", "C1CC(N"]  # none of the set's; one RDKit refuses
    with gzip.open(pretrain / "corpus.csv.gz", "wt", newline="") as fh:
        csv.writer(fh).writerows([["SMILES"], *([c] for c in corpus)])
    assert bench.in_pretraining_corpus(str(pretrain / "run"), s, 1) == 3
    keys = pretrain / "corpus-keys.txt.gz"
    assert keys.exists() and len(gzip.open(keys, "rt").read().splitlines()) == len(corpus)
    (pretrain / "corpus.csv.gz").unlink()  # the kept keys are what is read from now on
    (pretrain / "corpus.csv.gz").write_bytes(b"")
    assert bench.in_pretraining_corpus(str(pretrain / "run"), s, 1) == 3
    assert bench.in_pretraining_corpus(str(tmp_path / "elsewhere" / "run"), s, 1) is None


def test_a_task_without_a_training_label_is_scored_for_no_model(tmp_path, monkeypatch):
    """Where a split leaves a task no training label (a sparse ToxCast column can), no model
    learns it: the benchmark names it and scores the others, for every model alike (before,
    the forest's NaN predictions stopped scikit-learn)."""
    from sklearn.metrics import roc_auc_score

    bench = benchmark_script("moleculenet")
    src = tmp_path / "set.csv"
    _write_set(src)
    s = bench.describe_set("set", str(src), "SMILES", None, None)
    read = bench.read_peers

    def without_train_labels(path, labels):  # the second task's training labels all missing
        data = read(path, labels)
        data["train"][1][:, 1] = math.nan
        return data

    monkeypatch.setattr(bench, "read_peers", without_train_labels)
    monkeypatch.setattr(bench, "tokenizer_of", lambda run: None)
    args = argparse.Namespace(splits=["scaffold"], seeds=[0], models=["rf"], nproc=1,
                              output_dir=str(tmp_path / "out"))
    entry = bench.run_set(args, s, pretrained=None)
    assert entry["untrained_tasks"] == {"scaffold-0": [POLAR]}
    run = entry["splits"]["scaffold"]["rf"]["runs"][0]
    assert run["tasks_scored"] == 1
    data = read(str(tmp_path / "out" / "set" / "scaffold-0" / "peers.csv"), s["labels"])
    forest, _, _ = bench.random_forest(without_train_labels(str(tmp_path / "out" / "set" / "scaffold-0" / "peers.csv"),
                                                            s["labels"]), "classification", 0, 1)
    seen = ~np.isnan(data["test"][1][:, 0])
    assert run["roc_auc"] == pytest.approx(roc_auc_score(data["test"][1][seen, 0], forest[seen, 0]))


def test_finetune_overrides_are_recipe_keys_the_benchmark_does_not_set_itself():
    bench = benchmark_script("moleculenet")
    assert bench.finetune_overrides(["optim.lr=5e-4", "data.randomized_smiles=1.0"]) == {
        "optim.lr": "5e-4", "data.randomized_smiles": "1.0"}
    for bad, said in (("optim.lr", "give KEY=VALUE"), ("--optim.lr=1", "give KEY=VALUE"),
                      ("model.num_tasks=3", "the benchmark sets model.num_tasks"),
                      ("trainer.max_steps=9", "the benchmark sets trainer.max_steps")):
        with pytest.raises(SystemExit, match=said):
            bench.finetune_overrides([bad])


@pytest.mark.slow
def test_the_benchmark_scores_every_molecule_of_a_set_the_pretraining_vocabulary_lacks(tmp_path):
    """Pretrained for seconds on 500 MOSES molecules, forked onto a set with ions and metals:
    the vocabulary grows, and the encoder and the forest both score every test molecule (the
    benchmark stops if a model leaves one out)."""
    src = tmp_path / "set.csv"
    held = _write_set(src)
    out = tmp_path / "bench"
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "moleculenet.py"), "--input", str(src),
                           "--smiles-column", "SMILES", "--splits", "scaffold_random", "--seeds", "0",
                           "--models", "molds", "rf", "--corpus-every", "40", "--pretrain-time", "8s", "--epochs", "2",
                           "--min-steps", "30", "--finetune", "optim.lr=3e-4", "data.max_tokens_per_batch=1024",
                           "data.max_length=40", "--augment", "2", "--nproc", "1", "--output-dir", "bench"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # --finetune's overrides reach the fine-tuning, and its length counts the batches they make,
    # raised to --min-steps where the two passes make fewer
    assert result["finetune"] == {"optim.lr": "3e-4", "data.max_tokens_per_batch": "1024", "data.max_length": "40"}
    run_dir = out / "set" / "scaffold_random-0" / "molds-0"
    recipe = json.load(open(run_dir / "recipe.json"))
    assert recipe["optim"]["lr"] == 3e-4 and recipe["data"]["max_tokens_per_batch"] == 1024
    from molds.data.loader import MoleculeLoader
    from molds.eval.scoring import split_data_config

    cfg = dataclasses.replace(split_data_config(recipe["data"], str(out / "set" / "scaffold_random-0" / "data"),
                                                "train", mode="bucketed", with_labels=True), shuffle=True)
    per_pass = len(list(iter(MoleculeLoader(cfg, rank=0, world_size=1))))
    assert 2 * per_pass < 30 and result["min_steps"] == 30, per_pass
    assert recipe["trainer"]["max_steps"] == 30 == result["sets"]["set"]["splits"]["scaffold_random"][
        "molds"]["runs"][0]["steps"]
    # a rerun into the same folder with other settings is refused, not given the old run's scores
    again = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "moleculenet.py"), "--input", str(src),
                            "--smiles-column", "SMILES", "--splits", "scaffold_random", "--seeds", "0",
                            "--models", "molds", "--corpus-every", "40", "--pretrain-time", "8s", "--epochs", "2",
                            "--nproc", "1", "--output-dir", str(out)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode != 0 and "give another --output-dir" in again.stderr, again.stderr[-2000:]
    entry = result["sets"]["set"]
    assert entry["rows"]["in"] == held["rows"] and entry["rows"]["kept"] == held["rows"] - 2
    # the pretraining left the set out, and kept the keys it compared by
    assert entry["in_pretraining_corpus"] == 0 and (out / "pretrain" / "corpus-keys.txt.gz").exists()
    assert entry["rows"]["tokens_added"] > 0
    assert result["pretraining"]["read"] == 500 and result["pretraining"]["steps"] > 0
    split = entry["splits"]["scaffold_random"]
    test_rows = split["sizes"]["0"]["test"] if "0" in split["sizes"] else split["sizes"][0]["test"]
    for model in ("molds", "rf"):
        roc = split[model]["runs"][0]["roc_auc"]
        assert 0.0 <= roc <= 1.0, (model, split[model])
    with open(out / "set" / "scaffold_random-0" / "molds-0" / "test_predictions.csv", newline="") as fh:
        preds = list(csv.DictReader(fh))
    assert len(preds) == test_rows and all(r["note"] == "" or r["note"].startswith("truncated") for r in preds)
    # the test molecules longer than the fine-tuning's 40 tokens, counted from the tokenizer
    # directly: each is scored on its first tokens, and the result says how many
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(out / "set" / "scaffold_random-0" / "data" / "tokenizer"))
    longer = sum(len(tok(r["canonical"], add_special_tokens=False)["input_ids"]) + 2 > 40 for r in preds)
    assert longer > 0 and split["molds"]["runs"][0]["test_truncated"] == longer
    salts_in_test = [r for r in preds if any(t in r["canonical"] for t in ("Na+", "K+", "Br-"))]
    assert salts_in_test and all(r["lipophilic"] != "" for r in salts_in_test)
    assert set(result["headline"]["scaffold_random"]["roc_auc"]) == {"molds", "rf"}
    # the model is the mean of the checkpoints best on the validation split (molds-average --best 3)
    from molds.checkpoint import open_checkpoint
    from molds.eval.properties import predict_properties

    run = split["molds"]["runs"][0]
    lineage = json.load(open(run_dir / "chosen" / "lineage.json"))
    assert result["average"] == 3 and len(run["chosen"]) == 3
    assert [f"step-{s['step']:08d}" for s in lineage["averaged_from"]] == run["chosen"]
    # best first; of equal scores the later checkpoint
    ranked = sorted(sorted(lineage["chosen_by"]["scores"].items(), reverse=True), key=lambda kv: -kv[1])
    assert sorted(name for name, _ in ranked[:3]) == run["chosen"]
    # what settings are compared by: that model's validation score, again from its predictions
    # of the validation molecules in peers.csv, scored by scikit-learn
    from sklearn.metrics import roc_auc_score

    with open(out / "set" / "scaffold_random-0" / "peers.csv", newline="") as fh:
        valid = [r for r in csv.DictReader(fh) if r["split"] == "val"]
    # opened from this process's directory, not the one the benchmark ran in: the lineage's
    # relative manifest path ("bench/...") does not read from here, its absolute one does
    assert not os.path.exists(os.path.join("bench", "set")) and json.load(open(run_dir / "chosen" / "lineage.json"))[
        "recipe"]["data"]["manifest"].startswith("bench")
    chosen = open_checkpoint(str(run_dir / "chosen"))
    found = predict_properties(chosen, [r["smiles"] for r in valid], augment=2, seed=0)
    per_task = []
    for t, task in enumerate(("lipophilic", POLAR)):  # the mean over tasks whose labels hold both classes
        seen = [i for i, r in enumerate(valid) if r[task] != ""]
        labels = [float(valid[i][task]) for i in seen]
        if len(set(labels)) == 2:
            per_task.append(roc_auc_score(labels, [found.values[i][t] for i in seen]))
    want = sum(per_task) / len(per_task)
    assert run["valid_roc_auc"] == pytest.approx(want, abs=1e-9)
    assert split["molds"]["valid_roc_auc"]["mean"] == pytest.approx(want, abs=1e-4)

    # benchmarks/checkpoint_choice.py on this fine-tuning: the best checkpoint chosen on one half
    # of the validation split and scored on the other, recomputed here with scikit-learn
    import numpy as np

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "checkpoint_choice.py"), str(run_dir),
                           "--k", "3", "--halvings", "1"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    checkpoints = sorted(p for p in os.listdir(run_dir / "checkpoints") if p.startswith("step-"))
    preds = [predict_properties(open_checkpoint(str(run_dir / "checkpoints" / c)), [r["smiles"] for r in valid],
                                augment=1, seed=0) for c in checkpoints]

    def auc(found, rows):
        per = []
        for t, task in enumerate(("lipophilic", POLAR)):
            seen = [i for i in rows if valid[i][task] != ""]
            ys = [float(valid[i][task]) for i in seen]
            if len(set(ys)) == 2:
                per.append(roc_auc_score(ys, [found.values[i][t] for i in seen]))
        return sum(per) / len(per)

    order = np.random.default_rng(0).permutation(len(valid))
    halves = (list(order[: len(order) // 2]), list(order[len(order) // 2:]))
    got = []
    for a, b in (halves, halves[::-1]):
        scores = [auc(f, a) for f in preds]
        got.append(auc(preds[max(range(len(scores)), key=lambda i: (scores[i], i))], b))  # ties: the later
    assert line["runs"][0]["best"] == pytest.approx(sum(got) / 2, abs=1e-6)
    assert 0.0 <= line["runs"][0]["mean_of_3"] <= 1.0 and line["sets"]["set"]["runs"] == 1 and line["cpu"]


def test_a_pretraining_on_descriptors_learns_rdkits_values_and_forks_into_fresh_heads(tmp_path):
    """``--pretrain-labels descriptors``: the corpus carries each molecule's descriptors,
    equal to RDKit's own functions called here (a molecule RDKit cannot read has none); the
    pretraining's encoder has one regression head per descriptor and its lineage names them
    (a fine-tuning fork onto other labels starts its heads afresh:
    tests/engines/test_property_metrics.py)."""
    from rdkit import Chem
    from rdkit.Chem import Crippen, Descriptors, Lipinski, rdMolDescriptors

    bench = benchmark_script("moleculenet")
    corpus = tmp_path / "corpus.csv"
    smiles = sample_smiles(160, offset=500) + ["C[N+](C)(C)C.[Cl-]", "C1CC(N"]
    with open(corpus, "w", newline="") as fh:
        csv.writer(fh).writerows([["SMILES"], *([s] for s in smiles)])
    args = argparse.Namespace(
        corpus=str(corpus), corpus_column="SMILES", corpus_every=1, nproc=1, pretrain_labels="descriptors",
        pretrain_steps=2, pretrain_time="50m", pretrained=None, output_dir=str(tmp_path / "out"))
    run, info = bench.pretrain(args, [])
    assert info["labels"] == list(bench.DESCRIPTORS) and info["objective"] == "masked tokens and descriptors"
    with gzip.open(tmp_path / "out" / "pretrain-descriptors" / "corpus.csv.gz", "rt", newline="") as fh:
        written = list(csv.DictReader(fh))
    assert [r["SMILES"] for r in written] == smiles
    rdkit = {"mw": Descriptors.MolWt, "logp": Crippen.MolLogP, "tpsa": rdMolDescriptors.CalcTPSA,
             "hbd": Lipinski.NumHDonors, "hba": Lipinski.NumHAcceptors,
             "rotatable_bonds": rdMolDescriptors.CalcNumRotatableBonds, "rings": rdMolDescriptors.CalcNumRings,
             "aromatic_rings": rdMolDescriptors.CalcNumAromaticRings, "heavy_atoms": lambda m: m.GetNumHeavyAtoms(),
             "fsp3": rdMolDescriptors.CalcFractionCSP3,
             "formal_charge": lambda m: Chem.GetFormalCharge(m),
             "stereocenters": lambda m: len(Chem.FindMolChiralCenters(m, includeUnassigned=True))}
    assert set(rdkit) == set(bench.DESCRIPTORS)
    for row in written:
        mol = Chem.MolFromSmiles(row["SMILES"])
        for name, fn in rdkit.items():
            if mol is None:
                assert row[name] == "", (row["SMILES"], name)
            else:
                assert float(row[name]) == pytest.approx(fn(mol), rel=1e-12), (row["SMILES"], name)
    from molds.checkpoint import read_lineage, resolve

    lineage = read_lineage(resolve(run, quiet=True))
    assert lineage["labels"] == list(bench.DESCRIPTORS) and lineage["step"] == 2
    assert lineage["recipe"]["model"]["num_tasks"] == len(bench.DESCRIPTORS)
    assert lineage["recipe"]["model"]["task_type"] == "regression"
