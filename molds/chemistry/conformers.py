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

Or made by ``molds-preprocess --unit_template`` from JSON-lines records that already hold a
conformer (``UnitTemplate``): the template names the record's fields, the unit is checked
against the row's molecule and written in the same form as an ETKDG unit. Or by
``molds-preprocess --conformers sd`` from the 3D coordinates of SD records
(``unit_of_record``), checked and written the same way.

``bond_check``: how far a decoded conformer's bond lengths are from those of the MMFF-
relaxed geometry of the same molecule (``molds-eval --conformers``).
"""

from __future__ import annotations

import re
import string
import time

import numpy as np
from rdkit import Chem
from rdkit.Chem import AllChem, rdDistGeom, rdMolTransforms
from rdkit.Geometry import Point3D
from xxhash import xxh3_64_intdigest

from . import quiet_rdkit

TAGS = ("[SMILES]", "[/SMILES]", "[CONFORMER]", "[/CONFORMER]")
UNIT = re.compile(r"^\[SMILES\](.+?)\[/SMILES\]\[CONFORMER\](.*?)\[/CONFORMER\]$", re.S)
_NUM = r"-?\d+(?:\.\d+)?"  # a coordinate as ``format_unit`` writes it (no point with 0 decimals)
_BODY = re.compile(rf"{_NUM},{_NUM},{_NUM}(?:;{_NUM},{_NUM},{_NUM})*")
_NEGATIVE_ZERO = re.compile(r"(^|[,;])-(0(?:\.0+)?)(?=[,;]|$)")
BOND_TOLERANCE = 0.1  # Å: a sampled bond within this of the MMFF-relaxed geometry's is right


def format_unit(smiles: str, positions, decimals: int) -> str:
    """The unit string of a SMILES and its heavy atoms' coordinates (rows in SMILES order)."""
    atom = f"%.{decimals}f,%.{decimals}f,%.{decimals}f"
    body = ";".join(atom % (float(x), float(y), float(z)) for x, y, z in positions)
    body = _NEGATIVE_ZERO.sub(r"\1\2", body)  # no "-0.00": a value that rounds to zero is "0.00"
    return f"[SMILES]{smiles}[/SMILES][CONFORMER]{body}[/CONFORMER]"


def parse_unit(text: str):
    """(SMILES, [[x, y, z], ...]) of a unit string, or None when it is not one (a missing
    tag, a coordinate that is no number, an atom without three)."""
    m = UNIT.match(text or "")
    if m is None:
        return None
    smiles, body = m.group(1), m.group(2)
    if not _BODY.fullmatch(body):
        return None
    values = [float(v) for v in body.replace(";", ",").split(",")]
    return smiles, [values[i:i + 3] for i in range(0, len(values), 3)]


#: ``--unit_template``'s refusals (``molds.chemistry.representation.REASONS`` says each one in words)
UNIT_REASONS = ("unit_missing_field", "unit_malformed", "unit_smiles_mismatch", "unit_atom_count", "unit_geometry",
                "unit_stereo")
_COORDINATE_MAX = 10_000.0  # Å: no molecule's coordinate frame reaches this; beyond it, not Å or not a number
_BOND_RANGE = (0.9, 3.2)  # Å: every bond between heavy atoms (N#N 1.10 to Sn-Sn 2.8) lies inside
_CLASH = 0.5  # Å: two heavy atoms this close are one atom written twice
_SMILES_MAX = 20_000  # characters: a unit's SMILES longer than --max_smiles_length can be is not parsed


def check_frame(frame: str) -> None:
    """The frame of units from the input: ``canonical`` (ETKDG units' frame) or ``as_given``."""
    if frame not in ("canonical", "as_given"):
        raise ValueError(f"conformer_frame: 'canonical' or 'as_given', not {frame!r}")


class UnitTemplate:
    """``--unit_template``: conformer units from the fields of JSON-lines records.

    The template is the unit with ``{field}`` where a record's top-level key goes, e.g.
    ``[SMILES]{smiles}[/SMILES][CONFORMER]{xyz}[/CONFORMER]``, or ``{unit}`` for a field
    that holds whole units; keys are matched as ``--smiles_column`` is (exactly, else but for
    case). Text outside the fields may only be the unit's tags, in their order. A field's
    value is put in as it is when it is a string; a list of [x, y, z] number triples is the
    conformer's numbers (spelled ``x,y,z;...`` only when other text shares its tags). The result must read as a unit whose SMILES is the row's
    molecule and whose conformer has one x,y,z per heavy atom of *that* SMILES, in its atom
    order (the SMILES may be any spelling: the coordinates are put in the canonical
    SMILES' order). Then the unit is written as an ETKDG unit is: the canonical SMILES,
    ``decimals`` digits, and with ``frame`` "canonical" the centroid at the origin and the
    principal axes along x, y, z (RDKit's ``CanonicalizeConformer``; "as_given" keeps the
    record's frame, e.g. a docking pose in its pocket).

    ``build`` returns (unit, None, None) or (None, reason, example), reasons
    ``UNIT_REASONS``: ``unit_missing_field`` (a field absent or null), ``unit_malformed``
    (a value of another type; tags, separators or numbers not as above; a coordinate not
    finite or beyond 10,000 Å), ``unit_smiles_mismatch`` (the unit's SMILES does not parse,
    or is another molecule than the row's after standardization), ``unit_atom_count`` (not
    one x,y,z per heavy atom; explicit hydrogens are no heavy atoms), ``unit_geometry`` (a
    bond between heavy atoms outside 0.9-3.2 Å, or two atoms within 0.5 Å: coordinates in
    another atom order than the SMILES', or not in Å), ``unit_stereo`` (a stereocentre or
    double bond the SMILES specifies has the other configuration in 3D: a mirror image, a
    cis conformer of a trans SMILES)."""

    def __init__(self, template: str, decimals: int = 2, frame: str = "canonical", keep_stereo: bool = True):
        if not isinstance(template, str) or not template.strip():
            raise ValueError("unit_template: give the unit with {field} for each JSONL key, e.g. "
                             "'[SMILES]{smiles}[/SMILES][CONFORMER]{conformer}[/CONFORMER]'")
        check_frame(frame)
        if not 0 <= decimals <= 4:
            raise ValueError("conformer_decimals must be in [0, 4]")
        self.template, self.decimals, self.frame, self.keep_stereo = template, decimals, frame, keep_stereo
        self.pieces: list[tuple[str, str | None]] = []  # (literal text, field after it or None)
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise ValueError(f"unit_template {template!r}: {exc} (write a literal brace as {{{{ or }}}})") from None
        for literal, name, spec, conversion in parsed:
            if name is not None and (not name or spec or conversion):
                raise ValueError(f"unit_template {template!r}: each field is a plain {{key}} (no format spec, "
                                 f"conversion or empty name); got {{{name or ''}{'!' + conversion if conversion else ''}"
                                 f"{':' + spec if spec else ''}}}")
            self.pieces.append((literal, name))
        self.fields = tuple(dict.fromkeys(name for _, name in self.pieces if name is not None))
        if not self.fields:
            raise ValueError(f"unit_template {template!r} names no field: put each JSONL key in braces, e.g. {{smiles}}")
        tag = "|".join(map(re.escape, TAGS))
        literal_tags = [t for literal, _ in self.pieces for t in re.findall(tag, literal)]
        if (any(re.fullmatch(f"(?:{tag})*", literal) is None for literal, _ in self.pieces)
                or literal_tags != sorted(set(literal_tags), key=TAGS.index)):
            raise ValueError(f"unit_template {template!r}: the text outside the {{fields}} may only be the unit's tags "
                             f"{' '.join(TAGS)}, each at most once and in that order; the unit is "
                             f"[SMILES]<SMILES>[/SMILES][CONFORMER]x,y,z;...[/CONFORMER]")

    def describe(self) -> dict:
        return {"template": self.template, "fields": list(self.fields), "frame": self.frame}

    @quiet_rdkit
    def build(self, canonical: str, values: dict):
        """The unit of a row (canonical SMILES, {field: the record's value or None})."""
        missing = [name for name in self.fields if values.get(name) is None]
        if missing:
            return None, "unit_missing_field", f"no value for {', '.join(map(repr, missing))}"
        parts, arrays = [], {}
        for literal, name in self.pieces:
            parts.append(literal)
            if name is not None:
                value = _field_value(values[name])
                if value is None or (isinstance(value, str) and "\0" in value):
                    kind = type(values[name]).__name__
                    return None, "unit_malformed", f"{name!r} holds {kind}: {_short(values[name])}"
                if isinstance(value, str):
                    parts.append(value)
                else:  # a list of triples: used as numbers, spelled only where the text needs them
                    arrays[f"\0{name}\0"] = value
                    parts.append(f"\0{name}\0")
        text = "".join(parts)
        m = UNIT.match(text.strip())
        if m is None:
            shown = text
            for key, array in arrays.items():
                shown = shown.replace(key, _spelled(array))
            return None, "unit_malformed", f"not [SMILES]...[/SMILES][CONFORMER]...[/CONFORMER]: {_short(shown)}"
        smiles, body = m.group(1).strip(), m.group(2).strip()
        rows = arrays.get(body)
        if rows is None:
            for key, array in arrays.items():
                body = body.replace(key, _spelled(array))
            rows = _read_coordinates(body)
            if isinstance(rows, str):
                return None, "unit_malformed", rows
        if not (np.isfinite(rows).all() and np.abs(rows).max() <= _COORDINATE_MAX):
            return None, "unit_malformed", f"a coordinate is not finite or beyond {_COORDINATE_MAX:,.0f} A"
        mol = Chem.MolFromSmiles(smiles) if len(smiles) <= _SMILES_MAX else None
        if mol is not None and not self.keep_stereo:  # as the ETL's canonical SMILES drops it (isotopes stay)
            Chem.RemoveStereochemistry(mol)
        written = Chem.MolToSmiles(mol) if mol is not None else None
        if written != canonical:
            return None, "unit_smiles_mismatch", f"unit SMILES {_short(smiles)} is {written!r}, the row {canonical!r}"
        if len(rows) != mol.GetNumAtoms():
            return None, "unit_atom_count", f"{len(rows)} x,y,z for {mol.GetNumAtoms()} heavy atoms of {_short(smiles)}"
        return _unit_at(canonical, _placed(canonical, rows[_output_order(mol)]), None, self.decimals, self.frame)


@quiet_rdkit
def unit_of_record(canonical: str, mol, decimals: int = 2, frame: str = "canonical"):
    """``--conformers sd``: the unit of an SD record's own 3D coordinates. ``mol`` is the
    molecule the ETL made of the record (hydrogens removed, standardized: RDKit's fragment,
    charge and normalization steps keep each remaining atom's coordinates) and ``canonical``
    its canonical SMILES. (unit, None, None) or (None, reason, what is wrong): ``sd_not_3d``
    (the record's coordinates are 2D or absent), ``unit_malformed`` (a coordinate not
    finite or beyond 10,000 A), ``unit_geometry``, ``unit_stereo`` (as ``UnitTemplate``)."""
    if mol.GetNumConformers() == 0 or not mol.GetConformer().Is3D():
        return None, "sd_not_3d", "the record's coordinates are 2D (dimension code 2D, or every z is 0)"
    drawing = _drawing(mol)
    if drawing:
        return None, "sd_not_3d", f"a drawing: 3D header, but every z 0 ({drawing})"
    if Chem.MolToSmiles(mol) != canonical:  # the ETL's own molecule: never, unless a step lost an atom's place
        return None, "unit_smiles_mismatch", f"the record's molecule is {Chem.MolToSmiles(mol)!r}, the row {canonical!r}"
    rows = mol.GetConformer().GetPositions()
    if not (np.isfinite(rows).all() and np.abs(rows).max() <= _COORDINATE_MAX):
        return None, "unit_malformed", f"a coordinate is not finite or beyond {_COORDINATE_MAX:,.0f} A"
    return _unit_at(canonical, mol, _output_order(mol), decimals, frame)  # checked in the record's own atom order


def _drawing(mol) -> str | None:
    """Why a conformer whose every z is 0 is a drawing and no geometry (RDKit reads a record
    whose header says 3D as 3D, whatever its z): an atom that cannot lie in one plane with
    its heavy neighbours (sp3, three or more of them), or single and multiple bonds all of
    one length (a drawing's; C-C 1.5 and C=O 1.2 A in any geometry). A molecule that can be
    flat, drawn with bonds of several lengths, is left to the bond range."""
    positions = mol.GetConformer().GetPositions()
    if np.abs(positions[:, 2]).max() >= 5e-5:  # the molfile's 4 decimals: some z is not 0
        return None
    for atom in mol.GetAtoms():
        if atom.GetHybridization() == Chem.HybridizationType.SP3 and atom.GetDegree() >= 3:
            return f"atom {atom.GetIdx()}: sp3, {atom.GetDegree()} heavy neighbours"
    orders = {bond.GetBondType() == Chem.BondType.SINGLE for bond in mol.GetBonds()}
    if len(orders) == 2:
        lengths = [np.linalg.norm(positions[b.GetBeginAtomIdx()] - positions[b.GetEndAtomIdx()])
                   for b in mol.GetBonds()]
        if max(lengths) - min(lengths) < 0.05:
            return f"single and multiple bonds all {np.mean(lengths):.2f} A"
    return None


def _output_order(mol) -> list[int]:
    """Atom k of the SMILES RDKit last wrote of ``mol`` is ``mol``'s atom ``order[k]``."""
    return list(mol.GetPropsAsDict(True, True)["_smilesAtomOutputOrder"])


def _unit_at(canonical: str, placed, order, decimals: int, frame: str):
    """The unit of ``canonical`` with the geometry of ``placed`` (a molecule of it with one
    3D conformer; its atom ``order[k]`` is the canonical SMILES' atom k, or the same atom
    when ``order`` is None) once the geometry and the stereo the SMILES specifies check out:
    (unit, None, None) or (None, ``unit_geometry`` / ``unit_stereo``, what is wrong, its atom
    numbers ``placed``'s)."""
    atoms = f"atoms of {_short(canonical)}" if order is None else "the record's heavy atoms from 0"
    problem = _geometry_problem(placed)
    if problem:
        return None, "unit_geometry", f"{problem} ({atoms})"
    problem = _stereo_problem(placed) if any(c in canonical for c in "@/\\") else None
    if problem:
        return None, "unit_stereo", f"{problem} ({atoms})"
    if frame == "canonical":
        rdMolTransforms.CanonicalizeConformer(placed.GetConformer())
    positions = placed.GetConformer().GetPositions()
    if order is not None:
        positions = positions[order]
    return format_unit(canonical, positions.tolist(), decimals), None, None


def _short(value, limit: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _field_value(value):
    """A field's value: a string as it is, a list of [x, y, z] numbers as an (n, 3) array,
    anything else None."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(atom, list) and len(atom) == 3
            and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in atom) for atom in value):
        try:
            return np.array(value, dtype=np.float64)
        except OverflowError:  # an integer beyond float64: no coordinate
            return None
    return None


def _spelled(array) -> str:
    return ";".join(",".join(repr(float(c)) for c in atom) for atom in array)


_IN = r"\s*[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?\s*"  # a number as records spell them
_INPUT_BODY = re.compile(rf"{_IN},{_IN},{_IN}(?:;{_IN},{_IN},{_IN})*")


def _read_coordinates(body: str):
    """The (n, 3) array of a conformer as a record spells it (``x,y,z;...``, numbers in any
    decimal or exponent form, spaces around them), or what is wrong with it."""
    if not body:
        return "no coordinates"
    if _INPUT_BODY.fullmatch(body) is None:
        for n, atom in enumerate(body.split(";")):
            if not re.fullmatch(f"{_IN},{_IN},{_IN}", atom):
                return f"atom {n} is {atom.strip()[:40]!r}, not x,y,z"
        return f"not x,y,z;...: {_short(body)}"
    return np.array([float(v) for v in body.replace(";", ",").split(",")]).reshape(-1, 3)


def _placed(smiles: str, positions):
    """The molecule of ``smiles`` with one 3D conformer at ``positions`` (its atom order)."""
    mol = Chem.MolFromSmiles(smiles)
    conf = Chem.Conformer(mol.GetNumAtoms())
    for i, (x, y, z) in enumerate(positions.tolist()):
        conf.SetAtomPosition(i, Point3D(x, y, z))
    conf.Set3D(True)
    mol.AddConformer(conf, assignId=True)
    return mol


def _stereo_problem(mol) -> str | None:
    """A stereocentre (CIP label) or double bond (E/Z) that ``mol``'s SMILES specifies and
    its conformer has the other way round; stereo the SMILES leaves open is not checked."""
    want = Chem.Mol(mol)
    Chem.AssignStereochemistry(want, cleanIt=True, force=True)
    got = Chem.Mol(mol)
    Chem.AssignStereochemistryFrom3D(got)
    for atom in want.GetAtoms():
        if atom.HasProp("_CIPCode"):
            other = got.GetAtomWithIdx(atom.GetIdx())
            label = other.GetProp("_CIPCode") if other.HasProp("_CIPCode") else "no stereocentre"
            if label != atom.GetProp("_CIPCode"):
                return f"atom {atom.GetIdx()} is {label} in 3D, {atom.GetProp('_CIPCode')} in the SMILES"
    double = (Chem.BondStereo.STEREOE, Chem.BondStereo.STEREOZ)
    for bond in want.GetBonds():
        if bond.GetStereo() in double and got.GetBondWithIdx(bond.GetIdx()).GetStereo() != bond.GetStereo():
            return (f"bond {bond.GetBeginAtomIdx()}-{bond.GetEndAtomIdx()} is "
                    f"{got.GetBondWithIdx(bond.GetIdx()).GetStereo().name[-1]} in 3D, "
                    f"{bond.GetStereo().name[-1]} in the SMILES")
    return None


def _geometry_problem(mol) -> str | None:
    """What makes ``mol``'s conformer no geometry of it: a bond outside ``_BOND_RANGE``, two
    atoms within ``_CLASH``; None when nothing does."""
    distance = Chem.Get3DDistanceMatrix(mol)
    low, high = _BOND_RANGE
    for bond in mol.GetBonds():
        i, j = bond.GetBeginAtomIdx(), bond.GetEndAtomIdx()
        if not low <= distance[i, j] <= high:
            return f"bond {i}-{j} is {distance[i, j]:.2f} A (not in {low}-{high} A)"
    np.fill_diagonal(distance, np.inf)
    if distance.min() < _CLASH:
        i, j = np.unravel_index(int(distance.argmin()), distance.shape)
        return f"atoms {min(i, j)} and {max(i, j)} are {distance[i, j]:.2f} A apart"
    return None


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
        if not 1 <= timeout_s <= 3600 or not 0 <= decimals <= 4:
            raise ValueError("conformer timeout_s must be in [1, 3600] and decimals in [0, 4]")
        self.Chem, self.AllChem, self.dg, self.transforms = Chem, AllChem, rdDistGeom, rdMolTransforms
        self.seed, self.mmff, self.timeout_s, self.decimals, self.max_mmff_iters = (
            seed, mmff, timeout_s, decimals, max_mmff_iters)

    @quiet_rdkit
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
        positions, notes = self.embed(canonical, xxh3_64_intdigest(canonical.encode(), self.seed))
        if isinstance(positions, str):
            return None, positions, notes
        return format_unit(canonical, positions, self.decimals), None, notes


@quiet_rdkit
def reference_bond_lengths(smiles: str, seed: int = 0):
    """Heavy-atom bond lengths {(i, j): Å} of the MMFF-relaxed ETKDG geometry, or None."""
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


@quiet_rdkit
def bond_check(text: str, tolerance: float = BOND_TOLERANCE) -> dict:
    """One sampled unit: does it decode to a molecule with coordinates (one x,y,z per heavy
    atom), and are all its bond lengths within ``tolerance`` Å of the MMFF-relaxed geometry's?"""
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
