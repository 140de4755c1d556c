"""A property model's figures, checked from outside molds: ``molds-eval``'s ROC-AUC and RMSE
equal scikit-learn's on the predictions of the exported transformers model for the test
molecules and labels read from the shards; a regression head learns labels standardized by
the training split (its mean and standard deviation, computed here with numpy, kept in the
checkpoint) and its predictions, metrics and exported logits come back in the labels' own
units; the standardized loss is the one written out by hand."""

from __future__ import annotations

import csv
import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.preprocessing.conftest import sample_smiles


def _labelled(d, columns, n=360):
    """Molecules with two regression labels in large units (500 + 100 x Crippen logP; 10 x
    TPSA, missing for every fifth molecule) and two classes (logP > 2.5, missing for every
    seventh; TPSA > 60), preprocessed with the label ``columns`` named."""
    from rdkit import Chem
    from rdkit.Chem import Crippen, rdMolDescriptors

    from molds.preprocessing.config import PreprocessConfig
    from molds.preprocessing.pipeline import run

    path = d / "labelled.csv"
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["smiles", "logp", "tpsa", "lipophilic", "polar"])
        for i, s in enumerate(sample_smiles(n, offset=12000)):
            mol = Chem.MolFromSmiles(s)
            logp, tpsa = Crippen.MolLogP(mol), rdMolDescriptors.CalcTPSA(mol)
            w.writerow([s, 500 + 100 * logp, "" if i % 5 == 0 else 10 * tpsa, "" if i % 7 == 0 else int(logp > 2.5),
                        int(tpsa > 60)])
    out = str(d / "_".join(columns))
    run(PreprocessConfig(input=[str(path)], output=out, label_columns=list(columns), workers=1, progress=False,
                         split="scaffold"))
    return out


def _split(manifest_dir, split):
    """(token ids of each row, labels [N, T] with NaN) of a split, read from its shards."""
    import json

    m = json.load(open(os.path.join(manifest_dir, "manifest.json")))
    ids, labels = [], []
    for s in m["splits"][split]:
        t = pq.read_table(os.path.join(manifest_dir, s["uri"]))
        ids += t.column("token_ids").to_pylist()
        labels += [[np.nan if v is None else v for v in row] for row in t.column("labels").to_pylist()]
    return ids, np.asarray(labels, dtype=float)


def _argv(manifest, out, tasks, task_type, label_columns=None):
    return ["--data.manifest", manifest, "--data.mode", "bucketed", "--data.max_tokens_per_batch", "2048",
            "--data.bucket_pool", "200", "--data.max_length", "128", "--data.mlm_probability", "0.15",
            "--data.with_labels", "true", "--model.family", "encoder", "--model.hidden_size", "32",
            "--model.num_layers", "1", "--model.num_heads", "4", "--model.max_position_embeddings", "160",
            "--model.dropout", "0.0", "--model.num_tasks", str(tasks), "--model.task_type", task_type,
            "--parallel.engine", "ddp", "--optim.lr", "2e-3", "--optim.warmup_steps", "2",
            "--trainer.max_steps", "25", "--trainer.precision", "fp32", "--logging.progress", "false",
            "--eval.interval_steps", "0", "--checkpoint.average_last", "0", "--run.output_dir", out]


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """(a regression set, a classification set) of the same molecules."""
    d = tmp_path_factory.mktemp("props")
    return _labelled(d, ("logp", "tpsa")), _labelled(d, ("lipophilic", "polar"))


def _hf_predictions(export_dir, ids, specials):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(export_dir).eval()
    out = []
    with torch.no_grad():
        for row in ids:
            x = torch.tensor([[specials.bos, *row, specials.eos]])
            out.append(model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].numpy())
    return np.asarray(out)


def test_regression_learns_standardized_labels_and_answers_in_their_units(labelled, tmp_path, capfd):
    from sklearn.metrics import mean_squared_error

    from molds.checkpoint import open_checkpoint
    from molds.data.manifest import Manifest, label_moments
    from molds.eval.evaluate import evaluate_checkpoint
    from molds.export import export
    from molds.train import main

    labelled = labelled[0]
    _, train_labels = _split(labelled, "train")
    mean, std, count = label_moments(Manifest.load(labelled), "train")
    want_mean = np.nanmean(train_labels, axis=0)
    want_std = np.nanstd(train_labels, axis=0, ddof=1)
    assert np.allclose(mean, want_mean) and np.allclose(std, want_std)
    assert count == list((~np.isnan(train_labels)).sum(axis=0))

    run = str(tmp_path / "reg")
    result = main(_argv(labelled, run, 2, "regression"))
    assert "regression labels standardized by the train split's mean and standard deviation: logp" in \
        capfd.readouterr().err
    import json

    lineage = json.load(open(os.path.join(result["checkpoint"], "lineage.json")))
    assert np.allclose(lineage["label_scale"]["mean"], want_mean) and np.allclose(lineage["label_scale"]["std"],
                                                                                    want_std)
    loaded = open_checkpoint(run)
    assert np.allclose(loaded.model.label_std.numpy(), want_std)  # kept in the checkpoint's weights
    report = evaluate_checkpoint(run, split="test")
    out = str(tmp_path / "hf")
    export(run, out)
    ids, y = _split(labelled, "test")
    pred = _hf_predictions(out, ids, loaded.specials)
    for t, name in enumerate(["logp", "tpsa"]):
        seen = ~np.isnan(y[:, t])
        rmse = float(np.sqrt(mean_squared_error(y[seen, t], pred[seen, t])))
        assert report["property"]["per_task"][name]["rmse"] == pytest.approx(rmse, rel=1e-4), name
        # in the labels' units: within a few standard deviations of labels centred near 700 and 600
        assert rmse < 3 * want_std[t] and abs(pred[seen, t].mean() - y[seen, t].mean()) < 2 * want_std[t], name


def test_a_classification_head_refuses_labels_outside_0_to_1_before_a_step(labelled, tmp_path):
    """The regression set's labels (500 + 100 x logP) given to a classification head: refused
    in one line naming the label and a value the shards hold, and no step is taken (labels
    between 0 and 1, probabilities, are learnt: tests/engines/test_encoder.py); so is a head
    count other than the manifest's label columns (a raw torch error in the first step
    before)."""
    from molds.data.manifest import Manifest, first_label_outside
    from molds.errors import RecipeError
    from molds.train import main

    regression, classification = labelled
    assert first_label_outside(Manifest.load(classification)) is None
    _, train_labels = _split(regression, "train")
    name, row, value = first_label_outside(Manifest.load(regression))
    assert train_labels[row, ["logp", "tpsa"].index(name)] == pytest.approx(value)
    assert not 0.0 <= value <= 1.0
    for tasks in (1, 3):  # one head per label column, or refused in one line before a step
        with pytest.raises(RecipeError, match=rf"model.num_tasks={tasks}, but .* holds 2 label columns "
                                              r"\['lipophilic', 'polar'\]"):
            main(_argv(classification, str(tmp_path / f"heads{tasks}"), tasks, "classification"))
        assert not (tmp_path / f"heads{tasks}" / "checkpoints").exists()
    run = tmp_path / "cls"
    with pytest.raises(RecipeError, match=r"model.task_type=classification learns labels from 0 to 1 .*, but label "
                                          r"'logp' .* is [0-9.]+ \(row 0 of the split\)") as err:
        main(_argv(regression, str(run), 2, "classification"))
    assert "\n" not in str(err.value)
    assert not (run / "checkpoints").exists()


def test_a_forged_label_scale_is_refused_by_the_model_readers(labelled, tmp_path, capfd):
    """A regression checkpoint whose label_std is edited to 0 or less (training never writes
    one: a task whose labels do not vary gets 1) is refused by molds-predict, molds-eval and
    molds-export in one line, instead of answering a constant or the labels' mirror image."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from molds.checkpoint import checkpoints_dir, complete_checkpoints
    from molds.cli.evaluate import main as eval_main
    from molds.cli.export import main as export_main
    from molds.cli.predict import main as predict
    from molds.train import main

    run = str(tmp_path / "reg")
    main(_argv(labelled[0], run, 2, "regression"))
    src = tmp_path / "in.csv"
    src.write_text("smiles\nCCO\n")
    for forged in (0.0, -1.0):
        ckpt = complete_checkpoints(checkpoints_dir(run))[-1]
        path = os.path.join(ckpt, "model.safetensors")
        with safe_open(path, "pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        key = next(k for k in tensors if k.endswith("label_std"))
        tensors[key][1] = forged
        save_file(tensors, path, metadata=meta)
        capfd.readouterr()
        for cli, args in ((predict, [ckpt, "--input", str(src), "--out", str(tmp_path / "p.csv")]),
                          (eval_main, [ckpt, "--out", str(tmp_path / "ev")]),
                          (export_main, [ckpt, str(tmp_path / "hf")])):
            assert cli(args) == 2
            err = capfd.readouterr().err
            assert "a regression head's label_std must be positive" in err and f"{forged}" in err, err[-500:]
        assert not os.path.exists(tmp_path / "hf") and not os.path.exists(tmp_path / "p.csv")
    assert json.load(open(os.path.join(ckpt, "lineage.json")))["label_scale"]["std"][1] > 0  # what training wrote


def test_classification_roc_auc_is_scikit_learns_on_the_exported_model(labelled, tmp_path):
    from sklearn.metrics import roc_auc_score

    from molds.checkpoint import open_checkpoint
    from molds.eval.evaluate import evaluate_checkpoint
    from molds.export import export
    from molds.train import main

    labelled = labelled[1]
    run = str(tmp_path / "cls")
    main(_argv(labelled, run, 2, "classification"))
    report = evaluate_checkpoint(run, split="test")
    out = str(tmp_path / "hf")
    export(run, out)
    ids, y = _split(labelled, "test")
    pred = _hf_predictions(out, ids, open_checkpoint(run).specials)
    for t, name in enumerate(["lipophilic", "polar"]):
        seen = ~np.isnan(y[:, t])
        assert 0 < y[seen, t].sum() < seen.sum()
        want = roc_auc_score(y[seen, t], pred[seen, t])
        assert report["property"]["per_task"][name]["auroc"] == pytest.approx(want, abs=1e-6), name


def test_a_fork_onto_other_tasks_of_the_same_kind_and_count_starts_its_heads_afresh(labelled, tmp_path):
    """A regression model of (logp, tpsa) forked onto a manifest of (tpsa, logp): the same
    number and kind of tasks, under other names in another order. Its heads and label scale
    start afresh (the new manifest's training split), instead of reading each task with
    the other's head; a fork onto the same columns keeps them."""
    import json

    from molds.checkpoint.state import read_model
    from molds.data.manifest import Manifest, label_moments
    from molds.train import main

    first = str(tmp_path / "reg")
    parent = main(_argv(labelled[0], first, 2, "regression"))["checkpoint"]
    swapped = _labelled(tmp_path, ("tpsa", "logp"))
    fork = ["--checkpoint.resume", parent, "--checkpoint.fork", "true", "--optim.lr", "0",
            "--optim.warmup_steps", "0"]
    other = main([*_argv(swapped, str(tmp_path / "swapped"), 2, "regression"), "--trainer.max_steps", "1", *fork])
    lineage = json.load(open(os.path.join(other["checkpoint"], "lineage.json")))
    assert lineage["labels"] == ["tpsa", "logp"]
    assert lineage["fresh_heads"]["changes"] == {"labels": [["logp", "tpsa"], ["tpsa", "logp"]]}
    mean, std, _ = label_moments(Manifest.load(swapped), "train")
    assert np.allclose(lineage["label_scale"]["mean"], mean) and np.allclose(lineage["label_scale"]["std"], std)
    before, after = read_model(parent), read_model(other["checkpoint"])
    assert not torch.equal(before["classifier.out_proj.weight"], after["classifier.out_proj.weight"])
    same = main([*_argv(labelled[0], str(tmp_path / "same"), 2, "regression"), "--trainer.max_steps", "1", *fork])
    lineage = json.load(open(os.path.join(same["checkpoint"], "lineage.json")))
    assert "fresh_heads" not in lineage
    assert torch.equal(before["classifier.out_proj.weight"], read_model(same["checkpoint"])["classifier.out_proj.weight"])


def test_the_standardized_loss_is_the_one_written_by_hand():
    from molds.models.loss import masked_task_loss

    g = torch.Generator().manual_seed(0)
    pred, labels = torch.randn(7, 3, generator=g) * 50, torch.randn(7, 3, generator=g) * 50
    mask = torch.rand(7, 3, generator=g) > 0.3
    scale = torch.tensor([10.0, 0.5, 3.0])
    want = np.mean([((pred[i, t] - labels[i, t]) / scale[t]).item() ** 2
                    for i in range(7) for t in range(3) if mask[i, t]])
    got = masked_task_loss(pred, labels, mask, "regression", scale)
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_mean_pooling_reads_the_mean_of_a_molecules_tokens_whatever_the_padding():
    """``model.pooling mean``: the heads read the mean of the final states over the real
    tokens (written out here with the body's states and the head's layers), so a molecule
    scores the same alone and padded beside a longer one."""
    from molds.models.encoder import EncoderConfig, MoleculeEncoder

    torch.manual_seed(0)
    model = MoleculeEncoder(EncoderConfig(vocab_size=30, hidden_size=32, num_layers=2, num_heads=4, num_tasks=2,
                                          dropout=0.0, pooling="mean")).eval()
    short, long = [2, 7, 9, 11, 3], [2, 5, 6, 8, 12, 14, 15, 3]
    ids = torch.tensor([short + [0] * 3, long])
    mask = (ids != 0).long()
    with torch.no_grad():
        got = model(ids, mask)["predictions"]
        alone = model(torch.tensor([short]), torch.ones(1, 5, dtype=torch.long))["predictions"]
        states = model.mlm.roberta(input_ids=ids, attention_mask=mask).last_hidden_state
        want = []
        for row, n in ((0, 5), (1, 8)):
            pooled = states[row, :n].mean(0)
            head = model.classifier
            want.append(head.out_proj(torch.tanh(head.dense(pooled))))
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], alone[0], rtol=1e-5, atol=1e-6)
    bos = MoleculeEncoder(EncoderConfig(vocab_size=30, hidden_size=32, num_layers=2, num_heads=4, num_tasks=2,
                                        dropout=0.0)).eval()
    bos.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(bos(ids, mask)["predictions"], got)  # the first token's is another reading
    from molds.errors import MoldsError
    from molds.export import hf_encoder

    with pytest.raises(MoldsError, match="model.pooling mean: transformers' RobertaForSequenceClassification reads"):
        hf_encoder(model)  # no stock class pools so: refused, not exported as another model


@pytest.mark.parametrize("pooling,task_type,features,reads", [
    ("auto", "regression", "rdkit2d+morgan", "mean"), ("auto", "regression", "rdkit2d", "mean"),
    ("auto", "classification", "rdkit2d+morgan", "bos"), ("auto", "regression", "none", "bos"),
    ("bos", "regression", "rdkit2d", "bos"), ("mean", "classification", "none", "mean"),
])
def test_auto_pooling_reads_the_mean_for_regression_heads_beside_features(pooling, task_type, features, reads):
    """``model.pooling auto`` resolves by the task, from the recipe and from a checkpoint's
    stored model section alike: the mean of the tokens for regression heads that also read
    molecule features, the first token otherwise (heads on tokens alone stay exportable); a
    stored section written before the key reads the first token."""
    from molds.models import family_config, pooling_of
    from molds.recipe.sections import ModelConfig

    section = ModelConfig(family="encoder", num_tasks=2, task_type=task_type, pooling=pooling,
                          molecule_features=features)
    assert pooling_of(section) == reads
    stored = dataclasses.asdict(section)
    assert pooling_of(stored) == reads
    tokenizer = SimpleNamespace(vocab_size=30, pad=0, bos=2, eos=3)
    assert family_config(stored, tokenizer).pooling == reads
    del stored["pooling"]
    assert pooling_of(stored) == "bos"


@pytest.mark.parametrize("which,task_type", [(0, "regression"), (1, "classification")])
def test_molds_predict_scores_every_molecule_as_the_exported_model_does(labelled, tmp_path, which, task_type):
    """``molds-predict`` on raw SMILES: per molecule, the exported transformers model's output
    on the tokens the ETL stored for it (a regression's in label units, a classification's as
    the sigmoid of its logit); with ``--augment 3`` the mean of the exported model's outputs over
    the canonical and two randomized spellings; a row RDKit refuses and one with a token the
    vocabulary lacks are named, not dropped."""
    from molds.checkpoint import open_checkpoint
    from molds.cli.predict import main as predict
    from molds.data.randomize import restricted_variants
    from molds.export import export
    from molds.train import main

    manifest = labelled[which]
    run, hf = str(tmp_path / "run"), str(tmp_path / "hf")
    main(_argv(manifest, run, 2, task_type))
    export(run, hf)
    specials = open_checkpoint(run).specials
    ids, _ = _split(manifest, "test")
    import json

    m = json.load(open(os.path.join(manifest, "manifest.json")))
    raws, canon = [], []
    for s in m["splits"]["test"]:
        t = pq.read_table(os.path.join(manifest, s["uri"]))
        raws += t.column("raw_smiles").to_pylist()
        canon += t.column("canonical_smiles").to_pylist()
    src = tmp_path / "in.csv"
    with open(src, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "smiles"])
        w.writerows([i, s] for i, s in enumerate(raws + ["C1CC(", "CC[U]C"]))

    def read(path):
        with open(path, newline="") as fh:
            return list(csv.DictReader(fh))

    def expected(rows_of_ids):
        out = _hf_predictions(hf, rows_of_ids, specials)
        return out if task_type == "regression" else 1 / (1 + np.exp(-out))

    tasks = ["logp", "tpsa"] if which == 0 else ["lipophilic", "polar"]
    assert predict([run, "--input", str(src), "--column", "smiles", "--out", str(tmp_path / "p.csv")]) == 0
    rows = read(tmp_path / "p.csv")
    assert len(rows) == len(raws) + 2
    got = np.asarray([[float(r[t]) for t in tasks] for r in rows[:len(raws)]])
    assert [r["canonical"] for r in rows[:len(raws)]] == canon
    assert np.allclose(got, expected(ids), rtol=2e-6, atol=2e-6)
    assert rows[-2]["note"] == "parse_error" and rows[-2]["logp" if which == 0 else "polar"] == ""
    assert rows[-1]["note"] == "unknown_token"
    import gzip  # the same input gzipped reads the same

    with open(src, "rb") as fh, gzip.open(str(src) + ".gz", "wb") as gz:
        gz.write(fh.read())
    assert predict([run, "--input", str(src) + ".gz", "--column", "smiles", "--out", str(tmp_path / "z.csv")]) == 0
    assert read(tmp_path / "z.csv") == rows
    # as Excel writes it (a byte-order mark, the column in capitals, tabs): the same rows, the
    # column found without --column
    vendor = tmp_path / "in.tsv"
    vendor.write_text(open(src).read().replace(",", "\t").replace("id\tsmiles", "ID\tSMILES"), encoding="utf-8-sig")
    assert predict([run, "--input", str(vendor), "--out", str(tmp_path / "v.csv")]) == 0
    assert read(tmp_path / "v.csv") == rows
    # --id_column: each row carries its id, in a column after the row's line, chunk after chunk
    assert predict([run, "--input", str(vendor), "--id_column", "id", "--chunk_size", "4",
                    "--out", str(tmp_path / "i.csv")]) == 0
    with_ids = read(tmp_path / "i.csv")
    assert list(with_ids[0])[:3] == ["row", "id", "input"]
    assert [r["id"] for r in with_ids] == [str(i) for i in range(len(raws) + 2)]
    assert [{k: v for k, v in r.items() if k not in ("id", *tasks)} for r in with_ids] == \
        [{k: v for k, v in r.items() if k not in tasks} for r in rows]
    # the same molecules as an SD file (RDKit's mol blocks) and a record RDKit refuses: the same
    # canonical molecules and predictions, the refused record named in its row
    from rdkit import Chem

    sd = tmp_path / "in.sdf"
    with open(sd, "w") as fh:
        for s_ in raws:
            fh.write(Chem.MolToMolBlock(Chem.MolFromSmiles(s_)) + "$$$$\n")
        fh.write("broken\n\n\n  1  0  0  0  0  0  0  0  0  0999 V2000\n" + "    0.0000    0.0000    0.0000 Xx"
                 "  0  0  0  0  0  0  0  0  0  0  0  0\nM  END\n$$$$\n")
    assert predict([run, "--input", str(sd), "--out", str(tmp_path / "sd.csv")]) == 0
    from_sd = read(tmp_path / "sd.csv")
    assert [r["canonical"] for r in from_sd[:len(raws)]] == canon
    assert np.allclose([[float(r[t]) for t in tasks] for r in from_sd[:len(raws)]], got, rtol=1e-6, atol=1e-6)
    assert len(from_sd) == len(raws) + 1 and from_sd[-1]["note"] == "sdf_parse_error" and from_sd[-1][tasks[0]] == ""
    # read, predicted and written three sources at a time: the same rows (the values to float
    # precision: other molecules share a batch)
    assert predict([run, "--input", str(src), "--chunk_size", "3", "--out", str(tmp_path / "c.csv")]) == 0
    chunked = read(tmp_path / "c.csv")
    assert [{k: v for k, v in r.items() if k not in tasks} for r in chunked] == \
        [{k: v for k, v in r.items() if k not in tasks} for r in rows]
    assert np.allclose([[float(r[t] or "nan") for t in tasks] for r in chunked],
                       [[float(r[t] or "nan") for t in tasks] for r in rows], rtol=1e-6, atol=1e-6, equal_nan=True)
    # an input cut short half-way: refused in one line after the first chunks were written, and
    # no output file left behind
    blob = open(str(src) + ".gz", "rb").read()
    open(tmp_path / "cut.csv.gz", "wb").write(blob[:len(blob) // 2])
    assert predict([run, "--input", str(tmp_path / "cut.csv.gz"), "--chunk_size", "2",
                    "--out", str(tmp_path / "cut.csv")]) == 2
    assert not os.path.exists(tmp_path / "cut.csv") and not [f for f in os.listdir(tmp_path) if ".tmp-" in f]

    assert predict([run, "--input", str(src), "--column", "smiles", "--augment", "3",
                    "--out", str(tmp_path / "a.csv")]) == 0
    aug = np.asarray([[float(r[t]) for t in tasks] for r in read(tmp_path / "a.csv")[:len(raws)]])
    tok = open_checkpoint(run).tokenizer
    want = []
    for c, row_ids in zip(canon, ids):
        spellings = [row_ids] + [tok(v, add_special_tokens=False)["input_ids"]
                                 for v in restricted_variants(c, [1, 2])]
        want.append(expected(spellings).mean(axis=0))
    assert np.allclose(aug, np.asarray(want), rtol=2e-6, atol=2e-6)
    assert (~np.isclose(aug, got, rtol=2e-5, atol=2e-5)).any()  # the other spellings were read


def test_pictures_of_the_predictions_in_the_report_and_tensorboard(labelled, tmp_path):
    """A classification model's ROC curves: ``eval.json``'s points are scikit-learn's
    ``roc_curve`` on the exported model's test predictions, ``roc.png`` is linked from
    ``eval.md``, and the training's final evaluation put the picture in TensorBoard; a
    regression model gets ``parity.png``."""
    from sklearn.metrics import roc_curve
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from molds.checkpoint import open_checkpoint
    from molds.eval.evaluate import evaluate_checkpoint
    from molds.eval.report import write_report
    from molds.export import export
    from molds.train import main

    run, hf = str(tmp_path / "cls"), str(tmp_path / "hf")
    main(_argv(labelled[1], run, 2, "classification") + ["--eval.interval_steps", "25", "--eval.split", "valid",
                                                         "--logging.tensorboard", "true"])
    report = evaluate_checkpoint(run, split="test")
    out = str(tmp_path / "report")
    write_report(out, report)
    with open(os.path.join(out, "roc.png"), "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "![roc](roc.png)" in open(os.path.join(out, "eval.md")).read()
    export(run, hf)
    ids, y = _split(labelled[1], "test")
    pred = _hf_predictions(hf, ids, open_checkpoint(run).specials)
    import json

    points = json.load(open(os.path.join(out, "eval.json")))["property"]["roc"]
    for t, name in enumerate(["lipophilic", "polar"]):
        seen = ~np.isnan(y[:, t])
        fpr, tpr, _ = roc_curve(y[seen, t], pred[seen, t])
        assert len(points[name]["fpr"]) == len(fpr)
        assert np.allclose(points[name]["fpr"], fpr, atol=1e-6) and np.allclose(points[name]["tpr"], tpr, atol=1e-6)
    events = EventAccumulator(os.path.join(run, "tensorboard"), size_guidance={"images": 0}).Reload()
    assert "eval/roc" in events.Tags()["images"]

    reg = str(tmp_path / "reg")
    main(_argv(labelled[0], reg, 2, "regression"))
    out = str(tmp_path / "reg-report")
    write_report(out, evaluate_checkpoint(reg, split="test"))
    assert os.path.getsize(os.path.join(out, "parity.png")) > 1000
    assert "roc" not in json.load(open(os.path.join(out, "eval.json")))["property"]


@pytest.mark.slow
def test_the_predict_memory_benchmark_runs_both_ways_on_each_size(labelled, tmp_path, capsys):
    """``benchmarks/predict_memory.py``: molds-predict on the first N sources, chunked and whole,
    each its own process with its peak memory read back (tiny sizes: that it runs, not what it
    measures)."""
    import json

    from benchmarks.predict_memory import main as bench
    from molds.train import main

    run = str(tmp_path / "run")
    main(_argv(labelled[0], run, 2, "regression"))
    src = tmp_path / "in.csv"
    src.write_text("smiles\n" + "\n".join(sample_smiles(30, offset=500)) + "\n")
    assert bench(["--run", run, "--input", str(src), "--sizes", "12", "24", "--chunk_size", "5"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["sources"], r["read"], r["chunk_size"]) for r in out["runs"]] == \
        [(12, "chunked", 5), (12, "whole", 13), (12, "chunked_system_allocator", 5),
         (24, "chunked", 5), (24, "whole", 25), (24, "chunked_system_allocator", 5)]
    assert all(r["peak_rss_mib"] > 50 for r in out["runs"]) and isinstance(out["target_met"], bool)


@pytest.mark.parametrize("task_type", ["classification", "regression"])
def test_molds_average_best_averages_the_checkpoints_best_on_validation(labelled, tmp_path, task_type, capfd):
    """``molds-average RUN OUT --best 3``: each checkpoint's validation score is scikit-learn's on
    its exported model's predictions of the validation molecules read from the shards (the mean
    ROC-AUC over tasks, or of the RMSE in the labels' units, lower being better); the three best
    are averaged (their weights' mean), and the lineage says how they were chosen."""
    import json

    from safetensors.torch import load_file
    from sklearn.metrics import mean_squared_error, roc_auc_score

    from molds.checkpoint import open_checkpoint
    from molds.cli.average import main as average_main
    from molds.export import export
    from molds.train import main

    manifest = labelled[0] if task_type == "regression" else labelled[1]
    run = str(tmp_path / "run")
    main(_argv(manifest, run, 2, task_type) + ["--checkpoint.interval_steps", "5", "--checkpoint.keep_last", "0",
                                               "--optim.lr", "1e-2"])
    steps = sorted(os.listdir(os.path.join(run, "checkpoints")))
    steps = [s for s in steps if s.startswith("step-")]
    assert len(steps) == 5
    ids, y = _split(manifest, "valid")
    want = {}
    for step in steps:
        ckpt = os.path.join(run, "checkpoints", step)
        pred = _hf_predictions(export(ckpt, str(tmp_path / f"hf-{step}")), ids, open_checkpoint(ckpt).specials)
        per_task = []
        for t in range(2):
            seen = ~np.isnan(y[:, t])
            if task_type == "regression":
                per_task.append(float(np.sqrt(mean_squared_error(y[seen, t], pred[seen, t]))))
            elif 0 < y[seen, t].sum() < seen.sum():
                per_task.append(roc_auc_score(y[seen, t], pred[seen, t]))
        want[step] = float(np.mean(per_task))
    assert len(set(round(v, 6) for v in want.values())) == 5  # the checkpoints differ on validation
    best = sorted(want, key=lambda s: want[s], reverse=task_type == "classification")[:3]

    out = str(tmp_path / "best3")
    capfd.readouterr()
    assert average_main([run, out, "--best", "3"]) == 0
    lineage = json.load(open(os.path.join(out, "lineage.json")))
    chosen = lineage["chosen_by"]
    assert chosen["split"] == "valid" and chosen["best"] == 3
    assert chosen["metric"] == ("rmse" if task_type == "regression" else "roc_auc")
    assert chosen["scores"] == pytest.approx(want, abs=1e-5)
    assert [f"step-{s['step']:08d}" for s in lineage["averaged_from"]] == sorted(best)
    got = load_file(os.path.join(out, "model.safetensors"))
    sources = [load_file(os.path.join(run, "checkpoints", s, "model.safetensors")) for s in sorted(best)]
    for k, v in got.items():
        if v.is_floating_point():
            torch.testing.assert_close(v, torch.stack([s[k].double() for s in sources]).mean(0).float(),
                                       rtol=0, atol=1e-7)
    assert "the 3 best on valid" in capfd.readouterr().err

    # refused in one line: --best with --last, below 1, more than the run has, a model without heads
    from molds.cli import UsageError
    from molds.cli.average import run as average_run
    from molds.errors import MoldsError

    for bad in (["--best", "3", "--last", "2"], ["--best", "-1"], ["--best", "1", "--split", "test"]):
        with pytest.raises(UsageError):
            average_run([run, str(tmp_path / "no"), *bad])
    with pytest.raises(MoldsError, match="5 of 5 have one"):
        average_run([run, str(tmp_path / "no"), "--best", "6"])
    mlm = str(tmp_path / "mlm")
    main(_argv(manifest, mlm, 0, task_type)[:-2] + ["--trainer.max_steps", "2", "--run.output_dir", mlm])
    with pytest.raises(MoldsError, match="without property heads"):
        average_run([mlm, str(tmp_path / "no"), "--best", "1"])
    assert not os.path.exists(tmp_path / "no")


def test_a_choice_without_scores_says_why_and_ranks_unscored_checkpoints_last():
    """A validation split where no task holds both classes scores no checkpoint: asking for the
    best says so (and what to do) in one line; where some have a score, those come first."""
    from molds.errors import MoldsError
    from molds.eval.choose import Choice

    none = Choice(metric="roc_auc", split="valid", scores=[("r/step-00000010", None), ("r/step-00000020", None)])
    with pytest.raises(MoldsError, match="0 of 2 have one .*both classes.*--last N"):
        none.best(1)
    some = Choice(metric="rmse", split="valid", scores=[("r/step-00000030", 0.5), ("r/step-00000010", 0.7),
                                                       ("r/step-00000020", None)])
    assert some.scored == ["r/step-00000030", "r/step-00000010"]
    assert some.best(2) == ["r/step-00000010", "r/step-00000030"]  # in step order
    with pytest.raises(MoldsError, match="3 checkpoints asked for by their valid rmse, but 2 of 3 have one$"):
        some.best(3)
