"""RDKit's fingerprint generators, each made once per process and shared by every part of
molds that fingerprints molecules: the property heads' Morgan counts
(``molds.chemistry.features``), the scoring components' ECFP, FCFP and atom pairs
(``molds.scoring.components``), the generation metrics' SNN and internal diversity
(``molds.metrics.generation``) and the pair evaluation's similarity to the source
(``molds.eval.pairs``). Which radius and size each uses stays with it; this module only
keeps one generator of each kind (RDKit's are reusable and cost more to make than to use).
"""

from __future__ import annotations

import functools


@functools.cache
def morgan(radius: int = 2, bits: int = 2048, features: bool = False):
    """RDKit's Morgan generator: ``radius``, ``bits`` folded bits (sparse fingerprints
    ignore it), the feature invariants of FCFP where ``features``."""
    from rdkit.Chem import rdFingerprintGenerator  # here: importing molds.chemistry loads no RDKit

    if features:
        return rdFingerprintGenerator.GetMorganGenerator(
            radius=radius, fpSize=bits, atomInvariantsGenerator=rdFingerprintGenerator.GetMorganFeatureAtomInvGen())
    return rdFingerprintGenerator.GetMorganGenerator(radius=radius, fpSize=bits)


@functools.cache
def atom_pairs(max_distance: int = 10):
    """RDKit's atom-pair generator, pairs up to ``max_distance`` bonds apart."""
    from rdkit.Chem import rdFingerprintGenerator  # here: importing molds.chemistry loads no RDKit

    return rdFingerprintGenerator.GetAtomPairGenerator(maxDistance=max_distance)
