"""Transforms: a component's raw value (a similarity, a logP, a count) -> a score in [0, 1].

Each transform is a plain function of the raw value with named parameters, checked when a
scoring definition is built (``make_transform``), so an impossible one (``low >= high``, a
non-positive ``sigma``) is refused with the recipe key that holds it. The formulas:

- ``sigmoid`` (low, high, k): ``1 / (1 + 10 ** (10 k ((low + high) / 2 - x) / (high - low)))``;
  0.5 halfway between low and high, rising with x (REINVENT's definition).
- ``reverse_sigmoid`` (low, high, k): ``1 - sigmoid``, falling with x.
- ``double_sigmoid`` (low, high, coef_div=100, coef_si=150, coef_se=150): REINVENT's window,
  ``10**(se x / div) / (10**(se x / div) + 10**(se low / div)) - 10**(si x / div) /
  (10**(si x / div) + 10**(si high / div))``: about 1 inside [low, high], 0 outside.
- ``step`` (low, high): 1 inside [low, high] (ends included), else 0.
- ``value_mapping`` (mapping, default=0): the score listed for the raw value (a count, a
  class), else ``default``.
- ``gaussian`` (mu, sigma): ``exp(-((x - mu) / sigma)^2 / 2)``; ``min_gaussian``: 1 for
  x <= mu, the gaussian above; ``max_gaussian``: 1 for x >= mu, the gaussian below
  (GuacaMol's modifiers, which the PMO oracles use).
- ``clipped`` (upper_x, lower_x=0, high=1, low=0): the line through (lower_x, low) and
  (upper_x, high), clipped to [low, high]; ``thresholded`` (threshold): ``min(x, t) / t``.
- ``identity``: the raw value (already a score).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ..errors import RecipeError


def _sigmoid(x, low, high, k):
    z = np.clip(10.0 * k * ((low + high) / 2.0 - x) / (high - low), -300.0, 300.0)
    return 1.0 / (1.0 + np.power(10.0, z))


def _double_sigmoid(x, low, high, coef_div, coef_si, coef_se):
    def ratio(a, b, c):  # 10**(c a) / (10**(c a) + 10**(c b)), overflow-safe
        return 1.0 / (1.0 + np.power(10.0, np.clip(c * (b - a), -300.0, 300.0)))

    return ratio(x / coef_div, low / coef_div, coef_se) - ratio(x / coef_div, high / coef_div, coef_si)


def _gaussian(x, mu, sigma):
    return np.exp(-0.5 * np.power((x - mu) / sigma, 2.0))


KINDS = {
    "identity": ((), {}),
    "sigmoid": (("low", "high"), {"k": 0.5}),
    "reverse_sigmoid": (("low", "high"), {"k": 0.5}),
    "double_sigmoid": (("low", "high"), {"coef_div": 100.0, "coef_si": 150.0, "coef_se": 150.0}),
    "step": (("low", "high"), {}),
    "value_mapping": (("mapping",), {"default": 0.0}),
    "gaussian": (("mu", "sigma"), {}),
    "min_gaussian": (("mu", "sigma"), {}),
    "max_gaussian": (("mu", "sigma"), {}),
    "clipped": (("upper_x",), {"lower_x": 0.0, "high": 1.0, "low": 0.0}),
    "thresholded": (("threshold",), {}),
}


def make_transform(spec, where: str) -> Callable[[np.ndarray], np.ndarray]:
    """``spec`` ({"kind": ..., parameters} or None for identity) -> a vectorized function
    over raw values (NaN in, 0 out: a molecule the component could not measure)."""
    if spec is None:
        spec = {"kind": "identity"}
    if not isinstance(spec, dict) or "kind" not in spec:
        raise RecipeError(f"{where}: a transform is an object with a 'kind' (one of {sorted(KINDS)})")
    kind = spec["kind"]
    if kind not in KINDS:
        raise RecipeError(f"{where}.kind: unknown transform {kind!r} (one of {sorted(KINDS)})")
    required, defaults = KINDS[kind]
    unknown = set(spec) - {"kind", *required, *defaults}
    if unknown:
        raise RecipeError(f"{where}: unknown parameters {sorted(unknown)} for the {kind} transform "
                          f"(it takes {list(required) + list(defaults)})")
    missing = [k for k in required if k not in spec]
    if missing:
        raise RecipeError(f"{where}: the {kind} transform needs {missing}")
    p = {**defaults, **{k: v for k, v in spec.items() if k != "kind"}}
    if kind == "value_mapping":
        if not isinstance(p["mapping"], dict) or not p["mapping"]:
            raise RecipeError(f"{where}.mapping: an object of raw value -> score")
        try:
            table = {float(k): float(v) for k, v in p["mapping"].items()}
            default = float(p["default"])
        except (TypeError, ValueError) as exc:
            raise RecipeError(f"{where}.mapping: keys and scores must be numbers ({exc})") from None
        return _guard(lambda x: np.array([table.get(float(v), default) for v in np.ravel(x)]).reshape(np.shape(x)))
    for name, value in p.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise RecipeError(f"{where}.{name}: a finite number, got {value!r}")
    if kind in ("sigmoid", "reverse_sigmoid", "double_sigmoid", "step") and not p["low"] < p["high"]:
        raise RecipeError(f"{where}: the {kind} transform needs low < high (got {p['low']} and {p['high']})")
    if kind in ("gaussian", "min_gaussian", "max_gaussian") and p["sigma"] <= 0:
        raise RecipeError(f"{where}.sigma: must be > 0 (got {p['sigma']})")
    if kind == "double_sigmoid" and p["coef_div"] == 0:
        raise RecipeError(f"{where}.coef_div: must not be 0")
    if kind == "clipped" and (p["upper_x"] == p["lower_x"] or not p["low"] < p["high"]):
        raise RecipeError(f"{where}: the clipped transform needs upper_x != lower_x and low < high")
    if kind == "thresholded" and p["threshold"] <= 0:
        raise RecipeError(f"{where}.threshold: must be > 0 (got {p['threshold']})")
    fn = {
        "identity": lambda x: x,
        "sigmoid": lambda x: _sigmoid(x, p["low"], p["high"], p["k"]),
        "reverse_sigmoid": lambda x: 1.0 - _sigmoid(x, p["low"], p["high"], p["k"]),
        "double_sigmoid": lambda x: _double_sigmoid(x, p["low"], p["high"], p["coef_div"], p["coef_si"],
                                                    p["coef_se"]),
        "step": lambda x: ((x >= p["low"]) & (x <= p["high"])).astype(np.float64),
        "gaussian": lambda x: _gaussian(x, p["mu"], p["sigma"]),
        "min_gaussian": lambda x: _gaussian(np.maximum(x, p["mu"]), p["mu"], p["sigma"]),
        "max_gaussian": lambda x: _gaussian(np.minimum(x, p["mu"]), p["mu"], p["sigma"]),
        "clipped": lambda x: np.clip((p["high"] - p["low"]) / (p["upper_x"] - p["lower_x"]) * (x - p["upper_x"])
                                     + p["high"], p["low"], p["high"]),
        "thresholded": lambda x: np.minimum(x, p["threshold"]) / p["threshold"],
    }[kind]
    return _guard(fn)


def _guard(fn):
    def transformed(x):
        x = np.asarray(x, dtype=np.float64)
        bad = ~np.isfinite(x)
        out = np.asarray(fn(np.where(bad, 0.0, x)), dtype=np.float64)
        return np.where(bad, 0.0, out)

    return transformed
