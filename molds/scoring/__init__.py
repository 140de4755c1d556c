"""Scoring functions: molecules -> a score in [0, 1], for steering a model toward a goal.

A definition is data (JSON in a recipe's ``goal.scoring``, or a PMO oracle by name):

    {"aggregate": "geometric",            # or "arithmetic": the weighted mean of the scores
     "components": [
        {"kind": "qed", "weight": 1},
        {"kind": "similarity", "smiles": "CC(=O)Oc1ccccc1C(=O)O", "fingerprint": "ECFP4",
         "transform": {"kind": "clipped", "upper_x": 0.6}},
        {"kind": "substructure", "smarts": ["[N+](=O)[O-]", "C(=O)Cl"], "mode": "exclude"},
        {"kind": "property", "property": "mw", "transform": {"kind": "double_sigmoid",
                                                             "low": 250, "high": 450}}]}

or ``{"oracle": "celecoxib_rediscovery"}`` (``molds.scoring.pmo``). Component kinds:
``qed``, ``similarity``, ``substructure`` (require / exclude: structural alerts),
``property`` (RDKit descriptors: windows and preferences through a transform),
``isomer`` (a molecular formula), ``sa_score``, ``property_model`` (a molds encoder
checkpoint), ``plugin`` (a component from an installed package's entry point). Each
component's raw value goes through its transform (``molds.scoring.transforms``) into
[0, 1]; the total is the weighted geometric or arithmetic mean. A molecule RDKit cannot
read scores 0 with its reason. Everything is checked when the definition is built: an
unknown kind or key, a SMARTS or SMILES RDKit cannot read, impossible transform
parameters are refused with the key that holds them (``goal.scoring.components[2].smarts``).

May import the packages below it in molds' stack: ``errors``, ``runtime``, ``chemistry``,
``recipe``, ``data``, ``models``, ``kernels``, ``checkpoint``, ``engines``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..chemistry import quiet_rdkit
from ..errors import RecipeError
from . import components, external, transforms


@dataclass
class Scores:
    """One scoring of a list of molecules."""

    smiles: list
    total: np.ndarray  # [N] in [0, 1]
    valid: np.ndarray  # [N] bool: RDKit read the molecule
    reasons: list  # [N] None, or why the molecule scored 0 unmeasured ("empty", "invalid_smiles")
    raw: dict  # component name -> [N] raw values (NaN: not measured)
    components: dict  # component name -> [N] transformed scores

    def rows(self):
        """One dict per molecule: SMILES, total, each component raw and transformed."""
        for i, s in enumerate(self.smiles):
            row = {"smiles": s, "total": float(self.total[i]), "valid": bool(self.valid[i]),
                   "reason": self.reasons[i] or ""}
            for name in self.components:
                row[f"{name}_raw"] = float(self.raw[name][i])
                row[name] = float(self.components[name][i])
            yield row


class Scorer:
    @quiet_rdkit  # a SMARTS RDKit cannot read is said once, by the refusal
    def __init__(self, definition, where: str = "scoring"):
        if isinstance(definition, str):
            definition = {"oracle": definition}
        if not isinstance(definition, dict):
            raise RecipeError(f"{where}: a scoring definition is an object (components and an aggregate) or "
                              f"{{'oracle': NAME}}")
        if "oracle" in definition:
            from .pmo import oracle_definition  # here: molds-score --help loads no torch or RDKit

            if set(definition) != {"oracle"}:
                raise RecipeError(f"{where}: an oracle is named alone ({{'oracle': NAME}}), got {sorted(definition)}")
            self.name = definition["oracle"]
            definition = oracle_definition(self.name, f"{where}.oracle")
        else:
            self.name = definition.get("name", "custom")
        unknown = set(definition) - {"name", "aggregate", "components"}
        if unknown:
            raise RecipeError(f"{where}: unknown keys {sorted(unknown)} (a definition has name, aggregate, "
                              f"components)")
        self.aggregate = definition.get("aggregate", "geometric")
        if self.aggregate not in ("geometric", "arithmetic"):
            raise RecipeError(f"{where}.aggregate: geometric or arithmetic, got {self.aggregate!r}")
        specs = definition.get("components")
        if not isinstance(specs, list) or not specs:
            raise RecipeError(f"{where}.components: a non-empty list of components")
        kinds = {**components.KINDS, "property_model": external.PropertyModel, "plugin": external.Plugin}
        self.parts, names = [], set()
        for i, spec in enumerate(specs):
            at = f"{where}.components[{i}]"
            if not isinstance(spec, dict) or spec.get("kind") not in kinds:
                kind = spec.get("kind") if isinstance(spec, dict) else spec
                raise RecipeError(f"{at}.kind: unknown component {kind!r} (one of {sorted(kinds)})")
            name = spec.get("name", f"{spec['kind']}_{i}")
            if not isinstance(name, str) or not name or name in names or name in ("smiles", "total", "valid"):
                raise RecipeError(f"{at}.name: {name!r} is taken or empty; each component needs its own name")
            names.add(name)
            weight = spec.get("weight", 1.0)
            if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not weight > 0:
                raise RecipeError(f"{at}.weight: a number > 0, got {weight!r}")
            component = kinds[spec["kind"]](spec, at)
            self.parts.append((name, float(weight), component,
                               transforms.make_transform(spec.get("transform"), f"{at}.transform")))
        self.definition = definition

    @quiet_rdkit
    def __call__(self, smiles: list) -> Scores:
        from rdkit import Chem  # here: molds-score --help loads no RDKit

        smiles = list(smiles)
        mols, reasons = [], []
        for s in smiles:
            mol = Chem.MolFromSmiles(s) if isinstance(s, str) and s.strip() else None
            mols.append(mol)
            reasons.append(None if mol is not None else ("empty" if not (isinstance(s, str) and s.strip())
                                                          else "invalid_smiles"))
        valid = np.array([m is not None for m in mols], dtype=bool)
        good = [m for m in mols if m is not None]
        raw, scored = {}, {}
        n = len(smiles)
        for name, _, component, transform in self.parts:
            values = np.full(n, np.nan)
            if good:
                values[valid] = component.raw(good)
            raw[name] = values
            scored[name] = np.clip(np.where(valid, transform(values), 0.0), 0.0, 1.0)
        weights = np.array([w for _, w, _, _ in self.parts])
        stack = np.stack([scored[name] for name, *_ in self.parts])  # [C, N]
        if self.aggregate == "arithmetic":
            total = (weights[:, None] * stack).sum(0) / weights.sum()
        else:
            with np.errstate(divide="ignore"):
                logs = np.where(stack > 0, np.log(np.where(stack > 0, stack, 1.0)), -np.inf)
            total = np.exp((weights[:, None] * logs).sum(0) / weights.sum())
        total = np.where(valid, total, 0.0)
        return Scores(smiles, total, valid, reasons, raw, scored)
