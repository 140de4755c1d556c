"""The bounded-memory prefix cut against a brute-force sort of every group."""

from __future__ import annotations

import numpy as np
import pytest

from molds.preprocessing.split import assign_split, check_fractions, group_major, large_group_size, plan_split


def brute_force(method, hashes, sizes, fractions, large=None):
    """Every group sorted by its whole key at once; the rows before it place it."""
    major = group_major(method, sizes, large)
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

    large = large_group_size(method, int(sizes.sum()), fractions)

    def tables():
        for idx in parts:
            yield group_major(method, sizes[idx], large), hashes[idx], sizes[idx]

    thresholds = plan_split(tables, int(sizes.sum()), fractions, large)
    assert thresholds.large == large
    got = assign_split(thresholds, group_major(method, sizes, large), hashes)
    np.testing.assert_array_equal(got, brute_force(method, hashes, sizes, fractions, large))


@pytest.mark.parametrize("fractions", [(0.8, 0.1, 0.1), (0.7, 0.3, 0.0), (0.8, 0.0, 0.2)])
def test_a_large_scaffold_group_cannot_empty_an_evaluation_split(fractions):
    """ESOL-like groups: one scaffold (the acyclic molecules) holds a fifth of the rows, the
    rest are small. In a random order without the balanced rule, some seeds draw the large
    group just before the train cut, and train runs past the validation cut. With it, over
    every seed, each split of non-zero fraction receives at least half its share, and every
    group larger than ``large`` is in train."""
    rng = np.random.default_rng(7)
    sizes = np.concatenate([[230, 90, 60], rng.integers(1, 8, size=300)]).astype(np.int64)
    total = int(sizes.sum())
    large = large_group_size("scaffold_random", total, fractions)
    assert large == int(min(f * total for f in fractions[1:] if f) // 2)
    emptied = 0
    for seed in range(40):
        hashes = np.unique(np.random.default_rng(seed).integers(0, 2**64, size=len(sizes), dtype=np.uint64,
                                                                 endpoint=False))
        if len(hashes) < len(sizes):
            continue
        np.random.default_rng(seed).shuffle(hashes)
        old = brute_force("scaffold_random", hashes, sizes, fractions)  # no large: the old random order
        emptied += any(fractions[k] > 0 and not sizes[old == k].sum() for k in (1, 2))
        got = brute_force("scaffold_random", hashes, sizes, fractions, large)
        rows = [int(sizes[got == k].sum()) for k in range(3)]
        for k in (1, 2):
            assert rows[k] >= (fractions[k] * total) / 2 if fractions[k] else rows[k] == 0, (seed, rows)
        assert (got[sizes > large] == 0).all(), seed
    if fractions == (0.8, 0.1, 0.1):
        assert emptied > 0  # the case is real: the plain random order empties a split for some seeds


def test_fractions_are_checked():
    with pytest.raises(ValueError):
        check_fractions([0.5, 0.2])
    with pytest.raises(ValueError):
        check_fractions([0.0, 0.5, 0.5])
    assert check_fractions([0.9, 0.1]) == (0.9, 0.1, 0.0)


def test_the_etl_warns_of_a_split_asked_for_that_received_no_row(tmp_path, capsys):
    """Four molecules of one scaffold: the whole group goes to train, and the ETL says, in a
    line, that the valid and test splits are empty."""
    from tests.preprocessing.conftest import run_etl

    src = tmp_path / "one.csv"
    src.write_text("smiles\nc1ccccc1C\nc1ccccc1CC\nc1ccccc1CCC\nc1ccccc1O\n")
    m = run_etl(str(tmp_path / "out"), [str(src)], split="scaffold_random")
    assert {k: v["rows"] for k, v in m["stats"]["splits"].items()} == {"train": 4, "valid": 0, "test": 0}
    err = capsys.readouterr().err
    for name in ("valid", "test"):
        assert f"warning: the {name} split holds no row (fraction 0.1 of 4 rows)" in err, err
    assert "the train split holds no row" not in err
