"""Pair tasks as data: a reaction or a molecule pair turned into a canonical (source, target).

Reaction prediction (``forward``: reactants to products), retrosynthesis (``retro``:
products to reactants) and molecule-to-molecule models (``mol2mol``) train on pairs of
SMILES sides. A side is one or several molecules (``A.B``). The ETL reads a pair either as
a reaction SMILES (``reactants>reagents>products``, ``reactants>>products``, the layout of
USPTO-50k and USPTO-MIT) or as two columns (source, target); this module makes both
canonical, so that the same reaction written with other atom maps, another molecule order
or another SMILES spelling is the same pair:

- atom maps are removed (``[CH3:1]`` is ``C``), then each molecule of a side is
  canonicalized by the ETL's own ``Canonicalizer`` (the manifest's options: stereo,
  standardization, size caps), one fragment at a time (``GetMolFrags``, so a ring bond
  written across a dot stays one molecule);
- a side's molecules are put in canonical order (sorted canonical SMILES, joined by ``.``);
- reagents follow a policy (``reagents``): ``mix`` puts them among the reactants (the
  Molecular Transformer's "mixed" USPTO-MIT task), ``separate`` keeps them after a ``>``
  (``reactants>reagents``), ``drop`` leaves them out; ``auto`` is ``mix`` for ``forward``
  and ``drop`` otherwise (retrosynthesis predicts the reactants, not the solvent);
- the pair's split group is the scaffold of its product side (the target of ``forward`` and
  ``mol2mol``, the source of ``retro``), so a scaffold split holds out product scaffolds.

Every refusal is a named reason: the molecule reasons of ``molds.chemistry.canonical.REJECT_REASONS`` for
a molecule of either side, and ``PAIR_REASONS`` for the pair itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rdkit import Chem
from rdkit.Chem import rdFMCS

from . import quiet_rdkit
from .canonical import PAIR_REASONS, Canonicalizer, ChemOptions  # noqa: F401 (PAIR_REASONS: the pair refusals)
from .tasks import REAGENT_POLICIES, TASKS, PairOptions  # noqa: F401 (the ETL reads them from here)

# a trailing CXSMILES extension (``|f:0.1|``: USPTO's fragment groups), read as nothing more
_TRAILING_EXTENSION = re.compile(r"^(\S+)[ \t]+\|[^\s|]*\|\s*$")


@dataclass
class Pair:
    source: str  # the canonical source side
    target: str  # the canonical target side
    scaffold: str  # the product side's scaffolds: the split group
    key: str  # the dedupe key: the pair itself
    product: str  # the product side (the target, or the source of ``retro``): ``--split random``'s group


def split_reaction(text: str) -> tuple[str, str, str] | str:
    """``(reactants, reagents, products)`` of a reaction SMILES, or ``not_a_reaction``."""
    text = text.strip()
    if any(c.isspace() for c in text):
        m = _TRAILING_EXTENSION.match(text)
        if m is None:
            return "not_a_reaction"
        text = m.group(1)
    parts = text.split(">")  # '>' never occurs inside a SMILES (nor inside its bracket atoms)
    if len(parts) != 3:
        return "not_a_reaction"
    return parts[0], parts[1], parts[2]


class PairCanonicalizer:
    """Reactions (``reaction``) or source / target texts (``pair``) to a ``Pair``, or the
    reason it is refused. Built once per worker process, as ``Canonicalizer`` is."""

    def __init__(self, chem: ChemOptions, options: PairOptions):
        self.chem, self.options = chem, options
        self._canon = Canonicalizer(chem)
        self._frags = Chem.GetMolFrags

    def molecules(self, text: str) -> tuple[list[str], list[str]] | str:
        """The canonical SMILES of each molecule of a side (in canonical order) and their
        scaffolds, or a reason. An empty side is ``([], [])``."""
        text = text.strip()
        if not text:
            return [], []
        mol = self._canon.parse(text)
        if isinstance(mol, str):
            return mol
        for atom in mol.GetAtoms():
            atom.SetAtomMapNum(0)
        found = []
        for frag in self._frags(mol, asMols=True):
            molecule = self._canon.from_mol(frag, check_length=True)
            if isinstance(molecule, str):
                return molecule
            found.append((molecule.canonical, molecule.scaffold))
        found.sort()
        return [c for c, _ in found], [s for _, s in found]

    def source(self, text: str) -> tuple[str | None, str | None]:
        """A source side given alone (``molds-predict``'s input) made canonical as the ETL makes
        the sources of this task: ``(source, None)``, or ``(None, reason)`` when it is refused.
        A forward model's source may be written ``reactants>reagents`` (a reaction without its
        products) or as reactants alone: the reagents are mixed in, kept after the ``>`` or
        dropped as the model's policy did at training (``separate`` writes the ``>`` even with
        no reagent, as the ETL does). Any other task reads molecules only (a ``>``:
        ``not_a_reaction``); no reactant is ``empty_side``."""
        forward = self.options.task == "forward"
        parts = text.split(">") if forward else [text]
        if len(parts) > 2 or (not forward and ">" in text):
            return None, "not_a_reaction"
        found = []
        for part in parts:
            got = self.molecules(part)
            if isinstance(got, str):
                return None, got
            found.append(got[0])
        reactants, reagents = found[0], (found[1] if len(found) > 1 else [])
        if not reactants:
            return None, "empty_side"
        if not forward:
            return ".".join(reactants), None
        policy = self.options.reagent_policy
        if policy == "mix":
            return ".".join(sorted(reactants + reagents)), None
        if policy == "separate":
            return ".".join(reactants) + ">" + ".".join(reagents), None
        return ".".join(reactants), None

    def reaction(self, text: str) -> Pair | str:
        parts = split_reaction(text)
        if isinstance(parts, str):
            return parts
        sides = []
        for part in parts:
            got = self.molecules(part)
            if isinstance(got, str):
                return got
            sides.append(got)
        (reactants, _), (reagents, _), (products, product_scaffolds) = sides
        if not reactants or not products:
            return "empty_side"
        if set(products) <= set(reactants) | set(reagents):
            return "no_op_reaction"
        policy = self.options.reagent_policy
        if policy == "mix":
            left = ".".join(sorted(reactants + reagents))
        elif policy == "separate":
            left = ".".join(reactants) + ">" + ".".join(reagents)
        else:
            left = ".".join(reactants)
        right = ".".join(products)
        if self.options.task == "retro":
            return self._pair(right, left, right, product_scaffolds)
        return self._pair(left, right, right, product_scaffolds)

    def pair(self, source: str, target: str) -> Pair | str:
        sides = []
        for text in (source, target):
            got = self.molecules(text)
            if isinstance(got, str):
                return got
            if not got[0]:
                return "empty_side"
            sides.append(got)
        (src, src_scaffolds), (tgt, tgt_scaffolds) = sides
        source, target = ".".join(src), ".".join(tgt)
        if self.options.task == "retro":
            return self._pair(source, target, source, src_scaffolds)
        return self._pair(source, target, target, tgt_scaffolds)

    @staticmethod
    def _pair(source: str, target: str, product: str, product_scaffolds: list[str]) -> Pair:
        scaffold = ".".join(sorted(s for s in product_scaffolds if s))
        return Pair(source, target, scaffold, f"{source}>>{target}", product)


#: common atoms below which a molecule is not aligned with the anchor side (``_correspondence``)
MIN_ALIGNED_ATOMS = 3


def _correspondence(mol, anchor) -> dict[int, int]:
    """Atoms of ``mol`` matched to atoms of ``anchor`` (mol index -> anchor index) by their
    largest common substructure (RDKit's FMCS: elements compared, any bond order, so that a
    bond the reaction changes still aligns; ring atoms only to ring atoms; at most one second a
    pair). Fewer than ``MIN_ALIGNED_ATOMS`` in common (a solvent, a base): no correspondence."""
    found = rdFMCS.FindMCS([mol, anchor], atomCompare=rdFMCS.AtomCompare.CompareElements,
                           bondCompare=rdFMCS.BondCompare.CompareAny, ringMatchesRingOnly=True, timeout=1)
    if found.numAtoms < MIN_ALIGNED_ATOMS:
        return {}
    query = Chem.MolFromSmarts(found.smartsString)
    a, b = mol.GetSubstructMatch(query), anchor.GetSubstructMatch(query)
    return dict(zip(a, b)) if a and b else {}


def class_roots(mol) -> list[int]:
    """One atom of each class of symmetric atoms of ``mol`` (its lowest index), in index
    order: the roots that write distinct strings (an equivalent root writes the same one)."""
    classes = list(Chem.CanonicalRankAtoms(mol, breakTies=False))
    return sorted({c: i for i, c in reversed(list(enumerate(classes)))}.values())


def _write(mols, i: int, root: int, where: dict | None) -> str:
    """Molecule ``i`` of a side rooted at atom ``root`` (-1: RDKit's canonical start); with
    ``where`` (a dict), also records where each written atom stands: (molecule, atom) -> its
    place in the whole side, after the atoms written before it."""
    text = Chem.MolToSmiles(mols[i], rootedAtAtom=int(root))
    if where is not None:
        written = mols[i].GetPropsAsDict(True, True)["_smilesAtomOutputOrder"]
        offset = len(where)
        where.update({(i, int(a)): offset + n for n, a in enumerate(written)})
    return text


def _draw_spelling(mols, roots, rng, where: dict | None = None) -> tuple[str, dict | None]:
    """One spelling of a side's molecules (``roots``: each one's ``class_roots``): the
    molecules in a random order, each rooted at one of its roots drawn at random. With
    ``where`` (a dict), also where each written atom stands (``_write``)."""
    texts = [_write(mols, i, roots[i][int(rng.integers(0, len(roots[i])))], where)
             for i in rng.permutation(len(mols)).tolist()]
    return ".".join(texts), where


@quiet_rdkit
def rooted_spellings(side: str, *, rng, count: int) -> list[str]:
    """Up to ``count`` distinct spellings of a canonical side, for test-time augmentation: the
    side as given first, then each molecule rooted at a random atom (one per class of
    symmetric atoms) and the molecules in a random order, as the root-aligned spellings a
    model trained on (``aligned_spellings``) write a source whose target is unknown. Reagents
    after a ``>`` stay as they are. Fewer when the side has fewer spellings (a small
    symmetric molecule); only the side itself when RDKit cannot read it."""
    head, sep, rest = side.partition(">")
    mols = [Chem.MolFromSmiles(x) for x in head.split(".")] if head else []
    if not mols or any(m is None for m in mols):
        return [side]
    roots = [class_roots(m) for m in mols]
    out, seen = [side], {side}
    for _ in range(8 * count):  # bounded: a side may have fewer spellings than asked
        if len(out) >= count:
            break
        text = _draw_spelling(mols, roots, rng)[0] + sep + rest
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


@quiet_rdkit
def aligned_spellings(source: str, target: str, *, rng, count: int,
                      canonical_first: bool = False) -> list[tuple[str, str]] | None:
    """``count`` root-aligned spellings of a canonical pair (R-SMILES, Zhong et al. 2022). The
    source is written as a user may write it, the way ``rooted_spellings`` draws it at test
    time: each molecule rooted at a random atom (one per class of symmetric atoms), the
    molecules in a random order. Each molecule of the target is then rooted at its atom that
    corresponds to the earliest written source atom it holds, and placed in the order of
    those atoms, so that source and target start alike and differ little. Correspondences
    come from each target molecule's largest common substructure with each source molecule
    (``_correspondence``; a target atom found in two source molecules follows the larger
    match); a target molecule with none (a reagent, a by-product) follows, as the canonical
    form writes it. Reagents after a ``>`` stay as they are. A source of one molecule takes
    its roots without repetition among its classes while they last, so the first spellings
    all differ; a source of several draws order and roots afresh, trying again (a bounded
    number of times) for a spelling not drawn yet. With ``canonical_first`` the first spelling
    writes the source canonically instead (its molecules in the canonical order, each from
    RDKit's canonical start atom; the target aligned to it as to any other), as R-SMILES's
    first augmentation does, so that the spelling ``molds-eval`` scores from is one the model
    read; a source of one molecule then takes its other roots from the remaining classes.
    None when RDKit cannot read a side."""
    def parts(side):
        head, sep, rest = side.partition(">")
        return head, (sep + rest)

    (s_head, s_rest), (t_head, t_rest) = parts(source), parts(target)
    s_mols = [Chem.MolFromSmiles(x) for x in s_head.split(".")] if s_head else []
    t_mols = [Chem.MolFromSmiles(x) for x in t_head.split(".")] if t_head else []
    if not s_mols or not t_mols or any(m is None for m in s_mols + t_mols):
        return None
    maps = []  # per target molecule: its atom -> (source molecule, atom)
    for mol in t_mols:
        found = sorted(((i, _correspondence(mol, anchor)) for i, anchor in enumerate(s_mols)),
                       key=lambda x: (-len(x[1]), x[0]))
        corr: dict[int, tuple[int, int]] = {}
        for i, c in found:
            for a, b in c.items():
                corr.setdefault(a, (i, b))
        maps.append(corr)
    classes = [class_roots(m) for m in s_mols]
    single = [classes[0][i] for i in rng.permutation(len(classes[0])).tolist()] if len(s_mols) == 1 else None
    spelled, seen = [], set()  # the source's spellings, each with where its atoms stand
    if canonical_first and count > 0:
        where: dict = {}
        spelled.append((".".join(_write(s_mols, i, -1, where) for i in range(len(s_mols))), where))
        if single is not None and len(single) > 1:  # its start atom's class is spelled: the others follow
            ranks = list(Chem.CanonicalRankAtoms(s_mols[0], breakTies=False))
            start = next(atom for (_, atom), place in where.items() if place == 0)
            single = [r for r in single if ranks[r] != ranks[start]]
    seen.update(text for text, _ in spelled)
    for k in range(count - len(spelled)):
        if single is not None:  # the k-th root of a drawn order while they last
            root = single[k] if k < len(single) else single[int(rng.integers(0, len(single)))]
            source_text, where = _draw_spelling(s_mols, [[root]], rng, {})
        else:
            for _ in range(8):  # bounded: a small source may have fewer spellings than asked
                source_text, where = _draw_spelling(s_mols, classes, rng, {})
                if source_text not in seen:
                    break
        seen.add(source_text)
        spelled.append((source_text, where))
    out = []
    for source_text, where in spelled:
        placed, loose = [], []
        for mol, corr in zip(t_mols, maps):
            if not corr:
                loose.append(Chem.MolToSmiles(mol))
                continue
            atom = min(corr, key=lambda a: where[corr[a]])
            placed.append((where[corr[atom]], Chem.MolToSmiles(mol, rootedAtAtom=int(atom))))
        target_text = ".".join([t for _, t in sorted(placed)] + sorted(loose))
        out.append((source_text + s_rest, target_text + t_rest))
    return out
