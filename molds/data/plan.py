"""Who reads which training row, in which order, in each epoch.

Rows are addressed by a global id ``gid`` (shards in manifest order, rows in shard
order). A *unit* is one Parquet row group: the smallest piece read at once.

For (seed, epoch) the epoch order is fixed: units in a seeded random order, rows inside
each unit in a seeded random order. That order is a line of positions 0..N-1. A share
is a list of explicit gids followed by position intervals; in a fresh epoch, virtual
rank v of V (V = ranks x DataLoader workers) owns the single interval
[floor(v N / V), floor((v+1) N / V)). Shares are disjoint and cover every row, so
every row is read by exactly one virtual rank per epoch, and the split is balanced to
one row.

Changing the topology mid-epoch (``resplit``): what each old virtual rank has not yet
consumed (explicit gids it held in buffers, and the suffix of its share) is pooled and
dealt out again to the new virtual ranks: explicit gids round-robin, intervals cut
into V' contiguous, equal parts. Nothing consumed is read again; nothing unconsumed is
lost. That is the exactly-once guarantee across a world-size change (tested 4 -> 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Unit:
    shard: int
    row_group: int
    first_row: int  # first row of the row group inside its shard
    num_rows: int
    first_gid: int


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) & 0xFFFFFFFF for k in key])


@dataclass
class Share:
    """What one virtual rank reads in one epoch, in order."""

    explicit: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # gids
    intervals: list = field(default_factory=list)  # [(start position, end position)]

    def __len__(self) -> int:
        return len(self.explicit) + sum(b - a for a, b in self.intervals)

    def suffix(self, k: int) -> "Share":
        """The share without its first ``k`` items."""
        if k <= len(self.explicit):
            return Share(self.explicit[k:], list(self.intervals))
        k -= len(self.explicit)
        out = []
        for a, b in self.intervals:
            if k >= b - a:
                k -= b - a
                continue
            out.append((a + k, b))
            k = 0
        return Share(np.zeros(0, np.int64), out)

    def to_state(self) -> dict:
        return {"explicit": self.explicit.tolist(), "intervals": [list(iv) for iv in self.intervals]}

    @classmethod
    def from_state(cls, state: dict) -> "Share":
        return cls(np.asarray(state["explicit"], np.int64), [tuple(iv) for iv in state["intervals"]])


class EpochPlan:
    """The epoch order of ``units`` for one (seed, epoch)."""

    def __init__(self, units: list[Unit], seed: int, epoch: int, shuffle: bool = True):
        self.units = units
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        order = _rng(seed, epoch, 0x5EED).permutation(len(units)) if shuffle else np.arange(len(units))
        self.order = order
        sizes = np.array([units[i].num_rows for i in order], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        self.total = int(self.starts[-1])

    def row_order(self, k: int) -> np.ndarray:
        """Row offsets inside the k-th unit of the epoch order, in epoch order."""
        unit = self.units[self.order[k]]
        if not self.shuffle:
            return np.arange(unit.num_rows)
        return _rng(self.seed, self.epoch, 0xB10C, self.order[k]).permutation(unit.num_rows)

    def locate(self, position: int) -> tuple[int, int]:
        """(k-th unit of the epoch order, offset inside it) of a position."""
        k = int(np.searchsorted(self.starts, position, side="right") - 1)
        return k, position - int(self.starts[k])

    def fresh_share(self, vrank: int, vworld: int) -> Share:
        a = self.total * vrank // vworld
        b = self.total * (vrank + 1) // vworld
        return Share(np.zeros(0, np.int64), [(a, b)] if b > a else [])


def resplit(remaining: list[Share], vworld: int) -> list[Share]:
    """Deal the union of ``remaining`` shares out to ``vworld`` new virtual ranks."""
    explicit = np.sort(np.concatenate([s.explicit for s in remaining] + [np.zeros(0, np.int64)]))
    intervals = sorted(iv for s in remaining for iv in s.intervals if iv[1] > iv[0])
    total = sum(b - a for a, b in intervals)
    shares = [Share(explicit[v::vworld].copy(), []) for v in range(vworld)]
    cuts = [total * v // vworld for v in range(vworld + 1)]
    pos = 0  # position along the concatenated intervals
    v = 0
    for a, b in intervals:
        while a < b:
            while v < vworld - 1 and pos >= cuts[v + 1]:
                v += 1
            take = min(b - a, cuts[v + 1] - pos) if v < vworld - 1 else b - a
            if take <= 0:
                v += 1
                continue
            shares[v].intervals.append((a, a + take))
            a += take
            pos += take
    return shares
