"""molds.chemistry.pairs: reactions and molecule pairs made canonical, held to RDKit read directly
(each molecule canonicalized alone, atom maps cleared by hand) and to the reasons a
record is refused for."""

from __future__ import annotations

import re

import pytest
from rdkit import Chem
from rdkit.Chem.Scaffolds import MurckoScaffold

from molds.chemistry.canonical import REJECT_REASONS, ChemOptions
from molds.chemistry.pairs import PAIR_REASONS, PairCanonicalizer, PairOptions, split_reaction

# real reaction classes, written with atom maps as USPTO writes them, and the same without
AMIDE = ("[CH3:1][C:2](=[O:3])[OH:4].[NH2:5][CH2:6][c:7]1[cH:8][cH:9][cH:10][cH:11][cH:12]1"
         ">CN(C)C=O.CCN(C(C)C)C(C)C>[CH3:1][C:2](=[O:3])[NH:5][CH2:6][c:7]1[cH:8][cH:9][cH:10][cH:11][cH:12]1")
AMIDE_PLAIN = "CC(=O)O.NCc1ccccc1>CN(C)C=O.CCN(C(C)C)C(C)C>CC(=O)NCc1ccccc1"
SUZUKI = "Brc1ccc(C#N)cc1.OB(O)c1ccccc1>[Pd].O=C([O-])[O-].[K+].[K+]>N#Cc1ccc(-c2ccccc2)cc1"
BOC_REMOVAL = "CC(C)(C)OC(=O)N1CC[C@H](O)C1>Cl>O[C@H]1CCNC1"


def rdkit_side(text: str) -> list[str]:
    """The reference: each molecule of a side canonicalized by RDKit alone, maps cleared."""
    out = []
    for part in text.split("."):
        if not part:
            continue
        mol = Chem.MolFromSmiles(part)
        for atom in mol.GetAtoms():
            atom.SetAtomMapNum(0)
        out.append(Chem.MolToSmiles(Chem.MolFromSmiles(Chem.MolToSmiles(mol))))
    return sorted(out)


def make(task="forward", reagents="auto", **chem):
    return PairCanonicalizer(ChemOptions(**chem), PairOptions(task=task, reagents=reagents))


@pytest.mark.parametrize("reaction", [AMIDE, AMIDE_PLAIN, SUZUKI, BOC_REMOVAL])
def test_each_side_equals_rdkit_reading_each_molecule_alone(reaction):
    reactants, reagents, products = reaction.split(">")
    pair = make("forward", "separate").reaction(reaction)
    assert pair.source == ".".join(rdkit_side(reactants)) + ">" + ".".join(rdkit_side(reagents))
    assert pair.target == ".".join(rdkit_side(products))
    # the split group is the product's Murcko scaffold, as RDKit computes it
    scaffolds = sorted(Chem.MolToSmiles(MurckoScaffold.GetScaffoldForMol(Chem.MolFromSmiles(p)), isomericSmiles=False)
                       for p in rdkit_side(products))
    assert pair.scaffold == ".".join(s for s in scaffolds if s)
    assert ":" not in pair.source + pair.target  # no atom map survives


def test_atom_maps_molecule_order_and_spelling_do_not_change_the_pair():
    spellings = [
        AMIDE,
        AMIDE_PLAIN,
        # other maps, reactants and reagents in another order, other SMILES of the same molecules
        "[NH2:9][CH2:8]c1ccccc1.[OH:1][C:2]([CH3:3])=[O:4]>CCN(C(C)C)C(C)C.O=CN(C)C>c1ccc(cc1)[CH2:8][NH:9][C:2]([CH3:3])=O",
        "OC(C)=O.c1ccccc1CN>CCN(C(C)C)C(C)C.CN(C)C=O>O=C(C)NCc1ccccc1 |f:0.1|",
    ]
    for task in ("forward", "retro"):
        for policy in ("mix", "separate", "drop"):
            canon = make(task, policy)
            keys = {canon.reaction(s).key for s in spellings}
            assert len(keys) == 1, (task, policy, keys)


def test_reagent_policies_and_tasks():
    r, g, p = (".".join(rdkit_side(x)) for x in AMIDE_PLAIN.split(">"))
    mixed = ".".join(sorted(rdkit_side(AMIDE_PLAIN.split(">")[0]) + rdkit_side(AMIDE_PLAIN.split(">")[1])))
    assert make("forward", "mix").reaction(AMIDE).source == mixed
    assert make("forward", "auto").reaction(AMIDE).source == mixed  # auto: mixed for forward prediction
    assert make("forward", "separate").reaction(AMIDE).source == f"{r}>{g}"
    assert make("forward", "drop").reaction(AMIDE).source == r
    retro = make("retro", "auto").reaction(AMIDE)  # auto: the reactants alone for retrosynthesis
    assert (retro.source, retro.target) == (p, r)
    assert make("retro", "mix").reaction(AMIDE).target == mixed
    fwd = make("forward").reaction(AMIDE)
    assert retro.scaffold == fwd.scaffold == "c1ccccc1"  # the product's scaffold in both directions
    assert PairOptions(task="retro").describe()["product_side"] == "source"
    assert PairOptions(task="forward").describe()["reagents"] == "mix"


def test_a_source_given_alone_is_made_as_the_etl_makes_the_reactions_source():
    """molds-predict's input: a forward model reads ``reactants>reagents`` (a reaction without
    its products) with its reagents mixed in, kept apart or dropped as the ETL did for it."""
    r, g, p = AMIDE_PLAIN.split(">")
    shuffled = "c1ccccc1CN.OC(C)=O>O=CN(C)C.CCN(C(C)C)C(C)C"  # another order and spelling
    for policy in ("mix", "separate", "drop"):
        canon = make("forward", policy)
        want = canon.reaction(AMIDE).source
        assert canon.source(f"{r}>{g}") == canon.source(shuffled) == (want, None), policy
        alone = {"mix": ".".join(rdkit_side(r)), "separate": ".".join(rdkit_side(r)) + ">",
                 "drop": ".".join(rdkit_side(r))}[policy]
        assert canon.source(r) == (alone, None), policy  # no reagent given
        assert canon.source(AMIDE_PLAIN) == (None, "not_a_reaction")
        assert canon.source(f">{g}") == (None, "empty_side")
    assert make("retro").source(p) == (".".join(rdkit_side(p)), None)
    assert make("retro").source(f"{r}>{g}") == (None, "not_a_reaction")
    assert make("forward").source("C1CC>O")[1] == "parse_error"


def test_two_columns_make_the_same_pair_as_the_reaction():
    r, _, p = AMIDE.split(">")
    assert make("forward", "drop").pair(r, p) == make("forward", "drop").reaction(AMIDE)
    assert make("retro").pair(p, r) == make("retro").reaction(AMIDE)
    m2m = make("mol2mol").pair("c1ccccc1CCO", "OCCc1ccc(F)cc1")
    assert (m2m.source, m2m.target) == ("OCCc1ccccc1", "OCCc1ccc(F)cc1")
    assert m2m.scaffold == "c1ccccc1"  # the target's (the molecule produced)


def test_a_ring_bond_written_across_a_dot_is_one_molecule_and_stereo_is_kept():
    pair = make("mol2mol").pair("C1CC.C1", "[C@@H:1](F)(Cl)Br")
    assert pair.source == Chem.MolToSmiles(Chem.MolFromSmiles("C1CC.C1")) == "CCCC"
    assert pair.target == Chem.MolToSmiles(Chem.MolFromSmiles("[C@@H](F)(Cl)Br")) == "F[C@H](Cl)Br"
    assert make("mol2mol", keep_stereo=False).pair("CCO", "[C@@H](F)(Cl)Br").target == "FC(Cl)Br"


def test_the_canonical_pair_reads_back_as_itself():
    for reaction in (AMIDE, SUZUKI, BOC_REMOVAL):
        for policy in ("mix", "separate", "drop"):
            first = make("forward", policy).reaction(reaction)
            again = (make("forward", policy).reaction(f"{first.source}>>{first.target}") if policy != "separate"
                     else make("forward", policy).reaction(f"{first.source}>{first.target}"))
            assert again.key == first.key, (reaction, policy)


@pytest.mark.parametrize("text, reason", [
    ("CCO>CCN", "not_a_reaction"),  # one '>'
    ("CCO>>CC>>O", "not_a_reaction"),
    ("CCO>>CC=O extra words", "not_a_reaction"),
    (">>CC=O", "empty_side"),
    ("CCO>>", "empty_side"),
    ("CCO.CC(=O)O>>CCO", "no_op_reaction"),
    ("CCO>[Na+].[OH-]>[Na+].[OH-]", "no_op_reaction"),
    ("CC(C>>CC", "parse_error"),
    ("CCO>>C(C)(C)(C)(C)C", "valence_error"),
    ("c1cccc1>>CC", "kekulize_error"),
    ("C" * 600 + ">>CC", "too_long"),
])
def test_each_refused_reaction_is_named_by_its_reason(text, reason):
    assert make().reaction(text) == reason
    assert reason in PAIR_REASONS or reason in REJECT_REASONS


def test_atom_map_numbers_do_not_count_toward_the_length_limit():
    """A mapped molecule longer than max_smiles_length only by its map numbers is read (as
    RDKit reads it unmapped); one longer without them is refused. USPTO-50k's validation
    split holds two such reactions (534 characters a side mapped, 336 without)."""
    from rdkit import Chem

    chain = 30
    mapped = "[CH3:1]" + "".join(f"[CH2:{i}]" for i in range(2, chain + 1)) + f"[OH:{chain + 1}]"
    product = "C" * chain + "=O"
    plain_length = len(re.sub(r":\d+\]", "]", mapped))
    assert len(mapped) > plain_length + 60
    pair = make("retro", max_smiles_length=plain_length).reaction(f"{mapped}>>{product}")
    assert pair.target == Chem.MolToSmiles(Chem.MolFromSmiles("C" * chain + "O"))
    assert make("retro", max_smiles_length=plain_length - 1).reaction(f"{mapped}>>{product}") == "too_long"


def test_refused_pairs_and_options():
    canon = make("mol2mol")
    assert canon.pair("", "CCO") == "empty_side"
    assert canon.pair("CCO", "   ") == "empty_side"
    assert canon.pair("CCO", "C1CC") == "parse_error"
    assert make("mol2mol", max_heavy_atoms=5).pair("CCO", "CCCCCCC") == "too_many_heavy_atoms"
    with pytest.raises(ValueError, match="task must be one of"):
        PairOptions(task="backward")
    with pytest.raises(ValueError, match="reagents must be one of"):
        PairOptions(reagents="keep")
    assert split_reaction("CC>>O |f:0.1|") == ("CC", "", "O")


@pytest.mark.parametrize("side", ["CC(=O)NCc1ccccc1", "O[C@H]1CCNC1", "CC(=O)O.NCc1ccccc1",
                                  "Brc1ccc(C#N)cc1.OB(O)c1ccccc1>[Pd].[K+].[K+]"])
def test_rooted_spellings_spell_the_side_read_by_rdkit(side):
    """Test-time augmentation's spellings of a source: the side itself first, then distinct
    strings that RDKit reads back as the same molecules (stereo kept), each starting at
    another atom or molecule; reagents after a ``>`` untouched."""
    import numpy as np

    from molds.chemistry.pairs import rooted_spellings

    head, sep, rest = side.partition(">")
    got = rooted_spellings(side, rng=np.random.default_rng(0), count=6)
    assert got[0] == side and len(got) == len(set(got)) == 6
    for text in got:
        h, s, r = text.partition(">")
        assert (s, r) == (sep, rest)
        assert rdkit_side(h) == rdkit_side(head), text
    assert len({t.split(".")[0][:3] for t in got}) > 1  # not the same start each time


def test_a_side_with_fewer_spellings_than_asked_gives_those_it_has():
    import numpy as np

    from molds.chemistry.pairs import rooted_spellings

    rng = np.random.default_rng(0)
    assert rooted_spellings("c1ccccc1", rng=rng, count=5) == ["c1ccccc1"]  # every atom alike: one string
    assert sorted(rooted_spellings("CCO", rng=rng, count=5)) == sorted(["CCO", "OCC", "C(C)O"])
    assert rooted_spellings("not a molecule", rng=rng, count=5) == ["not a molecule"]
