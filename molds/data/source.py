"""Reading a split's shards: verification, row groups as units, molecules by gid.

A loaded unit keeps its token ids as one flat array with BOS/EOS already put around
every molecule, so a molecule is a slice and a packed row a concatenation of slices.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow.parquet as pq

from ..chemistry.features import molecule_features
from ..errors import ManifestError
from .manifest import Manifest, Shard, first_id_outside, outside_vocabulary
from .plan import Unit


def _stat(path: str):
    """(size, modification time) of a local file, None for remote ones."""
    if "://" in path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


@dataclass
class LoadedUnit:
    unit: Unit
    tokens: np.ndarray  # int32, BOS t1 .. tn EOS for each molecule, back to back
    offsets: np.ndarray  # int64, len num_rows + 1, into ``tokens``
    labels: np.ndarray | None  # float32 [num_rows, num_labels] (NaN = missing)
    prompt: np.ndarray | None = None  # pairs: int64 [num_rows], tokens of BOS source SEP (no loss on them)
    features: np.ndarray | None = None  # float32 [num_rows, F]: molecule features (molds.chemistry.features)

    def span(self, row: int) -> tuple[int, int]:
        return int(self.offsets[row]), int(self.offsets[row + 1])


class SplitSource:
    """The shards of one split of a manifest, verified, with a small row-group cache."""

    def __init__(self, manifest: Manifest, split: str, *, verify: str = "eager", on_bad_shard: str = "error",
                 bos_id: int = 2, eos_id: int = 3, pad_id: int = 0, with_labels: bool = False, cache_units: int = 8,
                 max_skipped_fraction: float = 0.0, span_molecules: int = 0, randomizer=None,
                 vocab_size: int | None = None, sep_id: int | None = None, features: str = ""):
        if verify not in ("eager", "lazy", "off"):
            raise ValueError(f"data.verify must be eager, lazy or off, got {verify!r}")
        if on_bad_shard not in ("error", "skip"):
            raise ValueError(f"data.on_bad_shard must be error or skip, got {on_bad_shard!r}")
        if on_bad_shard == "skip" and verify != "eager":
            raise ValueError("data.on_bad_shard=skip needs data.verify=eager (every rank must skip the same shards)")
        self.manifest, self.split = manifest, split
        self.verify, self.with_labels = verify, with_labels
        self.features = features  # a feature set of molds.chemistry.features each row also loads with
        self.randomizer = randomizer  # randomize.Randomizer: some molecules read as randomized SMILES
        self.epoch = 0  # which epoch's randomized forms ``load`` returns
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        # a manifest of pairs: each row is read as BOS source SEP target EOS (a prompt and its completion)
        self.pairs = manifest.pairs is not None
        if self.pairs and (sep_id is None or (randomizer is not None and not randomizer.stored) or with_labels):
            raise ManifestError(f"{manifest.path} holds pairs: they are read with a sep token between source and "
                                f"target, without labels, and only in the spellings the ETL stores")
        self.sep_id = sep_id
        self.vocab_size = vocab_size  # token ids at or above it are refused (checked with the shards, and as read)
        shards = manifest.shards(split)
        if not shards or sum(s.num_rows for s in shards) == 0:
            raise ManifestError(f"{manifest.path}: split {split!r} is empty")
        self.skipped: list[tuple[str, str]] = []
        self.skipped_rows = 0
        self.skip_note = None
        if verify == "eager":
            kept = []
            for shard in shards:
                try:
                    manifest.verify_shard(shard, vocab_size)
                    kept.append(shard)
                except ManifestError as exc:
                    if on_bad_shard == "error":
                        raise
                    self.skipped.append((shard.uri, str(exc)))
                    self.skipped_rows += shard.num_rows
            shards = kept
            total = self.skipped_rows + sum(s.num_rows for s in kept)
            if self.skipped:
                frac = self.skipped_rows / max(1, total)
                what = (f"split {split!r} of {manifest.path}: {len(self.skipped)} bad shard(s) skipped, "
                        f"{self.skipped_rows} of {total} rows ({frac:.2%})")
                if not kept or frac > max_skipped_fraction:
                    raise ManifestError(f"{what}, more than data.max_skipped_fraction={max_skipped_fraction}: "
                                        + "; ".join(f"{u}: {w}" for u, w in self.skipped[:5]))
                self.skip_note = (f"{what} (data.on_bad_shard=skip): "
                                  + "; ".join(f"{u}: {w}" for u, w in self.skipped[:5]))
        self.shards: list[Shard] = shards
        self._verified = set(range(len(shards))) if verify == "eager" else set()
        self._files: dict[int, object] = {}
        self.units = self._list_units()
        self.num_rows = sum(u.num_rows for u in self.units)
        self._gid_starts = np.array([u.first_gid for u in self.units] + [self.num_rows], dtype=np.int64)
        self._cache: OrderedDict[int, LoadedUnit] = OrderedDict()
        # A reader draws from a window of ``span_molecules`` consecutive epoch positions (the
        # shuffle window plus the packer's lookahead, which still holds the previous window's
        # molecules): every unit such a stretch touches must stay cached, or each draw
        # re-reads row groups (on full MOSES an LRU of 8 re-read every row group 24 times).
        typical = int(np.median([u.num_rows for u in self.units])) if self.units else 1
        needed = 2 * (-(-span_molecules // max(1, typical)) + 1) + 2
        self._cache_size = max(cache_units, min(needed, 4096))

    def __getstate__(self):  # DataLoader workers get the verified shard list, not open files
        state = dict(self.__dict__)
        state["_files"], state["_cache"] = {}, OrderedDict()
        return state

    def _file(self, shard_index: int):
        f = self._files.get(shard_index)
        if f is None:
            shard = self.shards[shard_index]
            if self.verify == "lazy" and shard_index not in self._verified:
                self.manifest.verify_shard(shard, self.vocab_size)
                self._verified.add(shard_index)
            if shard_index in self._stats and _stat(shard.path) != self._stats[shard_index]:
                raise ManifestError(f"shard {shard.uri} of {self.manifest.path} changed on disk after the run "
                                    f"checked it (size or modification time); the data under a run must not change")
            try:
                f = pq.ParquetFile(fsspec.open(shard.path, "rb").open())
            except FileNotFoundError as exc:
                raise ManifestError(f"shard {shard.uri} listed in {self.manifest.path} is missing") from exc
            except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
                raise ManifestError(f"shard {shard.uri} of {self.manifest.path} is not readable Parquet ({exc})") \
                    from exc
            self._files[shard_index] = f
        return f

    def _list_units(self) -> list[Unit]:
        units, gid = [], 0
        self._stats = {}
        for i, shard in enumerate(self.shards):
            st = _stat(shard.path)
            if st is not None:
                self._stats[i] = st
            try:
                with fsspec.open(shard.path, "rb") as fh:
                    meta = pq.ParquetFile(fh).metadata
            except FileNotFoundError as exc:
                raise ManifestError(f"shard {shard.uri} listed in {self.manifest.path} is missing") from exc
            except (OSError, ValueError) as exc:
                raise ManifestError(f"shard {shard.uri} of {self.manifest.path} is not readable Parquet ({exc})") \
                    from exc
            if meta.num_rows != shard.num_rows:
                raise ManifestError(f"shard {shard.uri}: {meta.num_rows} rows, the manifest says {shard.num_rows}")
            first = 0
            for rg in range(meta.num_row_groups):
                n = meta.row_group(rg).num_rows
                if n:
                    units.append(Unit(i, rg, first, n, gid + first))
                first += n
            gid += shard.num_rows
        return units

    def set_epoch(self, epoch: int) -> None:
        """Loads from now on are epoch ``epoch``'s (only randomized SMILES differ by epoch)."""
        if epoch != self.epoch and self.randomizer is not None:
            self._cache.clear()
        self.epoch = epoch

    def unit_of_gid(self, gid: int) -> int:
        return int(np.searchsorted(self._gid_starts, gid, side="right") - 1)

    def load(self, unit_index: int) -> LoadedUnit:
        hit = self._cache.get(unit_index)
        if hit is not None:
            self._cache.move_to_end(unit_index)
            return hit
        unit = self.units[unit_index]
        if self.pairs:
            return self._load_pairs(unit_index)
        columns = (["token_ids"] + (["labels"] if self.with_labels else [])
                   + (["canonical_smiles"] if self.features else [])
                   + ([self.randomizer.column] if self.randomizer is not None else []))
        try:
            table = self._file(unit.shard).read_row_group(unit.row_group, columns=columns)
        except (OSError, ValueError) as exc:
            raise ManifestError(f"shard {self.shards[unit.shard].uri} of {self.manifest.path}: row group "
                                f"{unit.row_group} is not readable ({exc})") from exc
        ids = table.column("token_ids").combine_chunks()
        if self.vocab_size is not None:  # whatever data.verify is: an id outside the vocabulary never reaches a model
            found = first_id_outside(ids, self.vocab_size)
            if found is not None:
                raise outside_vocabulary(f"shard {self.shards[unit.shard].uri} of {self.manifest.path}",
                                         unit.first_row + found[0], unit.row_group, found[1], self.vocab_size)
        offsets = ids.offsets.to_numpy().astype(np.int64)
        offsets = offsets - offsets[0]
        flat = ids.values.to_numpy(zero_copy_only=False).astype(np.int32)
        lengths = np.diff(offsets)
        n = len(lengths)
        new_offsets = offsets + 2 * np.arange(n + 1)
        tokens = np.empty(len(flat) + 2 * n, dtype=np.int32)
        tokens[new_offsets[:-1]] = self.bos_id
        tokens[new_offsets[1:] - 1] = self.eos_id
        row_of = np.repeat(np.arange(n), lengths)
        tokens[np.arange(len(flat)) + 2 * row_of + 1] = flat
        if self.randomizer is not None:
            col = table.column(self.randomizer.column)
            col = col.combine_chunks() if self.randomizer.stored else col.to_pylist()
            tokens, new_offsets = self.randomizer.rewrite(unit, self.epoch, tokens, new_offsets, col,
                                                          where=f"shard {self.shards[unit.shard].uri} of "
                                                                f"{self.manifest.path}")
        labels = None
        if self.with_labels:
            lab = table.column("labels").combine_chunks()
            width = len(lab[0].as_py()) if n else 0
            labels = lab.values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(n, width)
        features = None
        if self.features:
            features = molecule_features(table.column("canonical_smiles").to_pylist(), self.features, cache=True)
        loaded = LoadedUnit(unit, tokens, new_offsets, labels, features=features)
        self._cache[unit_index] = loaded
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return loaded

    def _load_pairs(self, unit_index: int) -> LoadedUnit:
        """A row group of pairs as BOS source SEP target EOS, with each row's prompt length."""
        unit = self.units[unit_index]
        where = f"shard {self.shards[unit.shard].uri} of {self.manifest.path}"
        try:
            table = self._file(unit.shard).read_row_group(
                unit.row_group, columns=["source_token_ids", "target_token_ids"]
                + ([self.randomizer.column] if self.randomizer is not None else []))
        except (OSError, ValueError) as exc:
            raise ManifestError(f"{where}: row group {unit.row_group} is not readable ({exc})") from exc
        sides = []
        for name in ("source_token_ids", "target_token_ids"):
            ids = table.column(name).combine_chunks()
            if self.vocab_size is not None:
                found = first_id_outside(ids, self.vocab_size)
                if found is not None:
                    raise outside_vocabulary(where, unit.first_row + found[0], unit.row_group, found[1],
                                             self.vocab_size)
            offsets = ids.offsets.to_numpy().astype(np.int64)
            sides.append((ids.values.to_numpy(zero_copy_only=False).astype(np.int32), offsets - offsets[0]))
        (src, src_off), (tgt, tgt_off) = sides
        src_len, tgt_len = np.diff(src_off), np.diff(tgt_off)
        n = len(src_len)
        lengths = src_len + tgt_len + 3
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.empty(int(offsets[-1]), dtype=np.int32)
        start = offsets[:-1]
        tokens[start] = self.bos_id
        tokens[start + 1 + src_len] = self.sep_id
        tokens[offsets[1:] - 1] = self.eos_id
        row = np.repeat(np.arange(n), src_len)
        tokens[start[row] + 1 + np.arange(len(src)) - src_off[row]] = src
        row = np.repeat(np.arange(n), tgt_len)
        tokens[start[row] + 2 + src_len[row] + np.arange(len(tgt)) - tgt_off[row]] = tgt
        prompt = src_len + 2
        if self.randomizer is not None:  # some pairs in a stored root-aligned spelling: source <sep> target
            tokens, offsets = self.randomizer.rewrite(unit, self.epoch, tokens, offsets,
                                                      table.column(self.randomizer.column).combine_chunks(),
                                                      where=where)
            seps = np.flatnonzero(tokens == self.sep_id)  # one a pair: sources and targets never hold it
            if len(seps) != n:
                raise ManifestError(f"{where}: row group {unit.row_group}: a stored pair spelling holds "
                                    f"{'no' if len(seps) < n else 'more than one'} sep token")
            prompt = seps - offsets[:-1] + 1
        loaded = LoadedUnit(unit, tokens, offsets, None, prompt=prompt)
        self._cache[unit_index] = loaded
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return loaded

    def spans(self, gids: np.ndarray):
        """For many gids at once: (unit index, start, length) arrays in gid order, and
        the loaded units by index."""
        units = np.searchsorted(self._gid_starts, gids, side="right") - 1
        starts = np.empty(len(gids), np.int64)
        lengths = np.empty(len(gids), np.int64)
        loaded = {}
        for u in np.unique(units).tolist():
            sel = units == u
            lu = loaded[u] = self.load(u)
            rows = gids[sel] - self.units[u].first_gid
            starts[sel] = lu.offsets[rows]
            lengths[sel] = lu.offsets[rows + 1] - starts[sel]
        return units, starts, lengths, loaded

    def molecule(self, gid: int) -> tuple[LoadedUnit, int]:
        """(loaded unit, row inside it) of one molecule, by global id."""
        u = self.unit_of_gid(gid)
        return self.load(u), gid - self.units[u].first_gid

    def compound_ids(self, gids) -> list[str]:
        """The ``compound_id`` of molecules (for tests and audits; reads the column)."""
        out = []
        for gid in gids:
            u = self.unit_of_gid(int(gid))
            unit = self.units[u]
            col = self._file(unit.shard).read_row_group(unit.row_group, columns=["compound_id"]).column(0)
            out.append(col[int(gid) - unit.first_gid].as_py())
        return out
