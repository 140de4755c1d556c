"""Which model a property fine-tuning keeps, judged on the validation split alone: its best
checkpoint, or the mean of the weights of its K best (``molds-average --best K``).

    python benchmarks/checkpoint_choice.py RUN [RUN ...] [--k 3] [--halvings 2] [--seed 0]

Each RUN is a fine-tuning made by ``benchmarks/moleculenet.py`` (``OUT/SET/SPLIT/molds-SEED``:
its parent holds ``peers.csv``, the molecules and labels of every split). Both rules choose by
the validation score, so that score of the chosen model flatters each of them, the one with
more freedom the more. The comparison is therefore cross-fitted: the validation molecules
are halved at random (``--halvings`` times, seeded), each rule chooses on one half and its
model is scored on the other, then the halves swap; a rule's figure is the mean of those
scores. The test split is not read.

Scores: the mean ROC-AUC over tasks (classification; higher is better) or the mean RMSE over
tasks in the labels' units (regression; lower is better), by ``molds.metrics.property``.
Every checkpoint's validation predictions come from ``molds.eval.properties`` (what
``molds-predict`` runs), each average from ``molds.checkpoint.average``. One line per run on
stderr; one final JSON line: per run and per set (the mean over its runs) the two rules'
cross-fitted scores.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _metric(y, p, labels, kind, idx):
    from molds.metrics.property import classification_metrics, regression_metrics

    y, p = y[idx], p[idx]
    if kind == "classification":
        return classification_metrics(y, p, labels)["macro"]["auroc"]
    return regression_metrics(y, p, labels)["macro"]["rmse"]


def _predict(checkpoint: str, smiles: list[str]):
    import numpy as np

    from molds.checkpoint import open_checkpoint
    from molds.eval.properties import predict_properties

    found = predict_properties(open_checkpoint(checkpoint), smiles, augment=1, seed=0, cache_features=True)
    if len(found.values) != len(smiles):
        raise SystemExit(f"{checkpoint}: {len(smiles) - len(found.values)} validation molecules have no prediction")
    return np.asarray([found.values[i] for i in range(len(smiles))], float)


def cross_fitted(run: str, k: int, halvings: int, seed: int) -> dict:
    import numpy as np

    import moleculenet as bench
    from molds.checkpoint import checkpoints_dir, complete_checkpoints
    from molds.checkpoint.average import average_checkpoints

    peers = os.path.join(os.path.dirname(os.path.normpath(run)), "peers.csv")
    if not os.path.isfile(peers):
        raise SystemExit(f"{run}: no peers.csv beside it (not a benchmarks/moleculenet.py fine-tuning)")
    with open(peers, encoding="utf-8", newline="") as fh:
        labels = next(csv.reader(fh))[1:-1]  # smiles, the labels, split
    data = bench.read_peers(peers, labels)
    train = data["train"][1]
    kind = "classification" if set(np.unique(train[~np.isnan(train)])) <= {0.0, 1.0} else "regression"
    higher = kind == "classification"
    smiles, y = data["valid"]
    checkpoints = complete_checkpoints(checkpoints_dir(run))
    if len(checkpoints) < k:
        raise SystemExit(f"{run}: {len(checkpoints)} checkpoints, fewer than --k {k}")
    preds = [_predict(c, smiles) for c in checkpoints]
    rng = np.random.default_rng(seed)
    best, mean_k = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(halvings):
            order = rng.permutation(len(smiles))
            a, b = order[: len(order) // 2], order[len(order) // 2:]
            for choose_on, score_on in ((a, b), (b, a)):
                scores = np.array([_metric(y, p, labels, kind, choose_on) for p in preds])
                # best first; of equal scores the later checkpoint, as molds.eval.choose ranks them
                ranked = sorted(range(len(scores)), key=lambda i: (-scores[i] if higher else scores[i], -i))
                best.append(_metric(y, preds[ranked[0]], labels, kind, score_on))
                avg = average_checkpoints([checkpoints[i] for i in sorted(ranked[:k])], os.path.join(tmp, "avg"))
                mean_k.append(_metric(y, _predict(avg, smiles), labels, kind, score_on))
    return {"run": run, "metric": "roc_auc" if higher else "rmse", "valid": len(smiles),
            "checkpoints": len(checkpoints), "best": float(np.mean(best)), f"mean_of_{k}": float(np.mean(mean_k))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="fine-tunings of benchmarks/moleculenet.py (OUT/SET/SPLIT/molds-SEED)")
    ap.add_argument("--k", type=int, default=3, help="the rule's checkpoints averaged (molds-average --best K)")
    ap.add_argument("--halvings", type=int, default=2, help="random halvings of the validation split")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.k < 2 or args.halvings < 1:
        ap.error("--k must be 2 or more and --halvings 1 or more")
    rows, sets = [], {}
    for run in args.runs:
        row = cross_fitted(run, args.k, args.halvings, args.seed)
        rows.append(row)
        name = os.path.basename(os.path.dirname(os.path.dirname(os.path.normpath(run))))
        sets.setdefault(name, []).append(row)
        print(f"[checkpoint_choice] {run}: {row['metric']} best {row['best']:.4f}, mean of {args.k} "
              f"{row[f'mean_of_{args.k}']:.4f}", file=sys.stderr, flush=True)
    summary = {name: {"metric": rs[0]["metric"], "runs": len(rs),
                      "best": round(sum(r["best"] for r in rs) / len(rs), 4),
                      f"mean_of_{args.k}": round(sum(r[f"mean_of_{args.k}"] for r in rs) / len(rs), 4)}
               for name, rs in sets.items()}
    try:
        commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or None
    except OSError:
        commit = None
    from molds.runtime.lifecycle import cpu_description

    print(json.dumps({"benchmark": "checkpoint_choice", "commit": commit, "cpu": cpu_description(), "k": args.k,
                      "halvings": args.halvings, "seed": args.seed, "sets": summary, "runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
