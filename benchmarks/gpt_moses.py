"""Train the MOSES decoder recipe for a while, then score 10,000 sampled molecules.

    python benchmarks/gpt_moses.py [--recipe recipes/smoke/gpt_moses.json] [--steps 3000]
                                   [--num 10000] [--fcd] [-- extra recipe overrides]

Trains ``--recipe`` in this process (one rank; ``--steps`` overrides trainer.max_steps,
in-training evaluation off), then samples ``--num`` molecules from the final checkpoint
and scores them against the manifest's training split (``molds.eval.evaluate``). The default
recipe is the CPU smoke twin on the bundled sample (``runs/quickstart/data``, made by
``.ci/quickstart``, or here if missing); ``recipes/gpt_moses.json`` is the GPU run on
the full MOSES set. One JSON line: validity, unique@10k, novelty (with the MOSES
paper's CharRNN figures beside them), internal diversity, filters, scaffold novelty,
FCD with ``--fcd``, training and sampling time.
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
MOSES_CHARRNN = {"validity": 0.975, "unique@10k": 0.999, "novelty": 0.842}  # Polykovskiy et al. 2020, table 2


def ensure_sample_manifest(path: str) -> None:
    if os.path.exists(os.path.join(path, "manifest.json")):
        return
    subprocess.run(["molds-preprocess", "--input", os.path.join(ROOT, "molds", "sample_data", "moses_sample.csv.gz"),
                    "--smiles-column", "SMILES", "--output", path, "--split", "scaffold",
                    "--split-fractions", "0.8,0.1,0.1", "--tokenizer", "regex", "--workers", "2"], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "smoke", "gpt_moses.json"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--num", type=int, default=10000)
    ap.add_argument("--split", default="test", help="split for the loss (and FCD)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--fcd", action="store_true")
    ap.add_argument("--output_dir", default=os.path.join(ROOT, "runs", "bench-gpt-moses"))
    args, overrides = ap.parse_known_args()
    overrides = [o for o in overrides if o != "--"]

    from molds.eval.evaluate import evaluate_checkpoint
    from molds.recipe import parse_recipe
    from molds.train import main as train

    argv = ["--recipe", args.recipe, "--trainer.max_steps", str(args.steps), "--eval.interval_steps", "0",
            "--eval.full_interval_steps", "0", "--checkpoint.resume", "null", "--logging.progress", "false",
            "--run.output_dir", args.output_dir, *overrides]
    recipe = parse_recipe(argv)
    if os.path.normpath(recipe.data.manifest).endswith(os.path.join("quickstart", "data")):
        ensure_sample_manifest(recipe.data.manifest)
    t0 = time.perf_counter()
    result = train(argv)
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = evaluate_checkpoint(result["checkpoint"], split=args.split, num=args.num, seeds=(0,),
                                 temperature=args.temperature, fcd=args.fcd, max_batches=50)
    eval_s = time.perf_counter() - t0
    m = report["per_seed"][0]
    import torch

    print(json.dumps({
        "device": "cuda" if torch.cuda.is_available() else "cpu", "recipe": os.path.relpath(args.recipe, ROOT),
        "manifest": recipe.data.manifest, "steps": result["step"], "train_s": round(train_s, 1),
        "eval_s": round(eval_s, 1), "samples": m["samples"], f"{args.split}_loss": round(report["loss"], 4),
        "validity": m["validity"], "unique@10k": m["unique@10k"], "novelty": m.get("novelty"),
        "int_div": m["int_div"], "filters": m["filters"], "scaffold_novelty": m.get("scaffold_novelty"),
        "fcd": m.get("fcd"), "unfinished_or_special": m["unfinished_or_special"], "moses_charrnn": MOSES_CHARRNN}))


if __name__ == "__main__":
    sys.exit(main())
