"""Reaction prediction on a template-reaction set: the decoder beside the encoder-decoder, on
the same pairs, split and CPU budget.

    python benchmarks/seq2seq_templates.py [--input moses/train.csv.gz --every 8]
        [--tasks retro forward] [--budget 30m] [--nproc 2] [--num 1000] [--beams 10]
        [--variants 0] [--augment 1] [--output_dir runs/seq2seq-bench]

1. Data: ``molds/sample_data/make_pairs.py reactions`` on ``--input`` (every ``--every``-th
   molecule, at most ``--limit``): each molecule a product, disconnected by twelve named
   reaction classes. Default: the bundled 20,000-molecule sample. ``--every 8`` on the MOSES
   training file gives the benchmark's set (about 200,000 molecules).
2. ETL: ``molds-preprocess --task T`` for each task, split by product scaffold (80/10/10),
   regex tokenizer; ``--variants K`` also stores K root-aligned spellings of each training
   pair (R-SMILES), and the runs read them half the time (``data.randomized_smiles 0.5``).
3. Training, each family for the same time budget (``trainer.max_time``) under ``torchrun``:
   the decoder (``recipes/smoke/seq2seq_{task}.json``: prompt and completion) and the
   encoder-decoder (``recipes/smoke/bart_forward.json``, BART, from scratch, without dropout,
   4,096 tokens a micro-batch: ``OVERRIDES``), both ZeRO-2 at width 128. The last checkpoint
   is scored.
4. ``molds-eval``'s top-k exact match (canonical molecules, any order) on ``--num`` pairs of
   the test split with ``--beams`` beams; with ``--augment K`` also the same pairs with
   test-time augmentation over K spellings (``molds-eval --augment K``), as ``augmented``.

One JSON line: the set (reactions, classes), each task's pairs per split, each family's
steps, top-1/3/5/10 and invalid beams, and ``seq2seq_over_decoder_top1`` per task.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SAMPLE = os.path.join(ROOT, "molds", "sample_data", "moses_sample.csv.gz")
RECIPES = {"decoder": os.path.join(ROOT, "recipes", "smoke", "seq2seq_{task}.json"),
           "seq2seq": os.path.join(ROOT, "recipes", "smoke", "bart_forward.json")}
#: what the benchmark changes in a family's smoke recipe: the encoder-decoder trains from
#: scratch (no pretraining: both families get the same budget), without dropout and at 4,096
#: tokens a micro-batch; the smoke recipe's dropout and smaller batch are for its 4,622 pairs,
#: which this set's 255,907 are not at risk of being overfitted in a budget of minutes
OVERRIDES = {"decoder": [], "seq2seq": ["--model.dropout", "0.0", "--data.max_tokens_per_batch", "4096"]}


def make_reactions(args, path: str) -> dict:
    """The template reactions (made once) and their count per class."""
    if not os.path.exists(path):
        from molds.sample_data.make_pairs import main as make_pairs

        make_pairs(["reactions", "--input", args.input, "--out", path, "--every", str(args.every),
                    "--workers", str(args.nproc), *(["--limit", str(args.limit)] if args.limit else [])])
    with gzip.open(path, "rt") as fh:
        return dict(collections.Counter(r["class"] for r in csv.DictReader(fh)))


def preprocess(reactions: str, task: str, out: str, variants: int, workers: int) -> dict:
    if not os.path.exists(os.path.join(out, "manifest.json")):
        subprocess.run(["molds-preprocess", "--input", reactions, "--smiles-column", "reactants>reagents>production",
                        "--id-column", "id", "--task", task, "--split", "scaffold", "--split-fractions", "0.8,0.1,0.1",
                        "--tokenizer", "regex", "--workers", str(workers), "--progress", "false",
                        *(["--randomized-variants", str(variants)] if variants else []), "--output", out], check=True)
    from molds.data.manifest import Manifest

    return {s: v["rows"] for s, v in Manifest.load(out).data["stats"]["splits"].items()}


def train(args, family: str, task: str, manifest: str, out: str) -> dict:
    recipe = RECIPES[family].format(task=task)
    argv = ["--recipe", recipe, "--data.manifest", manifest, "--run.output_dir", out, "--run.overwrite", "true",
            "--trainer.max_steps", "null", "--trainer.max_time", args.budget, "--eval.interval_steps", "0",
            "--eval.full_interval_steps", "0", "--checkpoint.interval_steps", "0", "--checkpoint.keep_last", "0",
            "--logging.progress", "false", "--optim.warmup_steps", "null", "--optim.warmup_fraction", "0.05",
            "--data.randomized_smiles", "0.5" if args.variants else "0", *OVERRIDES[family]]
    launcher = ([sys.executable, os.path.join(ROOT, "molds", "train.py")] if args.nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
                 os.path.join(ROOT, "molds", "train.py")])
    t0 = time.perf_counter()
    subprocess.run(launcher + argv, check=True)
    train_s = time.perf_counter() - t0
    from molds.checkpoint import read_lineage
    from molds.eval.evaluate import evaluate_checkpoint

    t0 = time.perf_counter()
    report = evaluate_checkpoint(out, split="test", num=args.num, beams=args.beams, max_batches=50)
    lineage = read_lineage(report["checkpoint"])
    keep = ("top1", "top3", "top5", "top10", "invalid_beams", "invalid_top1", "inputs")
    entry = {"recipe": os.path.relpath(recipe, ROOT), "steps": lineage["step"], "train_s": round(train_s, 1),
             "eval_s": round(time.perf_counter() - t0, 1), "test_loss": round(report["loss"], 4),
             **{k: report["pairs"][k] for k in keep if k in report["pairs"]}}
    if args.augment > 1:  # the same pairs again, each source searched in --augment spellings and voted
        from molds.checkpoint import open_checkpoint
        from molds.eval.pairs import evaluate_pairs

        t0 = time.perf_counter()
        aug = evaluate_pairs(open_checkpoint(report["checkpoint"]), "test", num=args.num, beams=args.beams,
                             augment=args.augment)
        entry["augmented"] = {"eval_s": round(time.perf_counter() - t0, 1), "spellings_per_source": round(
            aug["spellings_per_source"], 2), **{k: aug[k] for k in keep if k in aug}}
    return entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", default=SAMPLE, help="molecules to make the reactions from (MOSES-style CSV)")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--limit", type=int, default=0, help="at most this many molecules (0: all)")
    ap.add_argument("--tasks", nargs="+", default=["retro", "forward"], choices=["retro", "forward"])
    ap.add_argument("--families", nargs="+", default=["decoder", "seq2seq"], choices=sorted(RECIPES))
    ap.add_argument("--budget", default="30m", help="trainer.max_time of each run")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--num", type=int, default=1000, help="test pairs scored")
    ap.add_argument("--beams", type=int, default=10)
    ap.add_argument("--variants", type=int, default=0, help="root-aligned spellings stored per training pair")
    ap.add_argument("--augment", type=int, default=1,
                    help="also score each model with test-time augmentation over this many spellings (1: no)")
    ap.add_argument("--output_dir", default=os.path.join(ROOT, "runs", "seq2seq-bench"))
    args = ap.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    reactions = os.path.join(args.output_dir, "reactions.csv.gz")
    t0 = time.perf_counter()
    classes = make_reactions(args, reactions)
    result = {"input": os.path.basename(args.input), "every": args.every, "limit": args.limit,
              "reactions": sum(classes.values()), "classes": classes, "make_s": round(time.perf_counter() - t0, 1),
              "budget": args.budget, "nproc": args.nproc, "beams": args.beams, "variants": args.variants, "tasks": {}}
    for task in args.tasks:
        manifest = os.path.join(args.output_dir, f"data-{task}")
        entry = result["tasks"][task] = {"pairs": preprocess(reactions, task, manifest, args.variants, args.nproc)}
        for family in args.families:
            entry[family] = train(args, family, task, manifest, os.path.join(args.output_dir, f"{family}-{task}"))
        if {"decoder", "seq2seq"} <= set(entry) and entry["decoder"]["top1"]:
            entry["seq2seq_over_decoder_top1"] = round(entry["seq2seq"]["top1"] / entry["decoder"]["top1"], 3)
    from molds.runtime.lifecycle import cpu_description

    result["cpu"] = cpu_description()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
