"""How far samples' properties lie from the data's: what shows a model drifting away.

FCD says *that* samples differ from the data, not *how*. These say how, per property:

- the Wasserstein-1 distance between the samples' and the reference set's distribution of
  molecular weight, logP (Crippen), SA score and QED: MOSES's property metrics (its
  ``weight``, ``logP``, ``SA``, ``QED``; CharRNN's published runs are at 2.3-2.8, 0.04-0.08,
  0.012-0.022 and 0.0014-0.0027), computed the same way (``scipy.stats.wasserstein_distance``
  over every valid sample and every reference molecule);
- the same distance, and histograms on shared bins, for heavy atoms, rings, aromatic
  rings, the aromatic-atom fraction and rotatable bonds;
- the share of valid samples outside the training split's range of each property (its
  minimum and maximum over up to ``TRAIN_LIMIT`` training molecules, every shard in
  proportion), and outside any of them: a data set cut at hard bounds (MOSES keeps
  molecular weight 250-350, at most 7 rotatable bonds, logP at most 3.5) shows here when
  the model leaks past them.

``PropertyReference`` computes the reference and training values once: a process scoring
several seeds or evaluations against the same manifest reuses them (``reference_properties``),
and other processes (a resume, the next run on that data, ``molds-eval``) read them from the
disk cache (``molds.metrics.disk_cache``; 20,000 training molecules take about two minutes of
a CPU core).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
from rdkit import Chem, rdBase
from rdkit.Chem import QED, Crippen, Descriptors, Lipinski, rdMolDescriptors
from scipy.stats import wasserstein_distance

from ..chemistry import quiet_rdkit
from ..scoring.components import _sascorer
from .disk_cache import cached_arrays
from .generation import reference_smiles

#: MOSES's four property distances, then the structure counts (name: what it is)
PROPERTIES = {
    "weight": "molecular weight (Descriptors.MolWt)",
    "logp": "octanol-water partition coefficient (Crippen.MolLogP)",
    "sa": "synthetic accessibility score (Ertl and Schuffenhauer, RDKit Contrib)",
    "qed": "quantitative estimate of drug-likeness (QED.qed)",
    "heavy_atoms": "heavy atoms",
    "rings": "rings (SSSR)",
    "aromatic_rings": "aromatic rings",
    "aromatic_fraction": "aromatic atoms / heavy atoms",
    "rotatable_bonds": "rotatable bonds (Lipinski.NumRotatableBonds)",
}
MOSES_PROPERTIES = ("weight", "logp", "sa", "qed")
#: integer-valued properties: one histogram bin per value
COUNTS = ("heavy_atoms", "rings", "aromatic_rings", "rotatable_bonds")
#: training molecules whose ranges bound the samples'
TRAIN_LIMIT = 20000
#: bins of a continuous property's histogram
BINS = 40


def molecule_properties(mol) -> dict:
    """Every property of ``PROPERTIES`` of one RDKit molecule."""
    heavy = mol.GetNumHeavyAtoms()
    return {"weight": Descriptors.MolWt(mol), "logp": Crippen.MolLogP(mol), "sa": _sascorer().calculateScore(mol),
            "qed": QED.qed(mol), "heavy_atoms": heavy, "rings": rdMolDescriptors.CalcNumRings(mol),
            "aromatic_rings": rdMolDescriptors.CalcNumAromaticRings(mol),
            "aromatic_fraction": sum(a.GetIsAromatic() for a in mol.GetAtoms()) / heavy if heavy else 0.0,
            "rotatable_bonds": Lipinski.NumRotatableBonds(mol)}


def property_table(mols: Sequence) -> dict[str, np.ndarray]:
    """{property: values over ``mols``} (molecules RDKit cannot score are left out of all)."""
    rows = []
    for mol in mols:
        try:
            rows.append(molecule_properties(mol))
        except Exception:  # noqa: BLE001 - a molecule a descriptor fails on counts in none
            continue
    return {name: np.asarray([r[name] for r in rows], dtype=float) for name in PROPERTIES}


@quiet_rdkit
def _mols(smiles: Sequence[str]) -> list:
    return [m for m in (Chem.MolFromSmiles(s) for s in smiles if s) if m is not None]


#: what a cached property table was computed with: bump the number when ``molecule_properties``
#: changes what it computes
_TABLE_VERSION = f"molds property_table 1, rdkit {rdBase.rdkitVersion}, {' '.join(PROPERTIES)}"


def smiles_property_table(smiles: Sequence[str]) -> dict[str, np.ndarray]:
    """``property_table`` of the molecules of ``smiles`` (those RDKit parses), from the disk
    cache when these SMILES were scored before with the same RDKit."""
    def valid(z: dict) -> bool:
        sizes = {z[k].shape if k in z and z[k].ndim == 1 and z[k].dtype.kind == "f" else None for k in PROPERTIES}
        return len(sizes) == 1 and None not in sizes

    return cached_arrays("properties", _TABLE_VERSION, smiles, lambda: property_table(_mols(smiles)), valid)


class PropertyReference:
    """The reference set's property values and the training split's ranges."""

    def __init__(self, reference_smiles: Sequence[str], train_smiles: Sequence[str] | None = None,
                 description: str = ""):
        self.values = smiles_property_table(list(reference_smiles))
        self.size = len(self.values["weight"])
        train = smiles_property_table(list(train_smiles)) if train_smiles else {}
        self.ranges = {k: (float(v.min()), float(v.max())) for k, v in train.items() if len(v)}
        self.train_size = len(train.get("weight", ()))
        self.description = description

    def scores(self, mols: Sequence) -> tuple[dict, dict]:
        """(scalars, histograms) of the samples ``mols`` (valid ones) against this reference:
        ``w_<property>`` for each property, ``out_of_train_range`` and
        ``out_of_train_range_<property>``; each histogram holds the shared bin ``edges`` and
        the ``samples`` and ``reference`` shares per bin."""
        gen = property_table(mols)
        scalars: dict = {}
        hists: dict = {}
        n = len(gen["weight"])
        for name in PROPERTIES:
            g, r = gen[name], self.values[name]
            scalars[f"w_{name}"] = float(wasserstein_distance(g, r)) if len(g) and len(r) else None
            if len(g) and len(r):
                hists[name] = histogram(g, r, integer=name in COUNTS)
        if self.ranges and n:
            outside = np.zeros(n, dtype=bool)
            for name, (lo, hi) in self.ranges.items():
                out = (gen[name] < lo) | (gen[name] > hi)
                scalars[f"out_of_train_range_{name}"] = float(out.mean())
                outside |= out
            scalars["out_of_train_range"] = float(outside.mean())
        return scalars, hists


def histogram(samples: np.ndarray, reference: np.ndarray, integer: bool = False) -> dict:
    """Both value sets' shares on shared bins (one per integer value for a count, else
    ``BINS`` equal bins over both sets' span)."""
    lo, hi = float(min(samples.min(), reference.min())), float(max(samples.max(), reference.max()))
    if integer:
        edges = np.arange(np.floor(lo), np.floor(hi) + 2) - 0.5
    else:
        edges = np.linspace(lo, hi if hi > lo else lo + 1.0, BINS + 1)
    s, _ = np.histogram(samples, edges)
    r, _ = np.histogram(reference, edges)
    return {"edges": [round(float(e), 6) for e in edges], "samples": (s / max(1, s.sum())).round(6).tolist(),
            "reference": (r / max(1, r.sum())).round(6).tolist()}


_CACHE: dict = {}


def reference_properties(manifest, split: str, limit: int = 10000, ranges_from: str | None = "train",
                         reference: tuple[str, Sequence[str]] | None = None) -> PropertyReference:
    """The properties of up to ``limit`` molecules of ``manifest``'s ``split`` (or of
    ``reference``: a file's name and its SMILES), a fixed draw (seed 0), and the ranges of
    the ``ranges_from`` split's; computed once a process for each manifest, split or file."""
    if ranges_from and not manifest.shards(ranges_from):
        ranges_from = None
    key = (manifest.path, manifest.hash, split, limit, ranges_from, reference[0] if reference else None)
    if key not in _CACHE:
        if reference:
            name, every = reference[0], list(reference[1])
            ref = random.Random(0).sample(every, limit) if len(every) > limit else every
            what = f"{name} ({len(ref)} of its {len(every)} molecules)"
        else:
            ref = reference_smiles(manifest, split, limit, seed=0)
            what = f"split {split} ({len(ref)} molecules)"
        train = reference_smiles(manifest, ranges_from, TRAIN_LIMIT, seed=0) if ranges_from else None
        if len(_CACHE) >= 8:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = PropertyReference(ref, train, what)
    return _CACHE[key]
