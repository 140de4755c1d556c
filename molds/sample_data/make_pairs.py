"""Pair data made from real molecules, for reaction prediction, retrosynthesis and Mol2Mol:

- ``reactions``: a template-reaction set. Each MOSES molecule is taken as a product and
  disconnected by twelve named reaction classes (RDKit reaction SMARTS run backwards: the
  retro template gives the reactants), so every product is a real molecule and every
  reaction is one a chemist would write; reagents are drawn (seeded) from each class's
  usual ones. Written as USPTO-50k writes its files: ``id,class,reactants>reagents>production``.
- ``mmp``: matched molecular pairs. Each molecule is cut once at every acyclic single bond
  between two heavy atoms (RDKit's ``rdMMPA``); molecules that share a core and differ in a
  small substituent (at most ``--max_variable`` heavy atoms) are pairs, both ways:
  ``source,target,core``.
- ``molecules``: the input's molecules that are in no pair of ``--exclude`` (on either side,
  any molecule of a multi-molecule side; compared by their parents, as the ETL's
  standardization makes them one: ``molds.chemistry.overlap``), as a ``SMILES`` CSV: a denoising pretraining set for the encoder-decoder that holds no product
  or reactant of the pairs, so no test answer is seen in pretraining.

No reaction data set ships on the package index; USPTO-50k and USPTO-MIT are public
downloads a user fetches (see docs/tutorials). These sets are what the tests, the smoke
recipes and the CPU benchmark train on. The bundled samples are
``moses_sample_reactions.csv.gz`` and ``moses_sample_mmp.csv.gz``, written from
``moses_sample.csv.gz`` by

    python molds/sample_data/make_pairs.py reactions --out molds/sample_data/moses_sample_reactions.csv.gz
    python molds/sample_data/make_pairs.py mmp --out molds/sample_data/moses_sample_mmp.csv.gz

the smoke encoder-decoder's pretraining molecules (16,449 of the sample's 20,000) by

    python molds/sample_data/make_pairs.py molecules --exclude molds/sample_data/moses_sample_reactions.csv.gz \
        --out pretrain-molecules.csv

and the benchmark's set from the whole MOSES training set by
``--input moses/train.csv.gz --every 8`` (about 200,000 molecules).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import os
import random
from collections import defaultdict
from itertools import permutations
from multiprocessing import Pool

from rdkit import Chem
from rdkit.Chem import rdChemReactions, rdMMPA

from molds.chemistry.overlap import Parents, parents
from molds.errors import MoldsError
from molds.eval.evaluate import smiles_cells

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (retro template: product >> reactants, forward template: reactants >> product,
#          the reagents a chemist uses for it, one of which each reaction gets)
CLASSES = {
    "amide_coupling": (
        "[C;!R;$(C(=O)-[#6]):1](=[O:2])-!@[N;!$(N(-C=O)-[C,S]=[O,S]):3]>>[C:1](=[O:2])O.[N:3]",
        "[C:1](=[O:2])[OH].[N;!H0:3]>>[C:1](=[O:2])[N:3]",
        ["CN(C)C(On1nnc2cccnc21)=[N+](C)C.F[P-](F)(F)(F)(F)F.CCN(C(C)C)C(C)C", "CCN=C=NCCCN(C)C.On1nnc2ccccc21",
         "CN(C)C=O.CCN(C(C)C)C(C)C.O=C(On1nnc2ccccc21)N(C)C"]),
    "ester_formation": (
        "[C;!R;$(C(=O)-[#6]):1](=[O:2])-!@[O:3]-!@[CH2,CH3;!$(C-C=O):4]>>[C:1](=[O:2])O.[O:3][C:4]",
        "[C:1](=[O:2])[OH].[OH:3][C:4]>>[C:1](=[O:2])[O:3][C:4]",
        ["O=S(=O)(O)O", "CCN=C=NCCCN(C)C.CN(C)c1ccncc1"]),
    "sulfonamide_formation": (
        "[S:1](=[O:2])(=[O:3])-!@[N;!H0,$(N(C)C):4]>>[S:1](=[O:2])(=[O:3])Cl.[N:4]",
        "[S:1](=[O:2])(=[O:3])Cl.[N;!H0:4]>>[S:1](=[O:2])(=[O:3])[N:4]",
        ["c1ccncc1", "CCN(CC)CC.ClCCl"]),
    "urea_formation": (
        "[N;H1;!R;$(N-[#6]):1]-!@[C;!R](=[O;!R])-!@[N;!$(N-a):2]>>O=C=[N:1].[N:2]",
        "O=C=[N:1].[N;!H0:2]>>[N:1]C(=O)[N:2]",
        ["ClCCl", "C1CCOC1"]),
    "suzuki_coupling": (
        "[c;$(c(c)c):1]-!@[c;$(c(c)c):2]>>[c:1]Br.OB(O)[c:2]",
        "[c:1]Br.OB(O)[c:2]>>[c:1]-[c:2]",
        ["O=C([O-])[O-].[K+].[K+].c1ccc([P](c2ccccc2)(c2ccccc2)[Pd]([P](c2ccccc2)(c2ccccc2)c2ccccc2)"
         "([P](c2ccccc2)(c2ccccc2)c2ccccc2)[P](c2ccccc2)(c2ccccc2)c2ccccc2)cc1",
         "O=C([O-])[O-].[Na+].[Na+].Cl[Pd]Cl.[Fe].c1ccc(P(c2ccccc2)[c-]2cccc2)cc1.c1ccc(P(c2ccccc2)[c-]2cccc2)cc1"]),
    "buchwald_amination": (
        "[c:1]-!@[N;!$(N-[C,S]=[O,S,N]);!$(N(-a)-a);$(N-[CX4]):2]>>[c:1]Br.[N:2]",
        "[c:1]Br.[N;!H0:2]>>[c:1][N:2]",
        ["CC(C)(C)[O-].[Na+].O=C(/C=C/c1ccccc1)/C=C/c1ccccc1.[Pd]", "O=C([O-])[O-].[Cs+].[Cs+].[Pd]"]),
    "reductive_amination": (
        "[#6;!$([#6]=O):3]-[CH2;!R:1]-!@[N;!$(N-[C,S]=[O,S,N]);!$(N-a):2]>>[#6:3][CH:1]=O.[N:2]",
        "[#6:3][CH:1]=O.[N;!H0:2]>>[#6:3][CH2:1][N:2]",
        ["CC(=O)O[BH-](OC(C)=O)OC(C)=O.[Na+]", "[BH3-]C#N.[Na+].CO"]),
    "williamson_ether": (
        "[c:1]-!@[O:2]-!@[CH2;!R:3]-[#6:4]>>[c:1][OH:2].Br[CH2:3][#6:4]",
        "[c:1][OH:2].Br[CH2:3][#6:4]>>[c:1][O:2][CH2:3][#6:4]",
        ["O=C([O-])[O-].[K+].[K+].CN(C)C=O", "[H-].[Na+].C1CCOC1"]),
    "boc_deprotection": (
        "[N;!H0;!$(N-[C,S]=[O,S,N]);!a:1]>>CC(C)(C)OC(=O)[N:1]",
        "CC(C)(C)OC(=O)[N:1]>>[N:1]",
        ["O=C(O)C(F)(F)F.ClCCl", "Cl.O1CCOCC1"]),
    "ester_hydrolysis": (
        "[C;!R:1](=[O:2])[OH1:3]>>[C:1](=[O:2])[O:3]C",
        "[C:1](=[O:2])[O:3][CH3]>>[C:1](=[O:2])[OH:3]",
        ["[Li+].[OH-].C1CCOC1.O", "[Na+].[OH-].CO"]),
    "nitro_reduction": (
        "[c:1]-[NH2:2]>>[c:1][N+:2](=O)[O-]",
        "[c:1][N+:2](=O)[O-]>>[c:1][NH2+0:2]",
        ["[H][H].[Pd]", "Cl[Sn]Cl.CCO", "[Fe].[NH4+].[Cl-]"]),
    "ketone_reduction": (
        "[C;H1;!R;$(C(-[#6])-[#6]):1]-[OH:2]>>[C:1]=[O:2]",
        "[#6:3][C:1](=[O:2])[#6:4]>>[#6:3][CH:1]([OH:2])[#6:4]",
        ["[BH4-].[Na+].CO", "[Li+].[AlH4-].C1CCOC1"]),
}


def read_smiles(path: str, every: int = 1, limit: int | None = None) -> list[str]:
    """SMILES of a MOSES-style CSV (a ``SMILES`` header, else the first column), every ``every``-th."""
    opener = gzip.open if path.endswith(".gz") else open
    out = []
    with opener(path, "rt") as fh:
        rows = csv.reader(fh)
        header = next(rows)
        col = next((i for i, h in enumerate(header) if h.strip().lower() == "smiles"), 0)
        for n, row in enumerate(rows):
            if n % every == 0 and row:
                out.append(row[col])
                if limit is not None and len(out) >= limit:
                    break
    return out


_COMPILED = {}


def _templates():
    if not _COMPILED:
        for name, (retro, forward, _) in CLASSES.items():
            _COMPILED[name] = (rdChemReactions.ReactionFromSmarts(retro), rdChemReactions.ReactionFromSmarts(forward))
    return _COMPILED


def reactions_of(product: str, sites: int = 2) -> list[tuple[str, str, str]]:
    """(class, reactants, product) for each class that disconnects ``product`` (up to ``sites``
    different disconnections a class), each checked by running the class's forward template
    on the reactants: the product must be among what it makes. All SMILES are RDKit's."""
    mol = Chem.MolFromSmiles(product)
    if mol is None:
        return []
    product = Chem.MolToSmiles(mol)
    out = []
    for name, (retro, forward) in _templates().items():
        seen = set()
        for made in retro.RunReactants((mol,), maxProducts=20):
            try:
                parts = []
                for m in made:
                    Chem.SanitizeMol(m)
                    parts.append(Chem.MolFromSmiles(Chem.MolToSmiles(m)))
                if any(p is None for p in parts):
                    continue
            except Exception:  # noqa: BLE001 - a disconnection RDKit cannot sanitize
                continue
            key = ".".join(sorted(Chem.MolToSmiles(p) for p in parts))
            if key in seen:
                continue
            if not _makes(forward, parts, product):
                continue
            seen.add(key)
            out.append((name, key, product))
            if len(seen) >= sites:
                break
    return out


def _makes(forward, reactants, product: str) -> bool:
    """Whether the forward template, run on the reactants in either order, makes ``product``."""
    n = forward.GetNumReactantTemplates()
    if len(reactants) != n:
        return False
    for order in permutations(reactants):
        for made in forward.RunReactants(tuple(order), maxProducts=50):
            try:
                m = made[0]
                Chem.SanitizeMol(m)
                if Chem.MolToSmiles(Chem.MolFromSmiles(Chem.MolToSmiles(m))) == product:
                    return True
            except Exception:  # noqa: BLE001
                continue
    return False


def _reactions_batch(batch: list[str]) -> list[tuple[str, str, str]]:
    out = []
    for smiles in batch:
        out.extend(reactions_of(smiles))
    return out


def make_reactions(smiles: list[str], seed: int = 0, workers: int = 1) -> list[list[str]]:
    """Rows ``[id, class, reactants>reagents>product]`` of every reaction of ``smiles``."""
    batches = [smiles[i:i + 256] for i in range(0, len(smiles), 256)]
    if workers > 1:
        with Pool(workers) as pool:
            found = [r for part in pool.imap(_reactions_batch, batches) for r in part]
    else:
        found = [r for b in batches for r in _reactions_batch(b)]
    rng = random.Random(seed)
    rows = []
    for i, (name, reactants, product) in enumerate(found):
        reagents = rng.choice(CLASSES[name][2])
        rows.append([f"T{i}", name, f"{reactants}>{reagents}>{product}"])
    return rows


def _cuts(smiles: str, max_variable: int) -> list[tuple[str, str, str]]:
    """(core, variable part, molecule) of each single acyclic cut of ``smiles``, the variable
    part the smaller side, of at most ``max_variable`` heavy atoms."""
    mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        return []
    smiles = Chem.MolToSmiles(mol)
    out = []
    for core, chains in rdMMPA.FragmentMol(mol, maxCuts=1, resultsAsMols=False):
        parts = chains.split(".")
        if core or len(parts) != 2:
            continue
        a, b = sorted(parts, key=lambda p: (Chem.MolFromSmiles(p).GetNumHeavyAtoms(), p))
        if Chem.MolFromSmiles(a).GetNumHeavyAtoms() <= max_variable:  # the attachment point (*) is no heavy atom
            out.append((b, a, smiles))
    return out


def make_mmp(smiles: list[str], max_variable: int = 8, per_core: int = 10, seed: int = 0) -> list[list[str]]:
    """Rows ``[source, target, core]``: pairs of molecules sharing a core (a single cut), both
    ways, at most ``per_core`` pairs a core (drawn, seeded); a pair two cores share is written once."""
    by_core = defaultdict(dict)
    for s in smiles:
        for core, variable, mol in _cuts(s, max_variable):
            by_core[core].setdefault(variable, mol)
    rng = random.Random(seed)
    rows, seen = [], set()
    for core in sorted(by_core):
        mols = sorted(set(by_core[core].values()))
        pairs = [(a, b) for a in mols for b in mols if a != b and (a, b) not in seen]  # a pair once, at its first core
        if len(pairs) > per_core:
            pairs = rng.sample(pairs, per_core)
        seen.update(pairs)
        rows.extend([a, b, core] for a, b in sorted(pairs))
    return rows


def pair_molecules(path: str) -> set[str]:
    """The parent (``molds.chemistry.overlap``) of every molecule in a pair file's ``source``
    / ``target`` columns and its reaction columns (a header holding ``>``:
    ``reactants>reagents>products``): each molecule of each side, atom maps removed."""
    opener = gzip.open if path.endswith(".gz") else open
    parents = Parents()
    with opener(path, "rt") as fh:
        rows = csv.reader(fh)
        header = next(rows, None) or []
        cols = [i for i, h in enumerate(header) if ">" in h or h.strip().lower() in ("source", "target")]
        if not cols:
            raise SystemExit(f"{path}: no pair column (source, target, or a reaction column such as "
                             f"reactants>reagents>production) in its header {header}")
        found = set()
        for row in rows:
            for i in cols:
                found.update(parents.of_side(row[i] if i < len(row) else ""))
    return found


def molecules_not_in(smiles: list[str], exclude: set[str], workers: int = 1) -> list[list[str]]:
    """The molecules (as given) whose parent is not in ``exclude``; unreadable ones are kept
    for the ETL to reject and count."""
    return [[smi] for smi, parent in zip(smiles, parents(smiles, workers)) if parent is None or parent not in exclude]


def _write(path: str, header: list[str], rows: list[list[str]]) -> None:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    data = buf.getvalue().encode()
    if path.endswith(".gz"):
        with gzip.GzipFile(path, "wb", mtime=0) as out:
            out.write(data)
    else:
        with open(path, "wb") as out:
            out.write(data)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("kind", choices=["reactions", "mmp", "molecules"])
    p.add_argument("--input", default=os.path.join(HERE, "moses_sample.csv.gz"), help="MOSES-style CSV of SMILES")
    p.add_argument("--out", required=True, help="the CSV to write (.gz: gzip)")
    p.add_argument("--every", type=int, default=1, help="take every N-th molecule of the input")
    p.add_argument("--limit", type=int, default=None, help="at most this many molecules")
    p.add_argument("--max_variable", type=int, default=8, help="mmp: heavy atoms of the changed part, at most")
    p.add_argument("--per_core", type=int, default=10, help="mmp: pairs kept a core, at most")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exclude", action="append", default=None,
                   help="molecules: a pair file whose molecules are left out (again for more files)")
    p.add_argument("--smiles_column", default=None,
                   help="molecules: the SMILES column of a .csv / .tsv --input (default: SMILES in any case, else the first)")
    args = p.parse_args(argv)
    if (args.kind == "molecules") != (args.exclude is not None):
        p.error("--exclude goes with molecules, and molecules needs it")
    if args.kind == "molecules":  # any SMILES file molds-eval reads: .csv / .tsv by --smiles_column, else lines
        try:
            table, cells = smiles_cells(args.input, "molecules", need_column=False, column=args.smiles_column)
        except MoldsError as exc:
            raise SystemExit(str(exc)) from None
        if not table:  # a .smi line: the SMILES, then perhaps a name
            cells = [c.split()[0] if c.split() else "" for c in cells]
        smiles = [c for c in cells if c][::args.every][:args.limit]
    else:
        smiles = read_smiles(args.input, args.every, args.limit)
    if args.kind == "reactions":
        rows = make_reactions(smiles, args.seed, args.workers)
        _write(args.out, ["id", "class", "reactants>reagents>production"], rows)
        classes = sorted({r[1] for r in rows})
        print(f"{len(rows):,} reactions of {len(smiles):,} molecules, {len(classes)} classes -> {args.out}")
    elif args.kind == "molecules":
        exclude = set().union(*(pair_molecules(path) for path in args.exclude))
        rows = molecules_not_in(smiles, exclude, args.workers)
        _write(args.out, ["SMILES"], rows)
        print(f"{len(rows):,} of {len(smiles):,} molecules are in no pair of {', '.join(args.exclude)} -> {args.out}")
    else:
        rows = make_mmp(smiles, args.max_variable, args.per_core, args.seed)
        _write(args.out, ["source", "target", "core"], rows)
        print(f"{len(rows):,} matched pairs of {len(smiles):,} molecules -> {args.out}")


if __name__ == "__main__":
    main()
