"""The bounded-memory prefix cut against a brute-force sort of every group."""

from __future__ import annotations

import numpy as np
import pytest

from molds.preprocessing.split import assign_split, check_fractions, group_major, plan_split


def brute_force(method, hashes, sizes, fractions):
    major = group_major(method, sizes)
    order = np.lexsort((hashes, major))
    before = np.concatenate([[0], np.cumsum(sizes[order])[:-1]])
    total = sizes.sum()
    t1 = round(fractions[0] * total)
    t2 = round((fractions[0] + fractions[1]) * total)
    split = np.where(before < t1, 0, np.where(before < t2, 1, 2))
    out = np.empty(len(hashes), dtype=np.int8)
    out[order] = split
    return out


@pytest.mark.parametrize("method", ["scaffold", "random", "scaffold_random"])
@pytest.mark.parametrize("seed", range(6))
def test_plan_split_matches_brute_force(method, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 4000))
    hashes = np.unique(rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False))
    if seed % 2:  # crowd hashes into few top-16-bit cells so the exact pass has work
        hashes = np.unique((hashes >> np.uint64(56)) << np.uint64(48) | (hashes & np.uint64(0xFFFF)))
    rng.shuffle(hashes)
    sizes = rng.zipf(1.7, size=len(hashes)).clip(max=5000).astype(np.int64)
    if method == "random":
        sizes[:] = 1
    fractions = check_fractions([0.8, 0.1, 0.1] if seed < 3 else [0.7, 0.3])
    parts = np.array_split(np.arange(len(hashes)), 5)

    def tables():
        for idx in parts:
            yield group_major(method, sizes[idx]), hashes[idx], sizes[idx]

    thresholds = plan_split(tables, int(sizes.sum()), fractions)
    got = assign_split(thresholds, group_major(method, sizes), hashes)
    np.testing.assert_array_equal(got, brute_force(method, hashes, sizes, fractions))


def test_fractions_are_checked():
    with pytest.raises(ValueError):
        check_fractions([0.5, 0.2])
    with pytest.raises(ValueError):
        check_fractions([0.0, 0.5, 0.5])
    assert check_fractions([0.9, 0.1]) == (0.9, 0.1, 0.0)
