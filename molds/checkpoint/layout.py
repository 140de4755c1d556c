"""Where checkpoints live and how a reference to one is resolved (the one place).

::

    RUN/                       run.output_dir
      recipe.json  metrics.jsonl  tensorboard/
      checkpoints/
        step-00000100/         model.safetensors  optimizer.safetensors  train_state.json
                               rng-rank00000.json ...  data_state.json  lineage.json
                               COMPLETE   (written last: the files and their sizes)
        latest                 the name of the newest complete checkpoint

A checkpoint is *complete* when its ``COMPLETE`` marker exists and every file it lists
has the size it lists. References accepted everywhere (``--checkpoint.resume``,
``molds-export``, ``molds-eval``, ``molds-sample``): a checkpoint directory, a run
directory or its ``checkpoints/`` directory (their latest complete checkpoint), or a
``latest`` pointer file. A missing or stale ``latest`` falls back to the newest
complete checkpoint, and says so.

What a run *made* (``resolve_model``, for ``molds-sample``, ``molds-eval`` and
``molds-export``): a run directory's ``averaged/`` (``checkpoint.average_last``'s mean of
its last checkpoints, ``RUN/averaged``) when it is complete and its newest source is the
run's newest checkpoint; otherwise its latest checkpoint, with the reason said. Resume and
averaging read training checkpoints only (``resolve``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

from ..errors import CheckpointError
from ..runtime.atomic import fsync_tree, write_json, write_text

CHECKPOINTS = "checkpoints"
AVERAGED = "averaged"  # RUN/averaged: the run's final model when checkpoint.average_last is set
LATEST = "latest"
COMPLETE = "COMPLETE"
LINEAGE = "lineage.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS)


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def incomplete_reason(path: str) -> str | None:
    """None if ``path`` is a complete checkpoint, else what is wrong with it."""
    marker = os.path.join(path, COMPLETE)
    if not os.path.isfile(marker):
        return "no COMPLETE marker (it was being written when its run stopped, or is not a molds checkpoint)"
    try:
        with open(marker, encoding="utf-8") as fh:
            listed = json.load(fh)["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its COMPLETE marker is unreadable ({exc})"
    for name, size in listed.items():
        full = os.path.join(path, name)
        if os.path.basename(name) != name or not os.path.isfile(full):
            return f"{name} is missing"
        if os.path.getsize(full) != size:
            return f"{name} has {os.path.getsize(full)} bytes, {size} were written"
    return None


def write_complete_marker(directory: str, step: int) -> None:
    """Seal ``directory`` as a checkpoint: fsync its files, then list them with their sizes in COMPLETE.

    The reader is :func:`incomplete_reason`; a training save and ``molds-average`` both write it here."""
    files = {n: os.path.getsize(os.path.join(directory, n)) for n in sorted(os.listdir(directory))
             if os.path.isfile(os.path.join(directory, n))}
    fsync_tree(directory)
    write_json(os.path.join(directory, COMPLETE), {"step": step, "files": files}, indent=1)


def complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directories under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    steps = sorted((int(m.group(1)), d) for d in os.listdir(root) if (m := _STEP_DIR.match(d)))
    return [os.path.join(root, d) for _, d in steps if incomplete_reason(os.path.join(root, d)) is None]


def write_latest(root: str, name: str) -> None:
    write_text(os.path.join(root, LATEST), name)


def _latest_in(root: str, *, quiet: bool = False) -> str | None:
    """The checkpoint ``root/latest`` names, or the newest complete one when it is
    missing, unreadable or names an incomplete one."""
    pointer = os.path.join(root, LATEST)
    named = None
    if os.path.isfile(pointer):
        with open(pointer, encoding="utf-8") as fh:
            name = fh.read().strip()
        if _STEP_DIR.match(name):
            named = os.path.join(root, name)
            if incomplete_reason(named) is None:
                return named
    done = complete_checkpoints(root)
    if not done:
        return None
    if not quiet:
        why = (f"{pointer} names {named}, which is incomplete" if named else f"{pointer} is missing or unreadable")
        print(f"[molds] {why}; using the newest complete checkpoint {done[-1]}", file=sys.stderr)
    return done[-1]


def resolve(ref: str, *, quiet: bool = False) -> str:
    """A checkpoint reference (see the module docstring) -> a complete checkpoint directory."""
    if not ref:
        raise CheckpointError("no checkpoint given")
    path = os.path.normpath(ref)
    if os.path.basename(path) == LATEST and (os.path.isfile(path) or not os.path.exists(path)):
        root = os.path.dirname(path) or "."
        if not os.path.isdir(root) or (not os.path.isfile(path) and os.path.isdir(os.path.join(root, CHECKPOINTS))):
            root = os.path.join(root, CHECKPOINTS)
        found = _latest_in(root, quiet=quiet)
        if found is None:
            raise CheckpointError(f"{ref}: no complete checkpoint under {root}")
        return found
    if not os.path.isdir(path):
        raise CheckpointError(f"{ref}: no such checkpoint or run directory")
    if os.path.exists(os.path.join(path, COMPLETE)) or os.path.exists(os.path.join(path, LINEAGE)) \
            or _STEP_DIR.match(os.path.basename(path).removesuffix(".tmp")):
        why = incomplete_reason(path)
        if why:
            done = complete_checkpoints(os.path.dirname(path))
            hint = f"; the newest complete one beside it is {done[-1]}" if done else ""
            raise CheckpointError(f"{ref} is not a complete checkpoint: {why}{hint}")
        return path
    for root in (os.path.join(path, CHECKPOINTS), path):
        if os.path.isdir(root) and (os.path.exists(os.path.join(root, LATEST)) or complete_checkpoints(root)):
            found = _latest_in(root, quiet=quiet)
            if found:
                return found
    raise CheckpointError(f"{ref} holds no complete checkpoint (looked for {os.path.join(path, CHECKPOINTS)}/"
                          f"step-*/ with a COMPLETE marker, and a checkpoint directory itself)")


def resolve_model(ref: str, *, quiet: bool = False) -> str:
    """The model a reference means for sampling, scoring and export: a checkpoint as
    ``resolve`` finds it, except that a run directory gives its ``averaged/`` model when
    that is complete and made from the run's newest checkpoint (an older average, left
    from before a resume, is passed over and named)."""
    path = os.path.normpath(ref) if ref else ref
    latest = resolve(ref, quiet=quiet)
    if not path or not os.path.isdir(os.path.join(path, CHECKPOINTS)):
        return latest  # not a run directory: what was named
    averaged = os.path.join(path, AVERAGED)
    if not os.path.isdir(averaged):
        return latest
    why = incomplete_reason(averaged)
    if why is None:
        try:
            sources = read_lineage(averaged).get("averaged_from") or []
            newest = int(sources[-1]["step"]) if sources else None
        except (CheckpointError, KeyError, TypeError, ValueError) as exc:
            newest, why = None, f"its lineage is unreadable ({exc})"
        step = int(read_lineage(latest)["step"])
        if why is None and newest == step:
            if not quiet:
                print(f"[molds] {ref}: its averaged model {averaged} (the mean of checkpoints up to step {step})",
                      file=sys.stderr)
            return averaged
        why = why or f"it averages checkpoints up to step {newest}, and the run's newest is step {step}"
    if not quiet:
        print(f"[molds] {ref}: {averaged} passed over ({why}); using {latest}", file=sys.stderr)
    return latest


def run_directory(ref: str) -> str:
    """The run a checkpoint reference belongs to (RUN, RUN/averaged, RUN/checkpoints,
    RUN/checkpoints/latest, RUN/checkpoints/step-N): where to write what is made from it,
    never inside a checkpoint."""
    path = os.path.abspath(ref)
    if os.path.basename(path) == LATEST or not os.path.isdir(path):
        path = os.path.dirname(path)
    parts = path.split(os.sep)
    if CHECKPOINTS in parts:
        return os.sep.join(parts[:len(parts) - 1 - parts[::-1].index(CHECKPOINTS)])
    return os.path.dirname(path) if os.path.basename(path) == AVERAGED else path


def read_lineage(checkpoint: str) -> dict:
    try:
        with open(os.path.join(checkpoint, LINEAGE), encoding="utf-8") as fh:
            lineage = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint}: cannot read {LINEAGE} ({exc})") from exc
    if not isinstance(lineage, dict) or not isinstance(lineage.get("recipe"), dict) or "step" not in lineage:
        raise CheckpointError(f"{checkpoint}: {LINEAGE} lacks the recipe or the step")
    return lineage


def prune(root: str, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints (0: all). Only complete ones count,
    so the newest complete checkpoint is never removed; leftovers of interrupted saves
    (``*.tmp``) are removed."""
    if not os.path.isdir(root):
        return
    for d in os.listdir(root):
        if d.endswith(".tmp") and _STEP_DIR.match(d[:-4]):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    if keep <= 0:
        return
    done = complete_checkpoints(root)
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
