"""Which molecules of a corpus a set of files holds, compared as the ETL would make them one.

A pretraining corpus must hold no molecule of the files a model is scored on:
``make_pairs.py molecules --exclude`` (the encoder-decoder's denoising corpus, less every
molecule of the reaction files) and ``benchmarks/moleculenet.py`` (the encoder's corpus,
less every molecule of the property sets) leave out each corpus molecule whose *parent* is
the parent of a molecule of those files.

A molecule's parent is what the ETL's strictest canonicalization makes of it: its normal
form (RDKit's ``Normalizer``), its largest fragment, uncharged, without stereo, as
canonical SMILES (``Canonicalizer`` with ``normalize``, ``largest_fragment``, ``uncharge``
and ``keep_stereo=False``, the size caps at their limits). Spellings that any ETL setting
makes one molecule have one parent (a salt and its free base, a carboxylate and its acid, a
sulfoxide drawn charge-separated or with a double bond, two stereoisomers), so the
comparison leaves out at least what the ETL would call the same molecule, and a little more
(a corpus molecule is also left out for a stereoisomer or a salt of a benchmark molecule).
In a file of reactions or pairs each molecule of a side (each fragment: reactants, reagents
and products alike), atom maps removed, is a molecule of its own.
"""

from __future__ import annotations

from ..runtime.pool import chunked_map
from .canonical import MAX_HEAVY_ATOMS_CAP, MAX_SMILES_LENGTH_CAP, Canonicalizer, ChemOptions

#: the ETL's strictest canonicalization: what a parent is
PARENT_OPTIONS = ChemOptions(keep_stereo=False, largest_fragment=True, uncharge=True, normalize=True,
                             max_heavy_atoms=MAX_HEAVY_ATOMS_CAP, max_smiles_length=MAX_SMILES_LENGTH_CAP)


class Parents:
    """Parents of molecules (``of``) and of each molecule of a reaction side (``of_side``);
    ``None`` / left out where RDKit cannot read or standardize one (the ETL refuses those
    too). Built once per process, as ``Canonicalizer`` is."""

    def __init__(self):
        from rdkit import Chem  # here: importing the package loads no RDKit (molds.chemistry's rule)

        self._canon = Canonicalizer(PARENT_OPTIONS)
        self._chem = Chem

    def _parent(self, mol) -> str | None:
        mol = self._canon.standardize(mol)
        return None if isinstance(mol, str) else (self._chem.MolToSmiles(mol) or None)

    def of(self, smiles: str) -> str | None:
        """The parent of one molecule (a salt or mixture: of its largest fragment)."""
        mol = self._canon.parse(smiles) if smiles and smiles.strip() else None
        return None if mol is None or isinstance(mol, str) else self._parent(mol)

    def of_side(self, text: str) -> list[str]:
        """The parent of each molecule of a side (``A.B``, atom maps removed), or of every
        side of a reaction (``reactants>reagents>products``)."""
        found = []
        for side in text.split(">"):
            mol = self._canon.parse(side) if side.strip() else None
            if mol is None or isinstance(mol, str):
                continue
            for atom in mol.GetAtoms():
                atom.SetAtomMapNum(0)
            for frag in self._chem.GetMolFrags(mol, asMols=True):
                parent = self._parent(frag)
                if parent:
                    found.append(parent)
        return found


_SHARED: Parents | None = None


def _shared() -> Parents:
    global _SHARED
    if _SHARED is None:  # once per process (each worker of ``parents``' pool too)
        _SHARED = Parents()
    return _SHARED


def _of_chunk(chunk: list[str]) -> list[str | None]:
    return [_shared().of(s) for s in chunk]


def _of_sides_chunk(chunk: list[str]) -> list[list[str]]:
    return [_shared().of_side(s) for s in chunk]


def parents(texts: list[str], workers: int = 1, *, sides: bool = False, chunk: int = 2000) -> list:
    """``Parents.of`` of each text (``sides``: ``Parents.of_side``, a list each), in order, on
    ``workers`` processes when there is more than one chunk of work."""
    return chunked_map(_of_sides_chunk if sides else _of_chunk, texts, workers, chunk)

