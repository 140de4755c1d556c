"""``molds-average``: the mean of a run's last checkpoints, as a checkpoint.

    molds-average runs/cpu-moses runs/cpu-moses/averaged --last 3
    molds-average runs/bbbp runs/bbbp/best3 --best 3
    molds-average runs/a/checkpoints/step-00020000 runs/a/checkpoints/step-00022000 --out runs/a/avg

Why and what it writes: ``molds.checkpoint.average``; how ``--best`` chooses (a property
model's checkpoints by their validation score): ``molds.eval.choose``.
"""

from __future__ import annotations

import sys

from ..errors import run_cli
from . import CHECKPOINT_HELP, UsageError, new_parser, parse


def build_parser():
    p = new_parser("molds-average", "Average the weights of several checkpoints of one run into a checkpoint "
                                    "that molds-sample, molds-eval and molds-export read (it cannot be resumed).")
    p.add_argument("checkpoints", type=str, nargs="+",
                   help="with --last N: one run directory and the output directory; without: the checkpoints to "
                        "average (" + CHECKPOINT_HELP + ")")
    p.add_argument("--last", type=int, default=0,
                   help="average the N newest complete checkpoints of the run given first (0: the ones listed)")
    p.add_argument("--best", type=int, default=0,
                   help="a property model's run: average its K checkpoints best on --split (macro ROC-AUC, or "
                        "RMSE for regression heads; 1: the best one alone)")
    p.add_argument("--split", type=str, default="valid",
                   help="with --best: the split of the run's manifest the checkpoints are scored on (not test: "
                        "the split a choice is reported on)")
    p.add_argument("--out", type=str, default=None,
                   help="output checkpoint directory (replaced atomically); with --last it may be given second")
    return p


def run(argv: list[str]) -> int:
    args = parse(build_parser(), argv)
    from ..checkpoint.average import average_checkpoints, last_checkpoints  # after the parse: --help loads no torch

    refs, out, chosen_by = list(args.checkpoints), args.out, None
    if args.last and args.best:
        raise UsageError("give --last N or --best K, not both")
    if args.last or args.best:
        if out is None and len(refs) == 2:
            refs, out = refs[:1], refs[1]
        if len(refs) != 1:
            raise UsageError(f"{'--last N' if args.last else '--best K'} takes one run directory (and the output "
                             f"directory, or --out)")
    elif len(refs) < 2:
        raise UsageError("give two or more checkpoints to average, or a run directory with --last N or --best K")
    if not out:
        raise UsageError("--out: where to write the averaged checkpoint")
    if args.last:
        refs = last_checkpoints(refs[0], args.last)
    elif args.best:
        from ..eval.choose import score_checkpoints  # here: molds-average --help loads no torch

        if args.best < 1:
            raise UsageError(f"--best must be >= 1 (got {args.best})")
        if args.split == "test":
            raise UsageError("--split test: a model chosen by its test score has seen the test split, which then "
                             "no longer measures it; choose on valid, and score the choice on test")
        choice = score_checkpoints(refs[0], split=args.split)
        for ckpt, score in choice.scores:
            print(f"[molds] {ckpt}: {args.split} {choice.metric} {'none' if score is None else f'{score:.4f}'}",
                  file=sys.stderr)
        refs, chosen_by = choice.best(args.best), choice.record(args.best)
    path = average_checkpoints(refs, out, chosen_by=chosen_by)
    what = f"the {len(refs)} best on {args.split}" if chosen_by else f"the mean of {len(refs)} checkpoints"
    print(f"[molds] {path}: {what} ({', '.join(refs)})", file=sys.stderr)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("molds-average", run, argv)


if __name__ == "__main__":
    sys.exit(main())
