"""Conformer units: a molecule and one 3D conformer of it as one string a language model reads.

    [SMILES]CCO[/SMILES][CONFORMER]-1.23,0.35,0.00;0.04,-0.53,0.11;1.19,0.18,-0.11[/CONFORMER]

(the unit of the MolGen3D packed loader). The SMILES is the ETL's canonical SMILES; the
conformer lists each heavy atom's x,y,z in Å, in the order the atoms appear in that SMILES
(so a reader who parses the SMILES with RDKit gets atom i at coordinate i), with
``decimals`` digits after the point (2: 0.005 Å at most from the embedded geometry),
atoms separated by ``;``. The geometry is canonicalized before it is written: centroid at
the origin, principal axes along x, y, z (RDKit's ``CanonicalizeConformer``), so the same
molecule in the same shape is the same text.

Made by ``molds-preprocess --conformers etkdg``: RDKit's ETKDGv3 with explicit hydrogens,
seeded per molecule (the ETL seed and the canonical SMILES, so the output does not depend
on workers), optionally relaxed with MMFF94 (``mmff``; a molecule MMFF has no parameters
for keeps its ETKDG geometry, counted), within a time budget per molecule. The loader packs
a unit like any molecule: never split across rows, truncated in place when longer than a
row (counted, as for every molecule).

``bond_check``: how far a decoded conformer's bond lengths are from those of the MMFF-
relaxed geometry of the same molecule (``molds-eval --conformers``).
"""

from __future__ import annotations

import re
import time

TAGS = ("[SMILES]", "[/SMILES]", "[CONFORMER]", "[/CONFORMER]")
UNIT = re.compile(r"^\[SMILES\](.+?)\[/SMILES\]\[CONFORMER\](.*?)\[/CONFORMER\]$", re.S)
_NUMBER = re.compile(r"^-?\d+\.\d+$")
BOND_TOLERANCE = 0.1  # Å: a sampled bond within this of the MMFF-relaxed geometry's is right


def format_unit(smiles: str, positions, decimals: int) -> str:
    """The unit string of a SMILES and its heavy atoms' coordinates (rows in SMILES order)."""
    def number(v: float) -> str:
        text = f"{v:.{decimals}f}"
        return "0." + "0" * decimals if text.strip("-0.") == "" else text  # no "-0.00"

    atoms = ";".join(",".join(number(float(c)) for c in row) for row in positions)
    return f"[SMILES]{smiles}[/SMILES][CONFORMER]{atoms}[/CONFORMER]"


def parse_unit(text: str):
    """(SMILES, [[x, y, z], ...]) of a unit string, or None when it is not one (a missing
    tag, a coordinate that is no number, an atom without three)."""
    m = UNIT.match(text or "")
    if m is None:
        return None
    smiles, body = m.group(1), m.group(2)
    if not body:
        return None
    rows = []
    for atom in body.split(";"):
        parts = atom.split(",")
        if len(parts) != 3 or not all(_NUMBER.match(p) for p in parts):
            return None
        rows.append([float(p) for p in parts])
    return smiles, rows


#: RDKit's own (wall-clock) embedding timeout, in multiples of the per-molecule CPU budget
WALL_BACKSTOP = 4


class Embedder:
    """One conformer per molecule: ETKDGv3 (+ MMFF94), canonical orientation, the unit text.

    ``__call__(canonical)`` returns (unit, None, notes) or (None, reason, notes); reasons:
    ``conformer_error`` (ETKDG found no embedding), ``conformer_timeout`` (over the
    per-molecule budget of CPU seconds, or ETKDG stopped by its wall-clock backstop); notes (the ETKDG geometry kept
    unrelaxed): ``mmff_unparameterized``, ``mmff_failed``."""

    def __init__(self, seed: int = 0, mmff: bool = True, timeout_s: int = 2, decimals: int = 2,
                 max_mmff_iters: int = 500):
        from rdkit import Chem, RDLogger
        from rdkit.Chem import AllChem, rdDistGeom, rdMolTransforms

        RDLogger.DisableLog("rdApp.*")
        if not 1 <= timeout_s <= 3600 or not 0 <= decimals <= 4:
            raise ValueError("conformer timeout_s must be in [1, 3600] and decimals in [0, 4]")
        self.Chem, self.AllChem, self.dg, self.transforms = Chem, AllChem, rdDistGeom, rdMolTransforms
        self.seed, self.mmff, self.timeout_s, self.decimals, self.max_mmff_iters = (
            seed, mmff, timeout_s, decimals, max_mmff_iters)

    def embed(self, smiles: str, seed: int):
        """Heavy-atom positions (SMILES order) of one conformer, or a reason string; and notes."""
        Chem = self.Chem
        notes = []
        mol = Chem.AddHs(Chem.MolFromSmiles(smiles))
        params = self.dg.ETKDGv3()
        params.randomSeed = seed & 0x7FFFFFFF
        # The budget is this thread's CPU time (RDKit embeds and relaxes in the calling
        # thread), so a loaded or paused machine refuses the same molecules as an idle one.
        # RDKit can only be stopped by its own timeout, which is wall-clock: it is set to
        # WALL_BACKSTOP x the budget, a stop for a molecule that would run on and on, reached
        # before the budget only when this process gets under 1/WALL_BACKSTOP of a core.
        params.timeout = self.timeout_s * WALL_BACKSTOP
        start, wall = time.thread_time(), time.perf_counter()
        if self.dg.EmbedMolecule(mol, params) != 0:
            over = (time.thread_time() - start >= self.timeout_s
                    or time.perf_counter() - wall >= params.timeout)
            return ("conformer_timeout" if over else "conformer_error"), notes
        if self.mmff:
            if not self.AllChem.MMFFHasAllMoleculeParams(mol):
                notes.append("mmff_unparameterized")
            else:
                try:
                    self.AllChem.MMFFOptimizeMolecule(mol, maxIters=self.max_mmff_iters)
                except Exception:  # noqa: BLE001 - a force field RDKit cannot set up: the ETKDG geometry stays
                    notes.append("mmff_failed")
        if time.thread_time() - start > self.timeout_s:
            return "conformer_timeout", notes
        heavy = Chem.RemoveHs(mol)
        self.transforms.CanonicalizeConformer(heavy.GetConformer())
        return heavy.GetConformer().GetPositions(), notes

    def __call__(self, canonical: str):
        from xxhash import xxh3_64_intdigest

        positions, notes = self.embed(canonical, xxh3_64_intdigest(canonical.encode(), self.seed))
        if isinstance(positions, str):
            return None, positions, notes
        return format_unit(canonical, positions, self.decimals), None, notes


def reference_bond_lengths(smiles: str, seed: int = 0):
    """Heavy-atom bond lengths {(i, j): Å} of the MMFF-relaxed ETKDG geometry, or None."""
    from rdkit import Chem
    from rdkit.Chem import AllChem, rdDistGeom

    mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        return None
    mol = Chem.AddHs(mol)
    params = rdDistGeom.ETKDGv3()
    params.randomSeed = seed
    params.timeout = 5
    if rdDistGeom.EmbedMolecule(mol, params) != 0:
        return None
    if AllChem.MMFFHasAllMoleculeParams(mol):
        AllChem.MMFFOptimizeMolecule(mol, maxIters=1000)
    heavy = Chem.RemoveHs(mol)
    pos = heavy.GetConformer().GetPositions()
    return {(b.GetBeginAtomIdx(), b.GetEndAtomIdx()): float(((pos[b.GetBeginAtomIdx()] - pos[b.GetEndAtomIdx()])
                                                             ** 2).sum() ** 0.5) for b in heavy.GetBonds()}


def bond_check(text: str, tolerance: float = BOND_TOLERANCE) -> dict:
    """One sampled unit: does it decode to a molecule with coordinates (one x,y,z per heavy
    atom), and are all its bond lengths within ``tolerance`` Å of the MMFF-relaxed geometry's?"""
    from rdkit import Chem

    parsed = parse_unit(text)
    if parsed is None:
        return {"decodes": False, "bonds_ok": False}
    smiles, rows = parsed
    mol = Chem.MolFromSmiles(smiles)
    if mol is None or mol.GetNumAtoms() == 0 or len(rows) != mol.GetNumAtoms():
        return {"decodes": False, "bonds_ok": False}
    reference = reference_bond_lengths(smiles)
    if reference is None or not reference:
        return {"decodes": True, "bonds_ok": False, "max_bond_error": None}
    errors = []
    for (i, j), want in reference.items():
        got = sum((a - b) ** 2 for a, b in zip(rows[i], rows[j])) ** 0.5
        errors.append(abs(got - want))
    worst = max(errors)
    return {"decodes": True, "bonds_ok": worst <= tolerance, "max_bond_error": worst,
            "mean_bond_error": sum(errors) / len(errors)}


def conformer_metrics(texts: list, tolerance: float = BOND_TOLERANCE) -> dict:
    """``molds-eval --conformers``: over all samples (an unfinished one counts as failed):
    the share that decode to a molecule with coordinates, the share whose bonds are all
    within ``tolerance`` Å of the MMFF geometry, and the median worst bond error of those
    that decode."""
    checks = [bond_check(t, tolerance) if t else {"decodes": False, "bonds_ok": False} for t in texts]
    worst = sorted(c["max_bond_error"] for c in checks if c.get("max_bond_error") is not None)
    n = max(1, len(checks))
    return {"conformer_decodes": sum(c["decodes"] for c in checks) / n,
            "conformer_bonds_ok": sum(c["bonds_ok"] for c in checks) / n,
            "conformer_median_max_bond_error": worst[len(worst) // 2] if worst else None,
            "conformer_bond_tolerance": tolerance}
