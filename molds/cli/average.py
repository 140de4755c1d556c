"""``molds-average``: the mean of a run's last checkpoints, as a checkpoint.

    molds-average runs/cpu-moses runs/cpu-moses/averaged --last 3
    molds-average runs/a/checkpoints/step-00020000 runs/a/checkpoints/step-00022000 --out runs/a/avg

Why and what it writes: ``molds.checkpoint.average``.
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
    p.add_argument("--out", type=str, default=None,
                   help="output checkpoint directory (replaced atomically); with --last it may be given second")
    return p


def run(argv: list[str]) -> int:
    args = parse(build_parser(), argv)
    from ..checkpoint.average import average_checkpoints, last_checkpoints  # after the parse: --help loads no torch

    refs, out = list(args.checkpoints), args.out
    if args.last:
        if out is None and len(refs) == 2:
            refs, out = refs[:1], refs[1]
        if len(refs) != 1:
            raise UsageError("--last N takes one run directory (and the output directory, or --out)")
        refs = last_checkpoints(refs[0], args.last)
    elif len(refs) < 2:
        raise UsageError("give two or more checkpoints to average, or a run directory with --last N")
    if not out:
        raise UsageError("--out: where to write the averaged checkpoint")
    path = average_checkpoints(refs, out)
    print(f"[molds] {path}: the mean of {len(refs)} checkpoints ({', '.join(refs)})", file=sys.stderr)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("molds-average", run, argv)


if __name__ == "__main__":
    sys.exit(main())
