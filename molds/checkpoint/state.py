"""The canonical training state: one layout for every engine and every topology.

::

    model.safetensors      fp32 weights by canonical name (the single-device model's
                           ``state_dict`` names; a tied pair is stored once, under its
                           first name; MoE experts one entry each)
    optimizer.safetensors  AdamW moments: ``exp_avg/<name>``, ``exp_avg_sq/<name>``
    train_state.json       optimizer step count, scheduler position, format
    rng-rankNNNNN.json     each rank's torch / CUDA / Python / NumPy generator states

Nothing here unpickles: tensors are safetensors, the rest JSON. An engine maps its own
state to and from these names (ZeRO partitions through DeepSpeed's
``safe_get_full_*`` / ``safe_set_full_*``, the pipeline engine by global layer id), so
a checkpoint written by one engine on N ranks loads on another engine on M ranks.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CheckpointError, NonFiniteError
from ..runtime.atomic import atomic_file, write_json

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAIN_STATE_FILE = "train_state.json"
MOMENTS = ("exp_avg", "exp_avg_sq")
FORMAT = 1


@dataclass
class Slot:
    """One tensor of a model and where it goes in the canonical state."""

    name: str  # its canonical name (a stacked tensor stands for several canonical entries)
    tensor: torch.Tensor  # the model's own parameter or persistent buffer
    owner: torch.nn.Module  # the module holding it
    attr: str  # its attribute name there

    @property
    def prefix(self) -> str:
        return self.name[: -len(self.attr) - 1] if "." in self.name else ""

    def split(self, value: torch.Tensor) -> dict:
        """The canonical entries of ``value`` (shaped like this slot's tensor)."""
        if hasattr(self.owner, "canonical_split"):
            return self.owner.canonical_split(self.prefix, self.attr, value)
        return {self.name: value}

    def join(self, entries: dict, where: str) -> torch.Tensor:
        """This slot's tensor assembled from canonical ``entries``."""
        try:
            if hasattr(self.owner, "canonical_join"):
                return self.owner.canonical_join(self.prefix, self.attr, entries)
            return entries[self.name]
        except KeyError as exc:
            raise CheckpointError(f"{where} lacks {exc.args[0]}") from None

    def keys(self) -> list[str]:
        if hasattr(self.owner, "canonical_split"):
            return list(self.split(self.tensor.detach()).keys())
        return [self.name]


def slots(module: torch.nn.Module, rename=None) -> list[Slot]:
    """Every parameter and persistent buffer of ``module`` once (the first name of a tied
    pair), in ``state_dict`` order; ``rename`` maps a module's own names to canonical ones."""
    seen, out = set(), []
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        prefix, _, attr = name.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        out.append(Slot(rename(name) if rename else name, t, owner, attr))
    return out


def canonical_state(module: torch.nn.Module, rename=None) -> dict:
    """The module's weights by canonical name, floating point tensors as fp32."""
    out = {}
    for slot in slots(module, rename):
        for k, v in slot.split(slot.tensor.detach()).items():
            out[k] = v.float() if v.is_floating_point() else v
    return out


def load_canonical(module: torch.nn.Module, tensors: dict, where: str, rename=None, strict: bool = True) -> None:
    """Copy canonical ``tensors`` into ``module``: every entry it needs present, every shape
    equal; with ``strict`` no entry left over (a pipeline stage loads only its part)."""
    used = set()
    with torch.no_grad():
        for slot in slots(module, rename):
            keys = slot.keys()
            missing = [k for k in keys if k not in tensors]
            if missing:
                raise CheckpointError(f"{where} does not fit this model: no {missing[:4]}")
            used.update(keys)
            value = slot.join(tensors, where)
            if tuple(value.shape) != tuple(slot.tensor.shape):
                raise CheckpointError(f"{where}: {slot.name} has shape {tuple(value.shape)}, the model "
                                      f"{tuple(slot.tensor.shape)}")
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                # molds never saves such weights (write_model refuses them): a damaged or forged file
                raise CheckpointError(f"{where}: {slot.name} holds non-finite values (NaN or inf), which molds "
                                      f"never saves: the file is damaged or was not written by molds")
            slot.tensor.copy_(value.to(device=slot.tensor.device, dtype=slot.tensor.dtype))
    extra = sorted(tensors.keys() - used)
    if strict and extra:
        raise CheckpointError(f"{where} does not fit this model: unexpected {extra[:8]}"
                              f"{'...' if len(extra) > 8 else ''}")


def _save_file(tensors: dict, path: str, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file  # here: molds-average --help loads no safetensors

    with atomic_file(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=metadata)


def _load_file(path: str) -> dict:
    from safetensors import SafetensorError  # here: molds-average --help loads no safetensors
    from safetensors.torch import load_file  # here: molds-average --help loads no safetensors

    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from exc


def write_model(directory: str, tensors: dict) -> None:
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise NonFiniteError(f"refusing to save non-finite weights ({len(bad)} tensors, e.g. {bad[:3]})")
    _save_file(tensors, os.path.join(directory, MODEL_FILE), {"format": "molds-canonical-1"})


def read_model(directory: str) -> dict:
    return _load_file(os.path.join(directory, MODEL_FILE))


def write_optimizer(directory: str, moments: dict, meta: dict) -> None:
    """``moments``: "exp_avg" / "exp_avg_sq" -> {canonical name: tensor}; ``meta`` holds
    the optimizer step count and the scheduler position."""
    flat = {f"{kind}/{name}": t.float() for kind, per in moments.items() for name, t in per.items()}
    _save_file(flat, os.path.join(directory, OPTIMIZER_FILE))
    write_json(os.path.join(directory, TRAIN_STATE_FILE), {"format": FORMAT, **meta}, indent=2)


def read_optimizer(directory: str) -> tuple[dict, dict]:
    flat = _load_file(os.path.join(directory, OPTIMIZER_FILE))
    moments: dict = {kind: {} for kind in MOMENTS}
    for key, t in flat.items():
        kind, _, name = key.partition("/")
        if kind not in MOMENTS or not name:
            raise CheckpointError(f"{directory}/{OPTIMIZER_FILE}: unexpected entry {key!r}")
        moments[kind][name] = t
    meta = read_json(os.path.join(directory, TRAIN_STATE_FILE))
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{directory}/{TRAIN_STATE_FILE}: unknown format {meta.get('format')!r}")
    return moments, meta


def read_json(path: str):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc})") from exc


# ---------------------------------------------------------------- generators

def rng_state() -> dict:
    """This process's generator states, as JSON."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state().tolist(), "python": [version, list(mt), gauss],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict, where: str) -> None:
    try:
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        version, mt, gauss = state["python"]
        random.setstate((version, tuple(mt), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: generator state is malformed ({exc})") from exc


def rng_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rng-rank{rank:05d}.json")
