"""The ETL's stages as functions over files, shared by the local and Ray engines.

    map        raw chunks -> canonical rows, hashed and spilled to disk by shuffle bucket
               (``preprocessing.map_stage``)
    reduce     one bucket range from every spill file -> deduplicated partition
               (+ its group table: group hash -> size)
    finalize   partition + split thresholds + tokenizer -> token ids, length buckets,
               rows ordered by (split, length bucket, shuffle bucket, row hash)
    assemble   slices of finalized partitions -> one Parquet shard with its sha256

The output depends only on the data, the options and the seed: not on the number of
workers, the partitioning, or the engine. Rows are ordered by keys derived from
content hashes, and partitions are contiguous ranges of the 4096 shuffle buckets, so
concatenating partitions in order gives the same stream whatever the ranges are.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from molds.chemistry.canonical import ChemOptions
from .readers import Columns
from .split import assign_split, group_major
from .tokenizer import GRAMMARS, count_tokens, make_encoder

NUM_BUCKETS = 4096
BUCKET_SHIFT = np.uint64(64 - 12)
GROUP_SALT = 0x5CAF_F01D
_EXAMPLES_PER_REASON = 5
SHARD_COLUMNS = ("compound_id", "raw_smiles", "canonical_smiles", "text", "source_smiles", "target_smiles", "scaffold",
                 "token_ids", "source_token_ids", "source_length", "target_token_ids", "target_length", "token_length",
                 "randomized_token_ids", "labels", "source")
# text: the SELFIES / SAFE string the tokens spell (absent for SMILES). Pair shards (``--task``)
# hold source_* and target_* instead of canonical_smiles and token_ids; their token_length is
# source_length + target_length.


@dataclass(frozen=True)
class StageOptions:
    chem: ChemOptions
    split: str
    seed: int
    num_labels: int
    check_regex: bool  # reject canonical SMILES the SMILES regex cannot cover
    two_stage: bool  # dedupe key does not decide the group: dedupe, then regroup
    columns: Columns | None = None  # SD inputs: the id tag and label tags the workers read
    representation: str = "smiles"  # what the tokens spell (molds.chemistry.representation)
    representation_options: tuple = ()  # (key, value) pairs: the conformer units' embedding options
    decimal: str = "."  # the decimal mark of label values
    per_molecule: int = 1  # conformer units of one molecule kept (0: all; the input's conformers)
    pairs: object = None  # molds.chemistry.pairs.PairOptions: the rows are pairs for this task (None: molecules)
    pair_target: bool = False  # a pair's target is in a column (--target_column), else rows are reactions
    split_from: str | None = None  # --split given: "column" (--split_column) or "file" (the input's name)


@dataclass
class Stats:
    rows_in: int = 0
    rejected: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)  # reason -> [(source, raw)]
    truncated: list = field(default_factory=list)  # source of every truncated_input row (one per cut file)
    notes: Counter = field(default_factory=Counter)  # counts that are no rejection (safe: single_fragment)
    sd_repaired: int = 0  # SD records read after dropping blank lines before their header
    cxsmiles: int = 0  # rows read from CXSMILES (``SMILES |extension|``): the extension applied by RDKit
    label_conflicts: int | None = None  # labelled input: duplicates dropped whose labels differ from the kept row's

    def reject(self, reason: str, source: str, raw):
        self.rejected[reason] += 1
        if reason == "truncated_input":
            self.truncated.append(source)
        ex = self.examples.setdefault(reason, [])
        if len(ex) < _EXAMPLES_PER_REASON:
            ex.append((source, raw if raw is None else _clip(_printable(str(raw)))))

    def merge(self, other: "Stats"):
        self.rows_in += other.rows_in
        self.rejected.update(other.rejected)
        self.truncated = sorted(self.truncated + other.truncated)
        self.notes.update(other.notes)
        self.sd_repaired += other.sd_repaired
        self.cxsmiles += other.cxsmiles
        for reason, ex in other.examples.items():
            mine = self.examples.setdefault(reason, [])
            mine.extend(ex[: _EXAMPLES_PER_REASON - len(mine)])


def _printable(text: str) -> str:
    """An example as the report can write it: bytes that were not UTF-8 (lone surrogates from
    ``surrogateescape``, RDKit's undecodable SD values) spelled as escapes (``\\xe9``)."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate surrogateescape did not make
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def hash64(texts: list[str], seed: int) -> np.ndarray:
    """Seeded 64-bit xxh3 of each string (stable across runs, machines and engines)."""
    from xxhash import xxh3_64_intdigest

    return np.fromiter((xxh3_64_intdigest(t.encode(), seed) for t in texts), np.uint64, count=len(texts))


def _write_ipc(table: pa.Table, path: str) -> None:
    from molds.runtime.atomic import atomic_file

    with atomic_file(path, durable=False) as tmp:  # work files: the output is synced when published
        with pa.OSFile(tmp, "wb") as sink, ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)


def read_ipc(path: str) -> pa.Table:
    """Memory-mapped: a slice only pages in what is read."""
    return ipc.open_file(pa.memory_map(path, "r")).read_all()


def bucket_offsets(buckets: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.bincount(buckets, minlength=NUM_BUCKETS))]).astype(np.int64)


def spill_sorted(table: pa.Table, path: str) -> tuple[str, list[int]]:
    """Write ``table`` sorted by bucket; return (path, bucket offsets as int64 array)."""
    table = table.sort_by([("bucket", "ascending"), ("order", "ascending")])
    offsets = bucket_offsets(table.column("bucket").to_numpy())
    _write_ipc(table, path)
    return path, offsets


# ---------------------------------------------------------------- reduce

def read_pieces(pieces) -> pa.Table | None:
    """Concatenate (spill path, first row, row count) slices."""
    parts = [read_ipc(path).slice(start, length) for path, start, length in pieces]
    return pa.concat_tables(parts) if parts else None


def _first_of_each(table: pa.Table, key: str, per_key: int = 1, unit: str | None = None,
                   rank: str | None = None) -> tuple[pa.Table, int]:
    """Keep the earliest input rows (by ``order``) of each distinct ``key``: one, or with
    ``unit`` (a column: a molecule's conformer units) the first ``per_key`` distinct units
    (0: all of them); with ``rank`` (a column) the lowest-ranked ones first, ties by order.
    Returns (the rows kept, sorted by key, rank and order; how many were not)."""
    rows = len(table)
    if unit is not None:  # identical units of one molecule count once, the earliest kept
        table, _ = _first_of_each(table.append_column("_both", pc.binary_join_element_wise(
            table.column(key), table.column(unit), "\x1f")), "_both")
        table = table.drop_columns(["_both"])
    table = table.sort_by([(key, "ascending")] + ([(rank, "ascending")] if rank else []) + [("order", "ascending")])
    keys = table.column(key).combine_chunks()
    if len(keys) <= 1 or per_key == 0:
        return table, rows - len(table)
    starts = np.ones(len(keys), dtype=bool)
    starts[1:] = pc.not_equal(keys.slice(1), keys.slice(0, len(keys) - 1)).to_numpy(zero_copy_only=False)
    if per_key == 1:
        keep = starts
    else:  # each row's place among its key's rows: its index less its run's first index
        first = np.maximum.accumulate(np.where(starts, np.arange(len(keys)), 0))
        keep = np.arange(len(keys)) - first < per_key
    kept = table.filter(pa.array(keep))
    return kept, rows - len(kept)


def _label_conflicts(table: pa.Table, key: str) -> int:
    """How many rows of ``table`` share ``key`` with an earlier row (by ``order``) whose labels
    differ from theirs (a missing label equals only a missing one): the duplicates whose
    labels the ETL drops with them, though they are not the kept row's."""
    if "labels" not in table.column_names or len(table) < 2:
        return 0
    table = table.select([key, "order", "labels"]).sort_by([(key, "ascending"), ("order", "ascending")])
    keys = table.column(key).combine_chunks()
    starts = np.ones(len(keys), dtype=bool)
    starts[1:] = pc.not_equal(keys.slice(1), keys.slice(0, len(keys) - 1)).to_numpy(zero_copy_only=False)
    if starts.all():
        return 0
    y = np.asarray(table.column("labels").to_pylist(), dtype=float).reshape(len(keys), -1)
    first = y[np.maximum.accumulate(np.where(starts, np.arange(len(keys)), 0))]
    same = ((y == first) | (np.isnan(y) & np.isnan(first))).all(axis=1)
    return int(np.count_nonzero(~same & ~starts))


def reduce_partition(pieces, options: StageOptions, work_dir: str, index: int, stage: str):
    """``stage`` is ``regroup`` (InChIKey dedupe, re-spill by group) or ``final``.

    ``pieces``: the (spill path, first row, row count) slices of one bucket range.
    Returns a dict: rows, duplicates, and either ``spill`` or ``staged``+``groups``.
    """
    table = read_pieces(pieces)
    if table is None:
        return {"index": index, "rows": 0, "duplicates": 0, "label_conflicts": 0}
    duplicates = conflicts = 0
    dedupe_here = stage == "regroup" or not options.two_stage
    if dedupe_here:
        key = "dedupe_key" if options.chem.dedupe_key != "canonical" else "canonical_smiles"
        whole = evaluation_kept_whole(options) and "given_split" in table.column_names
        if whole:  # each evaluation row its own key: only the training split is deduplicated
            table = table.append_column("_dedupe", pc.if_else(
                pc.fill_null(pc.equal(table.column("given_split"), 0), False), table.column(key),
                pc.binary_join_element_wise(table.column(key), pc.cast(table.column("order"), pa.string()),
                                            "\x1f")))
            key = "_dedupe"
        if options.per_molecule == 1:
            conflicts = _label_conflicts(table, key)
        table, duplicates = _first_of_each(table, key, options.per_molecule,
                                           "text" if options.per_molecule != 1 else None,
                                           "rank" if "rank" in table.column_names else None)
        if whole:
            table = table.drop_columns(["_dedupe"])
    if stage == "regroup":
        buckets = (table.column("group_hash").to_numpy() >> BUCKET_SHIFT).astype(np.uint16)
        table = table.set_column(table.schema.get_field_index("bucket"), "bucket", pa.array(buckets))
        spill = spill_sorted(table, os.path.join(work_dir, f"regroup-{index}.arrow"))
        return {"index": index, "rows": len(table), "duplicates": duplicates, "label_conflicts": conflicts,
                "spill": spill}
    table = table.sort_by([("bucket", "ascending"), ("row_hash", "ascending")])
    staged = os.path.join(work_dir, f"partition-{index}.arrow")
    _write_ipc(table, staged)
    hashes, sizes = np.unique(table.column("group_hash").to_numpy(), return_counts=True)
    groups = os.path.join(work_dir, f"groups-{index}.npz")
    np.savez(groups, hash=hashes, size=sizes.astype(np.int64))
    return {"index": index, "rows": len(table), "duplicates": duplicates, "label_conflicts": conflicts,
            "staged": staged, "groups": groups}


def evaluation_kept_whole(options: StageOptions) -> bool:
    """Pairs in a given split (``--split given``, a published benchmark's): the evaluation
    splits stay as published, every row of them kept where the publisher put it, so that a
    score is over the whole published split. Only the training split is deduplicated; a pair
    or target that an evaluation split shares with training is counted
    (``overlap_counts``), not refused."""
    return options.pairs is not None and options.split_from is not None


def load_group_table(path: str, method: str, large: int | None = None):
    """A partition's group keys (``group_major`` with ``large``), hashes and sizes."""
    with np.load(path) as z:
        hashes, sizes = z["hash"], z["size"]
    return group_major(method, sizes, large), hashes, sizes


def partition_splits(staged_table: pa.Table, groups_path: str, method: str, thresholds) -> np.ndarray:
    """Split index (0/1/2) of every row of a reduced partition (``given``: the input's own)."""
    if method == "given":
        return staged_table.column("given_split").to_numpy().astype(np.int8)
    major, hashes, _ = load_group_table(groups_path, method, thresholds.large)
    row_groups = staged_table.column("group_hash").to_numpy()
    pos = np.searchsorted(hashes, row_groups)
    return assign_split(thresholds, major[pos], row_groups)


def token_texts(table: pa.Table) -> pa.ChunkedArray:
    """What the tokenizer reads: the representation's string, or the canonical SMILES."""
    return table.column("text" if "text" in table.column_names else "canonical_smiles")


def partition_smiles(staged: str, groups: str, method: str, thresholds, splits: set[int]):
    """The token texts (canonical SMILES, the representation's strings, or both sides of
    each pair) of a partition's rows that fall in ``splits`` (vocabulary passes)."""
    table = read_ipc(staged)
    which = partition_splits(table, groups, method, thresholds)
    mask = pa.array(np.isin(which, list(splits)))
    if "source_smiles" in table.column_names:
        return (table.column("source_smiles").filter(mask).to_pylist()
                + table.column("target_smiles").filter(mask).to_pylist())
    return token_texts(table).filter(mask).to_pylist()


def partition_targets(staged: str, groups: str, method: str, thresholds) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (target hash, split) of a partition's pairs: where a target lies."""
    table = read_ipc(staged)
    which = partition_splits(table, groups, method, thresholds).astype(np.uint64)
    both = np.unique(np.stack([table.column("target_hash").to_numpy(), which], axis=1), axis=0)
    return both[:, 0], both[:, 1].astype(np.int8)


def _pair_hashes(table: pa.Table) -> dict:
    """{"pairs", "sources", "targets": 64-bit hashes} of a pair table's rows (what
    ``overlap_counts`` compares): the map stage's ``row_hash`` (of the pair, the dedupe key)
    and ``target_hash``, and the source side's hashed here."""
    return {"pairs": table.column("row_hash").to_numpy(), "targets": table.column("target_hash").to_numpy(),
            "sources": hash64(table.column("source_smiles").to_pylist(), 0)}


def partition_train_hashes(staged: str, groups: str, method: str, thresholds) -> dict:
    """The hashes (``_pair_hashes``) of a partition's training pairs."""
    table = read_ipc(staged)
    train = pa.array(partition_splits(table, groups, method, thresholds) == 0)
    return _pair_hashes(table.select(["row_hash", "target_hash", "source_smiles"]).filter(train))


def training_hashes(found: list[dict]) -> dict:
    """Every partition's ``partition_train_hashes`` as one sorted array per kind."""
    return {kind: np.unique(np.concatenate([f[kind] for f in found] or [np.zeros(0, np.uint64)]))
            for kind in ("pairs", "sources", "targets")}


def overlap_counts(table: pa.Table, split: np.ndarray, keep: np.ndarray, train: dict) -> dict:
    """{split index: {kind: rows}}: how many kept rows of each evaluation split share their
    pair, their source or their target with a training pair (``train``: ``training_hashes``)."""
    hashes = _pair_hashes(table)
    out = {}
    for i in (1, 2):
        rows = keep & (split == i)
        out[i] = {kind: int(np.count_nonzero(rows & np.isin(hashes[kind], train[kind])))
                  for kind in ("pairs", "sources", "targets")}
    return out


def targets_in_two_splits(found) -> dict:
    """{target hash: the first split holding it} of each target that more than one split holds
    (``found``: every partition's ``partition_targets``)."""
    if not found:
        return {}
    hashes = np.concatenate([h for h, _ in found])
    splits = np.concatenate([s for _, s in found])
    order = np.lexsort((splits, hashes))
    hashes, splits = hashes[order], splits[order]
    uniq, first = np.unique(hashes, return_index=True)
    # a target in two partitions of one split shows twice with the same split: count distinct splits
    spread = np.maximum.reduceat(splits, first) > splits[first]
    return {int(h): int(s) for h, s in zip(uniq[spread].tolist(), splits[first][spread].tolist())}


def partition_token_counts(staged: str, groups: str, method: str, thresholds, splits: set[int],
                           representation: str = "smiles") -> Counter:
    """Regex token counts of a partition's rows in ``splits``, counted where they are read."""
    return count_tokens(partition_smiles(staged, groups, method, thresholds, splits), GRAMMARS[representation])


# ---------------------------------------------------------------- finalize

def length_bucket_of(lengths: np.ndarray, boundaries) -> np.ndarray:
    """Bucket i holds lengths in (boundaries[i-1], boundaries[i]]; the last is open."""
    return np.searchsorted(np.asarray(boundaries), lengths, side="left").astype(np.int16)


_VARIANT_SALT = 0x7A2D_5EED


def randomized_variants(canonical: list[str], row_hash: np.ndarray, rows: np.ndarray, count: int, seed: int,
                        encoder) -> tuple[pa.ListArray, int]:
    """``count`` tokenized restricted randomized SMILES of each molecule in ``rows`` (the
    others get an empty list), as list<list<uint16>>, and how many spellings were stored
    empty because RDKit or the vocabulary could not take them. Each molecule's atom orders
    come from (seed, its row hash), so any engine and partitioning writes the same ones."""
    from molds.data.randomize import restricted_variants

    n = len(canonical)
    texts = []
    for i in rows.tolist():
        rng = np.random.default_rng([_VARIANT_SALT, seed, int(row_hash[i])])
        texts += [t or "" for t in restricted_variants(canonical[i], rng=rng, count=count)]
    flat, lengths = encoder.encode_batch(texts) if texts else (np.zeros(0, np.uint16), np.zeros(0, np.int32))
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    good = encoder.roundtrip_ok(flat, lengths, texts) if texts else np.zeros(0, bool)
    unk_cum = np.concatenate([[0], np.cumsum(flat == encoder.unk_id)])
    good &= (unk_cum[bounds[1:]] - unk_cum[bounds[:-1]] == 0) & (np.asarray(lengths) > 0)
    keep = np.repeat(good, lengths)
    # 64-bit offsets: K spellings of a 250,000-row partition can pass 2^31 tokens
    inner = pa.LargeListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(np.where(good, lengths, 0))])
                                                   .astype(np.int64)), pa.array(flat[keep], pa.uint16()))
    per_row = np.zeros(n, np.int32)
    per_row[rows] = count
    outer = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(per_row)]).astype(np.int32)), inner)
    return outer, int(len(texts) - good.sum())


def aligned_pair_variants(sources: list[str], targets: list[str], row_hash: np.ndarray, rows: np.ndarray, count: int,
                          seed: int, encoder, canonical_first: bool = False) -> tuple[pa.ListArray, int]:
    """``count`` root-aligned spellings of each pair in ``rows`` (``molds.chemistry.pairs.aligned_spellings``,
    R-SMILES), each stored as the source's tokens, the sep token, the target's tokens: the
    layout ``randomized_variants`` gives molecules (list<list<uint16>>, empty for the other
    rows and for a spelling the vocabulary cannot take, which is counted); ``canonical_first``: the
    first spelling is the canonical source's (``aligned_spellings``). Roots come from
    (seed, the row hash), so any engine and partitioning writes the same ones."""
    from molds.chemistry.pairs import aligned_spellings

    from .tokenizer import SPECIAL_TOKENS

    # the sides were canonicalized already: RDKit's warnings on reading them again (a hydride
    # reagent's "not removing hydrogen atom without neighbors", once per spelling) are noise,
    # blocked by ``aligned_spellings``
    sep = encoder.token_id(SPECIAL_TOKENS["sep_token"])
    if sep is None:
        raise ValueError("--randomized_variants with pairs stores each pair as source <sep> target: the tokenizer "
                         "has no <sep> token")
    n = len(sources)
    src_texts, tgt_texts = [], []
    for i in rows.tolist():
        rng = np.random.default_rng([_VARIANT_SALT, seed, int(row_hash[i])])
        found = aligned_spellings(sources[i], targets[i], rng=rng, count=count,
                                  canonical_first=canonical_first) or [("", "")] * count
        src_texts += [a for a, _ in found]
        tgt_texts += [b for _, b in found]
    pieces, failed = [], 0
    if src_texts:
        sides = []
        for texts in (src_texts, tgt_texts):
            flat, lengths = encoder.encode_batch(texts)
            bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            good = encoder.roundtrip_ok(flat, lengths, texts) & (np.asarray(lengths) > 0)
            unk_cum = np.concatenate([[0], np.cumsum(flat == encoder.unk_id)])
            good &= unk_cum[bounds[1:]] - unk_cum[bounds[:-1]] == 0
            sides.append((flat, bounds, good))
        (s_flat, s_bounds, s_good), (t_flat, t_bounds, t_good) = sides
        good = s_good & t_good
        failed = int(len(good) - good.sum())
        sep_arr = np.asarray([sep], np.uint16)
        for j in range(len(good)):
            pieces.append(np.concatenate([s_flat[s_bounds[j]:s_bounds[j + 1]], sep_arr,
                                          t_flat[t_bounds[j]:t_bounds[j + 1]]]) if good[j] else sep_arr[:0])
    lengths = np.fromiter((len(p) for p in pieces), np.int64, count=len(pieces))
    flat = np.concatenate(pieces).astype(np.uint16) if pieces else np.zeros(0, np.uint16)
    inner = pa.LargeListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)),
                                          pa.array(flat, pa.uint16()))
    per_row = np.zeros(n, np.int32)
    per_row[rows] = count
    outer = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(per_row)]).astype(np.int32)), inner)
    return outer, failed


def _encode(encoder, texts: list[str]) -> tuple[pa.ListArray, np.ndarray, np.ndarray, np.ndarray]:
    """(token ids as list<uint16>, lengths, round trip ok, holds an unknown token) of each text."""
    flat, lengths = encoder.encode_batch(texts)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ok = encoder.roundtrip_ok(flat, lengths, texts)
    unk_cum = np.concatenate([[0], np.cumsum(flat == encoder.unk_id)])
    unk = (unk_cum[offsets[1:]] - unk_cum[offsets[:-1]]) > 0
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.uint16())), np.asarray(lengths), ok, unk


def finalize_partition(result: dict, method: str, thresholds, encoder_spec, boundaries, vocab_from: str,
                       work_dir: str, representation: str = "smiles", randomized: tuple = (0, 0, False),
                       targets_first: dict | None = None, train_hashes: dict | None = None) -> dict:
    """Tokenize, check the round trip, bucket by length and order a reduced partition
    (``randomized``: (K, seed, canonical_first), K randomized spellings of each training molecule too). Pairs:
    both sides tokenized, and a pair whose target ``targets_first`` (target hash -> split)
    puts in an earlier split is refused (``target_in_two_splits``); with ``train_hashes``
    (``evaluation_kept_whole``) nothing is refused for it and the evaluation rows that share
    their pair, source or target with training are counted (``shared_with_train``)."""
    encoder = make_encoder(encoder_spec)
    table = read_ipc(result["staged"])
    n = len(table)
    split = partition_splits(table, result["groups"], method, thresholds)
    pairs = "source_smiles" in table.column_names
    if pairs:
        source_ids, source_lengths, ok, unk = _encode(encoder, table.column("source_smiles").to_pylist())
        target_ids, target_lengths, ok_t, unk_t = _encode(encoder, table.column("target_smiles").to_pylist())
        ok, unk, lengths = ok & ok_t, unk | unk_t, source_lengths + target_lengths
        sides = {"source_token_ids": source_ids, "source_length": pa.array(source_lengths, pa.int32()),
                 "target_token_ids": target_ids, "target_length": pa.array(target_lengths, pa.int32())}
    else:
        token_ids, lengths, ok, unk = _encode(encoder, token_texts(table).to_pylist())
    # a grown vocabulary (encoder_spec[3]: the given vocabulary's size): the rows that use a token it added
    added_from = encoder_spec[3] if encoder_spec[0] == "regex" and len(encoder_spec) > 3 else None
    if added_from is None:
        added = np.zeros(n, dtype=bool)
    else:
        id_lists = [token_ids] if not pairs else [source_ids, target_ids]
        added = np.zeros(n, dtype=bool)
        for ids in id_lists:
            flat = ids.values.to_numpy(zero_copy_only=False).astype(np.int64)
            cum = np.concatenate([[0], np.cumsum(flat >= added_from)])
            offsets = ids.offsets.to_numpy()
            added |= (cum[offsets[1:]] - cum[offsets[:-1]]) > 0
    # unknown tokens are expected outside the vocabulary's own split: kept, counted
    expected_unk = unk & (split != 0) if vocab_from == "train" else np.zeros(n, dtype=bool)
    ok = (ok & ~unk) | expected_unk
    stats = Stats()
    if not ok.all():
        sources = table.column("source").to_pylist()
        raws = table.column("raw_smiles").to_pylist()
        for i in np.flatnonzero(~ok).tolist():
            stats.reject("tokenizer_roundtrip", sources[i], raws[i])
    if pairs and targets_first:
        first = np.array([targets_first.get(h, 3) for h in table.column("target_hash").to_numpy().tolist()])
        later = ok & (split > first)
        if later.any():
            sources, raws = table.column("source").to_pylist(), table.column("raw_smiles").to_pylist()
            for i in np.flatnonzero(later).tolist():
                stats.reject("target_in_two_splits", sources[i], raws[i])
            ok &= ~later
    shared = overlap_counts(table, split, ok, train_hashes) if pairs and train_hashes is not None else None
    variants = None
    if randomized[0] and pairs:  # source and target rooted at matching atoms (R-SMILES)
        variants, failed = aligned_pair_variants(table.column("source_smiles").to_pylist(),
                                                 table.column("target_smiles").to_pylist(),
                                                 table.column("row_hash").to_numpy(), np.flatnonzero(ok & (split == 0)),
                                                 randomized[0], randomized[1], encoder,
                                                 canonical_first=randomized[2])
        stats.notes["randomized_failed"] += failed
    elif randomized[0]:
        variants, failed = randomized_variants(table.column("canonical_smiles").to_pylist(),
                                               table.column("row_hash").to_numpy(), np.flatnonzero(ok & (split == 0)),
                                               randomized[0], randomized[1], encoder)
        stats.notes["randomized_failed"] += failed
    lbucket = length_bucket_of(lengths, boundaries)
    out = pa.table({
        "compound_id": table.column("compound_id"),
        "raw_smiles": table.column("raw_smiles"),
        **({"source_smiles": table.column("source_smiles"), "target_smiles": table.column("target_smiles")}
           if pairs else {"canonical_smiles": table.column("canonical_smiles")}),
        **({"text": table.column("text")} if "text" in table.column_names else {}),
        "scaffold": table.column("scaffold"),
        **(sides if pairs else {"token_ids": token_ids}),
        "token_length": pa.array(lengths, pa.int32()),
        **({"randomized_token_ids": variants} if variants is not None else {}),
        **({"labels": table.column("labels")} if "labels" in table.column_names else {}),
        "source": table.column("source"),
        "_split": pa.array(split),
        "_lbucket": pa.array(lbucket),
        "_unk": pa.array(unk),
        "_added": pa.array(added),
        "_bucket": table.column("bucket"),
        "_row_hash": table.column("row_hash"),
        "_group_hash": table.column("group_hash"),
    })
    if not ok.all():
        out = out.filter(pa.array(ok))
    out = out.sort_by([("_split", "ascending"), ("_lbucket", "ascending"), ("_bucket", "ascending"),
                       ("_row_hash", "ascending")])
    if "text" in out.column_names and representation == "safe":  # the no-cut rule's rows, as kept
        stats.notes["single_fragment"] += int(pc.sum(pc.invert(pc.match_substring(out.column("text"), "."))).as_py()
                                              or 0)
    path = os.path.join(work_dir, f"final-{result['index']}.arrow")
    _write_ipc(out, path)
    s = out.column("_split").to_numpy()
    lb = out.column("_lbucket").to_numpy()
    tl = out.column("token_length").to_numpy()
    # rows are sorted by (split, length bucket): each segment is one contiguous run
    keys, seg_first, seg_rows = np.unique(s.astype(np.int64) * 1024 + lb, return_index=True, return_counts=True)
    segments = {(int(k) // 1024, int(k) % 1024): int(c) for k, c in zip(keys, seg_rows)}
    seg_start = {(int(k) // 1024, int(k) % 1024): int(f) for k, f in zip(keys, seg_first)}
    # the shards' size is planned on what the rows hold, not on where the input lay: the
    # columns that name its path (``source``, and the default ``compound_id`` made of it) are
    # left out, so that one file preprocessed from two places is cut into the same shards and
    # row groups, and trained in the same order
    text_bytes = sum(pc.sum(pc.binary_length(out.column(c))).as_py() or 0
                     for c in ("raw_smiles", "canonical_smiles", "text", "source_smiles", "target_smiles", "scaffold")
                     if c in out.column_names)
    return {
        "index": result["index"],
        "path": path,
        "segments": segments,
        "segment_start": seg_start,
        "stats": stats,
        "bytes": int(text_bytes + 2 * int(tl.sum()) + out.num_rows * (16 + 4 * _num_labels(out))
                     + (2 * len(out.column("randomized_token_ids").combine_chunks().flatten().flatten())
                        if "randomized_token_ids" in out.column_names else 0)),
        "length_hist": {k: np.bincount(tl[s == k]).tolist() for k in range(3)},
        **({"shared_with_train": shared} if shared is not None else {}),
        "unknown_rows": {k: int(np.count_nonzero(out.column("_unk").to_numpy(zero_copy_only=False) & (s == k)))
                         for k in range(3)},
        "groups": {k: int(len(np.unique(out.column("_group_hash").to_numpy()[s == k]))) for k in range(3)},
        "added_rows": {k: int(np.count_nonzero(out.column("_added").to_numpy(zero_copy_only=False) & (s == k)))
                       for k in range(3)},
    }


def _num_labels(table: pa.Table) -> int:
    if "labels" not in table.column_names or table.num_rows == 0:
        return 0
    first = table.column("labels")[0].as_py()
    return len(first) if first else 0


# ---------------------------------------------------------------- assemble

def write_shard(pieces, path: str, row_group_rows: int = 2048) -> dict:
    """Concatenate (final partition path, start, length) slices into one Parquet shard."""
    parts = [read_ipc(p).slice(start, length) for p, start, length in pieces]
    table = pa.concat_tables(parts)
    table = table.select([c for c in SHARD_COLUMNS if c in table.column_names])
    from molds.runtime.atomic import atomic_file

    with atomic_file(path, durable=False) as tmp:  # synced with the whole output when it is published
        pq.write_table(table, tmp, row_group_size=row_group_rows, compression="zstd")
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return {
        "num_rows": table.num_rows,
        "token_count": int(pc.sum(table.column("token_length")).as_py() or 0),
        "sha256": digest.hexdigest(),
    }
