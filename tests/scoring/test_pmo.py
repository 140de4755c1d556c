"""Every PMO oracle against PyTDC's own oracle code (a test-only dependency, installed
without its dependencies by .ci/install) on 1,000 MOSES molecules, the tasks' own target
molecules and molecules that reach the tasks' SMARTS, to 1e-6."""

from __future__ import annotations

import gzip
import importlib.metadata
import os
import sys
import types

import numpy as np
import pytest

from molds.scoring import Scorer
from molds.scoring.pmo import ORACLES

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")

# molecules that match the SMARTS of valsartan_smarts, deco_hop and scaffold_hop, and the targets
EXTRA = ["CCCCC(=O)N(Cc1ccc(-c2ccccc2-c2nnn[nH]2)cc1)C(C(C)C)C(=O)O",  # valsartan
         "CN(C=O)Cc1ccc(-c2ccccc2)cc1", "CN(C(=O)C(N)CO)Cc1ccc(-c2ccccc2O)cc1",
         "NC(=O)CN(C=O)Cc1ccc(-c2ccc(O)cc2)cc1", "OCCN(C(=O)CN)Cc1ccc(-c2ccccc2F)cc1",
         "CC(N)C(=O)N(CC(=O)O)Cc1ccc(-c2ccccc2)cc1",
         "CCCOc1cc2ncnc(Nc3ccc4ncsc4c3)c2cc1S(=O)(=O)C(C)(C)C",
         "COc1cc2ncnc(Nc3ccccc3)c2cc1O", "CCCOc1ccccc1NC(=O)c1ccc2ncsc2c1"]


def _tdc():
    """PyTDC's oracle module on today's setuptools and RDKit: its two stale imports
    (``pkg_resources`` for a version string, ``rdkit.six`` for ``iteritems``) stubbed."""
    try:
        importlib.metadata.version("PyTDC")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("PyTDC is not installed (bash .ci/install installs it for the tests)")
    if "pkg_resources" not in sys.modules:
        try:
            import pkg_resources  # noqa: F401
        except ImportError:
            stub = types.ModuleType("pkg_resources")
            stub.get_distribution = lambda name: types.SimpleNamespace(version=importlib.metadata.version(name))
            sys.modules["pkg_resources"] = stub
    if "rdkit.six" not in sys.modules:
        six = types.ModuleType("rdkit.six")
        six.iteritems = lambda d: iter(d.items())
        six.PY3 = True
        sys.modules["rdkit.six"] = six
    import tdc.chem_utils.oracle.oracle as oracle

    return oracle


@pytest.fixture(scope="module")
def molecules():
    from molds.scoring import pmo

    rows = gzip.open(os.path.join(ROOT, "molds", "sample_data", "moses_sample.csv.gz"), "rt").read().splitlines()
    targets = [v for k, v in vars(pmo).items() if k.isupper() and isinstance(v, str) and "[#" not in v]
    return [r.split(",")[0] for r in rows[1:1001]] + targets + EXTRA


@pytest.mark.parametrize("name", ORACLES)
def test_oracle_matches_pytdc(molecules, name):
    import warnings

    from rdkit import RDLogger

    oracle = _tdc()
    RDLogger.DisableLog("rdApp.*")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = np.array([float(getattr(oracle, name)(s)) for s in molecules])
    ours = Scorer({"oracle": name})(molecules).total
    assert np.abs(ours - theirs).max() <= 1e-6, name
    # and relatively, where the scores are small (valsartan_smarts: 1e-25 .. 5e-4)
    nonzero = theirs > 0
    assert np.abs(ours[nonzero] / theirs[nonzero] - 1).max() <= 1e-9, name
    assert np.count_nonzero(theirs) >= 5 and theirs.std() > 0  # not a comparison of zeros


def test_twenty_oracles_and_their_refusal():
    from molds.errors import RecipeError

    assert len(ORACLES) == 20 and len(set(ORACLES)) == 20
    with pytest.raises(RecipeError, match="'drd2' is not a PMO oracle molds has"):
        Scorer({"oracle": "drd2"})
