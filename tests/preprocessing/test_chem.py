"""The RDKit stage against RDKit called directly."""

from __future__ import annotations

import pytest
from rdkit import Chem
from rdkit.Chem.MolStandardize import rdMolStandardize
from rdkit.Chem.Scaffolds import MurckoScaffold

from molds.chemistry.canonical import Canonicalizer, ChemOptions, Molecule

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


# Ring systems, linkers, exocyclic double bonds, aromatic N-H after a cut side chain, charges,
# isotopes, radicals, stereo, dummy atoms, dative bonds, metals, several fragments, no ring.
HOSTILE = """C1CC2CCC1C2 C12C3C4C1C5C2C3C45 c1ccc2c(c1)[nH]c1ccccc12 Cn1cccc1 Cn1ccnc1 O=C1CCCCC1
O=c1cc[nH]c(=O)[nH]1 C1CCC2(CC1)CCCC2 C[C@H]1CC[C@@H](C)CC1 [2H]c1ccccc1 [13CH3]c1ccccc1 C[N+](C)(C)c1ccccc1
[O-][n+]1ccccc1 C1CCCCCCCCCCC1 C1CC1C1CC1 c1ccccc1CCc1ccccc1 CCO [Na+].[Cl-] c1cc2ccc3cccc4ccc(c1)c2c34
C1C[C@H]2C[C@@H]1C=C2 C=C1CCCCC1 N#CC1CCCCC1 B1OC(C)(C)C(C)(C)O1 C[Si]1(C)CCCC1 O=P1(O)OCCO1 c1ccc2[se]ccc2c1
Fc1ccc(cc1)[C@@H]1CC[NH2+]CC1 C1CC[C@]2(CC1)OCCO2 C1CN2CCN1CC2 C12CC3CC(C1)CC(C3)C2 O=C1C=CC(=O)C=C1
[CH]1CCCC1 [C]1CCCC1 C1CC[N]CC1 c1ccc2c(c1)-c1ccccc1-2 C/C=C/c1ccccc1 *c1ccccc1 [*:1]C1CC1 C1CC1[Hg]C1CC1
[NH3]->[Pt]1(<-[NH3])OC(=O)C2(CCC2)C(=O)O1 c1ccccc1.c1ccncc1 C[C@@H]1C[C@H]2CC[C@@]1(C)C2 c1cc[o+]cc1""".split()


def _molblock_twins(smiles: str) -> list:
    """The molecule read back from V2000 and V3000 blocks with 2D coordinates and, when it
    embeds, with 3D ones (stereo then comes from the coordinates, as an SD record's does)."""
    from rdkit.Chem import AllChem

    mol = Chem.MolFromSmiles(smiles)
    flat = Chem.Mol(mol)
    AllChem.Compute2DCoords(flat)
    blocks = [Chem.MolToMolBlock(flat), Chem.MolToV3KMolBlock(flat)]
    solid = Chem.AddHs(mol)
    if AllChem.EmbedMolecule(solid, randomSeed=7) == 0:
        blocks.append(Chem.MolToMolBlock(Chem.RemoveHs(solid)))
    return [m for m in (Chem.MolFromMolBlock(b) for b in blocks) if m is not None]


@pytest.mark.parametrize("smiles", HOSTILE)
def test_from_mol_equals_rdkit_from_smiles_and_mol_blocks(smiles):
    """What an SD record gives (a molecule read from a mol block, with 2D or 3D coordinates)
    against RDKit called directly on an untouched copy: canonical SMILES, Murcko scaffold,
    and the InChIKey (InChI reads stereo from the coordinates)."""
    plain = Canonicalizer(ChemOptions())
    keyed = Canonicalizer(ChemOptions(dedupe_key="inchikey"))
    for mol in [Chem.MolFromSmiles(smiles), *_molblock_twins(smiles)]:
        want_scaffold = Chem.MolToSmiles(MurckoScaffold.GetScaffoldForMol(Chem.Mol(mol)), isomericSmiles=False)
        got = plain.from_mol(Chem.Mol(mol))
        assert isinstance(got, Molecule), got
        assert (got.canonical, got.scaffold) == (Chem.MolToSmiles(mol), want_scaffold)
        keyed_got, want_key = keyed.from_mol(Chem.Mol(mol)), Chem.MolToInchiKey(mol)
        if want_key:
            assert (keyed_got.dedupe_key, keyed_got.scaffold) == (want_key, want_scaffold)
        else:  # dummy atoms, dative bonds: InChI has no key for them
            assert keyed_got == "inchi_error"


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

    import molds.chemistry.canonical as canonical
    from molds.chemistry.canonical import MAX_HEAVY_ATOMS_CAP

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
    monkeypatch.setattr(canonical, "_HEAVY_ATOM_TOKEN", re.compile(r"(?!)"))  # an estimate that misses them
    assert canon(big) == "too_many_heavy_atoms"  # refused by the exact count right after parsing
