"""The console scripts, one module each, all in one style: jsonargparse parsers whose
``--help`` shows every option with its default and a one-line description, and
``molds.errors.run_cli`` around them (a user error is one line and exit status 2;
``--debug`` shows its traceback).

This package sits on top: it may import the trainer, evaluation and export; nothing
below imports it.
"""

from __future__ import annotations

import argparse

from jsonargparse import ArgumentParser

from ..errors import MoldsError

CHECKPOINT_HELP = ("a checkpoint reference: a checkpoint directory (RUN/checkpoints/step-N or RUN/averaged), a run "
                   "directory (the model it made: RUN/averaged when checkpoint.average_last wrote it from the run's "
                   "newest checkpoint, else its latest complete checkpoint), its checkpoints/ directory, or a "
                   "'latest' file")


class UsageError(MoldsError):
    """A command line that does not parse (unknown option, wrong type)."""


def new_parser(prog: str, description: str):
    return ArgumentParser(prog=prog, description=description, default_env=False, exit_on_error=False, allow_abbrev=False,
                          epilog="--debug shows the traceback of an error (also MOLDS_DEBUG=1).")


def parse(parser, argv: list[str]):
    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise UsageError(" ".join(str(exc).split())) from None
