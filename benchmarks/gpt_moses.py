"""A decoder recipe end to end on MOSES: ETL (when needed), training, sampling, scoring.

    python benchmarks/gpt_moses.py [--recipe recipes/cpu_moses.json] [--nproc 2]
                                   [--input moses/train.csv.gz] [--seed 0] [--steps N]
                                   [--num 10000] [--top_k 0] [--average_last 3] [--fcd] [--moses]
                                   [--reference test=moses/test.csv.gz] [--score_only]
                                   [-- extra recipe overrides]

1. ETL: when the recipe's manifest does not exist yet, ``molds-preprocess`` makes it from
   ``--input`` (the MOSES training file: random split 0.98/0.01/0.01, regex tokenizer, and for
   a recipe that reads randomized SMILES ``--randomized_variants`` stored spellings, 4 by
   default, as the command of docs/tutorials/cpu-moses.md), or from the bundled sample when the manifest is the
   quick start's ``runs/quickstart/data``.
2. Training: ``torchrun --nproc_per_node NPROC molds/train.py --recipe RECIPE`` (a fresh
   run directory; ``--seed`` sets run.seed and data.seed; ``--steps`` trainer.max_steps).
3. The model scored: the recipe's own average (``checkpoint.average_last``: RUN/averaged),
   or with ``--average_last N`` ``molds-average`` of the run's N newest checkpoints, or
   else the final checkpoint.
4. ``molds-sample``: ``--num`` molecules at ``--temperature`` and ``--top_k`` (the procedure ends here:
   ``procedure_s`` is ETL + training + averaging + sampling), then ``molds-eval --samples``:
   the generation metrics, FCD to the split with ``--fcd``, and with ``--moses`` FCD, SNN,
   Frag and Scaf against the whole split, and with ``--reference NAME=FILE`` against
   MOSES's own Test / TestSF files (timed apart: ``eval_s``). ``--score_only`` repeats
   steps 3-4 on a finished run.

One JSON line: every metric (validity counts empty and invalid samples; unique@10k over
the first 10,000 valid; novelty against the training split and against every split, i.e.
the whole MOSES training file; for a SELFIES or SAFE manifest the samples are decoded
SMILES, ``decodable`` the share that decode and ``finished`` the share that ended), the wall time of each phase, the run's horizon (steps,
time spent) and precision, and the published CharRNN (Test and TestSF) and MolGPT
figures beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Polykovskiy et al. 2020 (MOSES, and its repository's README table: Test / TestSF); Bagal et al. 2021 (MolGPT)
PUBLISHED = {"CharRNN": {"validity": 0.975, "unique@10k": 0.999, "novelty": 0.842, "fcd_test": 0.0732,
                         "fcd_testsf": 0.5204, "snn_test": 0.6015, "snn_testsf": 0.5649, "frag_test": 0.9998,
                         "frag_testsf": 0.9983, "scaf_test": 0.9242, "scaf_testsf": 0.1101},
             "MolGPT": {"validity": 0.994, "unique@10k": 1.0, "novelty": 0.797}}


def preprocess(source: str, manifest_dir: str, variants: int = 0) -> None:
    """The ETL command of docs/tutorials/cpu-moses.md (``variants``: stored randomized spellings per training molecule)."""
    subprocess.run(["molds-preprocess", "--input", source, "--smiles-column", "SMILES", "--output", manifest_dir,
                    "--split", "random", "--split-fractions", "0.98,0.01,0.01", "--tokenizer", "regex",
                    "--workers", str(os.cpu_count() or 1)]
                   + (["--randomized-variants", str(variants)] if variants else []), check=True)


def recipe_manifest_representation(manifest_dir: str) -> str:
    from molds.data.manifest import Manifest

    return (Manifest.load(manifest_dir).data.get("representation") or {}).get("name", "smiles")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "cpu_moses.json"))
    ap.add_argument("--nproc", type=int, default=2, help="training processes (torchrun)")
    ap.add_argument("--input", default=None, help="raw SMILES file for the ETL when the manifest is missing")
    ap.add_argument("--randomized_variants", type=int, default=4,
                    help="the ETL's stored spellings per training molecule, for a recipe that reads randomized "
                         "SMILES (0: the run writes them live)")
    ap.add_argument("--seed", type=int, default=None, help="run.seed and data.seed (default: the recipe's)")
    ap.add_argument("--steps", type=int, default=None, help="trainer.max_steps (default: the recipe's)")
    ap.add_argument("--num", type=int, default=10000)
    ap.add_argument("--split", default="test", help="split for the loss (and FCD)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top_k", type=int, default=0, help="molds-sample --top_k (0: the full distribution)")
    ap.add_argument("--fcd", action="store_true")
    ap.add_argument("--moses", action="store_true",
                    help="also MOSES's FCD, SNN, Frag and Scaf against the whole --split (the manifest's own "
                         "held-out molecules)")
    ap.add_argument("--reference", action="append", default=[], metavar="NAME=FILE",
                    help="also FCD, SNN, Frag and Scaf against a SMILES file, reported under NAME (MOSES's own "
                         "test.csv.gz and test_scaffolds.csv.gz: Test and TestSF); repeatable")
    ap.add_argument("--score_only", action="store_true",
                    help="no ETL and no training: sample and score the run already in --output_dir")
    ap.add_argument("--average_last", type=int, default=0,
                    help="score the mean of the run's N newest checkpoints (molds-average; 0: the final one)")
    ap.add_argument("--output_dir", default=None, help="run directory (default: runs/bench-<recipe name>)")
    args, overrides = ap.parse_known_args()
    overrides = [o for o in overrides if o != "--"]

    from molds.recipe.parse import parse_recipe

    name = os.path.splitext(os.path.basename(args.recipe))[0]
    out = args.output_dir or os.path.join(ROOT, "runs", f"bench-{name}" + ("" if args.seed is None else
                                                                          f"-seed{args.seed}"))
    argv = ["--recipe", args.recipe, "--run.output_dir", out, "--run.overwrite", "true",
            "--checkpoint.resume", "null", "--logging.progress", "false"]
    if args.seed is not None:
        argv += ["--run.seed", str(args.seed), "--data.seed", str(args.seed)]
    if args.steps is not None:
        argv += ["--trainer.max_steps", str(args.steps)]
    argv += overrides
    recipe = parse_recipe(argv)
    manifest_dir = recipe.data.manifest

    references = []
    for item in args.reference:
        label, sep, path = item.partition("=")
        if not sep or not label or not os.path.isfile(path):
            ap.error(f"--reference {item!r}: expected NAME=FILE with an existing file")
        references.append((label, path))

    etl_s = None
    if args.score_only:
        if not os.path.isfile(os.path.join(out, "checkpoints", "latest")):
            ap.error(f"--score_only: {out} holds no finished run")
    elif not os.path.exists(os.path.join(manifest_dir, "manifest.json")):
        if args.input:
            source = args.input
        elif os.path.normpath(manifest_dir).endswith(os.path.join("quickstart", "data")):
            source = os.path.join(ROOT, "molds", "sample_data", "moses_sample.csv.gz")
        else:
            ap.error(f"{manifest_dir} has no manifest.json: pass --input (the raw MOSES file) to make it")
        t0 = time.perf_counter()
        preprocess(source, manifest_dir, args.randomized_variants if recipe.data.randomized_smiles > 0 else 0)
        etl_s = time.perf_counter() - t0

    launcher = ([sys.executable, os.path.join(ROOT, "molds", "train.py")] if args.nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
                 os.path.join(ROOT, "molds", "train.py")])
    t0 = time.perf_counter()
    if not args.score_only:
        subprocess.run(launcher + argv, check=True)
    train_s = None if args.score_only else time.perf_counter() - t0

    from molds.checkpoint import read_lineage
    from molds.checkpoint.average import AVERAGED_FROM, average_checkpoints, last_checkpoints

    scored, averaged, average_s = out, None, 0.0
    if args.average_last:
        t0 = time.perf_counter()
        scored = average_checkpoints(last_checkpoints(out, args.average_last),
                                     os.path.join(out, f"averaged-last{args.average_last}"))
        average_s = time.perf_counter() - t0
    elif os.path.isdir(os.path.join(out, "averaged")):  # the recipe's own (checkpoint.average_last)
        scored = os.path.join(out, "averaged")
    if scored != out:
        averaged = [s["step"] for s in read_lineage(scored)[AVERAGED_FROM]]
    # the procedure's last part, as a user runs it: molds-sample, then molds-eval --samples
    from molds.cli.sample import main as sample_main
    from molds.eval.evaluate import evaluate_samples

    seed = 0 if args.seed is None else args.seed
    samples = os.path.join(out, "samples.smi")
    sampling = [scored, "--num", str(args.num), "--temperature", str(args.temperature), "--top_k", str(args.top_k),
                "--seed", str(seed)]
    t0 = time.perf_counter()
    if sample_main([*sampling, "--out", samples]):
        raise SystemExit("molds-sample failed")
    sample_s = time.perf_counter() - t0
    # what the tokens spell, sampled again with the same seed (the same samples): the share that
    # finished without a special token, and the share of all that decode to a SMILES (SELFIES, SAFE)
    raw_path = os.path.join(out, "samples.raw")
    if sample_main([*sampling, "--raw", "true", "--out", raw_path]):
        raise SystemExit("molds-sample --raw failed")
    raw = open(raw_path).read().split("\n")[:-1]
    decoded = open(samples).read().split("\n")[:-1]
    finished, decodable = sum(map(bool, raw)) / len(raw), sum(map(bool, decoded)) / len(decoded)
    t0 = time.perf_counter()
    report = evaluate_samples(samples, manifest_dir, split=args.split, fcd=args.fcd, moses=args.moses)
    from molds.eval.evaluate import evaluate_checkpoint

    loss = evaluate_checkpoint(scored, split=args.split, num=2, max_batches=50)["loss"]  # the held-out split's loss
    against = {}
    for label, path in references:
        r = evaluate_samples(samples, manifest_dir, split=args.split, reference_file=path)["metrics"]
        against[label] = {k: r.get(k) for k in ("fcd", "snn", "frag", "scaf", "moses_reference_molecules")}
        against[label]["file"] = os.path.basename(path)
    eval_s = time.perf_counter() - t0
    m = report["metrics"]
    keys = ("validity", "unique@10k", "novelty", "novelty_all_splits", "int_div", "filters", "scaffold_novelty",
            "fcd", "snn", "frag", "scaf", "moses_reference_molecules")
    lineage = read_lineage(os.path.join(out, "checkpoints", open(os.path.join(out, "checkpoints", "latest")).read()))
    from molds.runtime.lifecycle import cpu_description

    procedure_s = None if train_s is None else (etl_s or 0.0) + train_s + average_s + sample_s
    print(json.dumps({"cpu": cpu_description(),
        "recipe": os.path.relpath(args.recipe, ROOT), "manifest": manifest_dir, "nproc": args.nproc,
        "seed": recipe.run.seed, "steps": lineage["step"], "horizon": lineage.get("horizon"),
        "precision": lineage.get("precision"), "averaged_steps": averaged,
        "etl_s": None if etl_s is None else round(etl_s, 1), "train_s": None if train_s is None else round(train_s, 1),
        "average_s": round(average_s, 1), "sample_s": round(sample_s, 1),
        "procedure_s": None if procedure_s is None else round(procedure_s, 1), "eval_s": round(eval_s, 1), "samples": m["samples"],
        "representation": (recipe_manifest_representation(manifest_dir)), "finished": round(finished, 4),
        "decodable": round(decodable, 4),
        "temperature": args.temperature, "top_k": args.top_k, "reference_split": args.split, f"{args.split}_loss": round(loss, 4),
        **{k: m.get(k) for k in keys}, "against": against, "published": PUBLISHED}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
