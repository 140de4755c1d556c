"""Components that come from outside the scoring module: a molds property model (an
encoder checkpoint of the multitask recipe) and a user's component from an installed
Python package (an entry point named in the recipe; a recipe itself never runs code)."""

from __future__ import annotations

import dataclasses
from importlib.metadata import entry_points

import numpy as np
import torch
from rdkit import Chem

from ..checkpoint import open_checkpoint
from ..chemistry.canonical import Canonicalizer, ChemOptions
from ..chemistry.features import molecule_features
from ..chemistry.representation import of_manifest
from ..errors import MoldsError, RecipeError
from .components import Component

ENTRY_POINT_GROUP = "molds.scoring"


class PropertyModel(Component):
    """A molds encoder's prediction for one of its tasks (``task``: index or label name):
    a probability for a classification model (sigmoid of its logit), the value for a
    regression one. Molecules are canonicalized and spelled as the checkpoint's manifest
    says (its canonicalization options and representation), then tokenized by its
    tokenizer, in batches of ``batch_size``."""

    KEYS = ("checkpoint", "task", "batch_size")
    REQUIRED = ("checkpoint",)

    def __init__(self, spec, where):
        super().__init__(spec, where)
        try:
            self.loaded = open_checkpoint(spec["checkpoint"])
        except MoldsError as exc:
            raise RecipeError(f"{where}.checkpoint: {exc}") from None
        if self.loaded.family != "encoder" or not self.loaded.recipe["model"].get("num_tasks"):
            raise RecipeError(f"{where}.checkpoint: {self.loaded.checkpoint} holds no property model (an encoder "
                              f"with task heads, recipes/mlm_multitask_zero2.json)")
        names = self.loaded.manifest.label_columns
        n = int(self.loaded.recipe["model"]["num_tasks"])
        task = spec.get("task", 0)
        if isinstance(task, str):
            if task not in names:
                raise RecipeError(f"{where}.task: {task!r} is not one of the model's tasks {names}")
            task = names.index(task)
        if not isinstance(task, int) or isinstance(task, bool) or not 0 <= task < n:
            raise RecipeError(f"{where}.task: an index in [0, {n}) or a label name, got {spec.get('task')!r}")
        self.task = task
        self.classification = self.loaded.recipe["model"].get("task_type") == "classification"
        self.batch_size = int(spec.get("batch_size", 256))
        known = {f.name for f in dataclasses.fields(ChemOptions)}
        options = self.loaded.manifest.data["canonicalization"].get("options", {})
        self.canonicalize = Canonicalizer(ChemOptions(**{k: v for k, v in options.items() if k in known}))
        self.representation = of_manifest(self.loaded.manifest)
        self.torch = torch

    def raw(self, mols):
        texts, where, canonical = [], [], []
        for i, mol in enumerate(mols):
            got = self.canonicalize(Chem.MolToSmiles(mol))
            if isinstance(got, str):  # a rejection reason: not measurable
                continue
            text, _ = self.representation.encode(got.canonical)
            if text is not None:
                texts.append(text)
                where.append(i)
                canonical.append(got.canonical)
        out = np.full(len(mols), np.nan)
        tok, model = self.loaded.tokenizer, self.loaded.model
        with self.torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                enc = tok(texts[start:start + self.batch_size], padding=True, return_tensors="pt")
                extra = {}
                kind = getattr(model.config, "molecule_features", "")
                if kind:  # heads that read molecule features: those of the canonical molecules
                    extra["features"] = self.torch.from_numpy(
                        molecule_features(canonical[start:start + self.batch_size], kind))
                pred = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                             **extra)["predictions"]
                pred = pred[:, self.task].float()
                if self.classification:
                    pred = self.torch.sigmoid(pred)
                out[where[start:start + self.batch_size]] = pred.numpy()
        return out


class Plugin(Component):
    """A component from an installed package: ``entry_point`` names an entry point of the
    ``molds.scoring`` group (``[project.entry-points."molds.scoring"]``) that gives a
    callable; called with ``params`` (an object) it returns a function from a list of
    SMILES to a list of raw values (None or NaN: not measurable)."""

    KEYS = ("entry_point", "params")
    REQUIRED = ("entry_point",)

    def __init__(self, spec, where):
        super().__init__(spec, where)
        name = spec["entry_point"]
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            have = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
            raise RecipeError(f"{where}.entry_point: no installed package provides {name!r} in the "
                              f"{ENTRY_POINT_GROUP} entry points (installed: {have or 'none'})")
        params = spec.get("params", {})
        if not isinstance(params, dict):
            raise RecipeError(f"{where}.params: an object, got {type(params).__name__}")
        try:
            self.fn = found[0].load()(**params)
        except Exception as exc:  # the user's code: named, with its message
            raise RecipeError(f"{where}: the {name!r} component ({found[0].value}) failed to build: {exc}") from None

    def raw(self, mols):
        values = list(self.fn([Chem.MolToSmiles(m) for m in mols]))
        if len(values) != len(mols):
            raise MoldsError(f"{self.where}: the {self.spec['entry_point']!r} component returned {len(values)} "
                             f"values for {len(mols)} molecules")
        return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)
