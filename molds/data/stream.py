"""One virtual rank's molecules for one epoch, in order, with a seeded shuffle window.

The share (see plan.py) is read in windows of ``window`` molecules; each window is
permuted with a generator seeded by (seed, epoch, virtual rank, window index). The
stream's whole state is one integer, the number of molecules taken: seeking to it
recomputes one window, so restoring never replays the epoch.
"""

from __future__ import annotations

import numpy as np

from .plan import EpochPlan, Share, _rng
from .source import SplitSource


class MoleculeStream:
    def __init__(self, source: SplitSource, plan: EpochPlan, share: Share, *, window: int, key: tuple):
        self.source, self.plan, self.share = source, plan, share
        self.window = max(1, window)
        self.key = key  # (vrank, vworld, generation): seeds the window permutations
        self.total = len(share)
        self.taken = 0
        self._buf = np.zeros(0, np.int64)
        self._buf_start = -1
        self._row_orders: dict[int, np.ndarray] = {}

    # positions of the epoch order -> gids
    def _gids_of_positions(self, positions: np.ndarray) -> np.ndarray:
        plan = self.plan
        ks = np.searchsorted(plan.starts, positions, side="right") - 1
        out = np.empty(len(positions), np.int64)
        for k in np.unique(ks):
            sel = ks == k
            order = self._row_orders.get(int(k))
            if order is None:
                if len(self._row_orders) > 16:
                    self._row_orders.clear()
                order = self._row_orders[int(k)] = plan.row_order(int(k))
            unit = plan.units[plan.order[k]]
            out[sel] = unit.first_gid + order[positions[sel] - plan.starts[k]]
        return out

    def _share_slice(self, start: int, count: int) -> np.ndarray:
        """gids of share items [start, start + count)."""
        parts = []
        ex = self.share.explicit
        if start < len(ex):
            parts.append(ex[start:start + count])
        k = max(0, start - len(ex))
        need = count - sum(len(p) for p in parts)
        for a, b in self.share.intervals:
            if need <= 0:
                break
            if k >= b - a:
                k -= b - a
                continue
            lo = a + k
            hi = min(b, lo + need)
            parts.append(self._gids_of_positions(np.arange(lo, hi, dtype=np.int64)))
            need -= hi - lo
            k = 0
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _window(self, index: int) -> np.ndarray:
        if self._buf_start != index:
            gids = self._share_slice(index * self.window, self.window)
            perm = _rng(self.plan.seed, self.plan.epoch, 0x3A1D, *self.key, index).permutation(len(gids))
            self._buf, self._buf_start = gids[perm], index
        return self._buf

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` (or fewer, at the end) gids."""
        out = []
        while n > 0 and self.taken < self.total:
            w, off = divmod(self.taken, self.window)
            buf = self._window(w)
            got = buf[off:off + n]
            out.append(got)
            self.taken += len(got)
            n -= len(got)
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def untaken(self) -> Share:
        """What this stream has not handed out yet (for a topology change)."""
        w, off = divmod(self.taken, self.window)
        if off == 0:
            return self.share.suffix(self.taken)
        rest_of_window = self._window(w)[off:]
        rest = self.share.suffix((w + 1) * self.window)
        return Share(np.concatenate([rest_of_window, rest.explicit]), rest.intervals)

    def seek(self, taken: int) -> None:
        self.taken = min(taken, self.total)

    @property
    def exhausted(self) -> bool:
        return self.taken >= self.total
