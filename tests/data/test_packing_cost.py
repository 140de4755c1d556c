"""Regression guard: the packer's cost per batch, as a ratio to a plain reference path
on the same molecules in the same process (not a time: the machine's speed cancels)."""

from __future__ import annotations

import time

import numpy as np

from tests.data.conftest import make_loader

# packer / reference per batch, measured on the 2-core CI-class machine when the guard
# was written (the median of 5; the packer's exact-fill bookkeeping is Python): the guard
# fails when the packer gets 2x slower than that, relative to the same reads and fills
MEASURED_RATIO = 8.5


def _reference(source, gids, seq_len: int, batch: int, pad: int) -> int:
    """Molecules in arrival order, a row closed when the next one does not fit: the
    plainest packing there is, with the same gathers and array fills."""
    units, starts, lengths, loaded = source.spans(gids)
    batches, rows, row, used = 0, [], [], 0
    for u, s, n in zip(units.tolist(), starts.tolist(), lengths.tolist()):
        if used + n > seq_len:
            rows.append(row)
            row, used = [], 0
        row.append(loaded[u].tokens[s:s + n])
        used += n
        if len(rows) == batch:
            ids = np.full((batch, seq_len), pad, dtype=np.int64)
            for r, parts in enumerate(rows):
                flat = np.concatenate(parts)
                ids[r, :len(flat)] = flat
            batches += 1
            rows = []
    return batches


def _packer(source, gids, seq_len: int, batch: int, pad: int) -> int:
    from molds.data.packing import Packer

    packer = Packer(source, seq_len, lookahead=512, pad_id=pad)
    batches, i = 0, 0
    while True:
        rows = []
        for _ in range(batch):
            if packer.size < 257 and i < len(gids):  # refilled as the loader does
                take = 512 - packer.size
                packer.add(gids[i:i + take])
                i += take
            row = packer.next_row()
            if not row:
                break
            rows.append(row)
        if not rows:
            return batches
        packer.collate(rows)
        batches += 1


def test_packer_cost_per_batch_against_a_plain_path(dataset):
    loader = make_loader(dataset, seq_len=256, micro_batch_size=8)
    source, pad = loader.source, loader.specials.pad
    # the training split eight times over, in a shuffled order, every unit in memory: the
    # guard is about the packer's own work (benchmarks/dataloader.py covers the reads)
    gids = np.tile(np.random.default_rng(0).permutation(source.num_rows).astype(np.int64), 8)
    source._cache_size = len(source.units) + 1
    for u in range(len(source.units)):
        source.load(u)
    _reference(source, gids, 256, 8, pad), _packer(source, gids, 256, 8, pad)  # warm up
    ratios = []
    for _ in range(5):
        t0 = time.perf_counter()
        n_ref = _reference(source, gids, 256, 8, pad)
        t1 = time.perf_counter()
        n_pack = _packer(source, gids, 256, 8, pad)
        t2 = time.perf_counter()
        ratios.append(((t2 - t1) / n_pack) / ((t1 - t0) / n_ref))
    ratio = float(np.median(ratios))
    assert ratio <= 2 * MEASURED_RATIO, f"the packer costs {ratio:.2f}x the plain path per batch (was {MEASURED_RATIO})"
