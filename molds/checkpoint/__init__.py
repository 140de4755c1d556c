"""Checkpoints: canonical state, written atomically, resolved in one place, opened safely.

``save_checkpoint`` is a collective: every rank writes its part into ``step-N.tmp``
(the engine its canonical state, each rank its generator state), the ranks agree that
every write succeeded, then rank 0 writes the data cursor, the lineage and the
``COMPLETE`` marker (the file list with sizes), renames the directory into place,
points ``latest`` at it and prunes old ones. A failure on any rank (a full disk, a
read-only directory, non-finite weights) removes the partial directory, leaves the
previous checkpoint and ``latest`` as they were, and raises one clear error on every
rank. Layout and references: ``molds.checkpoint.layout``; canonical files:
``molds.checkpoint.state``; what a resume may change: ``molds.checkpoint.resume``.

May import the packages below it in molds' stack: ``errors``, ``runtime``, ``chemistry``,
``recipe``, ``data``, ``models``, ``kernels``.
"""

from __future__ import annotations

import datetime
import errno
import os
import shutil
import sys
from dataclasses import dataclass

import torch

from ..chemistry.features import feature_names, feature_set
from ..chemistry.tasks import direction, same_direction
from ..chemistry.tokens import tokenizer_info
from ..data.manifest import Manifest
from ..errors import CheckpointError, MoldsError
from ..runtime.atomic import publish_directory, write_json
from ..runtime.distributed import all_have
from .average import AVERAGED_FROM, refuse_averaged
from .layout import (
    LATEST,
    LINEAGE,
    checkpoints_dir,
    complete_checkpoints,
    prune,
    read_lineage,
    resolve,
    resolve_model,
    step_name,
    write_complete_marker,
    write_latest,
)
from .state import load_canonical, read_json, read_model, rng_file, rng_state, set_rng_state

__all__ = ["CheckpointError", "Loaded", "LATEST", "checkpoints_dir", "complete_checkpoints", "open_checkpoint",
           "read_lineage", "resolve", "resolve_model", "restore", "same_features", "save_checkpoint",
           "trained_manifest"]

DATA_STATE = "data_state.json"


def _agree(ok: bool, dist) -> bool:
    return all_have(ok, dist)


def _run_phase(fn, dist, tmp: str, what: str) -> None:
    """Run ``fn`` on every rank; if it fails on any, remove ``tmp`` and raise everywhere."""
    error = None
    try:
        fn()
    except (OSError, MoldsError) as exc:
        error = exc
    if _agree(error is None, dist):
        return
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is None:
        raise CheckpointError(f"{what}: another rank failed to write its part; {tmp} was removed")
    if isinstance(error, MoldsError):
        raise error
    raise _explain_os_error(error, tmp, what) from error


def _explain_os_error(exc: OSError, tmp: str, what: str) -> CheckpointError:
    root = os.path.dirname(tmp)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        free = shutil.disk_usage(root).free if os.path.isdir(root) else 0
        err = CheckpointError(f"{what}: no space left on the device holding {root} ({free / 2**20:.1f} MiB free); "
                              f"the partial {tmp} was removed and the previous checkpoint is intact")
    elif exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        err = CheckpointError(f"{what}: cannot write in {root} ({exc.strerror}); the previous checkpoint is intact")
    else:
        err = CheckpointError(f"{what}: {exc}; the partial {tmp} was removed and the previous checkpoint is intact")
    err.shared = False
    return err


def save_checkpoint(output_dir: str, engine, dist, step: int, data_state: dict, lineage: dict, *,
                    keep_last: int, needed_bytes: int = 0) -> str:
    """Write checkpoint ``step`` under ``output_dir/checkpoints`` (every rank calls this)."""
    root = checkpoints_dir(output_dir)
    name = step_name(step)
    final = os.path.join(root, name)
    tmp = final + ".tmp"
    what = f"saving checkpoint {name}"

    def prepare():
        if not dist.is_main:
            return
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(root).free
        if needed_bytes and free < needed_bytes:
            err = CheckpointError(f"{what}: {root} has {free / 2**20:.1f} MiB free, the checkpoint needs about "
                                  f"{needed_bytes / 2**20:.1f} MiB; nothing was written, the previous checkpoint "
                                  f"is intact")
            err.shared = False
            raise err
        os.makedirs(tmp)

    def engine_part():
        engine.save(tmp)
        write_json(rng_file(tmp, dist.rank), rng_state())

    def publish():
        if not dist.is_main:
            return
        write_json(os.path.join(tmp, DATA_STATE), data_state)
        record = dict(lineage, step=step, created=datetime.datetime.now(datetime.timezone.utc).isoformat())
        write_json(os.path.join(tmp, LINEAGE), record, indent=2)
        write_complete_marker(tmp, step)
        publish_directory(tmp, final, durable=True)
        write_latest(root, name)
        prune(root, keep_last)

    _run_phase(prepare, dist, tmp, what)
    _run_phase(engine_part, dist, tmp, what)
    _run_phase(publish, dist, tmp, what)
    return final


def restore(checkpoint: str, engine, dist, *, optimizer: bool = True, seed: int = 0,
            keep_schedule: bool = True, fresh: tuple[tuple[str, ...], dict] | None = None) -> tuple[int, dict]:
    """Load ``checkpoint`` into ``engine`` and this rank's generators; returns (step,
    the data cursor of every old rank). On another world size the generators cannot be
    the old ones: each rank is reseeded from (seed, step, rank), and this is said.
    ``keep_schedule=False`` (a fork): the schedule starts again at step 0 and the
    generators are not restored. ``fresh`` (a fine-tuning fork): (name prefixes, tensors):
    the checkpoint's weights under those prefixes are left out and the given tensors, the
    new model's own initialization, loaded in their place."""
    lineage = read_lineage(checkpoint)
    step = int(lineage["step"])
    averaged = bool(lineage.get(AVERAGED_FROM))
    if averaged and (keep_schedule or optimizer):
        refuse_averaged(checkpoint, lineage)  # a fork of its weights alone (fork_optimizer false) is fine
    if fresh is None:
        engine.load(checkpoint, optimizer=optimizer)
    else:
        prefixes, tensors = fresh
        weights = {k: v for k, v in read_model(checkpoint).items() if not k.startswith(prefixes)}
        engine.load(checkpoint, optimizer=optimizer, weights={**weights, **tensors})
    if not keep_schedule:
        engine.set_lr_schedule(engine.recipe.optim, engine.plan.horizon, position=0)
        return step, {} if averaged else read_json(os.path.join(checkpoint, DATA_STATE))
    old_world = int(lineage.get("world_topology", {}).get("world_size", lineage.get("world_size", 0)) or 0)
    path = rng_file(checkpoint, dist.rank)
    if old_world == dist.world_size:
        set_rng_state(read_json(path), path)
    else:
        torch.manual_seed(seed * 1_000_003 + step * 7919 + dist.rank)
        if dist.is_main:
            print(f"[molds] {checkpoint} was written by {old_world} ranks, this run has {dist.world_size}: "
                  f"generators reseeded from (run.seed, step, rank)", file=sys.stderr)
    data_state = read_json(os.path.join(checkpoint, DATA_STATE))
    return step, data_state


@dataclass
class Loaded:
    """A checkpoint opened for evaluation, sampling or export."""

    model: object
    family: str
    recipe: dict
    manifest: object
    tokenizer: object  # transformers tokenizer, loaded from the manifest's files
    specials: object  # molds.chemistry.tokens.TokenizerInfo
    lineage: dict
    checkpoint: str  # the checkpoint directory (a run directory: its averaged model, else its latest)


def same_features(checkpoint: str, lineage: dict, kind: str) -> None:
    """A model whose heads read molecule features is read, continued or forked with its heads
    only where RDKit computes the very features it was trained on (names and order);
    otherwise refused in one line."""
    kept = (lineage.get("molecule_features") or {})
    names, now = kept.get("names"), feature_names(kind)
    if not isinstance(names, list) or kept.get("kind") != kind:
        raise CheckpointError(f"{checkpoint}: model.molecule_features {kind!r}, but its lineage does not name the "
                              f"features it was trained on: damaged or not written by molds")
    if names != now:
        import rdkit  # here: for the line that refuses, alone

        first = next((i for i, (a, b) in enumerate(zip(names, now)) if a != b), min(len(names), len(now)))
        raise CheckpointError(f"{checkpoint} was trained on {len(names)} {kind} features computed by RDKit "
                              f"{kept.get('rdkit')}; RDKit {rdkit.__version__} here computes {len(now)}, the first "
                              f"difference at feature {first}: install RDKit {kept.get('rdkit')} to use it")


def trained_manifest(checkpoint: str, lineage: dict) -> Manifest:
    """The manifest ``checkpoint`` was trained on, wherever this process runs. Its lineage
    keeps the path as training was given it (``data.manifest``, often relative to the
    directory training ran in) and, since molds recorded it, that path made absolute
    (``manifest_dir``). Tried in turn: the absolute path; the recorded path as it reads from
    here; the recorded path under each directory above the checkpoint (training ran in one
    of them when its run directory was relative too, as the recipes' are). A manifest found
    by that search is taken only when its content hash is the lineage's; one that moved
    since is named with ``--manifest``."""
    recipe = lineage.get("recipe")
    data = recipe.get("data") if isinstance(recipe, dict) else None
    given = data.get("manifest") if isinstance(data, dict) else None
    if not isinstance(given, str) or not given:
        raise CheckpointError(f"{checkpoint}: its lineage names no data.manifest: damaged or not written by "
                              f"molds; give the manifest it was trained on (--manifest)")
    tried: list[str] = []

    def found(path: str, check: bool) -> Manifest | None:
        tried.append(path)
        if "://" not in path and not os.path.exists(path if path.endswith(".json")
                                                     else os.path.join(path, "manifest.json")):
            return None
        manifest = Manifest.load(path)
        return manifest if not check or manifest.hash == lineage.get("manifest_hash") else None

    absolute = lineage.get("manifest_dir")
    for path in ([absolute] if isinstance(absolute, str) else []) + [given]:
        manifest = found(path, False)
        if manifest is not None:
            return manifest
    if "://" not in given and not os.path.isabs(given):
        here = os.path.dirname(os.path.abspath(checkpoint))
        while True:
            manifest = found(os.path.join(here, given), True)
            if manifest is not None:
                return manifest
            if os.path.dirname(here) == here:
                break
            here = os.path.dirname(here)
    shown = ", ".join(tried[:3]) + (f" and {len(tried) - 3} more" if len(tried) > 3 else "")
    raise CheckpointError(f"{checkpoint} was trained on the manifest {given}, which is not where its lineage says "
                          f"(tried {shown}): give its directory with --manifest")


def open_checkpoint(ref: str, manifest_dir: str | None = None, device: str = "cpu", *,
                    with_tokenizer: bool = True) -> Loaded:
    """Any checkpoint reference -> its model in fp32, rebuilt from its lineage's recipe
    with the single model factory and loaded from the canonical weights (no pickle). A run
    directory means the model the run made (``resolve_model``: RUN/averaged when current)."""
    from ..models import build_model  # here: molds-average --help loads no Triton
    checkpoint = resolve_model(ref)
    lineage = read_lineage(checkpoint)
    recipe = lineage["recipe"]
    manifest = Manifest.load(manifest_dir) if manifest_dir else trained_manifest(checkpoint, lineage)
    info = tokenizer_info(manifest)
    if info.vocab_hash != lineage.get("vocab_hash"):
        raise CheckpointError(f"{manifest.path} has another tokenizer than {checkpoint} was trained with "
                              f"(vocab_hash {info.vocab_hash[:12]} != {str(lineage.get('vocab_hash'))[:12]})")
    if "pairs" in lineage and not same_direction(lineage["pairs"], manifest.pairs):
        # (a checkpoint written before lineages kept their direction is taken as its manifest says)
        raise CheckpointError(f"{checkpoint} was trained on {direction(lineage['pairs'])}; {manifest.path} holds "
                              f"{direction(manifest.pairs)}: give a manifest of the checkpoint's own task")
    if isinstance(recipe.get("model"), dict) and feature_set(recipe["model"].get("molecule_features")):
        same_features(checkpoint, lineage, recipe["model"]["molecule_features"])
    model = build_model(recipe["model"], info, seed=0)
    load_canonical(model, read_model(checkpoint), checkpoint)
    if getattr(model, "features", False) and not bool((model.feature_std > 0).all()):
        raise CheckpointError(f"{checkpoint}: the heads' feature_std must be positive: damaged or not written by "
                              f"molds")
    if getattr(model, "regression", False) and not bool((model.label_std > 0).all()):
        # training sets a task's scale to 1 where its labels do not vary: never 0 or less
        raise CheckpointError(f"{checkpoint}: a regression head's label_std must be positive, the file holds "
                              f"{[round(v, 6) for v in model.label_std.tolist()[:8]]}: damaged or not written by molds")
    model.to(device).eval()
    tok = None
    if with_tokenizer:
        from transformers import AutoTokenizer  # here: a rank that only trains loads no transformers

        tok = AutoTokenizer.from_pretrained(info.path, local_files_only=True)
    return Loaded(model, recipe["model"]["family"], recipe, manifest, tok, info, lineage, checkpoint)

