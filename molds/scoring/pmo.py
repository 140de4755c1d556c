"""The 20 RDKit-only oracles of the PMO benchmark (Gao et al., NeurIPS 2022), by PMO's names.

They are GuacaMol's goal-directed tasks (Brown et al. 2019) as Therapeutics Data Commons
scores them (after TDC's 2022 changes to the isomer scoring, which counts hydrogens),
written here as ordinary scoring definitions: each is a list of components with their
transforms and a mean, so ``molds-score --oracle NAME --print`` shows what it is, and a
recipe can name one (``{"oracle": "osimertinib_mpo"}``) or copy and edit it. The three
oracles PMO loads from model files (drd2, gsk3b, jnk3) are not here: nothing of molds
downloads at run time. ``tests/scoring/test_pmo.py`` holds every definition to PyTDC's
oracle code on 1,000 MOSES molecules.
"""

from __future__ import annotations

import copy

from rdkit import Chem
from rdkit.Chem import Crippen, Descriptors

from ..errors import RecipeError

# targets
CELECOXIB = "CC1=CC=C(C=C1)C1=CC(=NN1C1=CC=C(C=C1)S(N)(=O)=O)C(F)(F)F"
TROGLITAZONE = "Cc1c(C)c2OC(C)(COc3ccc(CC4SC(=O)NC4=O)cc3)CCc2c(C)c1O"
THIOTHIXENE = "CN(C)S(=O)(=O)c1ccc2Sc3ccccc3C(=CCCN4CCN(C)CC4)c2c1"
ALBUTEROL = "CC(C)(C)NCC(O)c1ccc(O)c(CO)c1"
MESTRANOL = "COc1ccc2[C@H]3CC[C@@]4(C)[C@@H](CC[C@@]4(O)C#C)[C@@H]3CCc2c1"
CAMPHOR, MENTHOL = "CC1(C)C2CCC1(C)C(=O)C2", "CC(C)C1CCC(C)CC1O"
TADALAFIL = "O=C1N(CC(N2C1CC3=C(C2C4=CC5=C(OCO5)C=C4)NC6=C3C=CC=C6)=O)C"
SILDENAFIL = "CCCC1=NN(C2=C1N=C(NC2=O)C3=C(C=CC(=C3)S(=O)(=O)N4CCN(CC4)C)OCC)C"
OSIMERTINIB = "COc1cc(N(C)CCN(C)C)c(NC(=O)C=C)cc1Nc2nccc(n2)c3cn(C)c4ccccc34"
FEXOFENADINE = "CC(C)(C(=O)O)c1ccc(cc1)C(O)CCCN2CCC(CC2)C(O)(c3ccccc3)c4ccccc4"
RANOLAZINE = "COc1ccccc1OCC(O)CN2CCN(CC(=O)Nc3c(C)cccc3C)CC2"
PERINDOPRIL = "O=C(OCC)C(NC(C(=O)N1C(C(=O)O)CC2CCCCC12)C)CCC"
AMLODIPINE = "Clc1ccccc1C2C(=C(/N/C(=C2/C(=O)OCC)COCCN)C)\\C(=O)OC"
ZALEPLON = "O=C(C)N(CC)C1=CC=CC(C2=CC=NC3=C(C=NN23)C#N)=C1"
SITAGLIPTIN = "Fc1cc(c(F)cc1F)CC(N)CC(=O)N3Cc2nnc(n2CC3)C(F)(F)F"
SITAGLIPTIN_VALSARTAN = "NC(CC(=O)N1CCn2c(nnc2C(F)(F)F)C1)Cc1cc(F)c(F)cc1F"  # the same drug, as that task writes it
PHARMACOPHORE = "CCCOc1cc2ncnc(Nc3ccc4ncsc4c3)c2cc1S(=O)(=O)C(C)(C)C"
HOP_SCAFFOLD = "[#7]-c1n[c;h1]nc2[c;h1]c(-[#8])[c;h0][c;h1]c12"


def _sim(name, smiles, fp, transform=None):
    spec = {"kind": "similarity", "name": name, "smiles": smiles, "fingerprint": fp}
    if transform:
        spec["transform"] = transform
    return spec


def _prop(name, prop, transform):
    return {"kind": "property", "name": name, "property": prop, "transform": transform}


def _descriptor(smiles: str, which: str) -> float:
    mol = Chem.MolFromSmiles(smiles)
    return float({"logp": Crippen.MolLogP, "tpsa": Descriptors.TPSA, "bertz": Descriptors.BertzCT}[which](mol))


def _gauss(mu, sigma, kind="gaussian"):
    return {"kind": kind, "mu": mu, "sigma": sigma}


def _clipped(upper_x):
    return {"kind": "clipped", "upper_x": upper_x}


def _definitions() -> dict:
    geo = "geometric"
    return {
        "qed": {"aggregate": geo, "components": [{"kind": "qed", "name": "qed"}]},
        "albuterol_similarity": {"aggregate": geo, "components": [
            _sim("albuterol", ALBUTEROL, "FCFP4", _clipped(0.75))]},
        "mestranol_similarity": {"aggregate": geo, "components": [
            _sim("mestranol", MESTRANOL, "AP", _clipped(0.75))]},
        "celecoxib_rediscovery": {"aggregate": geo, "components": [_sim("celecoxib", CELECOXIB, "ECFP4")]},
        "troglitazone_rediscovery": {"aggregate": geo, "components": [_sim("troglitazone", TROGLITAZONE, "ECFP4")]},
        "thiothixene_rediscovery": {"aggregate": geo, "components": [_sim("thiothixene", THIOTHIXENE, "ECFP4")]},
        "median1": {"aggregate": geo, "components": [_sim("camphor", CAMPHOR, "ECFP4"),
                                                     _sim("menthol", MENTHOL, "ECFP4")]},
        "median2": {"aggregate": geo, "components": [_sim("tadalafil", TADALAFIL, "ECFP6"),
                                                     _sim("sildenafil", SILDENAFIL, "ECFP6")]},
        "osimertinib_mpo": {"aggregate": geo, "components": [
            _prop("tpsa", "tpsa", _gauss(100, 10, "max_gaussian")),
            _prop("logp", "logp", _gauss(1, 1, "min_gaussian")),
            _sim("osimertinib_fcfp4", OSIMERTINIB, "FCFP4", _clipped(0.8)),
            _sim("osimertinib_ecfp6", OSIMERTINIB, "ECFP6", _gauss(0.85, 0.1, "min_gaussian"))]},
        "fexofenadine_mpo": {"aggregate": geo, "components": [
            _prop("tpsa", "tpsa", _gauss(90, 10, "max_gaussian")),
            _prop("logp", "logp", _gauss(4, 1, "min_gaussian")),
            _sim("fexofenadine", FEXOFENADINE, "AP", _clipped(0.8))]},
        "ranolazine_mpo": {"aggregate": geo, "components": [
            _prop("tpsa", "tpsa", _gauss(95, 20, "max_gaussian")),
            _prop("logp", "logp", _gauss(7, 1, "max_gaussian")),
            _sim("ranolazine", RANOLAZINE, "AP", _clipped(0.7)),
            _prop("fluorines", "atoms:F", _gauss(1, 1.0))]},
        "perindopril_mpo": {"aggregate": geo, "components": [
            _sim("perindopril", PERINDOPRIL, "ECFP4"),
            _prop("aromatic_rings", "aromatic_rings", _gauss(2, 0.5))]},
        "amlodipine_mpo": {"aggregate": geo, "components": [
            _sim("amlodipine", AMLODIPINE, "ECFP4"),
            _prop("rings", "rings", _gauss(3, 0.5))]},
        "sitagliptin_mpo": {"aggregate": geo, "components": [
            _sim("sitagliptin", SITAGLIPTIN, "ECFP4", _gauss(0, 0.1)),
            _prop("logp", "logp", _gauss(_descriptor(SITAGLIPTIN, "logp"), 0.2)),
            _prop("tpsa", "tpsa", _gauss(_descriptor(SITAGLIPTIN, "tpsa"), 5)),
            {"kind": "isomer", "name": "isomer", "formula": "C16H15F6N5O"}]},
        "zaleplon_mpo": {"aggregate": geo, "components": [
            _sim("zaleplon", ZALEPLON, "ECFP4"),
            {"kind": "isomer", "name": "isomer", "formula": "C19H17N3O2"}]},
        "isomers_c7h8n2o2": {"aggregate": geo, "components": [
            {"kind": "isomer", "name": "isomer", "formula": "C7H8N2O2"}]},
        "isomers_c9h10n2o2pf2cl": {"aggregate": geo, "components": [
            {"kind": "isomer", "name": "isomer", "formula": "C9H10N2O2PF2Cl"}]},
        "deco_hop": {"aggregate": "arithmetic", "components": [
            _sim("pharmacophore", PHARMACOPHORE, "PHCO", _clipped(0.85)),
            {"kind": "substructure", "name": "no_sulfone", "smarts": "CS([#6])(=O)=O", "mode": "exclude"},
            {"kind": "substructure", "name": "no_benzothiazole", "smarts": "[#7]-c1ccc2ncsc2c1", "mode": "exclude"},
            {"kind": "substructure", "name": "scaffold", "smarts": HOP_SCAFFOLD, "mode": "require"}]},
        "scaffold_hop": {"aggregate": "arithmetic", "components": [
            _sim("pharmacophore", PHARMACOPHORE, "PHCO", _clipped(0.75)),
            {"kind": "substructure", "name": "decoration",
             "smarts": "[#6]-[#6]-[#6]-[#8]-[#6]~[#6]~[#6]~[#6]~[#6]-[#7]-c1ccc2ncsc2c1", "mode": "require"},
            {"kind": "substructure", "name": "no_scaffold", "smarts": HOP_SCAFFOLD, "mode": "exclude"}]},
        "valsartan_smarts": {"aggregate": geo, "components": [
            {"kind": "substructure", "name": "valsartan_smarts", "smarts": "CN(C=O)Cc1ccc(c2ccccc2)cc1",
             "mode": "require"},
            _prop("tpsa", "tpsa", _gauss(_descriptor(SITAGLIPTIN_VALSARTAN, "tpsa"), 5)),
            _prop("logp", "logp", _gauss(_descriptor(SITAGLIPTIN_VALSARTAN, "logp"), 0.2)),
            _prop("bertz", "bertz", _gauss(_descriptor(SITAGLIPTIN_VALSARTAN, "bertz"), 30))]},
    }


ORACLES = ("albuterol_similarity", "amlodipine_mpo", "celecoxib_rediscovery", "deco_hop", "fexofenadine_mpo",
           "isomers_c7h8n2o2", "isomers_c9h10n2o2pf2cl", "median1", "median2", "mestranol_similarity",
           "osimertinib_mpo", "perindopril_mpo", "qed", "ranolazine_mpo", "scaffold_hop", "sitagliptin_mpo",
           "thiothixene_rediscovery", "troglitazone_rediscovery", "valsartan_smarts", "zaleplon_mpo")

_CACHE: dict = {}


def oracle_definition(name: str, where: str = "oracle") -> dict:
    """The scoring definition of a PMO oracle (a fresh copy, safe to edit)."""
    if name not in ORACLES:
        raise RecipeError(f"{where}: {name!r} is not a PMO oracle molds has (one of {list(ORACLES)}; drd2, gsk3b "
                          f"and jnk3 need model files from the internet and are left out)")
    if not _CACHE:
        _CACHE.update(_definitions())
    return copy.deepcopy({"name": name, **_CACHE[name]})
