"""Each transform against its formula at hand-computed points, and the refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from molds.errors import RecipeError
from molds.scoring.transforms import make_transform


def _at(spec, xs):
    return make_transform(spec, "t")(np.array(xs, dtype=float)).tolist()


def test_sigmoids_at_hand_computed_points():
    # sigmoid(low=0, high=10, k=0.5): 1 / (1 + 10 ** (10 * 0.5 * (5 - x) / 10)) = 1 / (1 + 10 ** ((5 - x) / 2))
    s = {"kind": "sigmoid", "low": 0, "high": 10, "k": 0.5}
    assert _at(s, [5, 7, 3, 10]) == pytest.approx([0.5, 1 / (1 + 10 ** -1), 1 / (1 + 10 ** 1), 1 / (1 + 10 ** -2.5)])
    r = {"kind": "reverse_sigmoid", "low": 0, "high": 10, "k": 0.5}
    assert _at(r, [5, 7, 3]) == pytest.approx([0.5, 1 - 1 / (1 + 10 ** -1), 1 - 1 / (1 + 10 ** 1)])
    # double sigmoid (low 200, high 400, div 100, si = se = 1): at 300
    # 10**3 / (10**3 + 10**2) - 10**3 / (10**3 + 10**4) = 1000/1100 - 1000/11000
    d = {"kind": "double_sigmoid", "low": 200, "high": 400, "coef_div": 100, "coef_si": 1, "coef_se": 1}
    assert _at(d, [300]) == pytest.approx([1000 / 1100 - 1000 / 11000])
    # REINVENT's defaults (150 / 150 / 100): ~1 inside the window, ~0 outside, 0.5 at its ends
    dd = {"kind": "double_sigmoid", "low": 200, "high": 400}
    inside, below, above, at_low = _at(dd, [300, 150, 450, 200])
    assert inside == pytest.approx(1.0, abs=1e-6) and below < 1e-6 and above < 1e-6
    assert at_low == pytest.approx(0.5, abs=1e-6)
    assert _at(s, [1e9, -1e9]) == pytest.approx([1.0, 0.0])  # no overflow


def test_windows_gaussians_clipping_and_mapping():
    assert _at({"kind": "step", "low": 2, "high": 4}, [1.999, 2, 3, 4, 4.001]) == [0, 1, 1, 1, 0]
    assert _at({"kind": "gaussian", "mu": 3, "sigma": 0.5}, [3, 3.5, 2]) == pytest.approx(
        [1.0, math.exp(-0.5), math.exp(-2.0)])
    assert _at({"kind": "min_gaussian", "mu": 1, "sigma": 1}, [0, 1, 2]) == pytest.approx([1, 1, math.exp(-0.5)])
    assert _at({"kind": "max_gaussian", "mu": 100, "sigma": 10}, [120, 100, 90]) == pytest.approx(
        [1, 1, math.exp(-0.5)])
    assert _at({"kind": "clipped", "upper_x": 0.8}, [-0.1, 0.0, 0.4, 0.8, 0.9]) == pytest.approx([0, 0, 0.5, 1, 1])
    assert _at({"kind": "clipped", "upper_x": 2, "lower_x": 4}, [1, 3, 5]) == pytest.approx([1, 0.5, 0])
    assert _at({"kind": "thresholded", "threshold": 0.5}, [0.25, 0.9]) == pytest.approx([0.5, 1.0])
    assert _at({"kind": "value_mapping", "mapping": {"0": 1.0, "1": 0.5}, "default": 0.1}, [0, 1, 2]) == \
        pytest.approx([1.0, 0.5, 0.1])
    assert _at(None, [0.3]) == pytest.approx([0.3])
    assert _at({"kind": "sigmoid", "low": 0, "high": 1}, [float("nan")]) == [0.0]  # not measured: 0


@pytest.mark.parametrize("spec,message", [
    ({"kind": "sigmoid", "low": 5, "high": 5}, "needs low < high"),
    ({"kind": "gaussian", "mu": 1, "sigma": 0}, r"t.sigma: must be > 0"),
    ({"kind": "sigmoid", "low": 0}, r"needs \['high'\]"),
    ({"kind": "sigmoid", "low": 0, "high": 1, "slope": 2}, r"unknown parameters \['slope'\]"),
    ({"kind": "bell", "mu": 1}, "unknown transform 'bell'"),
    ({"kind": "step", "low": "a", "high": 1}, "t.low: a finite number"),
    ({"kind": "value_mapping", "mapping": {"x": 1}}, "keys and scores must be numbers"),
    ({"kind": "clipped", "upper_x": 1, "lower_x": 1}, "upper_x != lower_x"),
])
def test_impossible_transforms_are_refused_naming_the_key(spec, message):
    with pytest.raises(RecipeError, match=message):
        make_transform(spec, "t")
