"""The RDKit stage against RDKit called directly."""

from __future__ import annotations

import pytest
from rdkit import Chem
from rdkit.Chem.MolStandardize import rdMolStandardize
from rdkit.Chem.Scaffolds import MurckoScaffold

from molds.chem import Canonicalizer, ChemOptions, Molecule

from .conftest import sample_smiles


def test_canonical_and_scaffold_equal_rdkit_on_held_out_sample():
    can = Canonicalizer(ChemOptions())
    for smi in sample_smiles(400, offset=15000):
        mol = Chem.MolFromSmiles(smi)
        got = can(smi)
        assert isinstance(got, Molecule)
        assert got.canonical == Chem.MolToSmiles(mol)
        assert got.scaffold == MurckoScaffold.MurckoScaffoldSmiles(mol=mol)
        assert got.dedupe_key == got.canonical


@pytest.mark.parametrize("smiles,reason", [
    ("", "empty"), ("  \t", "empty"), ("C1CC", "parse_error"), ("CC O", "parse_error"), ("Xx", "parse_error"),
    ("C(C)(C)(C)(C)C", "valence_error"), ("c1cccc1", "kekulize_error"), ("C" * 501, "too_long"),
    ("C" * 151, "too_many_heavy_atoms"),
])
def test_rejection_reasons(smiles, reason):
    assert Canonicalizer(ChemOptions())(smiles) == reason


def test_heavy_atom_estimate_ignores_explicit_hydrogens():
    # 10 carbons written with many explicit [H]: long string, few heavy atoms
    smiles = "".join("[CH2]" if i else "[CH3]" for i in range(10)).replace("[CH2]", "C([H])([H])")
    opts = ChemOptions(max_heavy_atoms=12)
    got = Canonicalizer(opts)(smiles)
    assert isinstance(got, Molecule)
    assert got.canonical == Chem.MolToSmiles(Chem.MolFromSmiles(smiles))
    assert Canonicalizer(ChemOptions(max_heavy_atoms=9))(smiles) == "too_many_heavy_atoms"


def test_stereo_stripped_keeps_isotopes():
    smi = "[2H]C[C@@H](N)C(=O)O"
    got = Canonicalizer(ChemOptions(keep_stereo=False))(smi)
    mol = Chem.MolFromSmiles(smi)
    Chem.RemoveStereochemistry(mol)
    assert got.canonical == Chem.MolToSmiles(mol)
    assert "@" not in got.canonical and "[2H]" in got.canonical
    assert "@" in Canonicalizer(ChemOptions())(smi).canonical


def test_standardization_matches_rdmolstandardize():
    opts = ChemOptions(largest_fragment=True, uncharge=True, normalize=True)
    can = Canonicalizer(opts)
    for smi in ["CC(=O)[O-].[Na+]", "C[N+](C)(C)C.[Cl-]", "CS(C)=O.c1ccccc1C(=O)O", "O=[N+]([O-])c1ccccc1"]:
        mol = Chem.MolFromSmiles(smi)
        mol = rdMolStandardize.Normalizer().normalize(mol)
        mol = rdMolStandardize.LargestFragmentChooser(preferOrganic=True).choose(mol)
        mol = rdMolStandardize.Uncharger().uncharge(mol)
        assert can(smi).canonical == Chem.MolToSmiles(mol)
    assert can("CC(=O)[O-].[Na+]").canonical == "CC(=O)O"


def test_generic_scaffold_and_inchikey():
    smi = "O=C(Nc1ccccc1)c1ccncc1"
    got = Canonicalizer(ChemOptions(scaffold="generic", dedupe_key="inchikey"))(smi)
    mol = Chem.MolFromSmiles(smi)
    generic = MurckoScaffold.MakeScaffoldGeneric(MurckoScaffold.GetScaffoldForMol(mol))
    assert got.scaffold == Chem.MolToSmiles(generic, isomericSmiles=False)
    assert got.dedupe_key == Chem.MolToInchiKey(mol)


def test_caps_are_bounded_and_checked_before_the_costly_steps(monkeypatch):
    import re

    import pytest

    import molds.chem
    from molds.chem import MAX_HEAVY_ATOMS_CAP

    with pytest.raises(ValueError, match="max_heavy_atoms=20000 is outside"):
        ChemOptions(max_heavy_atoms=20000)
    with pytest.raises(ValueError, match="max_smiles_length"):
        ChemOptions(max_smiles_length=10**6)
    canon = Canonicalizer(ChemOptions(max_heavy_atoms=MAX_HEAVY_ATOMS_CAP, max_smiles_length=20000,
                                      largest_fragment=True))

    def forbidden(*_):
        raise AssertionError("the scaffold of an over-cap molecule was computed")

    canon._scaffold_of = forbidden
    canon._steps = [forbidden]  # nor was it standardized
    big = "C1CC(C2CC2)CC1" * 130  # 1,040 heavy atoms (8 per copy)
    assert canon(big) == "too_many_heavy_atoms"  # refused by the estimate, before parsing
    monkeypatch.setattr(molds.chem, "_HEAVY_ATOM_TOKEN", re.compile(r"(?!)"))  # an estimate that misses them
    assert canon(big) == "too_many_heavy_atoms"  # refused by the exact count right after parsing
