"""Molecular string representations: what a model's tokens spell, and how to get a molecule back.

A manifest names its representation (``manifest["representation"]["name"]``; absent means
SMILES); the ETL writes it (``encode`` after canonicalization, each row decoded back and
compared with its canonical SMILES), and sampling, evaluation and export decode through
it, so every metric is computed on molecules.

- ``smiles``: RDKit canonical SMILES, the regex tokenizer of Schwaller et al.
- ``selfies`` (Krenn et al. 2020, the ``selfies`` package): every string decodes to a
  molecule. One token per bracket symbol (``[C]``, ``[=Branch1]``, ``[Ring1]``) and ``.``.
  Rows refused: ``selfies_encode_error`` (the encoder raises: an atom whose valence is
  beyond SELFIES' semantic constraints, e.g. hypervalent or charged forms it has no rule
  for, or a SMILES feature it does not take) and ``selfies_roundtrip`` (the string decodes
  to another molecule: SELFIES' constraints change a valence, or stereo is lost).
- ``conformer``: conformer units (``molds.chemistry.conformers``), the canonical SMILES and one 3D
  conformer as text, made by ``molds-preprocess --conformers etkdg``, taken from
  JSON-lines fields with ``--unit_template`` (``encode_fields``), or from SD records' own 3D
  coordinates with ``--conformers sd`` (``encode_mol``).
- ``safe`` (Noutahi et al. 2024, SAFE-GPT, the ``safe-mol`` package): the molecule cut at
  its BRICS bonds into fragments written one after another (``.``), each cut bond a
  ring-closure digit shared by its two fragments; a SMILES-compatible string. The SMILES
  regex tokenizes it (attachment points are its ring-closure digits and ``%nn``). The rule
  for a molecule with no BRICS bond to cut (ethanol, benzene, ~1 % of MOSES): kept as one
  fragment (SAFE's ``allow_empty``: the SMILES itself, still valid SAFE), counted as
  ``single_fragment`` in the manifest. Rows refused: ``safe_encode_error`` (SAFE raises)
  and ``safe_roundtrip`` (decodes to another molecule).

``selfies`` and ``safe-mol`` are optional extras (``pip install molds[selfies]``,
``molds[safe]``): asked for by name when a manifest or an ETL needs them.
"""

from __future__ import annotations

import importlib
import importlib.metadata

from ..errors import MoldsError
from . import quiet_rdkit

SMILES_PATTERN = (
    r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$"
    r"|%\([0-9]+\)|%[0-9]{2}|[0-9])"
)
SELFIES_PATTERN = r"(\[[^\]]+]|\.)"
# conformer units: the SMILES regex (its bracket alternative takes the [SMILES] ... tags whole,
# its digits, '-' and '.' the numbers) and the coordinate separators ',' and ';'
CONFORMER_PATTERN = SMILES_PATTERN[:-1] + r"|,|;)"

NAMES = ("smiles", "selfies", "safe", "conformer")
REASONS = {  # the ETL's rejection reasons of the representations (molds.chemistry.canonical.REJECT_REASONS holds them too)
    "selfies_encode_error": "the SELFIES encoder refuses the molecule (a valence beyond its semantic "
                            "constraints, or a SMILES feature it has no symbol for)",
    "selfies_roundtrip": "the SELFIES string decodes to another molecule (constraints changed a valence, "
                         "or stereo was lost)",
    "safe_encode_error": "SAFE's encoder raises on the molecule",
    "safe_roundtrip": "the SAFE string decodes to another molecule",
    "conformer_error": "RDKit's ETKDGv3 found no 3D embedding of the molecule (--conformers etkdg)",
    "conformer_timeout": "the conformer took longer than --conformer_timeout_s (ETKDG's own timeout included)",
    "conformer_roundtrip": "the conformer unit does not decode back to the molecule and its coordinates",
    "unit_missing_field": "a JSONL key --unit_template names is absent or null in the record",
    "unit_malformed": "the record's fields, put in --unit_template, do not spell a unit "
                      "([SMILES]...[/SMILES][CONFORMER]x,y,z;...[/CONFORMER], finite coordinates within 10,000 A)",
    "unit_smiles_mismatch": "the unit's SMILES does not parse, or is another molecule than the row's "
                            "(after standardization)",
    "unit_atom_count": "the unit's conformer does not give one x,y,z per heavy atom of its SMILES",
    "unit_geometry": "a bond of the unit's conformer is outside 0.9-3.2 A, or two atoms lie within 0.5 A "
                     "(coordinates in another atom order than the SMILES', or not in A)",
    "unit_stereo": "a stereocentre or double bond the unit's SMILES specifies has the other configuration in "
                   "its conformer (a mirror image, a cis conformer of a trans SMILES)",
    "sd_not_3d": "--conformers sd: the SD record's coordinates are 2D or absent (dimension code 2D, or every z is 0), "
                 "no conformer",
}
_PACKAGES = {"selfies": ("selfies", "selfies"), "safe": ("safe", "safe-mol")}  # module, pip name


class MissingPackage(ImportError):
    pass


def _require(name: str):
    module, pip_name = _PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingPackage(f"the {name} representation needs the {pip_name!r} package: "
                             f"pip install {pip_name} (or pip install 'molds[{name}]')") from exc


class Representation:
    """SMILES, the base case: the canonical SMILES is the text."""

    name = "smiles"
    pattern = SMILES_PATTERN
    notes: tuple | list = ()  # what encoding met that is no refusal, for the manifest's counts

    def encode(self, canonical: str) -> tuple[str | None, str | None]:
        """(text, None), or (None, reason) for a row the representation cannot hold."""
        return canonical, None

    def decode(self, text: str) -> str | None:
        """The SMILES a text spells (not canonicalized), or None when it spells none."""
        return text or None

    def describe(self) -> dict:
        """The manifest's ``representation`` block."""
        return {"name": self.name}


class Selfies(Representation):
    name = "selfies"
    pattern = SELFIES_PATTERN

    def __init__(self):
        self.sf = _require("selfies")

    def encode(self, canonical):
        try:
            text = self.sf.encoder(canonical, strict=True)
        except Exception:  # noqa: BLE001 - selfies.EncoderError and the errors behind it
            return None, "selfies_encode_error"
        return (text, None) if text else (None, "selfies_encode_error")

    def decode(self, text):
        try:
            return self.sf.decoder(text) or None
        except Exception:  # noqa: BLE001 - selfies.DecoderError: not a SELFIES string
            return None

    def describe(self):
        return {"name": self.name, "package": "selfies", "version": importlib.metadata.version("selfies"),
                "constraints": "selfies default", "tokens": "one per bracket symbol, and '.'"}


class Safe(Representation):
    name = "safe"

    def __init__(self):
        # (safe-mol's converter, all molds calls, logs nothing; its loguru logger, which the
        # package's other tools use, is left as the caller has it)
        self.safe = _require("safe")

    @quiet_rdkit
    def encode(self, canonical):
        safe = self.safe
        try:
            return safe.encode(canonical, canonical=True, slicer="brics"), None
        except safe.SAFEFragmentationError:  # no BRICS bond to cut: the rule above, one fragment
            try:
                return safe.encode(canonical, canonical=True, slicer="brics", allow_empty=True), None
            except Exception:  # noqa: BLE001
                return None, "safe_encode_error"
        except Exception:  # noqa: BLE001 - SAFEEncodeError and RDKit errors inside it
            return None, "safe_encode_error"

    @quiet_rdkit
    def encode_fragments(self, smiles: str, randomize: bool = False, seed: int = 0) -> str:
        """Fragments as they are (no slicing), each ``[*]`` an open attachment digit: the
        start of a SAFE string another fragment completes (constrained design)."""
        from safe.converter import SAFEConverter  # optional: the safe extra

        try:
            return SAFEConverter(slicer=None).encoder(smiles, canonical=not randomize, randomize=randomize,
                                                      allow_empty=True, seed=seed)
        except Exception as exc:  # noqa: BLE001 - SAFEEncodeError and RDKit errors inside it
            raise MoldsError(f"SAFE cannot encode {smiles!r} as a fragment: {exc}") from exc

    @quiet_rdkit
    def decode(self, text):
        try:
            return self.safe.decode(text, canonical=False, ignore_errors=True) or None
        except Exception:  # noqa: BLE001 - SAFEDecodeError
            return None

    def describe(self):
        return {"name": self.name, "package": "safe-mol", "version": importlib.metadata.version("safe-mol"),
                "slicer": "brics", "no_cut": "kept as one fragment (allow_empty), counted as single_fragment",
                "tokens": "the SMILES regex (attachment points are ring-closure digits)"}


class ConformerUnits(Representation):
    """``[SMILES]...[/SMILES][CONFORMER]x,y,z;...[/CONFORMER]``: the molecule and one 3D
    conformer (``molds.chemistry.conformers``); decodes to the SMILES part."""

    name = "conformer"
    pattern = CONFORMER_PATTERN

    def __init__(self, seed: int = 0, mmff: bool = True, timeout_s: int = 2, decimals: int = 2,
                 template: str | None = None, frame: str = "canonical", keep_stereo: bool = True,
                 from_sd: bool = False):
        self.options = {"seed": seed, "mmff": mmff, "timeout_s": timeout_s, "decimals": decimals}
        self._embedder = None
        self.template = None
        self.from_sd = from_sd  # units of the SD records' own coordinates (--conformers sd)
        self.frame = frame
        if template is not None and from_sd:
            raise ValueError("conformer units come from --unit_template or from SD records, not both")
        if template is not None:  # units from the input's fields (--unit_template), checked up front
            from .conformers import UnitTemplate  # here: molds-preprocess --help loads no xxhash

            self.template = UnitTemplate(template, decimals, frame, keep_stereo)
        if from_sd:
            from .conformers import check_frame  # here: molds-preprocess --help loads no xxhash

            check_frame(frame)
        if template is not None or from_sd:
            self.options = {"decimals": decimals}
        self.notes: list[str] = []

    def encode(self, canonical):
        from .conformers import Embedder  # here: molds-preprocess --help loads no xxhash

        if self.template is not None or self.from_sd:
            raise ValueError("these conformer units come from the input: encode_fields or encode_mol, not encode")
        if self._embedder is None:
            self._embedder = Embedder(**self.options)
        unit, reason, notes = self._embedder(canonical)
        self.notes += notes
        if reason is not None:
            return None, reason
        return self._checked(canonical, unit)

    def encode_fields(self, canonical: str, fields: dict):
        """``--unit_template``: the unit of a record's fields ({key: value}), or (what is
        wrong, reason)."""
        if self.template is None:
            raise ValueError("these conformer units are embedded (--conformers etkdg): encode, not encode_fields")
        unit, reason, detail = self.template.build(canonical, fields)
        if reason is not None:
            return detail, reason
        return self._checked(canonical, unit)

    def encode_mol(self, canonical: str, mol):
        """``--conformers sd``: the unit of the molecule the ETL read from an SD record, with
        that record's coordinates, or (what is wrong, reason)."""
        from .conformers import unit_of_record  # here: molds-preprocess --help loads no xxhash

        if not self.from_sd:
            raise ValueError("these conformer units are not the SD records' (--conformers sd): encode_mol is theirs")
        unit, reason, detail = unit_of_record(canonical, mol, self.options["decimals"], self.frame)
        if reason is not None:
            return detail, reason
        return self._checked(canonical, unit)

    def _checked(self, canonical: str, unit: str):
        """The unit, if it reads back as the canonical SMILES and the very numbers written
        (exact to its precision), else (None, ``conformer_roundtrip``)."""
        from .conformers import format_unit, parse_unit  # here: molds-preprocess --help loads no xxhash

        parsed = parse_unit(unit)
        if parsed is None or parsed[0] != canonical or format_unit(*parsed, self.options["decimals"]) != unit:
            return None, "conformer_roundtrip"
        return unit, None

    def decode(self, text):
        from .conformers import parse_unit  # here: molds-preprocess --help loads no xxhash

        parsed = parse_unit(text)
        return parsed[0] if parsed else None

    def describe(self):
        import rdkit  # here: molds-preprocess --help loads no RDKit

        given = self.template is not None or self.from_sd
        unit = ("[SMILES]<canonical SMILES>[/SMILES][CONFORMER]x,y,z;... (heavy atoms in SMILES order, Å, "
                + ("the input's frame" if given and self.frame == "as_given"
                   else "centroid at the origin, principal axes along x, y, z") + ")[/CONFORMER]")
        if self.from_sd:
            return {"name": self.name, "method": "the SD records' 3D coordinates (--conformers sd)",
                    "rdkit_version": rdkit.__version__, **self.options, "frame": self.frame, "unit": unit}
        if self.template is not None:
            return {"name": self.name, "method": "the input's conformers (--unit_template)",
                    "rdkit_version": rdkit.__version__, **self.options, **self.template.describe(), "unit": unit}
        return {"name": self.name, "method": "RDKit ETKDGv3" + (" + MMFF94" if self.options["mmff"] else ""),
                "rdkit_version": rdkit.__version__, **self.options, "unit": unit}


def get(name: str | None, **options) -> Representation:
    """The representation called ``name`` (None: SMILES); ``options`` for conformer units."""
    name = name or "smiles"
    if name == "smiles":
        return Representation()
    if name == "selfies":
        return Selfies()
    if name == "safe":
        return Safe()
    if name == "conformer":
        return ConformerUnits(**options)
    raise ValueError(f"unknown representation {name!r} (one of {', '.join(NAMES)})")


def of_manifest(manifest) -> Representation:
    """The representation a manifest (a ``Manifest`` or its dict) was written in."""
    data = getattr(manifest, "data", manifest) or {}
    block = data.get("representation") or {}
    return get(block.get("name", "smiles"))
