"""A run directory at the start of a run: continue it, fork from a checkpoint, or start
over, and never overwrite an earlier run by accident (docs/guides/training.md: run directories)."""

from __future__ import annotations

import os
import shutil
import sys

from ..errors import MoldsError, RecipeError
from ..runtime.distributed import all_have
from .layout import checkpoints_dir, complete_checkpoints, resolve


def prepare_output_dir(recipe, dist, *, resuming: bool) -> None:
    """Refuse to overwrite an earlier run unless told; check the directory is writable
    now, not at the first save."""
    out = recipe.run.output_dir
    error = None
    if dist.is_main:
        try:
            done = complete_checkpoints(checkpoints_dir(out))
            if done and not resuming:
                if not recipe.run.overwrite:
                    raise RecipeError(
                        f"run.output_dir={out} already holds a run (latest checkpoint {os.path.basename(done[-1])}). "
                        f"Continue it with --checkpoint.resume auto, start over with --run.overwrite true (deletes "
                        f"its checkpoints, metrics and TensorBoard events), or choose another --run.output_dir")
            if not resuming:  # an earlier run allowed to go (overwrite), or one that died before any checkpoint
                for name in ("checkpoints", "tensorboard", "metrics.jsonl", "scored.csv", "topk.csv"):
                    path = os.path.join(out, name)
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    elif os.path.exists(path):
                        os.remove(path)
            os.makedirs(checkpoints_dir(out), exist_ok=True)
            probe = os.path.join(out, f".molds-write-test-{os.getpid()}")
            with open(probe, "w") as fh:
                fh.write("ok")
            os.remove(probe)
        except PermissionError as exc:
            error = RecipeError(f"run.output_dir={out} is not writable ({exc.strerror}): choose another directory")
        except OSError as exc:
            error = RecipeError(f"run.output_dir={out}: {exc.strerror or exc}")
        except MoldsError as exc:
            error = exc
    if not all_have(error is None, dist):
        raise error or RecipeError(f"run.output_dir={out}: refused (see rank 0)")


def plan_resume(recipe) -> str | None:
    """The checkpoint this run continues or forks from, or None for a fresh start."""

    spec = recipe.checkpoint.resume
    if not spec:
        return None
    if spec == "auto":
        if recipe.checkpoint.fork:
            raise RecipeError("checkpoint.fork with checkpoint.resume=auto would fork the run into itself: give "
                              "the checkpoint to fork from and a new run.output_dir")
        root = checkpoints_dir(recipe.run.output_dir)
        if not complete_checkpoints(root) and not os.path.exists(os.path.join(root, "latest")):
            print(f"[molds] checkpoint.resume=auto: no checkpoint under {root}; starting at step 0", file=sys.stderr)
            return None
        return resolve(recipe.run.output_dir, quiet=int(os.environ.get("RANK", "0")) != 0)
    path = resolve(spec, quiet=int(os.environ.get("RANK", "0")) != 0)
    if recipe.checkpoint.fork:
        if os.path.abspath(os.path.dirname(path)) == os.path.abspath(checkpoints_dir(recipe.run.output_dir)):
            raise RecipeError("a fork starts a new run: give it a new --run.output_dir (the checkpoint it forks "
                              f"from is under {recipe.run.output_dir})")
    return path
