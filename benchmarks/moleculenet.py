"""Property prediction on MoleculeNet-style sets: molds' encoder beside Chemprop's D-MPNN and a
fingerprint random forest, on the very same splits, molecules and labels.

    python benchmarks/moleculenet.py --data-dir DIR [--sets bbbp bace tox21 esol lipo]
        | --input FILE [--smiles-column C] [--label-columns A,B] [--task-type T] [--name N]
        [--splits scaffold scaffold_random] [--seeds 0 1 2] [--models molds chemprop rf]
        [--corpus moses_train.csv.gz --corpus-every 4 --pretrain-time 50m | --pretrain-steps N]
        [--pretrain-labels none|descriptors] [--pretrained RUN]
        [--chemprop-python PY | --chemprop-venv DIR] [--epochs 20] [--min-steps 320]
        [--finetune KEY=VALUE ...]
        [--augment 1] [--average 3] [--nproc 2]
        [--output-dir runs/moleculenet]

Any CSV of the kind works: a SMILES column and label columns (by default every other column;
an empty cell is a missing label). The task type is ``classification`` when every label is
0 or 1, else ``regression``, unless ``--task-type`` says. ``--data-dir`` takes MoleculeNet's
files as Chemprop's repository ships them (``SETS``: the file, its SMILES column; nothing
else differs between sets).

1. **Pretraining, once.** The molecules of ``--corpus`` (MOSES: every ``--corpus-every``-th),
   less every molecule of the benchmark's files (compared by their parents, as the ETL's
   standardization makes molecules one: ``molds.chemistry.overlap``), are preprocessed
   (``molds-preprocess``, regex tokenizer) and ``recipes/cpu_property.json`` pretrains an
   encoder on them by masked-token loss alone (``--model.num_tasks 0``, no molecule features,
   15 % masking, lr 1e-3) for ``--pretrain-time`` (or ``--pretrain-steps``). With ``--pretrain-labels
   descriptors`` the corpus also carries RDKit descriptors of each molecule (``DESCRIPTORS``)
   as regression labels, and the encoder learns them from its first token beside the masked
   tokens (its heads start afresh in each fine-tuning fork). ``--pretrained RUN`` takes a
   run made so instead.
2. **Splits.** For each set and each split (``scaffold``: deterministic, the largest scaffold
   groups to train; ``scaffold_random``: scaffold groups in a seeded random order, the large
   ones to train first, one split per seed), ``molds-preprocess --label-columns ...
   --tokenizer PRETRAINED/tokenizer --split-fractions 0.8,0.1,0.1``: canonical molecules,
   duplicates dropped (the first row's labels kept, conflicts counted), the pretraining
   vocabulary grown by what the set needs.
   A molecule RDKit cannot read is refused and named in the set's ``report.md``; it is in
   no split, so in no model's test set. ``peers.csv`` is then written from molds' shards: the
   canonical SMILES, the labels and the split of every kept molecule, the one file every
   model reads.
3. **Models**, for each split and seed (``scaffold``: one split, ``--seeds`` model seeds;
   ``scaffold_random``: split seed = model seed):
   - ``rf``: scikit-learn's random forest, 500 trees, on 2048-bit Morgan radius-2 fingerprints
     (RDKit), one forest per task on its labelled training molecules;
   - ``chemprop``: Chemprop's CLI at its defaults (``chemprop train --splits-column split``,
     then ``chemprop predict`` on the test molecules) in its own Python (``--chemprop-python``,
     or a virtual environment made from ``requirements-chemprop.txt``: Chemprop 2.3.1 pins
     another RDKit than molds'), on the CPU, with ``--nproc`` threads;
   - ``molds``: a fork of the pretrained encoder with ``--model.num_tasks`` heads, which read
     RDKit's 2D descriptors and Morgan count fingerprint of each molecule beside its first token
     (a regression's: the mean of its tokens; the recipe's ``model.molecule_features
     rdkit2d+morgan`` and ``model.pooling auto``; ``--finetune
     model.molecule_features=none``: tokens alone, a model ``molds-export`` takes)
     (``recipes/cpu_property.json``: ``--epochs`` passes over the training split, or
     ``--min-steps`` optimizer steps where those passes take fewer; 10
     checkpoints; ``--finetune KEY=VALUE ...`` overrides the recipe's keys, the same for every
     set); the model kept is the mean of the weights of the ``--average`` checkpoints best
     on the validation split (``molds-average --best K``; K = 1: early stopping on the
     validation split) and ``molds-predict`` scores the test molecules, the mean over
     ``--augment`` spellings. A rerun into a folder fine-tuned with other settings stops.
4. **Scores**, by ``molds.metrics.property`` for every model alike, on the test molecules of
   ``peers.csv``: ROC-AUC (the mean over tasks whose test labels hold both classes) and
   PRC-AUC for classification, RMSE in the label's own units for regression; the mean and
   standard deviation over seeds; each model's train and predict seconds. A task the split
   leaves without a training label is learnt by no model, named (``untrained_tasks``) and
   scored for none.

One JSON line: per set the rows kept and refused, per split its sizes, per model the score of
every seed, mean and standard deviation and the seconds (``train_s``: training; for molds the
fine-tuning, with ``select_s`` the scoring of its checkpoints on the validation split;
``predict_s``: the test molecules); for molds also the checkpoints averaged (``chosen``) and
the model's score on the validation split (``valid_roc_auc`` or ``valid_rmse``), by which settings are
compared: the test scores are never used to choose; and the pretraining's cost. Every
stage's output stays under ``--output-dir`` and a rerun reuses what is complete.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gzip
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPE = os.path.join(ROOT, "recipes", "cpu_property.json")
SAMPLE = os.path.join(ROOT, "molds", "sample_data", "moses_sample.csv.gz")
#: MoleculeNet's files as Chemprop's repository ships them: (file, SMILES column); the labels
#: are every other column and the task type follows from them, as for any other file
SETS = {"bbbp": ("bbbp.csv.gz", "smiles"), "bace": ("bace.csv.gz", "mol"), "tox21": ("tox21.csv.gz", "smiles"),
        "hiv": ("hiv.csv.gz", "smiles"), "esol": ("delaney.csv.gz", "smiles"), "lipo": ("lipo.csv.gz", "smiles")}
SPLIT_NAMES = ("train", "valid", "test")
#: the ETL's widest size caps (preprocessing/config.py): no molecule is left out for its size
MAX_HEAVY_ATOMS, MAX_SMILES_LENGTH = 1000, 20000
#: the columns of ``peers.csv`` beside the labels
PEER_COLUMNS = ("smiles", "split")


def describe_set(name: str, path: str, smiles_column: str, label_columns: list[str] | None,
                 task_type: str | None) -> dict:
    """A set as the benchmark runs it: its columns and task type, read from the file's header
    and labels where not given, as the ETL reads them (``delimited_lines``: compression,
    byte-order marks, TSV, Excel's ``sep=`` line; a column found by name, else but for case;
    a missing label as the ETL's ``MISSING_LABELS``)."""
    from molds.errors import MoldsError
    from molds.preprocessing.map_stage import MISSING_LABELS
    from molds.data.inputs import column_index, delimited_lines

    require_delimited(path)
    try:
        lines = delimited_lines(path)
        header = [h.strip() for h in next(lines, (0, []))[1]]
        if not header:
            raise SystemExit(f"{path}: the file is empty")
        smiles_at = column_index(path, header, smiles_column, "SMILES")
        labels = label_columns or [c for i, c in enumerate(header) if i != smiles_at]
        at = [column_index(path, header, c) for c in labels]
    except MoldsError as exc:
        raise SystemExit(str(exc)) from None
    if not labels:
        raise SystemExit(f"{path}: no label column beside the SMILES; the header is {header}")
    clash = [c for c in labels if c.lower() in PEER_COLUMNS or [x.lower() for x in labels].count(c.lower()) > 1]
    if clash:  # peers.csv names its own columns so, and one name must be one column
        raise SystemExit(f"{path}: label column {clash[0]!r} is named twice or like a column of the peers' "
                         f"file {PEER_COLUMNS}; rename it in the file's header")
    values = set()
    for _, row in lines:
        values.update(v for v in (row[i].strip() if i < len(row) else "" for i in at)
                      if v.lower() not in MISSING_LABELS)
        if len(values) > 2:  # more than two values: no binary labels
            break
    try:
        binary = bool(values) and {float(v) for v in values} <= {0.0, 1.0}
    except ValueError:
        raise SystemExit(f"{path}: a label that is no number in {labels}: {sorted(values)[:3]}")
    if task_type is None:
        task_type = "classification" if binary else "regression"
    elif task_type == "classification" and not binary:
        raise SystemExit(f"{path}: --task-type classification, but the labels {labels} hold "
                         f"{sorted(values)[:3]}, not only 0 and 1")
    return {"name": name, "path": os.path.abspath(path), "smiles_column": smiles_column,
            "labels": [header[i] for i in at], "task_type": task_type}


def require_delimited(path: str) -> None:
    """A file the benchmark reads must be one the ETL reads as CSV or TSV (by its name, as the
    ETL tells formats): a ``.smi``/``.txt`` file has no label columns, another name none the ETL
    knows."""
    from molds.errors import MoldsError
    from molds.data.inputs import detect_format

    try:
        fmt = detect_format(path)
    except MoldsError:
        fmt = None
    if fmt not in ("csv", "tsv"):
        raise SystemExit(f"{path}: the benchmark reads a CSV or TSV file with a header (named .csv, .tsv or .tab, "
                         f"optionally compressed: .gz, .bz2, .xz, .zst); this name is read as "
                         f"{fmt or 'no format the ETL knows'}")


def read_column(path: str, column: str) -> list[str]:
    """One column of a CSV / TSV file, read as the ETL reads it."""
    from molds.errors import MoldsError
    from molds.data.inputs import column_index, delimited_lines

    require_delimited(path)
    try:
        lines = delimited_lines(path)
        header = [h.strip() for h in next(lines, (0, []))[1]]
        at = column_index(path, header, column, "SMILES")
    except MoldsError as exc:
        raise SystemExit(str(exc)) from None
    return [row[at].strip() if at < len(row) else "" for _, row in lines if row]


# --- the pretraining corpus, less the benchmark's molecules ---------------------------------

def pretraining_corpus(args, sets: list[dict], out: str) -> dict:
    """The corpus's molecules (every ``--corpus-every``-th) not in any benchmark file, written
    to ``out`` (a CSV with a SMILES column); what was left out."""
    done = out + ".json"
    if os.path.exists(done):
        return json.load(open(done))
    from molds.chemistry.overlap import parents  # here: --help loads no RDKit

    exclude = set()
    for s in sets:  # every set of --data-dir, not only those run: the model is reused for them
        # each fragment's parent of a benchmark molecule; a corpus molecule by its own parent
        for keys in parents(read_column(s["path"], s["smiles_column"]), args.nproc, sides=True):
            exclude.update(keys)
    smiles = read_column(args.corpus, args.corpus_column)[::args.corpus_every]
    kept, kept_keys = [], []
    for text, key in zip(smiles, parents(smiles, args.nproc)):
        if key not in exclude:
            kept.append(text)
            kept_keys.append(key)
    write_corpus_keys(kept_keys, corpus_keys_path(out))
    names = DESCRIPTORS if args.pretrain_labels == "descriptors" else ()
    values = descriptor_rows(kept, args.nproc) if names else [[] for _ in kept]
    tmp = out + ".tmp"
    with gzip.open(tmp, "wt", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["SMILES", *names])
        w.writerows([s, *("" if v is None else repr(v) for v in row)] for s, row in zip(kept, values))
    os.replace(tmp, out)
    info = {"corpus": os.path.basename(args.corpus), "every": args.corpus_every, "read": len(smiles),
            "left_out_as_benchmark_molecules": len(smiles) - len(kept), "kept": len(kept),
            "benchmark_keys": len(exclude), **({"labels": list(names)} if names else {})}
    with open(done, "w") as fh:
        json.dump(info, fh)
    return info


def corpus_keys_path(corpus: str) -> str:
    return corpus.replace(".csv.gz", "") + "-keys.txt.gz"


def write_corpus_keys(keys: list, path: str) -> None:
    """The pretraining corpus's molecules as the exclusion compares them (their parents: one
    per line, a molecule RDKit cannot read as an empty line)."""
    tmp = path + ".tmp"
    with gzip.open(tmp, "wt", encoding="utf-8") as fh:
        fh.writelines(f"{k or ''}\n" for k in keys)
    os.replace(tmp, path)


def in_pretraining_corpus(pretrained: str, s: dict, workers: int) -> int | None:
    """How many molecules of set ``s`` the pretraining corpus of run ``pretrained`` holds
    (compared as the exclusion compares them); None when the run was not pretrained by this
    benchmark (no ``corpus.csv.gz`` beside it). The keys of a corpus written before they were
    kept are computed once and kept."""
    from molds.chemistry.overlap import parents  # here: --help loads no RDKit

    corpus = os.path.join(os.path.dirname(os.path.abspath(pretrained)), "corpus.csv.gz")
    if not os.path.exists(corpus):
        return None
    path = corpus_keys_path(corpus)
    if not os.path.exists(path):
        write_corpus_keys(parents(read_column(corpus, "SMILES"), workers), path)
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        keys = {line.rstrip("\n") for line in fh} - {""}
    mine = parents(read_column(s["path"], s["smiles_column"]), workers, sides=True)
    return sum(1 for sides in mine if any(k in keys for k in sides))


#: ``--pretrain-labels descriptors``: what the encoder learns to predict from its first token
#: beside the masked tokens (RDKit's, by their names in ``molds.scoring.components``)
DESCRIPTORS = ("mw", "logp", "tpsa", "hbd", "hba", "rotatable_bonds", "rings", "aromatic_rings", "heavy_atoms",
               "fsp3", "formal_charge", "stereocenters")


def _descriptor_chunk(texts: list[str]) -> list:
    from molds.scoring.components import computed_properties  # here: --help loads no RDKit

    return computed_properties(texts, DESCRIPTORS)


def descriptor_rows(smiles: list[str], workers: int, chunk: int = 5000) -> list:
    """``DESCRIPTORS`` of each molecule, in order, on ``workers`` processes."""
    from molds.runtime.pool import chunked_map

    return chunked_map(_descriptor_chunk, smiles, workers, chunk)


def _launcher(nproc: int) -> list[str]:
    train = os.path.join(ROOT, "molds", "train.py")
    if nproc == 1:
        return [sys.executable, train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), train]


def _quiet_run(cmd: list[str], log: str, threads: int = 1) -> None:
    """Run ``cmd`` with ``threads`` threads a process, its output into ``log``; on failure, the
    log's tail and the command."""
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(threads)).returncode
    if rc:
        tail = open(log).read()[-3000:]
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}); {log} ends:\n{tail}")


def _env(threads: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))


def etl_args(s: dict, method: str, seed: int, tokenizer: str | None = None) -> list[str]:
    """``molds-preprocess``'s arguments for one split of a set. The label names go as a JSON
    list: a name may hold a comma (SIDER's "Injury, poisoning and procedural complications").
    The size caps are the ETL's widest: every molecule RDKit reads is scored (HIV has 17 of
    more than 150 heavy atoms, the ETL's default cap; molds reads the first ``data.max_length``
    tokens of a longer one and says so per molecule)."""
    return ["--input", s["path"], "--smiles-column", s["smiles_column"], "--label-columns", json.dumps(s["labels"]),
            "--max-heavy-atoms", str(MAX_HEAVY_ATOMS), "--max-smiles-length", str(MAX_SMILES_LENGTH),
            *(["--tokenizer", tokenizer] if tokenizer else []),
            "--split", method, "--split-fractions", "0.8,0.1,0.1", "--seed", str(seed)]


def label_columns(text: str | None) -> list[str] | None:
    """``--label-columns``: comma-separated names, or a JSON list where a name holds a comma."""
    if not text:
        return None
    if text.lstrip().startswith("["):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--label-columns {text!r}: not a JSON list of names ({exc})")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise SystemExit(f"--label-columns {text!r}: give a JSON list of column names")
        return names
    return [n for n in text.split(",") if n != ""]


def preprocess(argv: list[str], out: str, workers: int) -> dict:
    """``molds-preprocess ... --output out`` once (a complete manifest is reused)."""
    from molds.data.manifest import Manifest

    if not os.path.exists(os.path.join(out, "manifest.json")):
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        _quiet_run([sys.executable, "-m", "molds.preprocessing.cli", *argv, "--workers", str(workers),
                    "--progress", "false", "--output", out], out + ".log")
    return Manifest.load(out).data


def pretrain(args, sets: list[dict]) -> tuple[str, dict]:
    """The pretrained encoder's run directory and what making it cost."""
    if args.pretrained:
        return os.path.abspath(args.pretrained), {"pretrained": os.path.abspath(args.pretrained)}
    descriptors = args.pretrain_labels == "descriptors"
    base = os.path.join(args.output_dir, "pretrain-descriptors" if descriptors else "pretrain")
    os.makedirs(base, exist_ok=True)
    t0 = time.perf_counter()
    corpus = pretraining_corpus(args, sets, os.path.join(base, "corpus.csv.gz"))
    manifest = os.path.join(base, "data")
    data = preprocess(["--input", os.path.join(base, "corpus.csv.gz"), "--smiles-column", "SMILES",
                       *(["--label-columns", ",".join(DESCRIPTORS)] if descriptors else []),
                       "--split", "random", "--split-fractions", "0.98,0.01,0.01", "--tokenizer", "regex"],
                      manifest, args.nproc)
    prep_s = time.perf_counter() - t0
    run = os.path.join(base, "run")
    done = os.path.join(run, "pretrained.json")
    budget = (["--trainer.max_steps", str(args.pretrain_steps)] if args.pretrain_steps else
              ["--trainer.max_steps", "null", "--trainer.max_time", args.pretrain_time])
    heads = (["--data.with_labels", "true", "--model.num_tasks", str(len(DESCRIPTORS)), "--model.task_type",
              "regression"] if descriptors else ["--data.with_labels", "false", "--model.num_tasks", "0"])
    heads += ["--model.molecule_features", "none"]  # the encoder learns from tokens alone
    if not os.path.exists(done):
        t0 = time.perf_counter()
        _quiet_run(_launcher(args.nproc) + [
            "--recipe", RECIPE, "--data.manifest", manifest, *heads,
            "--data.mlm_probability", "0.15", "--data.max_tokens_per_batch", "4096",
            "--optim.lr", "1e-3", "--optim.warmup_fraction", "0.02", *budget, "--checkpoint.interval_fraction", "0.25",
            "--checkpoint.keep_last", "1", "--logging.interval_steps", "100", "--run.output_dir", run,
            "--run.overwrite", "true"], os.path.join(base, "pretrain.log"))
        from molds.checkpoint import read_lineage, resolve

        lineage = read_lineage(resolve(run, quiet=True))
        with open(done, "w") as fh:
            json.dump({"steps": lineage["step"], "train_s": round(time.perf_counter() - t0, 1)}, fh)
    info = json.load(open(done))
    return run, {**corpus, "rows": {s: v["rows"] for s, v in data["stats"]["splits"].items()},
                 "prep_s": round(prep_s, 1), "objective": "masked tokens" + (" and descriptors" if descriptors else ""),
                 **({"step_budget": args.pretrain_steps} if args.pretrain_steps
                    else {"time_budget": args.pretrain_time}),
                 **info}


# --- splits, and the one file every model reads ----------------------------------------------

def split_rows(manifest_dir: str) -> dict[str, list[tuple[str, list[float]]]]:
    """(canonical SMILES, labels) of every molecule of each split, as molds' shards hold them."""
    import pyarrow.parquet as pq

    from molds.data.manifest import Manifest

    m = Manifest.load(manifest_dir)
    out = {}
    for split in SPLIT_NAMES:
        rows = []
        for shard in m.shards(split):
            t = pq.read_table(shard.path, columns=["canonical_smiles", "labels"])
            rows.extend(zip(t.column("canonical_smiles").to_pylist(), t.column("labels").to_pylist()))
        out[split] = rows
    return out


def write_peers(manifest_dir: str, labels: list[str], path: str) -> dict:
    """``peers.csv``: smiles, the labels (empty when missing), split; its counts per split."""
    rows = split_rows(manifest_dir)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["smiles", *labels, "split"])
        for split in SPLIT_NAMES:
            for smi, ys in rows[split]:
                w.writerow([smi, *("" if y is None or math.isnan(y) else repr(float(y)) for y in ys),
                            "val" if split == "valid" else split])
    os.replace(tmp, path)
    return {s: len(rows[s]) for s in SPLIT_NAMES}


def read_peers(path: str, labels: list[str]) -> dict[str, tuple[list[str], "np.ndarray"]]:
    """Each split of ``peers.csv``: (SMILES, labels [N, T] with NaN where missing)."""
    import numpy as np

    smiles = {s: [] for s in SPLIT_NAMES}
    ys = {s: [] for s in SPLIT_NAMES}
    with open(path, encoding="utf-8", newline="") as fh:
        for r in csv.DictReader(fh):
            split = "valid" if r["split"] == "val" else r["split"]
            smiles[split].append(r["smiles"])
            ys[split].append([float(r[c]) if r[c] != "" else math.nan for c in labels])
    return {s: (smiles[s], np.asarray(ys[s], float).reshape(len(ys[s]), len(labels))) for s in SPLIT_NAMES}


def write_smiles(smiles: list[str], path: str) -> None:
    with open(path, "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["smiles"])
        w.writerows([s] for s in smiles)


# --- the models ----------------------------------------------------------------------------

def morgan(smiles: list[str]):
    import numpy as np
    from rdkit import Chem
    from rdkit.Chem import rdFingerprintGenerator

    gen = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    out = np.zeros((len(smiles), 2048), dtype=np.uint8)
    for i, s in enumerate(smiles):
        mol = Chem.MolFromSmiles(s)
        if mol is None:
            raise SystemExit(f"RDKit cannot read {s!r}, which molds' ETL kept")
        out[i] = gen.GetFingerprintAsNumPy(mol)
    return out


def random_forest(data: dict, task_type: str, seed: int, workers: int) -> tuple:
    """(test predictions [N, T], train seconds, predict seconds): one forest per task."""
    import numpy as np
    from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor

    t0 = time.perf_counter()
    x_train, x_test = morgan(data["train"][0]), morgan(data["test"][0])
    y = data["train"][1]
    forests = []
    for t in range(y.shape[1]):
        seen = ~np.isnan(y[:, t])
        kind = RandomForestClassifier if task_type == "classification" else RandomForestRegressor
        forest = kind(n_estimators=500, n_jobs=workers, random_state=seed)
        forests.append(forest.fit(x_train[seen], y[seen, t]) if seen.any() else None)
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pred = np.full((len(x_test), y.shape[1]), np.nan)
    for t, forest in enumerate(forests):
        if forest is None:  # no training label: the benchmark scores this task for no model
            continue
        if task_type == "regression":
            pred[:, t] = forest.predict(x_test)
        else:  # a task with one class in training: that class's probability is 1
            p = forest.predict_proba(x_test)
            pred[:, t] = p[:, list(forest.classes_).index(1.0)] if 1.0 in forest.classes_ else 0.0
    return pred, train_s, time.perf_counter() - t0


def chemprop_venv(path: str) -> str:
    """The Python of a virtual environment holding ``requirements-chemprop.txt``, made when missing."""
    python = os.path.join(path, "bin", "python")
    if not os.path.exists(os.path.join(path, "chemprop-installed")):
        print(f"[moleculenet] making {path} for chemprop (benchmarks/requirements-chemprop.txt)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", path], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "-r", os.path.join(HERE, "requirements-chemprop.txt")],
                       check=True)
        open(os.path.join(path, "chemprop-installed"), "w").close()
    return python


def chemprop(args, peers: str, data: dict, labels: list[str], task_type: str, seed: int, out: str) -> tuple:
    """(test predictions, train seconds, predict seconds) of Chemprop's CLI at its defaults. A
    rerun into the same output directory reuses a finished run (``finished.json``: its
    seconds), as it reuses molds' fine-tuning."""
    cli = [args.chemprop_python, "-c", "import sys; from chemprop.cli.main import main; sys.exit(main())"]
    test_in, preds = os.path.join(out, "test.csv"), os.path.join(out, "test_predictions.csv")
    finished = os.path.join(out, "finished.json")
    if os.path.exists(finished):
        done = json.load(open(finished))
        return _chemprop_predictions(preds, data, labels), done["train_s"], done["predict_s"]
    if os.path.isdir(out):  # a run cut short: Chemprop starts again in a clean directory
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    _quiet_run(cli + ["train", "--data-path", peers, "--smiles-columns", "smiles", "--target-columns", *labels,
                      "--splits-column", "split", "--task-type", task_type, "--output-dir", out,
                      "--pytorch-seed", str(seed), "--data-seed", str(seed), "--accelerator", "cpu", "--devices", "1",
                      "--num-workers", "0"], os.path.join(out, "train.log"), threads=args.nproc)
    train_s = time.perf_counter() - t0
    models = [os.path.join(d, f) for d, _, files in os.walk(out) for f in files if f == "best.pt"]
    if len(models) != 1:
        raise SystemExit(f"chemprop left {len(models)} best.pt files under {out}: {models}")
    write_smiles(data["test"][0], test_in)
    t0 = time.perf_counter()
    _quiet_run(cli + ["predict", "--test-path", test_in, "--smiles-columns", "smiles", "--model-paths", models[0],
                      "--preds-path", preds, "--accelerator", "cpu", "--devices", "1", "--num-workers", "0"],
               os.path.join(out, "predict.log"), threads=args.nproc)
    predict_s = time.perf_counter() - t0
    pred = _chemprop_predictions(preds, data, labels)
    with open(finished, "w") as fh:
        json.dump({"train_s": train_s, "predict_s": predict_s}, fh)
    return pred, train_s, predict_s


def _chemprop_predictions(preds: str, data: dict, labels: list[str]):
    import numpy as np

    with open(preds, encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    if [r["smiles"] for r in rows] != data["test"][0]:
        raise SystemExit(f"{preds}: chemprop's predictions are not one per test molecule, in order")
    return np.asarray([[float(r[c]) for c in labels] for r in rows], float)


def _recipe_hash() -> str:
    """The fine-tuning recipe's file, hashed: a rerun reuses only runs fine-tuned by this one."""
    with open(RECIPE, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()[:16]


def steps_per_epoch(manifest: str, nproc: int, overrides: dict | None = None) -> int:
    """Optimizer steps in one pass over the training split, as the recipe batches it with
    ``--finetune``'s overrides (parsed as the training parses them)."""
    from molds.data.loader import MoleculeLoader
    from molds.eval.scoring import split_data_config
    from molds.recipe.parse import parse_recipe

    data = parse_recipe(["--recipe", RECIPE, "--data.manifest", manifest, *override_args(overrides or {})]).data
    cfg = dataclasses.replace(split_data_config(dataclasses.asdict(data), manifest, "train", mode="bucketed",
                                                with_labels=True), shuffle=data.shuffle)
    return max(1, len(list(iter(MoleculeLoader(cfg, rank=0, world_size=nproc)))))


def molds_model(args, pretrained: str, manifest: str, s: dict, data: dict, seed: int, out: str) -> tuple:
    """(test predictions, train seconds, predict seconds, what was chosen): the pretrained
    encoder forked with property heads; the model is the mean of the ``--average`` checkpoints
    best on the validation split (``molds-average --best K``), written to ``OUT/chosen``."""
    import numpy as np

    overrides = args.overrides
    steps = max(steps_per_epoch(manifest, args.nproc, overrides) * args.epochs, args.min_steps)
    finished = os.path.join(out, "finished.json")
    if not os.path.exists(finished):
        t0 = time.perf_counter()
        _quiet_run(_launcher(args.nproc) + [
            "--recipe", RECIPE, "--data.manifest", manifest, "--checkpoint.resume", pretrained,
            "--checkpoint.fork", "true", "--model.num_tasks", str(len(s["labels"])),
            "--model.task_type", s["task_type"], "--run.seed", str(seed), "--data.seed", str(seed),
            "--trainer.max_steps", str(steps), "--run.output_dir", out, "--run.overwrite", "true",
            *override_args(overrides)], out + ".log")
        with open(finished, "w") as fh:
            json.dump({"steps": steps, "finetune": overrides, "recipe": _recipe_hash(),
                       "train_s": time.perf_counter() - t0}, fh)
    done = json.load(open(finished))  # a rerun reuses the fine-tuned run and its time, if made so
    recipe = os.path.relpath(RECIPE, ROOT)
    if (done.get("steps"), done.get("finetune", {}), done.get("recipe")) != (steps, overrides, _recipe_hash()):
        raise SystemExit(f"{out}: fine-tuned with {done.get('steps')} steps, {done.get('finetune', {})} and "
                         f"{recipe} {done.get('recipe')}, not {steps}, {overrides} and {recipe} {_recipe_hash()}: "
                         f"give another --output-dir (or delete the run)")
    train_s = done.get("train_s")
    t0 = time.perf_counter()
    # the checkpoints best on the validation split (molds-average --best K: K = 1 is early stopping)
    from molds.checkpoint import open_checkpoint
    from molds.checkpoint.average import average_checkpoints
    from molds.eval.choose import score_checkpoints
    from molds.eval.properties import predict_properties

    choice = score_checkpoints(out, split="valid")
    chosen = kept_checkpoints(choice, args.average, out)
    best = average_checkpoints(chosen, os.path.join(out, "chosen"), chosen_by=choice.record(len(chosen)))
    # the chosen model's own validation score, on peers.csv's molecules as the test split is read
    found = predict_properties(open_checkpoint(best), data["valid"][0], augment=args.augment, seed=seed)
    if len(found.values) != len(data["valid"][0]):
        raise SystemExit(f"{best}: {len(data['valid'][0]) - len(found.values)} validation molecules have no "
                         f"prediction: {sorted(set(found.notes.values()))}")
    pred = np.asarray([found.values[i] for i in range(len(data["valid"][0]))])
    metric = "roc_auc" if s["task_type"] == "classification" else "rmse"
    best_score = score(data["valid"][1], pred, s["labels"], s["task_type"])[metric]
    select_s = time.perf_counter() - t0
    test_in = os.path.join(out, "test.csv")
    write_smiles(data["test"][0], test_in)
    t0 = time.perf_counter()
    pred, truncated = predict(best, test_in, os.path.join(out, "test_predictions.csv"), s["labels"], args.augment,
                              seed, args.nproc)
    predict_s = time.perf_counter() - t0
    return np.asarray(pred), train_s, predict_s, {"steps": steps, "epochs": args.epochs, "select_s": select_s,
                                                   "chosen": [os.path.basename(c) for c in chosen],
                                                   "test_truncated": truncated,
                                                   "valid": None if best_score is None else (
                                                       {f"valid_{metric}": best_score})}


def kept_checkpoints(choice, k: int, out: str) -> list[str]:
    """The checkpoints the benchmark's model averages: the ``k`` best on the validation split
    (fewer where fewer have a score), or, where none has one (no task with both classes in
    the split), the last checkpoint, as trained, said on stderr."""
    if choice.scored:
        return choice.best(min(k, len(choice.scored)))
    print(f"[moleculenet] {out}: no checkpoint has a validation score (a task needs both classes there); "
          f"the last one is kept", file=sys.stderr, flush=True)
    return [max(c for c, _ in choice.scores)]  # step-NNNNNNNN: the newest


def finetune_overrides(pairs: list[str]) -> dict:
    """``--finetune KEY=VALUE`` pairs as recipe overrides of molds' fine-tuning (``optim.lr=5e-4``)."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key or key.startswith("-"):
            raise SystemExit(f"--finetune {pair!r}: give KEY=VALUE, a recipe key such as optim.lr=5e-4")
        if key in ("checkpoint.resume", "checkpoint.fork", "model.num_tasks", "model.task_type", "run.seed",
                   "data.seed", "data.manifest", "trainer.max_steps", "run.output_dir"):
            raise SystemExit(f"--finetune {pair!r}: the benchmark sets {key} itself")
        out[key] = value
    return out


def override_args(overrides: dict) -> list[str]:
    """``--finetune``'s overrides as the training's command-line arguments."""
    return [a for k, v in overrides.items() for a in ("--" + k, v)]


def predict(checkpoint: str, smiles_csv: str, out: str, labels: list[str], augment: int, seed: int,
            threads: int = 1):
    """``molds-predict`` on a SMILES file: predictions [N, T], every molecule predicted, and how
    many of them were read cut to the recipe's ``data.max_length`` (as its training cut them)."""
    import numpy as np

    _quiet_run([sys.executable, "-m", "molds.cli.predict", checkpoint, "--input", smiles_csv, "--column", "smiles",
                "--augment", str(augment), "--seed", str(seed), "--out", out], out + ".log", threads)
    with open(out, encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    unscored = [r for r in rows if any(r[c] == "" for c in labels)]  # a note alone may say it was cut
    if unscored:
        raise SystemExit(f"{out}: {len(unscored)} molecules have no prediction, first {unscored[0]}")
    return (np.asarray([[float(r[c]) for c in labels] for r in rows], float),
            sum(r["note"].startswith("truncated") for r in rows))


# --- scores --------------------------------------------------------------------------------

def score(y, pred, labels: list[str], task_type: str) -> dict:
    from molds.metrics.property import classification_metrics, regression_metrics

    if task_type == "classification":
        macro = classification_metrics(y, pred, labels)["macro"]
        return {"roc_auc": macro["auroc"], "prc_auc": macro["auprc"], "tasks_scored": macro["auroc_tasks"]}
    macro = regression_metrics(y, pred, labels)["macro"]
    return {"rmse": macro["rmse"], "mae": macro["mae"]}


def summarize(runs: list[dict]) -> dict:
    import numpy as np

    out = {}
    for key in runs[0]:
        vals = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and r[key] is not None]
        if vals and key not in ("seed", "tasks_scored", "steps", "test_truncated"):
            out[key] = {"mean": round(float(np.mean(vals)), 4), "std": round(float(np.std(vals)), 4)}
    return out


def run_set(args, s: dict, pretrained: str) -> dict:
    import numpy as np

    base = os.path.join(args.output_dir, s["name"])
    entry = {"file": os.path.basename(s["path"]), "labels": s["labels"], "task_type": s["task_type"], "splits": {}}
    if "molds" in args.models:
        # the pretraining leaves out the files it is given; a set it was not given may be in its corpus
        entry["in_pretraining_corpus"] = seen = in_pretraining_corpus(pretrained, s, args.nproc)
        if seen:
            print(f"[moleculenet] {s['name']}: {seen} of its molecules are in the pretraining corpus of {pretrained} "
                  f"(unlabelled, but seen): pretrain with this file among --data-dir or as --input to leave them "
                  f"out", file=sys.stderr, flush=True)
    for method in args.splits:
        split_seeds = [0] if method == "scaffold" else args.seeds
        runs = {m: [] for m in args.models}
        sizes = {}
        for split_seed in split_seeds:
            where = os.path.join(base, f"{method}-{split_seed}")
            manifest = os.path.join(where, "data")
            m = preprocess(etl_args(s, method, split_seed, tokenizer_of(pretrained)), manifest, args.nproc)
            stats = m["stats"]
            entry.setdefault("rows", {"in": stats["rows_in"], "kept": stats["rows_out"],
                                      "duplicates": stats["duplicates"], "refused": stats.get("rejected", {}),
                                      "duplicates_with_other_labels": stats.get("duplicates_with_other_labels", 0),
                                      "tokens_added": len((m["tokenizer"].get("extends") or {}).get("added_tokens",
                                                                                                     []))})
            peers = os.path.join(where, "peers.csv")
            sizes[split_seed] = write_peers(manifest, s["labels"], peers)
            data = read_peers(peers, s["labels"])
            empty = [name for name in SPLIT_NAMES if not data[name][0]]
            if empty:  # no model can be chosen or scored on it
                raise SystemExit(f"{s['name']} {method} seed {split_seed}: the {' and '.join(empty)} split holds no "
                                 f"molecule ({peers}): too few molecules or scaffold groups for an 80/10/10 split")
            # a task with no label in the training split is learnt by no model: scored for none
            untrained = [t for t, name in enumerate(s["labels"]) if np.isnan(data["train"][1][:, t]).all()]
            if untrained:
                entry.setdefault("untrained_tasks", {})[f"{method}-{split_seed}"] = [s["labels"][t] for t in untrained]
                print(f"[moleculenet] {s['name']} {method}-{split_seed}: no training label for "
                      f"{[s['labels'][t] for t in untrained]}; scored for no model", file=sys.stderr, flush=True)
            y_test = data["test"][1].copy()
            y_test[:, untrained] = np.nan
            model_seeds = args.seeds if method == "scaffold" else [split_seed]
            for seed in model_seeds:
                for model in args.models:
                    if model == "rf":
                        pred, train_s, predict_s = random_forest(data, s["task_type"], seed, args.nproc)
                        extra = {}
                    elif model == "chemprop":
                        pred, train_s, predict_s = chemprop(args, peers, data, s["labels"], s["task_type"], seed,
                                                            os.path.join(where, f"chemprop-{seed}"))
                        extra = {}
                    else:
                        pred, train_s, predict_s, extra = molds_model(args, pretrained, manifest, s, data, seed,
                                                                      os.path.join(where, f"molds-{seed}"))
                    result = {"seed": seed, **score(y_test, pred, s["labels"], s["task_type"]),
                              "train_s": None if train_s is None else round(train_s, 1),
                              "predict_s": round(predict_s, 1)}
                    if extra:
                        # the chosen checkpoint's score on the validation split: what settings are compared by
                        # test molecules longer than the recipe's data.max_length: scored on their
                        # first tokens, as the fine-tuning read them
                        result.update(chosen=extra["chosen"], steps=extra["steps"],
                                      test_truncated=extra["test_truncated"],
                                      select_s=round(extra["select_s"], 1),
                                      **(extra["valid"] or {}))
                    runs[model].append(result)
                    print(f"[moleculenet] {s['name']} {method}-{split_seed} {model} seed {seed}: "
                          f"{json.dumps(result)}", file=sys.stderr, flush=True)
        entry["splits"][method] = {"sizes": sizes, **{m: {"runs": r, **summarize(r)} for m, r in runs.items()}}
    return entry


def tokenizer_of(run: str) -> str:
    """The tokenizer directory of the manifest a run trained on (its lineage's)."""
    from molds.checkpoint import read_lineage, resolve, trained_manifest

    checkpoint = resolve(run, quiet=True)
    return trained_manifest(checkpoint, read_lineage(checkpoint)).tokenizer_path


def headline(result: dict, method: str = "scaffold") -> dict:
    """The mean test ROC-AUC over the classification sets and the mean RMSE over the
    regression sets, per model, on ``method``'s split."""
    out = {}
    for metric in ("roc_auc", "rmse"):
        per_model = {}
        for s in result["sets"].values():
            split = s["splits"].get(method, {})
            for model, v in split.items():
                if model != "sizes" and metric in v:
                    per_model.setdefault(model, []).append(v[metric]["mean"])
        out[metric] = {m: round(sum(v) / len(v), 4) for m, v in per_model.items()
                       if len(v) == max(len(x) for x in per_model.values())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", help="a folder of MoleculeNet's files as Chemprop ships them (SETS)")
    ap.add_argument("--sets", nargs="+", default=["bbbp", "bace", "tox21", "esol", "lipo"], choices=sorted(SETS))
    ap.add_argument("--input", help="one CSV instead of --data-dir")
    ap.add_argument("--name", help="--input's name in the results (default: the file's)")
    ap.add_argument("--smiles-column", default="smiles")
    ap.add_argument("--label-columns", help="comma-separated, or a JSON list where a name holds a comma "
                                           "(default: every column but the SMILES)")
    ap.add_argument("--task-type", choices=["classification", "regression"],
                    help="default: classification when every label is 0 or 1")
    ap.add_argument("--splits", nargs="+", default=["scaffold", "scaffold_random"],
                    choices=["scaffold", "scaffold_random"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--models", nargs="+", default=["molds", "chemprop", "rf"], choices=["molds", "chemprop", "rf"])
    ap.add_argument("--corpus", default=SAMPLE, help="the pretraining molecules (a CSV; MOSES's train file)")
    ap.add_argument("--corpus-column", default="SMILES")
    ap.add_argument("--corpus-every", type=int, default=1, help="take every N-th molecule of --corpus")
    ap.add_argument("--pretrain-time", default="50m", help="the pretraining's time budget")
    ap.add_argument("--pretrain-steps", type=int, help="a step budget instead of --pretrain-time (equal-cost "
                                                       "comparisons of pretrainings)")
    ap.add_argument("--pretrain-labels", choices=["none", "descriptors"], default="none",
                    help="descriptors: the encoder also learns RDKit descriptors of each corpus molecule (DESCRIPTORS) "
                         "from its first token, beside the masked tokens")
    ap.add_argument("--pretrained", help="a run pretrained so already (skips step 1)")
    ap.add_argument("--pretrain-only", action="store_true", help="stop after step 1")
    ap.add_argument("--epochs", type=int, default=20, help="passes over a set's training split in fine-tuning")
    ap.add_argument("--min-steps", type=int, default=320,
                    help="fine-tuning optimizer steps at least (more passes on a small training split; chosen on "
                         "ESOL's validation split, docs/benchmarks/moleculenet.md)")
    ap.add_argument("--finetune", nargs="+", default=[], metavar="KEY=VALUE",
                    help="molds: recipe overrides of the fine-tuning (optim.lr=5e-4 data.max_tokens_per_batch=1024); "
                         "compare settings by the validation scores, the same for every set")
    ap.add_argument("--augment", type=int, default=1, help="molds: predict the mean over this many spellings")
    ap.add_argument("--average", type=int, default=3,
                    help="molds: the model is the mean of the K checkpoints best on the validation split (1: the best "
                         "one alone; chosen on the validation splits, docs/benchmarks/moleculenet.md)")
    ap.add_argument("--chemprop-python", help="a Python with chemprop 2.3.1 (its own virtual environment)")
    ap.add_argument("--chemprop-venv", help="else: a virtual environment for chemprop, made here (python -m venv, "
                                            "pip install -r benchmarks/requirements-chemprop.txt) when missing")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--output-dir", default=os.path.join(ROOT, "runs", "moleculenet"))
    args = ap.parse_args(argv)
    for name in ("epochs", "augment", "average", "nproc"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.min_steps < 0:
        ap.error(f"--min-steps must be 0 or more, got {args.min_steps}")
    if args.pretrain_steps is not None and args.pretrain_steps < 1:
        ap.error(f"--pretrain-steps must be at least 1, got {args.pretrain_steps}")
    args.overrides = finetune_overrides(args.finetune)
    if args.input:
        sets = [describe_set(args.name or os.path.basename(args.input).split(".")[0], args.input, args.smiles_column,
                             label_columns(args.label_columns), args.task_type)]
    elif args.data_dir:
        sets = [describe_set(n, os.path.join(args.data_dir, SETS[n][0]), SETS[n][1], None, None) for n in args.sets]
    else:
        ap.error("give --data-dir or --input")
    os.makedirs(args.output_dir, exist_ok=True)
    if "chemprop" in args.models and not args.chemprop_python and not args.pretrain_only:
        args.chemprop_python = chemprop_venv(args.chemprop_venv or os.path.join(args.output_dir, "chemprop-venv"))
    result = {"sets": {}, "models": args.models, "splits": args.splits, "seeds": args.seeds, "epochs": args.epochs,
              "min_steps": args.min_steps,
              "finetune": args.overrides, "augment": args.augment, "average": args.average, "nproc": args.nproc}
    # the code this run loaded (read at the start: a long run outlives later commits)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    t0 = time.perf_counter()
    everything = sets if args.input else [describe_set(n, os.path.join(args.data_dir, f), c, None, None)
                                          for n, (f, c) in SETS.items() if os.path.exists(os.path.join(args.data_dir, f))]
    pretrained, result["pretraining"] = pretrain(args, everything)
    if args.pretrain_only:
        print(json.dumps(result["pretraining"]))
        return 0
    for s in sets:
        t1 = time.perf_counter()
        result["sets"][s["name"]] = run_set(args, s, pretrained)
        result["sets"][s["name"]]["wall_s"] = round(time.perf_counter() - t1, 1)
    result["headline"] = {m: headline(result, m) for m in args.splits}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if "chemprop" in args.models:
        result["chemprop_version"] = subprocess.run(
            [args.chemprop_python, "-c", "import chemprop, rdkit; print(chemprop.__version__, rdkit.__version__)"],
            capture_output=True, text=True).stdout.strip()
    from molds.runtime.lifecycle import cpu_description

    result["cpu"] = cpu_description()
    result["commit"] = commit
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
