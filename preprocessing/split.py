"""Deterministic train/valid/test splits over groups, in bounded memory.

A *group* is what must not straddle two splits: the scaffold for ``scaffold`` and
``scaffold_random``, the molecule for ``random``. Groups are put in one global order and
cut by cumulative row count: a group goes to the first split whose row target its
*starting* position has not reached yet. The order is

- ``scaffold``: largest group first (the MoleculeNet convention: big scaffolds to train),
  ties broken by a seeded hash of the scaffold;
- ``scaffold_random``: the groups larger than half the smaller evaluation split's share of
  rows first (to train, largest first), then the others by a seeded hash of the group, a
  random order. This is Chemprop's balanced scaffold split: without it, one large scaffold
  group (the acyclic molecules of a small set) drawn just before the train cut carries train
  past the validation cut, and the validation split is left empty (ESOL, seed 1);
- ``random``: by a seeded hash of the group, a random order.

Because the rule is a prefix cut, it is fixed by two threshold keys, found with three
histogram passes over the per-partition group tables (size class, top 16 hash bits,
then the groups of one cell). Memory is bounded by the size of a cell, never by the
number of groups, so a billion singleton groups need no billion-entry array.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

SPLITS = ("train", "valid", "test")
METHODS = ("scaffold", "random", "scaffold_random", "given")
# ``--split given``: the names a split column or a file name may use for each split
SPLIT_NAMES = {"train": 0, "training": 0, "val": 1, "valid": 1, "validation": 1, "dev": 1, "test": 2, "testing": 2}


def split_of_value(value) -> int | None:
    """The split (0, 1, 2) a ``--split_column`` value names, or None."""
    return SPLIT_NAMES.get(value.strip().lower()) if isinstance(value, str) else None


def split_of_file(path: str) -> int | None:
    """The split a file's name names as one of its words (``raw_train.csv``, ``src-valid.txt``,
    ``test.smi``), else its folder's (``valid/part-0.csv``); None when neither names exactly one."""
    for name in reversed(re.split(r"[\\/]", path.rstrip("/\\"))[-2:]):
        found = {SPLIT_NAMES[w] for w in re.split(r"[^a-z0-9]+", name.lower()) if w in SPLIT_NAMES}
        if found:
            return found.pop() if len(found) == 1 else None
    return None
_TOP = 1 << 64
_MINOR_SHIFT = 48
_MIN_MAJOR = -(1 << 63)
_MAX_MAJOR = (1 << 63) - 1  # above every real major (sizes are far below 2**63)


class SplitPlan(NamedTuple):
    """The two cuts (train|valid, valid|test) and the group size above which a
    ``scaffold_random`` group goes first (``large_group_size``; None for the other methods)."""

    first: "Threshold"
    second: "Threshold"
    large: int | None = None


@dataclass(frozen=True)
class Threshold:
    """Group keys (major, hash) below this go to an earlier split."""

    major: int
    hash: int  # may be 2**64: "after every hash of this major class"

    def below(self, major: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        if self.hash >= _TOP:
            return major <= self.major
        return (major < self.major) | ((major == self.major) & (hashes < np.uint64(self.hash)))


def group_major(method: str, sizes: np.ndarray, large: int | None = None) -> np.ndarray:
    """The first component of the order key: -size for ``scaffold``; for ``scaffold_random``,
    -size for a group of more than ``large`` rows (they come first, largest first) and 0 for
    the others; else 0."""
    if method == "scaffold":
        return -sizes.astype(np.int64)
    if method == "scaffold_random" and large is not None:
        return np.where(sizes > large, -sizes.astype(np.int64), 0)
    return np.zeros(len(sizes), dtype=np.int64)


def large_group_size(method: str, total_rows: int, fractions) -> int | None:
    """``scaffold_random``: half the smaller evaluation split's share of ``total_rows`` (a split
    of fraction 0 does not count); a larger group goes to train ahead of the random order.
    With every other group at most that size, a split whose fraction is not 0 receives rows
    (its share less at most half of it). None for the other methods."""
    if method != "scaffold_random":
        return None
    _, f_valid, f_test = check_fractions(fractions)
    shares = [f * total_rows for f in (f_valid, f_test) if f > 0]
    return int(min(shares) // 2) if shares else None


def check_fractions(fractions) -> tuple[float, float, float]:
    fr = [float(f) for f in fractions]
    if len(fr) == 2:
        fr.append(0.0)
    if len(fr) != 3 or any(f < 0 for f in fr) or abs(sum(fr) - 1.0) > 1e-6 or fr[0] <= 0:
        raise ValueError(
            f"split fractions must be 2 or 3 non-negative numbers summing to 1 with train > 0, got {fractions}"
        )
    return tuple(fr)


def _cut_in(order: list, rows: dict, target: int, inner):
    """Walk cells in order; return the threshold where the cumulative row count
    first reaches ``target`` (descending into a cell with ``inner`` when the cut may
    fall inside it). ``inner(cell, local_target)`` returns a threshold or None."""
    before = 0
    for cell in order:
        if before >= target:
            return ("start", cell)
        r = rows[cell]
        if before + r > target:
            found = inner(cell, target - before)
            if found is not None:
                return ("found", found)
        before += r
    return None


def find_threshold(load_tables, target: int) -> Threshold:
    """The key of the first group whose rows-before count is >= ``target``.

    ``load_tables()`` yields ``(major, hash, size)`` numpy arrays, one triple per
    partition; it is called once per histogram pass.
    """
    if target <= 0:
        return Threshold(_MIN_MAJOR, 0)
    per_major: dict[int, int] = {}
    for major, _, size in load_tables():
        uniq, inv = np.unique(major, return_inverse=True)
        sums = np.bincount(inv, weights=size, minlength=len(uniq))
        for m, s in zip(uniq.tolist(), sums.tolist()):
            per_major[m] = per_major.get(m, 0) + int(s)
    majors = sorted(per_major)

    def within_major(m: int, t: int):
        minor_rows = np.zeros(1 << 16, dtype=np.int64)
        for major, hashes, size in load_tables():
            sel = major == m
            minor_rows += np.bincount((hashes[sel] >> np.uint64(_MINOR_SHIFT)).astype(np.int64),
                                      weights=size[sel], minlength=1 << 16).astype(np.int64)
        cells = np.flatnonzero(minor_rows).tolist()

        def within_cell(b: int, t2: int):
            hs, ss = [], []
            for major, hashes, size in load_tables():
                sel = (major == m) & ((hashes >> np.uint64(_MINOR_SHIFT)) == np.uint64(b))
                hs.append(hashes[sel])
                ss.append(size[sel])
            h = np.concatenate(hs)
            s = np.concatenate(ss)
            idx = np.argsort(h, kind="stable")
            h, s = h[idx], s[idx]
            before = np.concatenate([[0], np.cumsum(s)[:-1]])
            hit = np.flatnonzero(before >= t2)
            return int(h[hit[0]]) if len(hit) else None

        res = _cut_in(cells, {c: int(minor_rows[c]) for c in cells}, t, within_cell)
        if res is None:
            return None
        kind, val = res
        return Threshold(m, val << _MINOR_SHIFT) if kind == "start" else Threshold(m, val)

    res = _cut_in(majors, per_major, target, within_major)
    if res is None:
        return Threshold(_MAX_MAJOR, 0)
    kind, val = res
    return Threshold(val, 0) if kind == "start" else val


def plan_split(load_tables, total_rows: int, fractions, large: int | None = None) -> SplitPlan:
    """Thresholds between train|valid and valid|test for ``total_rows`` rows; ``load_tables``
    yields the keys ``group_major`` made with ``large``, which the plan carries."""
    f_train, f_valid, _ = check_fractions(fractions)
    t1 = int(round(f_train * total_rows))
    t2 = int(round((f_train + f_valid) * total_rows))
    return SplitPlan(find_threshold(load_tables, t1), find_threshold(load_tables, t2), large)


def assign_split(thresholds, major: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """0 = train, 1 = valid, 2 = test, for each group key."""
    first, second = thresholds[0], thresholds[1]
    return (~first.below(major, hashes)).astype(np.int8) + (~second.below(major, hashes)).astype(np.int8)
