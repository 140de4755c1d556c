"""``molds-eval``: what a checkpoint (or a recipe, or a file of samples) knows about chemistry.

    molds-eval runs/gpt-moses --split test --num 10000 --seeds 0,1,2
    molds-eval runs/mlm --manifest data/bbbp --split test
    molds-eval --recipe recipes/smoke/mlm_multitask_zero2.json --seeds 0,1,2 --split test --trainer.max_steps=200
    molds-eval --samples other_model.smi --manifest data/moses --fcd

With ``--recipe`` the recipe is trained once per seed (``--run.seed``) and every final
checkpoint evaluated; recipe overrides (``--section.key=value``) pass through to the
trainer. Writes ``eval.json`` and ``eval.md`` to ``--out`` (default
``CHECKPOINT/eval-SPLIT``).
"""

from __future__ import annotations

import os
import sys

from ..errors import run_cli
from ..recipe.parse import SECTIONS
from . import CHECKPOINT_HELP, UsageError, new_parser, parse


def build_parser():
    p = new_parser("molds-eval", "Evaluate a checkpoint, a recipe over training seeds, or a file of SMILES.")
    p.add_argument("checkpoint", type=str, nargs="?", default=None, help=CHECKPOINT_HELP + " (or use --recipe)")
    p.add_argument("--manifest", type=str, default=None,
                   help="evaluate on this manifest (default: the one the checkpoint trained on)")
    p.add_argument("--split", type=str, default="test", help="the split scored")
    p.add_argument("--num", type=int, default=10000, help="samples per seed (decoders); pairs of the split scored "
                                                          "(a pair model: molds-preprocess --task), evenly spread over "
                                                          "it when it holds more")
    p.add_argument("--beams", type=int, default=10,
                   help="a pair model: beam width, and the largest k of the top-k accuracy reported")
    p.add_argument("--verify_with", type=str, default=None,
                   help="a forward model's run or checkpoint: each retro prediction's reactants are given to it, and "
                        "the report adds round_trip_top1 and round_trip_beams (the shares it turns back into the "
                        "product; Schwaller et al. 2020's round-trip accuracy)")
    p.add_argument("--augment", type=int, default=1,
                   help="a pair model: search each source in this many spellings (itself and others rooted at "
                        "other atoms) and rank the predictions by their votes (R-SMILES's test-time augmentation; "
                        "1: the source alone)")
    p.add_argument("--seeds", type=str, default="0",
                   help="comma-separated: sampling seeds of a checkpoint, or training seeds with --recipe")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    p.add_argument("--top_k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--max_batches", type=int, default=0, help="loss on at most this many batches (0: all)")
    p.add_argument("--fcd", type=bool, default=False, help="also the Fréchet ChemNet Distance to the split")
    p.add_argument("--moses", type=bool, default=False,
                   help="also MOSES's FCD, SNN, Frag and Scaf against the whole split (or --reference)")
    p.add_argument("--reference", type=str, default=None,
                   help="a SMILES file (MOSES's test.csv or test_scaffolds.csv) for FCD / SNN / Frag / Scaf")
    p.add_argument("--conformers", type=bool, default=False,
                   help="conformer-unit models: also the share of samples that decode to a molecule with coordinates "
                        "and the share whose bond lengths are within 0.1 A of its MMFF-relaxed geometry (with "
                        "--samples: the file holds units, from molds-sample --raw)")
    p.add_argument("--recipe", type=str, default=None,
                   help="train this recipe once per seed, then evaluate each final checkpoint")
    p.add_argument("--samples", type=str, default=None,
                   help="score the SMILES in this file (one per line; an empty line counts as invalid) against "
                        "--manifest, instead of a checkpoint's samples")
    p.add_argument("--out", type=str, default=None, help="report directory (default: CHECKPOINT/eval-SPLIT)")
    return p


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Recipe overrides (``--section.key[=value]``) for --recipe mode, and the rest."""
    ours, overrides, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        section = a[2:].split(".", 1)[0] if a.startswith("--") and "." in a.split("=")[0] else None
        if section in SECTIONS:
            overrides.append(a)
            if "=" not in a and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                overrides.append(argv[i + 1])
                i += 1
        else:
            ours.append(a)
        i += 1
    return ours, overrides


def run(argv: list[str]) -> int:
    ours, overrides = _split_overrides(argv)
    args = parse(build_parser(), ours)
    from ..eval.evaluate import evaluate_checkpoint, evaluate_samples  # after the parse: --help loads no torch
    from ..eval.report import flat_metrics, markdown, write_report  # after the parse: --help loads no torch

    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--seeds {args.seeds!r}: give comma-separated integers") from None
    if not seeds or args.num < 1 or args.temperature <= 0 or args.top_k < 0 or args.max_batches < 0 \
            or args.beams < 1 or args.augment < 1:
        raise UsageError("--seeds needs one seed at least, --num, --beams and --augment >= 1, --temperature > 0, "
                         "--top_k and --max_batches >= 0")
    if overrides and not args.recipe:
        raise UsageError(f"recipe overrides ({' '.join(overrides)}) need --recipe")
    common = dict(manifest_dir=args.manifest, split=args.split, num=args.num, temperature=args.temperature,
                  top_k=args.top_k, max_batches=args.max_batches, fcd=args.fcd, moses=args.moses,
                  reference_file=args.reference, conformers=args.conformers, beams=args.beams,
                  augment=args.augment, verify_with=args.verify_with)
    if args.samples and args.verify_with:
        raise UsageError("--verify_with checks a retro model's predictions: give its CHECKPOINT, not --samples")
    if args.samples:
        if args.checkpoint or args.recipe or not args.manifest:
            raise UsageError("--samples takes --manifest and neither a CHECKPOINT nor --recipe")
        report = evaluate_samples(args.samples, args.manifest, split=args.split, fcd=args.fcd, moses=args.moses,
                                  reference_file=args.reference, conformers=args.conformers)
        out = args.out or os.path.splitext(args.samples)[0] + "-eval"
    elif args.recipe:
        if args.checkpoint:
            raise UsageError("--recipe trains its own checkpoints: give no CHECKPOINT")
        from ..metrics.property import mean_std  # here: molds-eval --help loads no RDKit or scikit-learn
        from ..train import main as train  # here: molds-eval --help loads no torch or NumPy

        out = args.out or os.path.join("runs", "eval-" + os.path.splitext(os.path.basename(args.recipe))[0])
        reports = []
        for seed in seeds:
            result = train(["--recipe", args.recipe, "--run.seed", str(seed), "--data.seed", str(seed),
                            "--run.output_dir", os.path.join(out, f"seed{seed}"), "--run.overwrite", "true",
                            *overrides])
            reports.append(evaluate_checkpoint(result["checkpoint"], seeds=(seed,), **common))
        report = {**{k: reports[0][k] for k in ("manifest", "split", "family")},
                  "checkpoint": [r["checkpoint"] for r in reports], "training_seeds": seeds,
                  "per_seed": reports, "metrics": mean_std([flat_metrics(r) for r in reports])}
    else:
        if not args.checkpoint:
            raise UsageError("give a CHECKPOINT, --recipe or --samples")
        report = evaluate_checkpoint(args.checkpoint, seeds=seeds, **common)
        out = args.out or os.path.join(report["checkpoint"], f"eval-{args.split}")
    write_report(out, report)
    print(markdown(report))
    print(f"[molds] report: {os.path.join(out, 'eval.json')}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("molds-eval", run, argv)


if __name__ == "__main__":
    sys.exit(main())
