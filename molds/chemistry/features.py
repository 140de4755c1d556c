"""Molecule-level features a property model's heads read beside the encoder's pooled token
(``model.molecule_features``), as Chemprop's ``--molecule-featurizers`` add them to its
D-MPNN's readout.

- ``rdkit2d``: every 2D descriptor RDKit's ``Descriptors.CalcMolDescriptors`` computes (molecular
  weight, Crippen logP and molar refractivity, TPSA, counts of atoms, bonds, rings and groups,
  topological and electrotopological indices, partial-charge and BCUT ranges: 217 with RDKit
  2026.09), in its order, of the molecule as the ETL canonicalized it. A value RDKit cannot
  compute, or one that is not finite, is 0. Each value ``v`` is given as ``sign(v) log(1 + |v|)``:
  some descriptors span twenty orders of magnitude (``Ipc``), and the model standardizes what
  it reads by the training split's mean and standard deviation (kept in the checkpoint).
- ``morgan``: the molecule's Morgan count fingerprint, radius 2 folded to 2,048 bits (RDKit's
  ``rdFingerprintGenerator``; the atom environments of Chemprop's ``morgan_count`` and of the
  benchmark's random forest), each count ``c`` given as ``log(1 + c)``. These are read as they
  are, not standardized: a bit that is rare in the training split would otherwise read as many
  standard deviations wherever it is set.
- ``rdkit2d+morgan``: both, the descriptors first.

The descriptors are computed from the canonical SMILES, so every spelling of a molecule
(randomized SMILES at training, ``--augment`` at prediction) reads the same features. A
training process keeps what it computed (by SMILES): a split read for many passes is
computed once.
"""

from __future__ import annotations

import numpy as np

from ..errors import MoldsError
from . import fingerprints, quiet_rdkit

#: the feature sets by name
KINDS = ("rdkit2d", "morgan", "rdkit2d+morgan")
#: the Morgan count fingerprint's radius and width
MORGAN_RADIUS, MORGAN_BITS = 2, 2048
#: the parts a model reads as they are (the others standardized by the training split)
UNSCALED = ("morgan",)
#: ``model.molecule_features`` for none
NONE = "none"

_CACHE: dict[tuple[str, str], np.ndarray] = {}
_NAMES: dict[str, list[str]] = {}


def feature_set(value) -> str:
    """``model.molecule_features`` as the set the heads read, '' for none (``none``, or a
    recipe written before the key)."""
    return "" if value in (None, "", NONE) else str(value)


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise MoldsError(f"model.molecule_features {kind!r} is not a feature set molds computes: give one of "
                         f"{', '.join(KINDS)} (or none)")


def _parts(kind: str) -> list[str]:
    _check(kind)
    return kind.split("+")


def feature_names(kind: str) -> list[str]:
    """The names of ``kind``'s features, in the order a model reads them."""
    names = []
    for part in _parts(kind):
        if part not in _NAMES:
            if part == "morgan":
                _NAMES[part] = [f"morgan{MORGAN_RADIUS}_count_{i}" for i in range(MORGAN_BITS)]
            else:
                from rdkit import Chem  # here: a model without molecule features loads no RDKit
                from rdkit.Chem import Descriptors  # here: as above

                _NAMES[part] = list(Descriptors.CalcMolDescriptors(Chem.MolFromSmiles("C"), missingVal=0.0,
                                                                   silent=True))
        names += _NAMES[part]
    return names


def scaled(kind: str) -> np.ndarray:
    """bool [number of ``kind``'s features]: which the model standardizes by the training
    split (the others it reads as they are)."""
    return np.concatenate([np.full(len(feature_names(part)), part not in UNSCALED) for part in _parts(kind)])


@quiet_rdkit  # the descriptors' own notes too ("not removing hydrogen atom without neighbors", a hydride)
def _compute(smiles: str, kind: str) -> np.ndarray:
    from rdkit import Chem  # here: a model without molecule features loads no RDKit

    mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        raise MoldsError(f"molecule features: RDKit cannot read {smiles!r}")
    out = []
    for part in _parts(kind):
        if part == "morgan":
            counts = fingerprints.morgan(MORGAN_RADIUS, MORGAN_BITS).GetCountFingerprintAsNumPy(mol)
            out.append(np.log1p(counts.astype(np.float64)))
            continue
        from rdkit.Chem import Descriptors  # here: as above

        values = Descriptors.CalcMolDescriptors(mol, missingVal=float("nan"), silent=True)
        x = np.asarray([values.get(n, np.nan) for n in feature_names(part)], dtype=np.float64)
        x[~np.isfinite(x)] = 0.0
        out.append(np.sign(x) * np.log1p(np.abs(x)))
    return np.concatenate(out).astype(np.float32)


def molecule_features(smiles: list[str], kind: str, *, cache: bool = False) -> np.ndarray:
    """float32 [len(smiles), number of ``kind``'s features]: the features of each molecule,
    given as canonical SMILES (as the ETL wrote them). ``cache``: keep them in this process
    (a training split read for many passes; not a prediction stream, whose memory stays that
    of one chunk)."""
    width = len(feature_names(kind))
    out = np.empty((len(smiles), width), dtype=np.float32)
    for i, s in enumerate(smiles):
        hit = _CACHE.get((kind, s))
        if hit is None:
            hit = _compute(s, kind)
            if cache:
                _CACHE[(kind, s)] = hit
        out[i] = hit
    return out


def remember(smiles: list[str], kind: str, values: np.ndarray) -> None:
    """Keep ``values`` (rows of ``molecule_features(smiles, kind)``, computed elsewhere: another
    rank's share of a training split) in this process, as ``cache=True`` keeps what it computes."""
    if len(values) != len(smiles):
        raise ValueError(f"{len(values)} rows of features for {len(smiles)} molecules")
    for s, row in zip(smiles, values):
        _CACHE[(kind, s)] = row


def feature_moments(features: np.ndarray, kind: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(mean, standard deviation) per feature over rows; a feature constant over them has
    standard deviation 1 (it then reads as its distance from the mean, 0 on the training rows).
    With ``kind``, the features it reads as they are (``scaled``) get mean 0 and scale 1."""
    width = features.shape[1] if features.ndim == 2 else 0
    if not len(features):
        return np.zeros(width, np.float32), np.ones(width, np.float32)
    x = features.astype(np.float64)
    mean = x.mean(axis=0)
    std = x.std(axis=0, ddof=1) if len(x) > 1 else np.zeros_like(mean)
    std = np.where(std > 1e-6, std, 1.0)
    if kind is not None:
        keep = scaled(kind)
        if len(keep) != width:
            raise ValueError(f"{width} features given for {kind}'s {len(keep)}")
        mean, std = np.where(keep, mean, 0.0), np.where(keep, std, 1.0)
    return mean.astype(np.float32), std.astype(np.float32)
