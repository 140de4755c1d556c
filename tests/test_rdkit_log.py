"""molds as a library leaves RDKit's log as the caller set it: the molecules molds refuses say
nothing on stderr while molds reads them, and the caller's own RDKit calls afterwards log as
they did before (``molds.chemistry.quiet_rdkit``, not ``RDLogger.DisableLog``, which would
silence RDKit for the whole process)."""

from __future__ import annotations

import numpy as np
import pytest
from rdkit import Chem, rdBase

BROKEN = "C1CC"  # an unclosed ring: RDKit's SMILES parser logs an error for it
BAD_VALENCE = "C(C)(C)(C)(C)C"  # a five-valent carbon: RDKit logs an explicit-valence error
HYDRIDE = "[H-]"  # readable, but RDKit's descriptors note "not removing hydrogen atom without neighbors"


def _calls():
    """Library entry points of molds that read molecules a user or a model wrote."""
    from molds.chemistry.canonical import Canonicalizer, ChemOptions
    from molds.chemistry.features import molecule_features
    from molds.chemistry.pairs import rooted_spellings
    from molds.metrics.generation import parse_samples
    from molds.scoring import Scorer
    from molds.scoring.components import computed_properties

    canon = Canonicalizer(ChemOptions())
    return {
        "Canonicalizer.__call__": lambda: [canon(s) for s in (BROKEN, BAD_VALENCE)],
        "Canonicalizer.parse": lambda: [canon.parse(s) for s in (BROKEN, BAD_VALENCE)],
        "parse_samples": lambda: parse_samples([BROKEN, BAD_VALENCE, "CCO"]),
        "Scorer": lambda: Scorer({"oracle": "qed"})([BROKEN, BAD_VALENCE, "CCO"]),
        "computed_properties": lambda: computed_properties([BROKEN, BAD_VALENCE], ("logp",)),
        "molecule_features": lambda: molecule_features([HYDRIDE, "CCO"], "rdkit2d+morgan"),
        "rooted_spellings": lambda: rooted_spellings(BROKEN, rng=np.random.default_rng(0), count=3),
    }


@pytest.fixture
def rdkit_log_on():
    """RDKit's errors and warnings switched on (as a fresh process has them), restored after."""
    before = rdBase.LogStatus()
    rdBase.EnableLog("rdApp.error")
    rdBase.EnableLog("rdApp.warning")
    yield
    for line in before.splitlines():
        name, state = line.split(":")
        (rdBase.EnableLog if state == "enabled" else rdBase.DisableLog)(name)


@pytest.mark.parametrize("name", sorted(_calls()))
def test_molds_reads_bad_molecules_quietly_and_leaves_the_callers_rdkit_log_as_it_was(name, rdkit_log_on, capfd):
    # RDKit, unblocked, does log these molecules (so silence below is molds' doing)
    Chem.MolFromSmiles(BROKEN)
    Chem.MolFromSmiles(BAD_VALENCE)
    said = capfd.readouterr().err
    assert "unclosed ring" in said and "valence" in said.lower()

    status = rdBase.LogStatus()
    _calls()[name]()
    assert capfd.readouterr().err == "", f"{name} let RDKit's log through"
    assert rdBase.LogStatus() == status, f"{name} changed RDKit's log for the whole process"
    Chem.MolFromSmiles(BROKEN)
    assert "unclosed ring" in capfd.readouterr().err, f"{name} left RDKit's log switched off"
