"""RDKit stage of the ETL: parse, standardize, canonicalize, scaffold.

Every rejected molecule gets a named reason (the keys of ``REJECT_REASONS``) so the
manifest's ``rows_in == rows_out + duplicates + sum(rejected)`` invariant holds.
RDKit is imported inside the functions that need it: importing this module is cheap.
Shared by the ETL (``molds.preprocessing``) and the generation metrics, so that neither
imports the other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass

from . import quiet_rdkit
from .representation import REASONS as REPRESENTATION_REASONS

# the refusals of a pair record as a whole (``molds.chemistry.pairs``); a molecule of either side is
# refused for the molecule reasons below
PAIR_REASONS = {
    "not_a_reaction": "the reaction SMILES is not reactants>reagents>products (exactly two '>'), or text other "
                      "than a CXSMILES extension follows it",
    "empty_side": "the source or the target holds no molecule (reactants or products missing, an empty column)",
    "no_op_reaction": "every product is also a reactant or reagent: nothing reacts",
    "target_in_two_splits": "the pair's target is also the target of a pair in an earlier split (train before "
                            "valid before test): kept only there, so no target is learnt in one split and "
                            "scored in another (a given split, --split given, is kept whole instead: its "
                            "overlaps are counted, not refused)",
}

REJECT_REASONS = {
    "malformed_row": "the row has a different number of fields than the header, or is not a JSON object, or its "
                     "SMILES value is not a string",
    "non_utf8": "a field holds bytes that are not valid UTF-8",
    "missing_field": "the record has no SMILES field (JSONL / Parquet null)",
    "empty": "the SMILES field is empty or whitespace",
    "too_long": "the SMILES string, less its atom-map numbers, is longer than max_smiles_length (checked before "
                "parsing; for an SD record, its canonical SMILES)",
    "too_many_heavy_atoms": "more heavy atoms than max_heavy_atoms (estimated before parsing, exact after)",
    "parse_error": "RDKit cannot parse the SMILES (syntax, unclosed ring, embedded whitespace that does not open "
                   "a CXSMILES extension)",
    "cxsmiles_error": "the SMILES parses but its CXSMILES extension (`SMILES |...|`) does not, by RDKit's strict "
                      "CXSMILES reader",
    "valence_error": "RDKit parses the SMILES but an atom has an impossible valence",
    "kekulize_error": "RDKit cannot kekulize the aromatic system",
    "sanitize_error": "RDKit sanitization failed for another reason",
    "standardize_error": "rdMolStandardize raised on this molecule",
    "empty_molecule": "the molecule is empty (an SD record with no atoms) or empty after standardization",
    "scaffold_error": "the Murcko scaffold could not be computed",
    "inchi_error": "the InChIKey used as dedupe key could not be computed",
    "bad_label": "a label value is neither a number float32 holds (finite, at most 3.4e38) nor a recognised missing "
                 "marker",
    "tokenizer_roundtrip": "decoding the token ids does not give back the canonical SMILES",
    "sdf_parse_error": "RDKit cannot read the SD record's molblock (counts line, atom or bond block, no M  END)",
    "empty_record": "an SD record with nothing before its $$$$ line",
    "record_too_large": "an SD record over 8 MiB without a $$$$ line (not SDF, or a lost separator): skipped unread",
    "bad_conformer_rank": "the record's --conformer_rank_by value is missing or not a number",
    "padding": "a line, or an SD record, of nothing but NUL bytes or Ctrl-Z (DOS's end of file): NUL bytes where "
               "records should be can mean a copy or download that did not finish",
    "truncated_input": "the compressed input ends before its end marker: the record cut there (SDF), or the "
                       "unreadable rest of the file (one count per file); the records before it are read",
    "bad_split": "with --split given: the row's --split_column value (or its file's name) names no split (train, "
                 "val / valid / validation / dev, test)",
    **REPRESENTATION_REASONS,
    **PAIR_REASONS,
}

# Hard bounds on the caps: RDKit's Murcko scaffold costs ~0.1 s at 500 heavy atoms, ~1 s at
# 1,000 and ~10 s at 2,000 (cubic); a 10,000-atom molecule takes minutes and gigabytes.
MAX_HEAVY_ATOMS_CAP = 1000
MAX_SMILES_LENGTH_CAP = 20000

# Pre-parse heavy-atom estimate: atom tokens of the SMILES, minus bracket hydrogens
# ([H], [2H], [H+]) but not [Hg]/[He]/[Hf]/[Ho]/[Hs].
_HEAVY_ATOM_TOKEN = re.compile(r"\[(?!\d*H(?![a-z]))[^\]]*\]|Br|Cl|[BCNOSPFIbcnosp]")
_WHITESPACE = re.compile(r"\s")
#: an atom-map number (``[CH3:14]``): an annotation, not part of the molecule, and not counted
#: against max_smiles_length (a mapped reaction's SMILES is about twice its unmapped length)
ATOM_MAP = re.compile(r":\d+\]")
# ``SMILES |extension|``: ChemAxon's CXSMILES (enhanced stereo, atom labels, radicals,
# coordinates), as Enamine, PubChem and ChemAxon tools export. The extension holds no whitespace.
_CXSMILES = re.compile(r"(\S+)[ \t]+(\|[^\s|]*\|)")


def split_cxsmiles(text: str) -> tuple[str, str | None, str]:
    """``(SMILES, CXSMILES extension or None, what follows)`` of a cell or a ``.smi`` line."""
    m = _CXSMILES.match(text)
    if m is None:
        return text, None, ""
    return m.group(1), m.group(2), text[m.end():].strip()


@dataclass(frozen=True)
class ChemOptions:
    """What the RDKit stage does to each molecule; hashed into the manifest."""

    keep_stereo: bool = True
    largest_fragment: bool = False
    uncharge: bool = False
    normalize: bool = False
    max_heavy_atoms: int = 150
    max_smiles_length: int = 500
    scaffold: str = "murcko"  # or "generic"
    dedupe_key: str = "canonical"  # or "inchikey"

    @classmethod
    def of_manifest(cls, manifest) -> "ChemOptions":
        """The options a manifest was canonicalized with (``canonicalization.options``)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        opts = manifest.data["canonicalization"]["options"] if manifest is not None else {}
        return cls(**{k: v for k, v in opts.items() if k in fields})

    def __post_init__(self):
        if self.scaffold not in ("murcko", "generic"):
            raise ValueError(f"scaffold must be 'murcko' or 'generic', got {self.scaffold!r}")
        if self.dedupe_key not in ("canonical", "inchikey"):
            raise ValueError(f"dedupe_key must be 'canonical' or 'inchikey', got {self.dedupe_key!r}")
        if not 1 <= self.max_heavy_atoms <= MAX_HEAVY_ATOMS_CAP:
            raise ValueError(f"max_heavy_atoms={self.max_heavy_atoms} is outside [1, {MAX_HEAVY_ATOMS_CAP}] (RDKit's "
                             f"scaffold of a larger molecule takes seconds to minutes and gigabytes)")
        if not 1 <= self.max_smiles_length <= MAX_SMILES_LENGTH_CAP:
            raise ValueError(f"max_smiles_length={self.max_smiles_length} is outside [1, {MAX_SMILES_LENGTH_CAP}]")

    @property
    def standardizes(self) -> bool:
        return self.largest_fragment or self.uncharge or self.normalize

    def describe(self) -> dict:
        """The manifest's ``canonicalization`` block: versions, options and their hash."""
        import rdkit  # here: molds-preprocess --help loads no RDKit

        options = dataclasses.asdict(self)
        options.update(isomeric_smiles=True, canonical=True, scaffold_include_chirality=False,
                       standardize_order=["normalize", "largest_fragment", "uncharge"])
        blob = json.dumps({"rdkit": rdkit.__version__, "options": options}, sort_keys=True)
        return {
            "toolkit": "rdkit",
            "rdkit_version": rdkit.__version__,
            "options": options,
            "hash": hashlib.sha256(blob.encode()).hexdigest(),
        }


@dataclass
class Molecule:
    canonical: str
    scaffold: str
    dedupe_key: str
    mol: object = dataclasses.field(default=None, repr=False, compare=False)
    """The RDKit molecule behind ``canonical``, only where ``from_mol`` was asked to keep it."""


class Canonicalizer:
    """Turns one raw SMILES into a ``Molecule`` or a rejection reason (a ``str``).

    Built once per worker process: the standardizer objects are reused across rows.
    """

    def __init__(self, options: ChemOptions):
        from rdkit import Chem  # here: molds-preprocess --help loads no RDKit
        from rdkit.Chem.Scaffolds import MurckoScaffold  # here: molds-preprocess --help loads no RDKit

        self.options = options
        self._chem = Chem
        self._scaffold_of = MurckoScaffold.GetScaffoldForMol
        self._generic = MurckoScaffold.MakeScaffoldGeneric if options.scaffold == "generic" else None
        self._steps = []
        self._cx = None
        self.cxsmiles = 0  # molecules read from CXSMILES (``SMILES |extension|``), counted in the manifest
        if options.standardizes:
            from rdkit.Chem.MolStandardize import rdMolStandardize  # here: molds-preprocess --help loads no RDKit

            if options.normalize:
                self._steps.append(rdMolStandardize.Normalizer().normalize)
            if options.largest_fragment:
                self._steps.append(rdMolStandardize.LargestFragmentChooser(preferOrganic=True).choose)
            if options.uncharge:
                self._steps.append(rdMolStandardize.Uncharger().uncharge)

    @quiet_rdkit
    def __call__(self, raw: str) -> Molecule | str:
        mol = self._parse(raw)
        if isinstance(mol, str):
            return mol
        molecule = self._from_mol(mol)
        # a parsed SMILES with whitespace in it was read with its CXSMILES extension (any other
        # whitespace is refused by ``parse``)
        if isinstance(molecule, Molecule) and _WHITESPACE.search(raw.strip()):
            self.cxsmiles += 1
        return molecule

    def _parse(self, raw: str):
        """One raw SMILES (or CXSMILES) to an RDKit molecule, or the reason it is refused;
        the length checks that come before parsing included. ``__call__`` is ``parse`` then
        ``from_mol``; a caller that changes the molecule in between (``molds.chemistry.pairs`` clears
        atom maps) calls the two itself."""
        opts = self.options
        smiles = raw.strip()
        if not smiles:
            return "empty"
        cx = None
        if _WHITESPACE.search(smiles):
            smiles, cx, rest = split_cxsmiles(smiles)
            if cx is None or rest:
                return "parse_error"  # RDKit would silently read the text after a space as a name
        if len(smiles) > opts.max_smiles_length and len(ATOM_MAP.sub("]", smiles)) > opts.max_smiles_length:
            return "too_long"
        if len(smiles) > opts.max_heavy_atoms and len(_HEAVY_ATOM_TOKEN.findall(smiles)) > opts.max_heavy_atoms:
            return "too_many_heavy_atoms"
        if cx is None:
            mol = self._chem.MolFromSmiles(smiles)
        else:
            try:
                mol = self._chem.MolFromSmiles(f"{smiles} {cx}", self._cx_params())
            except RuntimeError:  # an invariant of RDKit's CXSMILES reader (a malformed data S-group)
                mol = None
            if mol is None and self._chem.MolFromSmiles(smiles) is not None:
                return "cxsmiles_error"
        if mol is None:
            return self._classify_failure(smiles)
        return mol

    def _cx_params(self):
        """RDKit's strict CXSMILES reading: the extension applied to the molecule (radicals,
        atom labels, enhanced stereo, coordinates); canonical SMILES keep what SMILES spell
        (stereo centres as drawn, radicals as hydrogen counts), not the labels, the
        enhanced-stereo groups or the coordinates."""
        if self._cx is None:
            self._cx = self._chem.SmilesParserParams()
            self._cx.allowCXSMILES, self._cx.strictCXSMILES, self._cx.parseName = True, True, False
        return self._cx

    def _from_mol(self, mol, check_length: bool = False, keep_mol: bool = False) -> Molecule | str:
        """The steps after parsing, for a molecule RDKit has already read (an SD record).
        ``check_length``: hold the canonical SMILES to ``max_smiles_length`` (a SMILES input
        is held to it before parsing). ``keep_mol``: the standardized molecule (with the
        record's coordinates) goes with the result as ``Molecule.mol``."""
        opts, Chem = self.options, self._chem
        mol = self._standardize(mol)
        if isinstance(mol, str):
            return mol
        if mol.GetNumHeavyAtoms() > opts.max_heavy_atoms:
            return "too_many_heavy_atoms"
        canonical = Chem.MolToSmiles(mol)
        if not canonical:
            return "empty_molecule"
        if check_length and len(canonical) > opts.max_smiles_length:
            return "too_long"
        try:
            core = self._scaffold_of(mol)
            if self._generic is not None:
                core = self._generic(core)
            scaffold = Chem.MolToSmiles(core, isomericSmiles=False)
        except Exception:
            return "scaffold_error"
        if opts.dedupe_key == "inchikey":
            key = Chem.MolToInchiKey(mol)
            if not key:
                return "inchi_error"
        else:
            key = canonical
        return Molecule(canonical, scaffold, key, mol if keep_mol else None)

    def _standardize(self, mol):
        """The options' standardization steps and stereo removal on a parsed molecule, or the
        reason it is refused (``from_mol``'s first steps)."""
        if mol.GetNumHeavyAtoms() > self.options.max_heavy_atoms:  # exact, before the costly steps (the
            return "too_many_heavy_atoms"  # scaffold of a huge molecule takes RDKit time cubic in its size)
        if self._steps:
            try:
                for step in self._steps:
                    mol = step(mol)
            except Exception:
                return "standardize_error"
            if mol is None:
                return "standardize_error"
        if not self.options.keep_stereo:
            self._chem.RemoveStereochemistry(mol)
        if mol.GetNumAtoms() == 0:
            return "empty_molecule"
        return mol

    def _classify_failure(self, smiles: str) -> str:
        """Only failed rows pay for this second, unsanitized parse."""
        Chem = self._chem
        mol = Chem.MolFromSmiles(smiles, sanitize=False)
        if mol is None:
            return "parse_error"
        try:
            Chem.SanitizeMol(mol)
        except Chem.AtomValenceException:
            return "valence_error"
        except Chem.KekulizeException:
            return "kekulize_error"
        except Exception:
            return "sanitize_error"
        return "sanitize_error"

    # the public steps, each with RDKit's log blocked (``__call__`` blocks it once for both)
    parse = quiet_rdkit(_parse)
    from_mol = quiet_rdkit(_from_mol)
    standardize = quiet_rdkit(_standardize)
