"""User-caused errors and how every console script reports them.

A ``MoldsError`` is a problem the user can fix (a recipe value, a path, a checkpoint, a
shard, a full disk). Every console script runs under ``run_cli``: such an error is
printed as one line, once (by rank 0 when every rank meets the same error, by the rank
concerned otherwise), and the process exits with status 2. The traceback is shown only
with ``--debug`` or ``MOLDS_DEBUG=1``. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import os
import sys
import time


class MoldsError(Exception):
    """A problem the user can fix; the message names the file, row or key."""

    #: every rank meets the same error (a recipe value, a manifest): only rank 0 reports it
    shared = True


class RecipeError(MoldsError, ValueError):
    """A recipe value or combination of values that cannot work (the message names the keys)."""


class ManifestError(MoldsError, ValueError):
    """The manifest or one of its shards does not match the contract (names which)."""


class CheckpointError(MoldsError, RuntimeError):
    """A checkpoint that is missing, incomplete, unsafe or does not fit the run."""


class InputError(MoldsError, ValueError):
    """A problem with an ETL input file as a whole: the message names the file."""


class NonFiniteError(MoldsError, FloatingPointError):
    """Training produced a NaN or infinite loss or gradient and the policy says stop."""


class CollectiveTimeout(MoldsError, RuntimeError):
    """A collective did not complete within ``parallel.collective_timeout_s``."""

    shared = False


class RankError(MoldsError):
    """An error met by one rank only (it reports it, with its rank)."""

    shared = False


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def debug_requested(argv: list[str] | None) -> bool:
    return os.environ.get("MOLDS_DEBUG", "") not in ("", "0") or bool(argv and "--debug" in argv)


def strip_debug(argv: list[str]) -> list[str]:
    return [a for a in argv if a != "--debug"]


SHARED_ERROR_GRACE_S = 5.0  # how long a rank other than 0 waits for rank 0 to report a shared error


def report(prog: str, exc: BaseException) -> None:
    """One line on stderr, from the rank that should say it."""
    shared = getattr(exc, "shared", True)
    r = rank()
    if shared and r != 0:
        # rank 0 says it. Leaving at once would let the launcher (torchrun, deepspeed) stop
        # rank 0 before it has said it, as it stops every rank once one has failed: the user
        # would see no error at all. So wait a little; rank 0's exit ends this rank anyway.
        time.sleep(SHARED_ERROR_GRACE_S)
        return
    where = f" [rank {r}]" if not shared and int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    text = " ".join(str(exc).split()) if isinstance(exc, OSError) else str(exc).strip()
    print(f"{prog}: error{where}: {text or type(exc).__name__}", file=sys.stderr, flush=True)


class KnownNoise(logging.Filter):
    """Drops the lines every model-building command printed on a CPU machine that say nothing
    about the user's run: torchao (imported by transformers; molds' FP8 emulation uses it)
    failing to load its CUDA extensions (``torchao/_C*.so``) into a CPU build of torch, which
    can never load them, and torch's deprecation notice to torchao's own code for registering
    torchao's enums as pytree constants. Only those records are dropped: both loggers keep
    every other record, and a CUDA build of torch keeps the first (there a failed load means
    something)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "torchao":
            torch = sys.modules.get("torch")
            version = getattr(torch, "version", None)
            cpu_build = version is not None and not getattr(version, "cuda", None) and not getattr(version, "hip", None)
            msg = record.getMessage()
            return not (cpu_build and msg.startswith("Failed to load ") and "torchao/_C" in msg.replace(os.sep, "/"))
        if record.name == "torch.utils._pytree" and record.args and isinstance(record.args, tuple):
            cls = record.args[0]
            return not (isinstance(cls, type) and cls.__module__.split(".")[0] == "torchao"
                        and "is an Enum subclass" in str(record.msg))
        return True


KNOWN_NOISE = KnownNoise()


def drop_known_noise() -> None:
    """``KnownNoise`` on the two loggers concerned, once per process (every console script)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if KNOWN_NOISE not in logger.filters:
            logger.addFilter(KNOWN_NOISE)


def run_cli(prog: str, main, argv: list[str] | None = None) -> int:
    """Run ``main(argv)``; user errors become one line and exit status 2."""
    drop_known_noise()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = strip_debug(argv)
    try:
        result = main(argv)
        return result if isinstance(result, int) else 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130
    except (MoldsError, OSError) as exc:
        if debug:
            raise
        report(prog, exc)
        return 2
