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


def _metric(y, p, labels, task_type, idx):
    """The benchmark's own score of the rows ``idx``: ROC-AUC or RMSE."""
    import moleculenet as bench

    return bench.score(y[idx], p[idx], labels, task_type)["roc_auc" if task_type == "classification" else "rmse"]


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
    from molds.checkpoint import checkpoints_dir, complete_checkpoints, read_lineage
    from molds.checkpoint.average import average_checkpoints
    from molds.eval.choose import Choice

    peers = os.path.join(os.path.dirname(os.path.normpath(run)), "peers.csv")
    if not os.path.isfile(peers):
        raise SystemExit(f"{run}: no peers.csv beside it (not a benchmarks/moleculenet.py fine-tuning)")
    with open(peers, encoding="utf-8", newline="") as fh:
        labels = next(csv.reader(fh))[1:-1]  # smiles, the labels, split
    smiles, y = bench.read_peers(peers, labels)["valid"]
    checkpoints = complete_checkpoints(checkpoints_dir(run))
    if len(checkpoints) < k:
        raise SystemExit(f"{run}: {len(checkpoints)} checkpoints, fewer than --k {k}")
    task_type = read_lineage(checkpoints[-1])["recipe"]["model"]["task_type"]
    metric = "roc_auc" if task_type == "classification" else "rmse"
    preds = [_predict(c, smiles) for c in checkpoints]
    rng = np.random.default_rng(seed)
    best, mean_k = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(halvings):
            order = rng.permutation(len(smiles))
            a, b = order[: len(order) // 2], order[len(order) // 2:]
            for choose_on, score_on in ((a, b), (b, a)):
                # ranked as molds-average --best ranks them (molds.eval.choose)
                choice = Choice(metric, "valid").ranked(
                    [(c, _metric(y, p, labels, task_type, choose_on)) for c, p in zip(checkpoints, preds)])
                best.append(_metric(y, preds[checkpoints.index(choice.best(1)[0])], labels, task_type, score_on))
                avg = average_checkpoints(choice.best(k), os.path.join(tmp, "avg"))
                mean_k.append(_metric(y, _predict(avg, smiles), labels, task_type, score_on))
    return {"run": run, "metric": metric, "valid": len(smiles),
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
