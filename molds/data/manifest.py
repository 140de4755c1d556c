"""The manifest contract between the ETL and everything that reads its output.

``DIR/manifest.json`` (schema in DESIGN.md) lists every shard with its row count, token
count, length bucket and sha256. Readers refuse a ``format_version`` they do not know.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from dataclasses import dataclass

import numpy as np

from ..errors import ManifestError

FORMAT_VERSION = 1
_REQUIRED = ("format_version", "created", "canonicalization", "tokenizer", "splits", "stats")


@dataclass(frozen=True)
class Shard:
    split: str
    uri: str  # as written in the manifest, relative to it
    path: str  # resolved against the manifest's directory
    num_rows: int
    token_count: int
    length_bucket: int
    sha256: str


def contained_path(base: str, rel, what: str, manifest_path: str) -> str:
    """``rel`` resolved against ``base``, refused unless it stays inside ``base``: no
    scheme (``file://``, ``http://``), no absolute path, no ``..`` that climbs out, no
    symbolic link that leads out (local manifests)."""
    if not isinstance(rel, str) or not rel.strip():
        raise ManifestError(f"{manifest_path}: {what} has no uri")
    if "://" in rel or rel.startswith(("/", "\\")) or ":" in rel.split("/")[0] or "\x00" in rel:
        raise ManifestError(f"{manifest_path}: {what} uri {rel!r} is not a path relative to the manifest's "
                            f"directory; refused")
    if "://" in base:
        norm = posixpath.normpath(rel)
        if norm == ".." or norm.startswith("../") or norm.startswith("/"):
            raise ManifestError(f"{manifest_path}: {what} uri {rel!r} leaves the manifest's directory; refused")
        return posixpath.join(base, norm)
    root = os.path.realpath(base)
    path = os.path.realpath(os.path.join(base, rel))
    if path != root and not path.startswith(root + os.sep):
        raise ManifestError(f"{manifest_path}: {what} uri {rel!r} resolves to {path}, outside the manifest's "
                            f"directory {root}; refused")
    return os.path.join(base, os.path.normpath(rel))


def vocab_hash(vocab: dict[str, int]) -> str:
    """Hash of a token -> id mapping (the manifest's ``tokenizer.vocab_hash``)."""
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def manifest_hash(manifest: dict) -> str:
    """Content hash of a manifest, independent of when it was written."""
    content = {k: v for k, v in manifest.items() if k not in ("created", "timings")}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


@dataclass
class Manifest:
    path: str
    base: str
    data: dict

    @classmethod
    def load(cls, path: str) -> "Manifest":
        """Read ``path`` (a manifest.json or its directory; local or fsspec URI)."""
        import fsspec  # here: molds-preprocess --help loads no fsspec

        if not path.endswith(".json"):
            path = path.rstrip("/") + "/manifest.json"
        try:
            with fsspec.open(path, "rt", encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError as exc:
            raise ManifestError(f"{path}: no manifest there") from exc
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ManifestError(f"{path}: not a manifest (a JSON object is expected)")
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise ManifestError(f"{path}: missing keys {missing}")
        for key in ("tokenizer", "stats"):
            if not isinstance(data[key], dict):
                raise ManifestError(f"{path}: {key!r} must be an object")
        if not isinstance(data["stats"].get("splits", {}), dict):
            raise ManifestError(f"{path}: 'stats.splits' must map split names to their statistics")
        if data["format_version"] != FORMAT_VERSION:
            raise ManifestError(
                f"{path}: format_version {data['format_version']!r} is not supported "
                f"(this molds reads version {FORMAT_VERSION})"
            )
        base = path.rsplit("/", 1)[0] if "/" in path else "."
        manifest = cls(path, base, data)
        manifest._check_uris()
        return manifest

    def _check_uris(self) -> None:
        """Every path the manifest names stays under its directory: checked before any read."""
        splits = self.data["splits"]
        if not isinstance(splits, dict):
            raise ManifestError(f"{self.path}: 'splits' must map split names to lists of shards")
        for split, shards in splits.items():
            if not isinstance(shards, list):
                raise ManifestError(f"{self.path}: splits.{split} must be a list of shards")
            for i, s in enumerate(shards):
                if not isinstance(s, dict):
                    raise ManifestError(f"{self.path}: splits.{split}[{i}] is not a shard record")
                contained_path(self.base, s.get("uri"), f"shard splits.{split}[{i}]", self.path)
        contained_path(self.base, self.data["tokenizer"].get("path"), "tokenizer.path", self.path)

    @property
    def pairs(self) -> dict | None:
        """The ``pairs`` block of a manifest of pairs (``molds-preprocess --task``), else None."""
        block = self.data.get("pairs")
        return block if isinstance(block, dict) else None

    @property
    def label_columns(self) -> list[str]:
        """The names of the label columns its shards hold (``molds-preprocess --label-columns``),
        in order; empty without labels."""
        return list((self.data.get("labels") or {}).get("columns") or [])

    def require_molecules(self, what: str) -> None:
        """Refuse a manifest of pairs where molecules are read (their shards have no ``token_ids``)."""
        if self.pairs is not None:
            task = self.pairs.get("task", "?")
            raise ManifestError(f"{self.path}: its shards hold {task} pairs (molds-preprocess --task {task}), not "
                                f"molecules; {what} reads molecule shards (canonical_smiles, token_ids)")

    @property
    def hash(self) -> str:
        return manifest_hash(self.data)

    @property
    def tokenizer_path(self) -> str:
        return contained_path(self.base, self.data["tokenizer"]["path"], "tokenizer.path", self.path)

    def check_tokenizer(self) -> dict[str, int]:
        """The tokenizer files' vocabulary, refused if it is not the manifest's."""
        import fsspec  # here: molds-preprocess --help loads no fsspec
        from tokenizers import Tokenizer  # here: molds-preprocess --help loads no tokenizers

        path = self.tokenizer_path.rstrip("/") + "/tokenizer.json"
        try:
            with fsspec.open(path, "rt", encoding="utf-8") as fh:
                vocab = Tokenizer.from_str(fh.read()).get_vocab(with_added_tokens=True)
        except FileNotFoundError as exc:
            raise ManifestError(f"{self.path}: tokenizer file {path} is missing") from exc
        expected = self.data["tokenizer"].get("vocab_hash")
        if expected and vocab_hash(vocab) != expected:
            raise ManifestError(f"{path}: vocabulary hash {vocab_hash(vocab)[:12]} does not match the manifest's "
                                f"{expected[:12]} (tokenizer files replaced after preprocessing?)")
        return vocab

    def length_range(self, split: str) -> tuple[int, int] | None:
        """(shortest, longest) token_length of a split, when the manifest records it."""
        st = self.data["stats"].get("splits", {}).get(split, {})
        if not isinstance(st, dict) or "min_token_length" not in st:
            return None
        try:
            return int(st["min_token_length"]), int(st["max_token_length"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{self.path}: stats.splits.{split} lacks or mangles its token lengths ({exc!r})") from exc

    def shards(self, split: str) -> list[Shard]:
        if split not in self.data["splits"]:
            raise ManifestError(f"{self.path}: no split {split!r} (has {sorted(self.data['splits'])})")
        out = []
        for i, s in enumerate(self.data["splits"][split]):
            path = contained_path(self.base, s.get("uri"), f"shard splits.{split}[{i}]", self.path)
            try:
                out.append(Shard(split, s["uri"], path, int(s["num_rows"]), int(s["token_count"]),
                                 int(s["length_bucket"]), str(s["sha256"])))
            except (KeyError, TypeError, ValueError) as exc:
                raise ManifestError(f"{self.path}: shard {s.get('uri')!r} of split {split!r} lacks or mangles "
                                    f"{exc}") from exc
        return out

    def verify_shard(self, shard: Shard, vocab_size: int | None = None) -> None:
        """Check a shard's sha256 and row count against the manifest and, with
        ``vocab_size``, that every token id lies in the vocabulary (``check_token_ids``)."""
        import fsspec  # here: molds-preprocess --help loads no fsspec
        import pyarrow.parquet as pq  # here: molds-train --help loads no pyarrow

        digest = hashlib.sha256()
        try:
            with fsspec.open(shard.path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
        except FileNotFoundError as exc:
            raise ManifestError(f"shard {shard.uri} listed in {self.path} is missing") from exc
        if digest.hexdigest() != shard.sha256:
            raise ManifestError(f"shard {shard.uri}: sha256 {digest.hexdigest()} does not match the manifest's")
        with fsspec.open(shard.path, "rb") as fh:
            pf = pq.ParquetFile(fh)
            rows = pf.metadata.num_rows
            if rows != shard.num_rows:
                raise ManifestError(f"shard {shard.uri}: {rows} rows, the manifest says {shard.num_rows}")
            if vocab_size is not None:
                check_token_ids(pf, f"shard {shard.uri} of {self.path}", vocab_size)


def split_labels(manifest: Manifest, split: str = "train") -> np.ndarray:
    """[N, T] float: the labels of a split's rows, in shard order, NaN where missing ([0, 0]
    without rows)."""
    blocks = []
    for values in _split_column(manifest, split, "labels"):
        values = values.combine_chunks()
        if len(values):
            blocks.append(np.asarray(values.to_pylist(), dtype=float).reshape(len(values), -1))
    return np.concatenate(blocks) if blocks else np.zeros((0, 0))


def split_smiles(manifest: Manifest, split: str = "train") -> list[str]:
    """The canonical SMILES of a split's rows, in shard order (what ``split_labels`` labels)."""
    return [s for values in _split_column(manifest, split, "canonical_smiles") for s in values.to_pylist()]


def _split_column(manifest: Manifest, split: str, column: str):
    """One column of a split, a pyarrow chunked array per shard, in shard order."""
    import fsspec  # here: molds-preprocess --help loads no fsspec
    import pyarrow.parquet as pq  # here: molds-train --help loads no pyarrow

    for shard in manifest.shards(split):
        with fsspec.open(shard.path, "rb") as fh:
            yield pq.read_table(fh, columns=[column]).column(column)


def label_moments(manifest: Manifest, split: str = "train") -> tuple[list[float], list[float], list[int]]:
    """(mean, standard deviation, count) of each label over a split's rows where it is
    present (a missing label is NaN); a task with fewer than two labels, or all equal, has
    standard deviation 1, a task with none mean 0. What a regression model standardizes its
    labels by (``molds.models.encoder``)."""
    y = split_labels(manifest, split)
    if not len(y):
        return [], [], []
    count = (~np.isnan(y)).sum(axis=0)
    with np.errstate(invalid="ignore"):
        mean = np.where(count > 0, np.nansum(y, axis=0) / np.maximum(count, 1), 0.0)
        std = np.sqrt(np.nansum((y - mean) ** 2, axis=0) / np.maximum(count - 1, 1))
    std = np.where((count > 1) & (std > 0), std, 1.0)
    return mean.tolist(), std.tolist(), count.astype(int).tolist()


def first_label_outside(manifest: Manifest, split: str = "train", low: float = 0.0,
                        high: float = 1.0) -> tuple[str, int, float] | None:
    """(column name, row of the split, value) of the first present label of ``split`` outside
    [low, high], or None: what a classification head refuses to learn from (its binary
    cross-entropy takes classes 0 and 1 or probabilities between; a pIC50 of 7.2 as a target
    would pull its logit up without end)."""
    y = split_labels(manifest, split)
    bad = np.argwhere(~np.isnan(y) & ((y < low) | (y > high)))
    if not len(bad):
        return None
    row, task = (int(v) for v in bad[0])
    names = manifest.label_columns
    return (names[task] if task < len(names) else f"task {task}"), row, float(y[row, task])


def first_id_outside(ids, vocab_size: int) -> tuple[int, int] | None:
    """(row, id) of the first token id outside [0, vocab_size) in ``ids`` (a pyarrow list
    array of ints, one list per row), or None."""

    values = ids.values.to_numpy(zero_copy_only=False)
    if not len(values):
        return None
    bad = np.flatnonzero((values < 0) | (values >= vocab_size))
    if not len(bad):
        return None
    offsets = ids.offsets.to_numpy() - ids.offsets[0].as_py()
    row = int(np.searchsorted(offsets, bad[0], side="right") - 1)
    return row, int(values[bad[0]])


def check_token_ids(pf, where: str, vocab_size: int) -> None:
    """Every token id of a shard's ``token_ids`` (a pair shard's ``source_token_ids`` and
    ``target_token_ids``) inside the vocabulary: a row group whose Parquet statistics say so
    costs nothing more; one without them, or whose statistics reach outside, is read and its
    first bad row named (an id outside the vocabulary would reach the embedding: an
    IndexError on a CPU, a device-side assert on a GPU)."""
    meta = pf.metadata
    paths = [meta.schema.column(i).path for i in range(meta.num_columns)]
    names = [n for n in ("token_ids", "source_token_ids", "target_token_ids") if any(p.startswith(n + ".")
                                                                                  for p in paths)]
    if not names or names == ["source_token_ids"] or names == ["target_token_ids"]:
        raise ManifestError(f"{where}: no token_ids column (nor source_token_ids and target_token_ids)")
    for name in names:
        leaf = next(i for i, p in enumerate(paths) if p.startswith(name + "."))
        first = 0
        for rg in range(meta.num_row_groups):
            md = meta.row_group(rg)
            st = md.column(leaf).statistics
            known = st is not None and st.has_min_max and st.min is not None and st.max is not None
            if not (known and st.min >= 0 and st.max < vocab_size):
                found = first_id_outside(pf.read_row_group(rg, columns=[name]).column(0).combine_chunks(), vocab_size)
                if found is not None:
                    raise outside_vocabulary(where, first + found[0], rg, found[1], vocab_size)
            first += md.num_rows


def outside_vocabulary(where: str, row: int, row_group: int, token_id: int, vocab_size: int) -> ManifestError:
    return ManifestError(f"{where}: row {row} (row group {row_group}) holds token id {token_id}, outside the "
                         f"tokenizer's {vocab_size} ids (a shard written by another tokenizer?)")
