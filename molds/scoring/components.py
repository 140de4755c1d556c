"""Scoring components: a molecule -> a raw value (RDKit, or a molds property model).

One class per kind, each built from its recipe object and checked there (a SMARTS RDKit
cannot read, an unknown fingerprint or property, a missing checkpoint: refused with the key
that holds it). ``raw(mols)`` returns one float per molecule (NaN where the molecule
cannot be measured: its score is 0).

Fingerprints for similarity are GuacaMol's (and so the PMO oracles'): ``ECFP4`` / ``ECFP6``
Morgan count vectors of radius 2 / 3, ``FCFP4`` / ``FCFP6`` the same on feature invariants,
``AP`` atom-pair counts up to distance 10, ``PHCO`` Gobbi's 2D pharmacophore fingerprint;
Tanimoto on counts (sum of minima over sum of maxima).
"""

from __future__ import annotations

import gzip
import math
import os
import pickle
import re

import numpy as np
from rdkit import Chem, DataStructs
from rdkit.Chem import QED as qed, Crippen, Descriptors, Lipinski, rdMolDescriptors
from rdkit.Chem.Pharm2D import Generate, Gobbi_Pharm2D
from rdkit.Contrib.SA_Score import sascorer

from ..chemistry import fingerprints, quiet_rdkit
from ..errors import RecipeError

FINGERPRINTS = ("ECFP4", "ECFP6", "FCFP4", "FCFP6", "AP", "PHCO")


def fingerprint(mol, kind: str):
    if kind == "PHCO":
        return Generate.Gen2DFingerprint(mol, Gobbi_Pharm2D.factory)
    if kind == "AP":
        return fingerprints.atom_pairs(10).GetSparseCountFingerprint(mol)
    radius = 2 if kind.endswith("4") else 3
    return fingerprints.morgan(radius, features=kind.startswith("F")).GetSparseCountFingerprint(mol)


def tanimoto(a, b) -> float:
    return DataStructs.TanimotoSimilarity(a, b)


@quiet_rdkit
def _mol(smiles: str, where: str):
    mol = Chem.MolFromSmiles(smiles) if isinstance(smiles, str) and smiles else None
    if mol is None:
        raise RecipeError(f"{where}: RDKit cannot read the SMILES {smiles!r}")
    return mol


@quiet_rdkit
def _smarts(pattern, where: str):
    q = Chem.MolFromSmarts(pattern) if isinstance(pattern, str) and pattern else None
    if q is None:
        raise RecipeError(f"{where}: RDKit cannot read the SMARTS {pattern!r}")
    return q


def _as_list(value, where: str) -> list:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise RecipeError(f"{where}: at least one is needed")
    return items


class Component:
    """A named part of a scoring function; ``raw`` values for a list of RDKit molecules."""

    #: keys of the component's object besides kind / name / weight / transform
    KEYS: tuple = ()
    REQUIRED: tuple = ()
    NEEDS_TRANSFORM = False  # raw values outside [0, 1]: a transform is required

    def __init__(self, spec: dict, where: str):
        self.where = where
        unknown = set(spec) - {"kind", "name", "weight", "transform", *self.KEYS}
        if unknown:
            raise RecipeError(f"{where}: unknown keys {sorted(unknown)} for a {spec['kind']} component "
                              f"(it takes {['name', 'weight', 'transform', *self.KEYS]})")
        missing = [k for k in self.REQUIRED if k not in spec]
        if missing:
            raise RecipeError(f"{where}: a {spec['kind']} component needs {missing}")
        if self.NEEDS_TRANSFORM and not spec.get("transform"):
            raise RecipeError(f"{where}.transform: a {spec['kind']} component's raw values are no scores in "
                              f"[0, 1]; give it a transform (sigmoid, double_sigmoid, step, gaussian, ...)")
        self.spec = spec

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.raw is Component.raw and not callable(getattr(cls, "one", None)):
            raise TypeError(f"{cls.__name__}: a scoring component defines raw(mols) or one(mol)")

    def raw(self, mols: list) -> np.ndarray:
        """Raw values of the molecules (NaN: not measurable); by default ``one`` per molecule."""
        return np.array([self.one(m) for m in mols], dtype=np.float64)


class QED(Component):
    def one(self, mol):
        return qed.qed(mol)


class Similarity(Component):
    """Tanimoto similarity to given molecules (``smiles``: one or a list; with a list,
    ``reduce`` max (default) or mean over them)."""

    KEYS = ("smiles", "fingerprint", "reduce")
    REQUIRED = ("smiles",)

    def __init__(self, spec, where):
        super().__init__(spec, where)
        self.fp = spec.get("fingerprint", "ECFP4")
        if self.fp not in FINGERPRINTS:
            raise RecipeError(f"{where}.fingerprint: {self.fp!r} is not one of {list(FINGERPRINTS)}")
        self.reduce = spec.get("reduce", "max")
        if self.reduce not in ("max", "mean"):
            raise RecipeError(f"{where}.reduce: max or mean, got {self.reduce!r}")
        targets = _as_list(spec["smiles"], f"{where}.smiles")
        self.targets = [fingerprint(_mol(s, f"{where}.smiles[{i}]"), self.fp) for i, s in enumerate(targets)]

    def one(self, mol):
        fp = fingerprint(mol, self.fp)
        sims = [tanimoto(t, fp) for t in self.targets]
        return max(sims) if self.reduce == "max" else float(np.mean(sims))


class Substructure(Component):
    """SMARTS: ``mode`` "require" scores 1 when the molecule matches (``match`` "any"
    pattern of a list, or "all"), 0 otherwise; "exclude" (structural alerts) scores 1 when
    it matches none of them."""

    KEYS = ("smarts", "mode", "match")
    REQUIRED = ("smarts",)

    def __init__(self, spec, where):
        super().__init__(spec, where)
        self.mode = spec.get("mode", "require")
        if self.mode not in ("require", "exclude"):
            raise RecipeError(f"{where}.mode: require or exclude, got {self.mode!r}")
        self.match = spec.get("match", "any")
        if self.match not in ("any", "all"):
            raise RecipeError(f"{where}.match: any or all, got {self.match!r}")
        self.patterns = [_smarts(p, f"{where}.smarts[{i}]")
                         for i, p in enumerate(_as_list(spec["smarts"], f"{where}.smarts"))]

    def one(self, mol):
        hits = [mol.HasSubstructMatch(q) for q in self.patterns]
        if self.mode == "exclude":
            return 0.0 if any(hits) else 1.0
        return 1.0 if (all(hits) if self.match == "all" else any(hits)) else 0.0


def _count_atoms(symbol):
    def count(mol):
        if symbol == "H":
            mol = Chem.AddHs(mol)
        return sum(1 for a in mol.GetAtoms() if a.GetSymbol() == symbol)

    return count


def _properties():
    return {
        "mw": Descriptors.MolWt, "exact_mw": Descriptors.ExactMolWt, "logp": Crippen.MolLogP,
        "tpsa": Descriptors.TPSA, "hbd": Lipinski.NumHDonors, "hba": Lipinski.NumHAcceptors,
        "rotatable_bonds": rdMolDescriptors.CalcNumRotatableBonds, "rings": rdMolDescriptors.CalcNumRings,
        "aromatic_rings": rdMolDescriptors.CalcNumAromaticRings, "heavy_atoms": lambda m: m.GetNumHeavyAtoms(),
        "bertz": Descriptors.BertzCT, "fsp3": rdMolDescriptors.CalcFractionCSP3,
        "formal_charge": lambda m: sum(a.GetFormalCharge() for a in m.GetAtoms()),
        "stereocenters": lambda m: len(__import__("rdkit.Chem", fromlist=["Chem"]).FindMolChiralCenters(
            m, includeUnassigned=True)),
    }


PROPERTY_NAMES = ("mw", "exact_mw", "logp", "tpsa", "hbd", "hba", "rotatable_bonds", "rings", "aromatic_rings",
                  "heavy_atoms", "bertz", "fsp3", "formal_charge", "stereocenters", "atoms:<element>")


@quiet_rdkit
def computed_properties(smiles: list[str], names: tuple[str, ...]) -> list[list[float | None]]:
    """Each text's ``names`` properties (``PROPERTY_NAMES``' table, RDKit's descriptors), in
    order; ``None`` for a property that cannot be computed, every one where RDKit cannot read
    the text."""
    table = _properties()
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"no computed property {unknown}: the names are {list(table)}")
    out = []
    for text in smiles:
        mol = Chem.MolFromSmiles(text) if text else None
        row = []
        for name in names:
            try:
                value = float(table[name](mol)) if mol is not None else None
            except Exception:  # noqa: BLE001 - a descriptor RDKit fails on is a missing value, not the row
                value = None
            row.append(value if value is not None and math.isfinite(value) else None)
        out.append(row)
    return out


class Property(Component):
    """A computed property (RDKit's descriptor), scored through a transform (a window:
    ``step`` or ``double_sigmoid``; a preference: ``sigmoid``, ``gaussian``, ...)."""

    KEYS = ("property",)
    REQUIRED = ("property",)
    NEEDS_TRANSFORM = True

    def __init__(self, spec, where):
        super().__init__(spec, where)
        name = spec["property"]
        table = _properties()
        if isinstance(name, str) and name.startswith("atoms:") and re.fullmatch(r"[A-Z][a-z]?", name[6:]):
            self.fn = _count_atoms(name[6:])
        elif name in table:
            self.fn = table[name]
        else:
            raise RecipeError(f"{where}.property: {name!r} is not one of {list(PROPERTY_NAMES)}")

    def one(self, mol):
        return float(self.fn(mol))


def parse_formula(formula: str, where: str) -> list[tuple[str, int]]:
    parts = re.findall(r"([A-Z][a-z]?)(\d*)", formula or "") if isinstance(formula, str) else []
    table = Chem.GetPeriodicTable()
    elements = {table.GetElementSymbol(z) for z in range(1, 119)}
    if not parts or "".join(e + n for e, n in parts) != formula or not all(e in elements for e, _ in parts):
        raise RecipeError(f"{where}: {formula!r} is not a molecular formula (like C7H8N2O2)")
    return [(e, int(n) if n else 1) for e, n in parts]


class Isomer(Component):
    """How close a molecule is to a molecular formula (GuacaMol's isomer score): for each
    element of the formula a gaussian of the molecule's count of it (sigma 1, hydrogens
    included), and one of its total atom count (sigma 2), combined by geometric mean."""

    KEYS = ("formula",)
    REQUIRED = ("formula",)

    def __init__(self, spec, where):
        super().__init__(spec, where)
        self.elements = parse_formula(spec["formula"], f"{where}.formula")
        self.total = sum(n for _, n in self.elements)

    def one(self, mol):
        full = Chem.AddHs(mol)
        counts = {}
        for atom in full.GetAtoms():
            counts[atom.GetSymbol()] = counts.get(atom.GetSymbol(), 0) + 1
        scores = [math.exp(-0.5 * (counts.get(e, 0) - n) ** 2) for e, n in self.elements]
        scores.append(math.exp(-0.5 * ((full.GetNumAtoms() - self.total) / 2.0) ** 2))
        return geometric_mean(scores)


class SAScore(Component):
    """Ertl and Schuffenhauer's synthetic accessibility score (1 easy .. 10 hard), RDKit's
    Contrib scorer; its fragment table is read without unpickling code."""

    NEEDS_TRANSFORM = True

    def __init__(self, spec, where):
        super().__init__(spec, where)
        self.scorer = _sascorer()

    def one(self, mol):
        return float(self.scorer.calculateScore(mol))


_SASCORER = None


def _sascorer():
    """RDKit's ``sascorer`` with its fragment scores loaded by a restricted unpickler
    (the table is plain lists of numbers: no class may be loaded), not by its own
    ``pickle.load``."""
    global _SASCORER
    if _SASCORER is None:
        class NumbersOnly(pickle.Unpickler):
            def find_class(self, module, name):
                raise pickle.UnpicklingError(f"fpscores.pkl.gz asks for {module}.{name}; refused")

        with gzip.open(os.path.join(os.path.dirname(sascorer.__file__), "fpscores.pkl.gz")) as fh:
            data = NumbersOnly(fh).load()
        sascorer._fscores = {key: float(row[0]) for row in data for key in row[1:]}
        _SASCORER = sascorer
    return _SASCORER


def geometric_mean(values, weights=None) -> float:
    values = np.asarray(values, dtype=np.float64)
    weights = np.ones_like(values) if weights is None else np.asarray(weights, dtype=np.float64)
    if np.any(values <= 0):
        return 0.0
    return float(np.exp(np.sum(weights * np.log(values)) / np.sum(weights)))


KINDS = {"qed": QED, "similarity": Similarity, "substructure": Substructure, "property": Property,
         "isomer": Isomer, "sa_score": SAScore}
