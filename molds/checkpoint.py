"""Checkpoints with lineage, written atomically, resumed safely.

Layout under ``run.output_dir/checkpoints``::

    step-00000100/   lineage.json  data_state.json  rng-rank00000.pt  + the engine's files
    latest           the name of the newest complete checkpoint

Every rank writes into ``step-N.tmp``; after a barrier rank 0 renames it and only then
points ``latest`` at it (os.replace), so a crash mid-save leaves the previous checkpoint
usable and ``latest`` pointing to it. Lineage records the resolved recipe, the
manifest's hash, the tokenizer's vocab_hash, the canonicalization hash, the code
version, the world topology, step, epoch and the data cursor. Resume refuses another
manifest or tokenizer unless ``checkpoint.fork`` is true. Our own files load with
``torch.load(weights_only=True)``, JSON or safetensors; DeepSpeed's ZeRO files are
read by DeepSpeed's own loader.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import shutil

import numpy as np
import torch

from . import __version__
from .distributed import barrier

LATEST = "latest"


class CheckpointError(RuntimeError):
    pass


def checkpoint_root(recipe) -> str:
    return os.path.join(recipe.run.output_dir, "checkpoints")


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": repr(random.getstate()),
             "numpy": json.dumps(np.random.get_state()[1].tolist())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(recipe, engine, dist, step: int, data_state: dict, lineage: dict) -> str:
    root = checkpoint_root(recipe)
    name = f"step-{step:08d}"
    final = os.path.join(root, name)
    tmp = final + ".tmp"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    barrier(dist)
    engine.save(tmp)
    torch.save(_rng_state(), os.path.join(tmp, f"rng-rank{dist.rank:05d}.pt"))
    barrier(dist)
    if dist.is_main:
        with open(os.path.join(tmp, "data_state.json"), "w") as fh:
            json.dump(data_state, fh)
        record = dict(lineage, step=step, code_version=__version__, engine=engine.name,
                      world_size=dist.world_size, created=datetime.datetime.now(datetime.timezone.utc).isoformat())
        with open(os.path.join(tmp, "lineage.json"), "w") as fh:
            json.dump(record, fh, indent=2)
        old = None
        if os.path.exists(final):  # never delete the one `latest` may name before its successor is in place
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        pointer = os.path.join(root, LATEST + ".tmp")
        with open(pointer, "w") as fh:
            fh.write(name)
        os.replace(pointer, os.path.join(root, LATEST))
        _prune(root, recipe.checkpoint.keep_last)
    barrier(dist)
    return final


def _prune(root: str, keep: int) -> None:
    if keep <= 0:
        return
    done = sorted(d for d in os.listdir(root) if d.startswith("step-") and "." not in d)
    for old in done[:-keep]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def find_checkpoint(recipe) -> str | None:
    spec = recipe.checkpoint.resume
    if not spec:
        return None
    if spec != "auto":
        if not os.path.exists(os.path.join(spec, "lineage.json")):
            raise CheckpointError(f"checkpoint.resume={spec}: not a complete checkpoint (no lineage.json)")
        return spec
    root = checkpoint_root(recipe)
    pointer = os.path.join(root, LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as fh:
        return os.path.join(root, fh.read().strip())


def check_lineage(path: str, lineage: dict, fork: bool) -> dict:
    with open(os.path.join(path, "lineage.json")) as fh:
        saved = json.load(fh)
    for key in ("manifest_hash", "vocab_hash"):
        if saved.get(key) != lineage.get(key) and not fork:
            raise CheckpointError(
                f"{path} was trained on another {key.replace('_', ' ')} ({str(saved.get(key))[:12]} vs "
                f"{str(lineage.get(key))[:12]}); pass --checkpoint.fork true to continue on the new data")
    return saved


def load_checkpoint(path: str, engine, dist) -> tuple[int, dict]:
    """Restores the engine and this rank's RNG; returns (step, data state of all ranks)."""
    engine.load(path)
    rng = os.path.join(path, f"rng-rank{dist.rank:05d}.pt")
    if os.path.exists(rng):
        _set_rng_state(torch.load(rng, weights_only=True))
    with open(os.path.join(path, "data_state.json")) as fh:
        data_state = json.load(fh)
    with open(os.path.join(path, "lineage.json")) as fh:
        step = int(json.load(fh)["step"])
    return step, data_state
