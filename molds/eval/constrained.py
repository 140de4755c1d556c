"""Constrained generation: every sample starts from a given beginning.

A causal model can only be steered from its left, so each constraint becomes one or more
*prefixes* in the model's representation, read after ``<bos>`` before sampling starts
(``sample_ids(prefix=...)``), and a test a finished sample must pass to *keep* it:

- ``--prefix TEXT`` (any representation): the text itself; kept when the sample is a
  molecule (the prefix is there by construction).
- SAFE models only, the design tasks as SAFE (Noutahi et al. 2024) defines them: a
  fragment whose attachment points (``[*]``) become SAFE's open ring-closure digits,
  followed by ``.`` so that the model writes the next fragments, which close them.
  ``--decorate CORE``: CORE has attachment points; the model writes its side chains.
  ``--scaffold SMILES``: molecules that contain the scaffold; as SAFE's superstructure
  task, the prefixes open one attachment point at each atom that carries a hydrogen (one
  prefix per such atom, symmetric ones merged) and all of them at once. ``--linker A B``:
  A and B each with an attachment point, written as two fragments; the model writes the
  fragment that joins them. Each prefix is written in several randomized atom orders
  (``variants``, seeded), and the samples are shared among the prefixes in turn.
  Kept: the sample is one connected molecule (SAFE's own quality filter for completions)
  that contains the fragments (attachment points removed, RDKit substructure match).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..chemistry import quiet_rdkit
from ..errors import MoldsError
from .sampling import sample_ids


@dataclass
class Design:
    task: str  # prefix | scaffold | decorate | linker
    prefixes: list[str]  # texts in the model's representation; samples take them in turn
    queries: list = field(default_factory=list)  # RDKit molecules a kept sample contains
    connected: bool = False  # a kept sample is one molecule (linker)
    what: str = ""  # what the keep test checks, for the report


@quiet_rdkit
def _mol(smiles: str, what: str):
    from rdkit import Chem  # here: molds-sample --help loads no RDKit

    mol = Chem.MolFromSmiles(smiles) if smiles else None
    if mol is None:
        raise MoldsError(f"{what} {smiles!r}: RDKit cannot read it as SMILES")
    return mol


def _without_dummies(mol):
    from rdkit import Chem  # here: molds-sample --help loads no RDKit

    return Chem.DeleteSubstructs(mol, Chem.MolFromSmarts("[#0]"))


def _dummies(mol) -> int:
    return sum(1 for a in mol.GetAtoms() if a.GetAtomicNum() == 0)


def open_attachment_points(scaffold) -> list[str]:
    """SMILES of the scaffold with one ``[*]`` on each atom that carries a hydrogen (one
    per symmetry class), then with ``[*]`` on all of them (SAFE's superstructure cores)."""
    from rdkit import Chem  # here: molds-sample --help loads no RDKit

    out, every = [], Chem.RWMol(scaffold)
    for atom in scaffold.GetAtoms():
        if atom.GetTotalNumHs() == 0:
            continue
        for rw in (Chem.RWMol(scaffold), every):
            dummy = rw.AddAtom(Chem.Atom(0))
            rw.AddBond(atom.GetIdx(), dummy, Chem.BondType.SINGLE)
            target = rw.GetAtomWithIdx(atom.GetIdx())
            if target.GetNumExplicitHs():
                target.SetNumExplicitHs(target.GetNumExplicitHs() - 1)
            if rw is not every:
                try:
                    mol = rw.GetMol()
                    Chem.SanitizeMol(mol)
                    out.append(Chem.MolToSmiles(mol))
                except Exception:  # noqa: BLE001 - an atom RDKit will not substitute there
                    pass
    try:
        mol = every.GetMol()
        Chem.SanitizeMol(mol)
        out.append(Chem.MolToSmiles(mol))
    except Exception:  # noqa: BLE001
        pass
    return list(dict.fromkeys(out))


def plan(task: str, values: list[str], representation, variants: int = 10, seed: int = 0) -> Design:
    """The prefixes and the keep test of a constraint (see the module docstring)."""
    if task == "prefix":
        return Design("prefix", [values[0]], what="a molecule (the prefix is there by construction)")
    if representation.name != "safe":
        raise MoldsError(f"--{task} needs a model trained on SAFE strings (molds-preprocess --representation safe); "
                         f"this one spells {representation.name}: use --prefix")
    if task == "decorate":
        core = _mol(values[0], "--decorate")
        if not _dummies(core):
            raise MoldsError(f"--decorate {values[0]!r}: mark where side chains go with [*] attachment points")
        cores, queries, what = [values[0]], [_without_dummies(core)], "the core, in one connected molecule"
    elif task == "scaffold":
        scaffold = _mol(values[0], "--scaffold")
        cores = [values[0]] if _dummies(scaffold) else open_attachment_points(scaffold)
        if not cores:
            raise MoldsError(f"--scaffold {values[0]!r}: no atom of it can take a substituent")
        queries, what = [_without_dummies(scaffold)], "the scaffold, in one connected molecule"
    elif task == "linker":
        mols = [_mol(v, "--linker") for v in values]
        if len(mols) != 2 or not all(_dummies(m) for m in mols):
            raise MoldsError("--linker takes two fragments, each with an [*] attachment point where the linker joins")
        cores = [".".join(values)]
        queries = [_without_dummies(m) for m in mols]
        what = "both fragments, in one connected molecule"
    else:
        raise ValueError(f"unknown constraint {task!r}")
    prefixes = []
    for k, core in enumerate(cores):
        for v in range(max(1, variants)):
            text = representation.encode_fragments(core, randomize=v > 0, seed=seed * 7919 + k * 101 + v)
            prefixes.append(text.rstrip(".") + ".")
    prefixes = list(dict.fromkeys(prefixes))
    return Design(task, prefixes, queries, connected=True, what=what)


@quiet_rdkit
def keeps(smiles: str | None, design: Design) -> bool:
    """Whether a decoded sample keeps the constraint."""
    from rdkit import Chem  # here: molds-sample --help loads no RDKit

    mol = Chem.MolFromSmiles(smiles) if smiles else None
    if mol is None or mol.GetNumAtoms() == 0:
        return False
    if design.connected and "." in smiles:
        return False
    return all(mol.HasSubstructMatch(q) for q in design.queries)


def encode_prefix(tokenizer, text: str) -> list[int]:
    """The token ids of a prefix, refused when the model's vocabulary cannot spell it."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.unk_token_id in ids or tokenizer.decode(ids).replace(" ", "") != text:
        raise MoldsError(f"prefix {text!r}: the model's tokenizer cannot spell it (a token outside its vocabulary)")
    return ids


def sample_design(model, tokenizer, design: Design, num: int, *, max_tokens: int, seed: int = 0, **sampling) -> list:
    """Token ids of ``num`` samples, shared among the design's prefixes in turn (each
    prefix its own seed), every one starting with its prefix."""
    room = model.config.max_position_embeddings - 1
    ids = []
    for k, text in enumerate(design.prefixes):
        share = num // len(design.prefixes) + (k < num % len(design.prefixes))
        if not share:
            continue
        prefix = encode_prefix(tokenizer, text)
        if len(prefix) >= room:
            raise MoldsError(f"prefix {text!r} is {len(prefix)} tokens: the model has {room} positions")
        ids += sample_ids(model, share, max_tokens=min(max_tokens, room - len(prefix)), prefix=prefix,
                          seed=seed * 1000003 + k, **sampling)
    return ids
