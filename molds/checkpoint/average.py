"""Checkpoint averaging: the mean of a run's last few checkpoints as one model.

    molds-average runs/cpu-moses runs/cpu-moses/averaged --last 3

The weights of checkpoints taken a few thousand steps apart late in a run, averaged
(Polyak averaging of snapshots, as fairseq's ``average_checkpoints.py`` and
stochastic weight averaging do), sit nearer the middle of the region the optimizer
wanders in than any one of them. For a chemical language model that means fewer
molecules it has memorized from its last few hundred thousand training rows and
more valid ones (measured on MOSES: docs/benchmarks/cpu-moses.md). It is done after training, on
the canonical files, so it is the same for every engine and parallel layout.

Why not ``torch.optim.swa_utils``: it averages a live module during training (it
would have to exist once per engine, in ZeRO shards and pipeline stages) and keeps
its state outside our checkpoints. Averaging what is already on disk needs
neither, and any past run can be averaged.

The result is a checkpoint directory that ``molds-sample``, ``molds-eval`` and
``molds-export`` open like any other: ``model.safetensors`` (fp32, the mean computed
in fp64), the newest source's ``lineage.json`` with ``averaged_from`` added, and a
``COMPLETE`` marker. It holds no optimizer state, data cursor or generator state, so
a resume refuses it and names its sources. Sources must be one model: the same model
recipe, manifest, tokenizer and canonicalization, the same tensor names, shapes
and dtypes, finite weights; anything else is refused with the file and key.
"""

from __future__ import annotations

import datetime
import os

import torch

from ..errors import CheckpointError
from ..runtime.atomic import atomic_directory, write_json
from .layout import LINEAGE, checkpoints_dir, complete_checkpoints, read_lineage, resolve, write_complete_marker
from .state import MODEL_FILE, read_model, write_model

AVERAGED_FROM = "averaged_from"
CHOSEN_BY = "chosen_by"

# Lineage keys that must agree for the sources to be snapshots of one model.
_SAME = ("manifest_hash", "vocab_hash", "canonicalization_hash")


def last_checkpoints(run: str, n: int) -> list[str]:
    """The ``n`` newest complete checkpoints of a run directory (or its checkpoints/)."""
    if n < 1:
        raise CheckpointError(f"--last must be >= 1 (got {n})")
    path = os.path.normpath(run)
    root = checkpoints_dir(path) if os.path.isdir(checkpoints_dir(path)) else path
    done = complete_checkpoints(root)
    if len(done) < n:
        raise CheckpointError(f"{run}: {n} checkpoints asked for, {len(done)} complete ones under {root}"
                              f"{' (' + ', '.join(os.path.basename(d) for d in done) + ')' if done else ''}")
    return done[-n:]


def _check_same(sources: list[str], lineages: list[dict]) -> None:
    for src, lin in zip(sources, lineages):
        if lin.get(AVERAGED_FROM):
            raise CheckpointError(f"{src} is itself an average; average the training checkpoints it came from")
    first, lin0 = sources[0], lineages[0]
    for src, lin in zip(sources[1:], lineages[1:]):
        if lin["recipe"].get("model") != lin0["recipe"].get("model"):
            raise CheckpointError(f"{src} and {first} hold different models (recipe 'model' sections differ)")
        for key in _SAME:
            if lin.get(key) != lin0.get(key):
                raise CheckpointError(f"{src} and {first} differ in lineage '{key}' "
                                      f"({str(lin.get(key))[:12]} != {str(lin0.get(key))[:12]}): not one model")


def average_checkpoints(refs: list[str], out: str, chosen_by: dict | None = None) -> str:
    """Write the mean of the checkpoints ``refs`` (any references ``resolve`` takes) to
    the checkpoint directory ``out`` (replaced atomically); returns ``out``. ``chosen_by``:
    how the sources were chosen (``molds.eval.choose``), kept in the lineage beside them."""
    if not refs:
        raise CheckpointError("no checkpoints to average")
    sources = [resolve(r) for r in refs]
    if len(set(map(os.path.realpath, sources))) != len(sources):
        raise CheckpointError(f"a checkpoint is listed twice: {sources}")
    out = os.path.normpath(out)
    if any(os.path.realpath(out) == os.path.realpath(s) for s in sources):
        raise CheckpointError(f"{out} is one of the checkpoints being averaged; write the average elsewhere")
    lineages = [read_lineage(s) for s in sources]
    order = sorted(range(len(sources)), key=lambda i: int(lineages[i]["step"]))
    sources, lineages = [sources[i] for i in order], [lineages[i] for i in order]
    _check_same(sources, lineages)

    total: dict = {}
    reference: dict = {}
    for src in sources:
        tensors = read_model(src)
        where = os.path.join(src, MODEL_FILE)
        if not total:
            reference = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
            total = {k: torch.zeros(v.shape, dtype=torch.float64) if v.is_floating_point() else v.clone()
                     for k, v in tensors.items()}
        if tensors.keys() != reference.keys():
            diff = sorted(tensors.keys() ^ reference.keys())
            raise CheckpointError(f"{where} holds other tensors than {sources[0]} ({diff[:5]})")
        for k, v in tensors.items():
            if (v.dtype, tuple(v.shape)) != reference[k]:
                raise CheckpointError(f"{where}: '{k}' is {v.dtype} {tuple(v.shape)}, "
                                      f"{sources[0]} has {reference[k][0]} {reference[k][1]}")
            if v.is_floating_point():
                if not torch.isfinite(v).all():
                    raise CheckpointError(f"{where}: '{k}' holds non-finite values")
                total[k] += v.double()
            elif not torch.equal(v, total[k]):
                raise CheckpointError(f"{where}: the integer tensor '{k}' differs from {sources[0]}'s; "
                                      f"it cannot be averaged")
    mean = {k: (v / len(sources)).to(reference[k][0]) if v.is_floating_point() else v for k, v in total.items()}

    newest = lineages[-1]
    record = dict(newest)
    record[AVERAGED_FROM] = [{"checkpoint": os.path.abspath(s), "step": int(lin["step"])}
                             for s, lin in zip(sources, lineages)]
    if chosen_by:
        record[CHOSEN_BY] = chosen_by
    record["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    with atomic_directory(out, durable=True) as tmp:
        write_model(tmp, mean)
        write_json(os.path.join(tmp, LINEAGE), record, indent=2)
        write_complete_marker(tmp, int(newest["step"]))  # the same marker a training save writes
    return out


def refuse_averaged(checkpoint: str, lineage: dict) -> None:
    """Resume needs optimizer state, data cursor and generators, which an average lacks."""
    src = lineage.get(AVERAGED_FROM)
    if src:
        steps = ", ".join(str(s.get("step")) for s in src if isinstance(s, dict))
        newest = src[-1].get("checkpoint") if isinstance(src[-1], dict) else src[-1]
        raise CheckpointError(f"{checkpoint} is an average of checkpoints (steps {steps}) made by molds-average: "
                              f"it has no optimizer state or data cursor to resume from; resume from one of "
                              f"its sources ({newest}), or start a new run from its weights alone with "
                              f"--checkpoint.fork true (fork_optimizer false)")
