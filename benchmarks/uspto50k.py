"""A reaction recipe end to end on USPTO-50k's published files: ETL (when needed), training,
top-k on an evaluation split with and without test-time augmentation, a learning curve.

    python benchmarks/uspto50k.py --input 'schneider50k/raw_*.csv' [--recipe recipes/cpu_uspto50k_retro.json]
                                  [--task retro] [--variants 20] [--canonical_first] [--nproc 2] [--split valid]
                                  [--beams 10] [--num 0] [--augment 20] [--augment_num 0] [--curve 500]
                                  [--score_only]
                                  [-- extra recipe overrides]

1. ETL: when the recipe's manifest does not exist yet, ``molds-preprocess`` makes it from
   ``--input`` (the published ``raw_train`` / ``raw_val`` / ``raw_test`` files, or any files
   in their layout) as docs/tutorials/uspto50k.md writes it: ``--task``, ``--split given``
   (each file's split from its name, evaluation splits kept whole), ``--variants``
   root-aligned spellings of each training pair (``--canonical_first``: the first of them writes
   the source canonically). A manifest that exists already is used when it was made so.
2. Training: ``torchrun --nproc_per_node NPROC molds/train.py --recipe RECIPE`` into a fresh
   run directory (the recipe's ``run.output_dir``, or ``--run.output_dir`` among the overrides).
3. ``molds-eval RUN --split SPLIT --beams BEAMS`` on every pair of the split (the run's model:
   its average when the recipe writes one), or on ``--num`` pairs evenly spread over it (the
   recipe comparisons of docs/benchmarks/uspto50k.md). ``procedure_s`` is ETL + training + this.
4. The learning curve: each checkpoint of the run scored on ``--curve`` pairs of the split
   (evenly spread over it; 0: skipped) with the same beams.
5. ``--augment A`` (R-SMILES's test-time augmentation: A searches a source; 0: skipped),
   timed apart, on ``--augment_num`` pairs evenly spread over the split (0: all of it; fewer
   are also scored without augmentation, for the like-for-like figure).

One JSON line: the split's size and what it shares with training, every top-k and invalid
share, the phases' wall times, the run's steps and tokens per second, the curve, the CPU it
ran on, and the published figures beside them (test split, reaction class unknown).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# top-1/3/5/10 on USPTO-50k's test split, reaction class unknown: Coley et al. 2017 (RetroSim),
# Irwin et al. 2022 (Chemformer, the vanilla Transformer row from its table), Zhong et al. 2022 (R-SMILES, 20x test-time
# augmentation; 51.2 / 83.0 top-1 / top-10 without), Chen & Jung 2021 (LocalRetro)
PUBLISHED_RETRO = {"RetroSim": [0.373, 0.547, 0.633, 0.741], "Transformer": [0.424, 0.586, 0.638, 0.677],
                   "Chemformer": [0.536, None, 0.623, None], "R-SMILES": [0.563, 0.792, 0.862, 0.910],
                   "LocalRetro": [0.534, 0.775, 0.859, 0.924]}
KS = (1, 3, 5, 10)


def preprocess(inputs: str, manifest_dir: str, task: str, variants: int, canonical_first: bool = False) -> None:
    """The ETL command of docs/tutorials/uspto50k.md."""
    subprocess.run(["molds-preprocess", "--input", inputs, "--smiles_column", "reactants>reagents>production",
                    "--id_column", "id", "--task", task, "--split", "given", "--output", manifest_dir]
                   + (["--randomized_variants", str(variants)] if variants else [])
                   + (["--canonical_first", "true"] if canonical_first else []), check=True)


def read_manifest(manifest_dir: str) -> dict:
    with open(os.path.join(manifest_dir, "manifest.json")) as fh:
        return json.load(fh)


def evaluate(target: str, split: str, num: int, beams: int, out: str, augment: int = 1,
             loss: bool = True) -> tuple[dict, float]:
    """``molds-eval`` on ``target`` (a run or checkpoint directory): its report and wall time.
    ``loss=False``: the split's loss on one batch only (a model whose whole-split loss is known)."""
    t0 = time.time()
    subprocess.run(["molds-eval", target, "--split", split, "--num", str(num), "--beams", str(beams),
                    "--augment", str(augment), "--out", out, *([] if loss else ["--max_batches", "1"])],
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "eval.json")) as fh:
        return json.load(fh), time.time() - t0


def accuracy(report: dict, loss: bool = True) -> dict:
    """The top-k, invalid shares (and the split's loss) of a molds-eval report on a pair model."""
    keys = [f"top{k}" for k in KS] + ["distinct_predictions", "invalid_top1", "invalid_beams", "top1_score",
                                     "spellings_per_source"]
    out = {k: report["pairs"][k] for k in keys if k in report["pairs"]}
    return {**out, "loss": report["loss"]} if loss else out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", default=None, help="the published files (a glob); needed when the manifest is missing")
    p.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "cpu_uspto50k_retro.json"))
    p.add_argument("--task", default="retro", choices=["retro", "forward"])
    p.add_argument("--variants", type=int, default=20, help="root-aligned spellings stored per training pair")
    p.add_argument("--canonical_first", action="store_true",
                   help="the first stored spelling of each training pair writes the source canonically")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--split", default="valid")
    p.add_argument("--beams", type=int, default=10)
    p.add_argument("--num", type=int, default=0, help="pairs of the split scored, evenly spread (0: all)")
    p.add_argument("--augment", type=int, default=20, help="spellings searched per source (0: skip this phase)")
    p.add_argument("--augment_num", type=int, default=0,
                   help="pairs of the split scored with augmentation, evenly spread (0: all); then also without")
    p.add_argument("--curve", type=int, default=500, help="pairs scored per checkpoint (0: no learning curve)")
    p.add_argument("--score_only", action="store_true", help="score a finished run (phases 3-5), training nothing")
    args = p.parse_args(argv)
    if args.num < 0:
        p.error(f"--num {args.num}: give the pairs to score, or 0 for the whole split")

    from molds.recipe import parse_recipe

    recipe = parse_recipe(["--recipe", args.recipe, *overrides])
    manifest, run_dir = recipe.data.manifest, recipe.run.output_dir
    result: dict = {"recipe": os.path.relpath(args.recipe, ROOT) if args.recipe.startswith(ROOT) else args.recipe,
                    "overrides": overrides, "task": args.task, "manifest": manifest, "run": run_dir,
                    "variants": args.variants, "canonical_first": args.canonical_first}
    etl_s = train_s = 0.0
    if not args.score_only:
        if not os.path.exists(os.path.join(manifest, "manifest.json")):
            if not args.input or not glob.glob(args.input):
                p.error(f"{manifest} holds no manifest: give --input, the published files")
            t0 = time.time()
            preprocess(args.input, manifest, args.task, args.variants, args.canonical_first)
            etl_s = time.time() - t0
        made = read_manifest(manifest)
        task = made.get("pairs", {}).get("task")
        if task != args.task:  # the recipe names a manifest of the other direction
            p.error(f"{manifest} holds {task or 'no'} pairs, not --task {args.task}: the recipe's data.manifest "
                    "is another direction's")
        randomized = made.get("randomized") or {}
        stored = randomized.get("variants", 0)
        first = bool(randomized.get("canonical_first"))  # absent: made before the option
        if (stored, first) != (args.variants, args.canonical_first):  # a manifest of another procedure
            p.error(f"{manifest} was made with {stored} spellings a pair{' (the canonical source first)' * first}, "
                    f"not --variants {args.variants}{' --canonical_first' * args.canonical_first}: remove it or "
                    "name another data.manifest")
        if os.path.exists(run_dir):
            p.error(f"{run_dir} exists: this measures a fresh run (remove it, or --score_only)")
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                        str(args.nproc), os.path.join(ROOT, "molds", "train.py"), "--recipe", args.recipe, *overrides],
                       check=True)
        train_s = time.time() - t0
    split = read_manifest(manifest)["stats"]["splits"][args.split]
    result.update(split=args.split, pairs=split["rows"], shared_with_train=split.get("shared_with_train"))
    scored = min(args.num or split["rows"], split["rows"])
    result["scored_pairs"] = scored
    suffix = (f"-{scored}" if scored < split["rows"] else "") + (f"-beams{args.beams}" if args.beams != 10 else "")
    report, eval_s = evaluate(run_dir, args.split, scored, args.beams, os.path.join(run_dir, f"eval-{args.split}{suffix}"))
    result.update(model=report.get("checkpoint"), accuracy=accuracy(report))
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        lines = [json.loads(x) for x in fh if x.strip()]
    steps = [x for x in lines if "train/tokens_per_sec" in x]
    result.update(steps=max((x["step"] for x in lines), default=0),
                  tokens_per_sec=round(sum(x["train/tokens_per_sec"] for x in steps) / max(1, len(steps))))
    if args.curve:
        curve = []
        checkpoints = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step-*")))
        for ckpt in checkpoints:
            r, _ = evaluate(ckpt, args.split, args.curve, args.beams, os.path.join(ckpt, f"curve-{args.split}"))
            a = accuracy(r)
            step = int(os.path.basename(ckpt).split("-")[1])
            curve.append({"step": step, **{k: a.get(k) for k in ("top1", "top10", "invalid_top1", "loss")}})
        result["curve"] = curve
    if args.augment > 1:  # on the same pairs without augmentation too, for a like-for-like pair of figures
        num = args.augment_num or split["rows"]
        if num == scored < split["rows"]:  # phase 3 scored these pairs
            result["accuracy_subset"] = accuracy(report, loss=False)
        elif num < split["rows"]:
            plain, _ = evaluate(run_dir, args.split, num, args.beams, os.path.join(run_dir, f"eval-{args.split}-{num}"),
                                loss=False)
            result["accuracy_subset"] = accuracy(plain, loss=False)
        augmented, augment_s = evaluate(run_dir, args.split, num, args.beams,
                                        os.path.join(run_dir, f"eval-{args.split}-{num}-augment{args.augment}"),
                                        augment=args.augment, loss=False)
        result.update(augment=args.augment, augment_pairs=num, accuracy_augmented=accuracy(augmented, loss=False),
                      augment_s=round(augment_s, 1))
    result.update(etl_s=round(etl_s, 1), train_s=round(train_s, 1), eval_s=round(eval_s, 1),
                  procedure_s=round(etl_s + train_s + eval_s, 1))
    from molds.runtime.lifecycle import cpu_description  # after the run: the parse loads no torch

    result["cpu"] = cpu_description()
    if args.task == "retro":
        result["published_test"] = {k: dict(zip([f"top{x}" for x in KS], v)) for k, v in PUBLISHED_RETRO.items()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
