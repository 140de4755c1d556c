"""molds/sample_data/make_pairs.py: the template-reaction set and the matched-pair set, held
to chemistry checked independently of the templates (atoms balance, each class's leaving
group in the reactants and its bond in the product, the core in both molecules of a pair),
and the bundled samples to what the script writes."""

from __future__ import annotations

import csv
import gzip
import os
import sys
from collections import Counter

import pytest
from rdkit import Chem

HERE = os.path.join(os.path.dirname(__file__), "..", "molds", "sample_data")
sys.path.insert(0, HERE)
import make_pairs  # noqa: E402

# per class: a SMARTS the reactants must hold (what leaves or reacts), one the product must hold
CHECKS = {
    "amide_coupling": ("C(=O)[OH]", "C(=O)N"),
    "ester_formation": ("C(=O)[OH]", "C(=O)O[CX4]"),
    "sulfonamide_formation": ("S(=O)(=O)Cl", "S(=O)(=O)N"),
    "urea_formation": ("N=C=O", "NC(=O)N"),
    "suzuki_coupling": ("cB(O)O", "c-!@c"),
    "buchwald_amination": ("cBr", "c-!@N"),
    "reductive_amination": ("[CH]=O", "[CH2]N"),
    "williamson_ether": ("[CH2]Br", "cO[CH2]"),
    "boc_deprotection": ("CC(C)(C)OC(=O)N", "[N;!H0]"),
    "ester_hydrolysis": ("C(=O)O[CH3]", "C(=O)[OH]"),
    "nitro_reduction": ("[N+](=O)[O-]", "c[NH2]"),
    "ketone_reduction": ("[#6]C(=O)[#6]", "[CH]([OH])"),
}


def elements(smiles: str) -> Counter:
    mol = Chem.AddHs(Chem.MolFromSmiles(smiles))
    return Counter(a.GetSymbol() for a in mol.GetAtoms() if a.GetSymbol() != "H")


def read_rows(name: str) -> list[list[str]]:
    with gzip.open(os.path.join(HERE, name), "rt") as fh:
        rows = list(csv.reader(fh))
    return rows


@pytest.fixture(scope="module")
def molecules():
    return make_pairs.read_smiles(os.path.join(HERE, "moses_sample.csv.gz"), limit=600)


@pytest.fixture(scope="module")
def reactions(molecules):
    return make_pairs.make_reactions(molecules)


def test_every_reaction_balances_and_has_its_class_chemistry(reactions, molecules):
    assert set(CHECKS) == set(make_pairs.CLASSES)
    inputs = {Chem.MolToSmiles(Chem.MolFromSmiles(s)) for s in molecules}
    assert len({r[1] for r in reactions}) >= 8 and len(reactions) > len(molecules) // 2
    for rid, name, text in reactions:
        reactants, reagents, product = text.split(">")
        assert product in inputs  # every product is a real molecule of the input
        assert Chem.MolFromSmiles(reagents) is not None
        # no heavy element appears in the product more than the reactants hold
        have, made = elements(reactants), elements(product)
        assert all(made[e] <= have[e] for e in made), (rid, text)
        leaving, formed = CHECKS[name]
        assert Chem.MolFromSmiles(reactants).HasSubstructMatch(Chem.MolFromSmarts(leaving)), (rid, text)
        assert Chem.MolFromSmiles(product).HasSubstructMatch(Chem.MolFromSmarts(formed)), (rid, text)
    assert len({r[2] for r in reactions}) == len(reactions)  # no reaction twice


def test_matched_pairs_share_their_core(molecules):
    rows = make_pairs.make_mmp(molecules, max_variable=8, per_core=10)
    assert len(rows) > 30
    assert len({(a, b) for a, b, _ in rows}) == len(rows)
    for source, target, core in rows:
        assert source != target
        query = Chem.MolFromSmarts(core.replace("[*:1]", "*"))  # the core as a query, its cut atom any atom
        for smiles in (source, target):
            mol = Chem.MolFromSmiles(smiles)
            assert mol.HasSubstructMatch(query), (smiles, core)
            # what the core leaves is the changed part: at most max_variable heavy atoms (+ the bond)
            assert mol.GetNumHeavyAtoms() - (query.GetNumAtoms() - 1) <= 8


def test_the_bundled_samples_are_what_the_script_writes(molecules):
    rows = read_rows("moses_sample_reactions.csv.gz")
    assert rows[0] == ["id", "class", "reactants>reagents>production"]
    again = make_pairs.make_reactions(molecules)
    assert rows[1:1 + len(again)] == again
    mmp = read_rows("moses_sample_mmp.csv.gz")
    assert mmp[0] == ["source", "target", "core"] and len(mmp) > 5_000
    assert len(Counter(r[1] for r in rows[1:])) >= 10  # the bundled set has at least ten classes


@pytest.mark.parametrize("layout", ["reactions", "columns"])
def test_pretraining_molecules_leave_out_every_molecule_of_the_pairs(tmp_path, layout):
    """``molecules --exclude``: a molecule on either side of a pair (any of a multi-molecule
    side, reagents too, in any spelling) is left out; the rest are kept as given, unreadable
    ones too (the ETL rejects and counts them)."""
    pairs = tmp_path / ("pairs.csv" if layout == "columns" else "reactions.csv")
    if layout == "reactions":
        pairs.write_text("id,class,reactants>reagents>production\n"  # atom-mapped, as USPTO's files are
                         "1,amide_coupling,[CH3:1][C:2](=O)O.[NH2:3]CCc1ccccc1>CN(C)C=O>"
                         "[CH3:1][C:2](=O)[NH:3]CCc1ccccc1\n")
    else:
        pairs.write_text("source,target\nCC(=O)O.NCCc1ccccc1,CC(=O)NCCc1ccccc1\nOCCN(C)C=O,CCO\n")
    given = ["OC(C)=O", "c1ccc(CCNC(C)=O)cc1", "C1CCCCC1", "O=CN(C)C", "C1CC(", "NCCc1ccccc1", "CCCO"]
    (tmp_path / "mols.smi").write_text("".join(f"{s} m{i}\n" if i % 2 else f"{s}\n" for i, s in enumerate(given)))
    out = tmp_path / "kept.csv"
    make_pairs.main(["molecules", "--input", str(tmp_path / "mols.smi"), "--exclude", str(pairs), "--out", str(out)])
    kept = [line.strip() for line in out.read_text().splitlines()][1:]
    unmapped = {"[CH3:1][C:2](=O)O": "CC(=O)O", "[NH2:3]CCc1ccccc1": "NCCc1ccccc1",
                "[CH3:1][C:2](=O)[NH:3]CCc1ccccc1": "CC(=O)NCCc1ccccc1"}
    in_pairs = {Chem.CanonSmiles(unmapped.get(m, m)) for row in csv.DictReader(pairs.open()) for k, v in row.items()
                if k in ("source", "target") or ">" in k for side in v.split(">") for m in side.split(".") if m}
    expected = [s for s in given if Chem.MolFromSmiles(s) is None or Chem.CanonSmiles(s) not in in_pairs]
    assert kept == expected
    assert "C1CCCCC1" in kept and "C1CC(" in kept and "OC(C)=O" not in kept
    assert ("O=CN(C)C" in kept) == (layout == "columns")  # a reagent of the reaction, not in the two columns


def _parent_by_rdkit(smiles: str) -> str:
    """A molecule's parent made with RDKit's standardizer directly: the normal form, the
    charge parent (largest fragment, uncharged), no stereo."""
    from rdkit.Chem.MolStandardize import rdMolStandardize

    mol = rdMolStandardize.ChargeParent(rdMolStandardize.Normalize(Chem.MolFromSmiles(smiles)))
    Chem.RemoveStereochemistry(mol)
    return Chem.MolToSmiles(mol)


def test_pretraining_molecules_leave_out_what_the_etl_makes_one_molecule_in_every_file(tmp_path):
    """Two split files given (``--exclude`` twice, as every split of a published set is):
    a corpus molecule is left out when it is a molecule of either file in another drawing that
    the ETL's standardization makes one (a salt, a charged form, a sulfoxide drawn
    charge-separated, another stereoisomer), checked against RDKit's standardizer called here; the
    others are kept."""
    train, test = tmp_path / "raw_train.csv", tmp_path / "raw_test.csv"
    train.write_text("id,class,reactants>reagents>production\n"
                     "t1,UNK,[CH3:1][C:2](=O)[OH:3].[NH2:4]CCc1ccccc1>>[CH3:1][C:2](=O)[NH:4]CCc1ccccc1\n")
    test.write_text("id,class,reactants>reagents>production\n"
                    "v1,UNK,CS(=O)c1ccc(Br)cc1.OB(O)c1ccccc1>[Pd]>CS(=O)c1ccc(-c2ccccc2)cc1\n"
                    "v2,UNK,C[C@H](N)C(=O)OC>>C[C@H](N)C(=O)O\n")
    corpus = {
        "CC(=O)[O-].[Na+]": False,  # the acid of t1, as its sodium salt
        "[NH3+]CCc1ccccc1": False,  # the amine of t1, protonated
        "C[S+]([O-])c1ccc(-c2ccccc2)cc1": False,  # v1's product, its sulfoxide drawn charge-separated
        "C[C@@H](N)C(=O)O": False,  # v2's product, the other enantiomer
        "OB(O)c1ccccc1": False,  # a reactant of the second file as written
        "C1CCCCC1": True, "CC(=O)NCCc1ccccn1": True, "CCCCBr": True,
    }
    (tmp_path / "corpus.csv").write_text("SMILES\n" + "".join(f"{s}\n" for s in corpus))
    out = tmp_path / "kept.csv"
    make_pairs.main(["molecules", "--input", str(tmp_path / "corpus.csv"), "--exclude", str(train),
                     "--exclude", str(test), "--out", str(out), "--workers", "1"])
    kept = [line.strip() for line in out.read_text().splitlines()][1:]
    assert kept == [s for s, keep in corpus.items() if keep]
    in_files = set()
    for path in (train, test):
        for row in csv.DictReader(path.open()):
            for side in row["reactants>reagents>production"].split(">"):
                mol = Chem.MolFromSmiles(side) if side else None
                if mol is None:
                    continue
                for atom in mol.GetAtoms():
                    atom.SetAtomMapNum(0)
                in_files.update(_parent_by_rdkit(Chem.MolToSmiles(f)) for f in Chem.GetMolFrags(mol, asMols=True))
    for s, keep in corpus.items():
        assert (_parent_by_rdkit(s) not in in_files) == keep, s
    # and the RDKit canonical forms alone would have let the first four through
    plain = {Chem.CanonSmiles(m) for p in (train, test) for row in csv.DictReader(p.open())
             for side in row["reactants>reagents>production"].split(">") for m in side.split(".") if m}
    assert sum(Chem.CanonSmiles(s) not in plain for s, keep in corpus.items() if not keep) >= 4
