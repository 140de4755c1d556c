"""Streaming readers for raw molecule dumps.

Each reader yields ``RawChunk``s of at most ``chunk_rows`` records, never the whole file.
Rows that are broken at the file level (wrong field count, bad bytes, no SMILES field)
are carried in the chunk with their rejection reason, so every record is counted.

Formats: CSV / TSV (Python's ``csv``: quoted commas, CRLF, embedded newlines), .smi
(``SMILES [whitespace id]``), SDF / MOL (V2000 and V3000, split into records here and
parsed by RDKit in the workers: ``sdf.py``), Parquet (pyarrow, by row group), JSONL, and HuggingFace
``datasets`` (a ``save_to_disk`` directory, or ``datasets:NAME[:CONFIG]`` already in the
local cache; nothing is downloaded). Any of the text formats may be gzip/bz2/xz/zstd
compressed; paths may be local, globs, or fsspec URIs.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import sys
from dataclasses import dataclass, field

from molds.chemistry.canonical import split_cxsmiles
from molds.data.inputs import (  # the text layer, shared with molds-predict
    column_index,
    delimited_lines,
    is_clean,
    is_padding,
    matching_column,
    open_binary,
    open_sd,
    open_text,
)
from molds.data.sdf import TITLE_TAG, read_sd_records, resolve_tag, sd_tags
from molds.errors import InputError  # a problem with an input file as a whole (names the file)


class TruncatedInputError(InputError):
    """A compressed input whose stream ends before its end marker (a cut-short download)."""


def warn_truncated(exc: TruncatedInputError) -> None:
    """``--on_truncated keep``: said on stderr as the input ends (and in the manifest)."""
    print(f"[molds-preprocess] WARNING: {exc}; the records before the cut are kept, the cut is counted as "
          f"'truncated_input' (--on_truncated keep)", file=sys.stderr, flush=True)


@dataclass
class RawChunk:
    """Up to ``chunk_rows`` consecutive records of one input file."""

    file_index: int
    path: str
    rows: list[int] = field(default_factory=list)  # where each record starts: 1-based line (text), row (binary)
    smiles: list = field(default_factory=list)  # str, or None when ``reasons`` has the row
    ids: list = field(default_factory=list)  # compound id or None
    labels: list = field(default_factory=list)  # list of raw label values, or None
    reasons: dict = field(default_factory=dict)  # position in chunk -> rejection reason
    # "smiles": ``smiles`` holds SMILES; "sdf": it holds SD records (bytes) and
    # ``records`` their record numbers, the worker reads id and labels from the record
    kind: str = "smiles"
    records: list = field(default_factory=list)
    units: list = field(default_factory=list)  # ``--unit_template``: {key: value} of each record, else empty

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class Columns:
    smiles: str
    id: str | None = None
    labels: tuple[str, ...] = ()
    units: tuple[str, ...] = ()  # JSONL keys ``--unit_template`` names
    rank: str | None = None  # the JSONL key or SD tag ``--conformer_rank_by`` names
    # (name, role) of the columns read after the labels, in ``labels`` too: ``--target_column``
    # ("target"), ``--split_column`` ("split"); the role names the column in an error
    roles: tuple[tuple[str, str], ...] = ()

    def role(self, name: str) -> str:
        """What a column of ``labels`` holds, as an error names it."""
        return dict(self.roles).get(name, "label")


def expand_inputs(patterns: list[str]) -> list[str]:
    """Globs and fsspec URIs to a sorted, de-duplicated list of existing inputs."""
    out: list[str] = []
    for pattern in patterns:
        if pattern.startswith("datasets:"):
            out.append(pattern)
        elif "://" in pattern:
            import fsspec

            fs, _, paths = fsspec.get_fs_token_paths(pattern)
            if not paths:
                raise InputError(f"input {pattern!r}: no such file")
            proto = fs.protocol[0] if isinstance(fs.protocol, (list, tuple)) else fs.protocol
            out.extend(sorted(p if "://" in p else f"{proto}://{p}" for p in paths))
        elif glob.has_magic(pattern):
            found = sorted(glob.glob(pattern))
            if not found:
                raise InputError(f"input {pattern!r}: the glob matches no file")
            out.extend(found)
        else:
            if not os.path.exists(pattern):
                raise InputError(f"input {pattern!r}: no such file or directory")
            out.append(pattern)
    seen, unique = set(), []
    for p in out:
        if p not in seen:
            seen.add(p)
            unique.append(p)
    if not unique:
        raise InputError("no input given")
    return unique


def _chunked(file_index: int, path: str, records, chunk_rows: int, kind: str = "smiles"):
    """Group (row, smiles, id, labels, reason) records into RawChunks (for ``kind`` "sdf":
    (row, record number, text, reason)). If reading fails part-way (a truncated archive),
    the records read so far are still handed on (so they are processed and counted) before
    the error; a stream cut short adds one ``truncated_input`` record where it was cut
    (unless the reader gave the record it cut itself)."""
    chunk = RawChunk(file_index, path, kind=kind)
    last = [0, None, 0]  # the last record's row, reason and record number

    def add(row, text, cid, labels, reason, number=None, unit=None):
        if reason is not None:
            chunk.reasons[len(chunk.rows)] = reason
            text = None
        chunk.rows.append(row)
        chunk.smiles.append(text)
        chunk.ids.append(cid)
        chunk.labels.append(labels)
        if number is not None:
            chunk.records.append(number)
        if unit is not None or chunk.units:  # one {key: value} per record once a chunk has them
            chunk.units.append(unit or {})
        last[:] = [row, reason, number]

    try:
        for record in records:
            if kind == "sdf":
                row, number, text, reason = record
                add(row, text, None, None, reason, number)
            elif len(record) == 6:  # JSONL with --unit_template: the fields it names
                add(*record[:5], unit=record[5])
            else:
                add(*record)
            if len(chunk.rows) >= chunk_rows:
                yield chunk
                chunk = RawChunk(file_index, path, kind=kind)
    except GeneratorExit:  # the consumer stopped early: nothing more may be yielded
        raise
    except BaseException as exc:
        if isinstance(exc, EOFError) and last[1] != "truncated_input":
            add(last[0] + 1, None, None, None, "truncated_input", last[2] + 1 if kind == "sdf" else None)
        if chunk.rows:
            yield chunk
        raise
    if chunk.rows:
        yield chunk



def _read_delimited(path, cols: Columns, delimiter: str | None, default: str):
    """CSV / TSV rows (``delimited_lines``) as (row, smiles, id, labels, reason) records."""
    lines = delimited_lines(path, delimiter, default)
    first = next(lines, None)
    if first is None:
        return
    header = first[1]
    s_idx = column_index(path, header, cols.smiles, "SMILES")
    i_idx = column_index(path, header, cols.id, "id") if cols.id else None
    l_idx = [column_index(path, header, name, cols.role(name)) for name in cols.labels]
    width = len(header)
    for row, record in lines:
        if not record:
            continue  # a blank line is not a record
        if len(record) == 1 and is_padding(record[0]):
            yield row, None, None, None, "padding"
        elif len(record) != width:
            yield row, None, None, None, "malformed_row"
        elif not all(map(is_clean, record)):
            yield row, None, None, None, "non_utf8"
        else:
            yield (row, record[s_idx], record[i_idx].strip() if i_idx is not None else None,
                   [record[i] for i in l_idx] if l_idx else None, None)


def _read_smi(path, has_header: bool):
    with open_text(path) as fh:
        for n, line in enumerate(fh):
            if n == 0 and has_header:
                continue
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            row = n + 1  # 1-based line number
            if is_padding(line):
                yield row, None, None, None, "padding"
            elif not is_clean(line):
                yield row, None, None, None, "non_utf8"
            else:
                if "|" in line:  # ``SMILES |extension| name``: the extension belongs to the SMILES
                    smiles, cx, rest = split_cxsmiles(line.strip())
                    if cx is not None:
                        yield row, f"{smiles} {cx}", rest or None, None, None
                        continue
                parts = line.strip().split(None, 1)
                yield row, parts[0], parts[1].strip() if len(parts) > 1 else None, None, None


def _read_jsonl(path, cols: Columns):
    """Records of a JSON-lines file. Keys are matched as CSV columns are (exactly, else the
    record's one key that matches but for case); a SMILES value that is no string is a
    ``malformed_row``; a file where no record has the SMILES key is refused at its end,
    naming the keys its records have (a misspelt ``--smiles-column``), and so is one where
    no record has a key ``--unit_template`` names. With ``cols.units``, each record comes
    with the values of those keys ({key: value}, None where absent) as a sixth item."""
    def value(rec: dict, wanted: str):
        if wanted in rec:
            return rec[wanted]
        keys = list(rec)
        found = matching_column(f"{path} line {row}", keys, wanted)
        return None if found is None else rec[keys[found]]

    units = cols.units + ((cols.rank,) if cols.rank and cols.rank not in cols.units else ())
    no_fields = ({},) if units else ()  # a refused record's (empty) fields, when they are read
    found, seen, records, unit_found = False, set(), 0, set()
    with open_text(path) as fh:
        for n, line in enumerate(fh):
            if not line.strip():
                continue
            row = n + 1  # 1-based line number
            if is_padding(line):
                yield (row, None, None, None, "padding") + no_fields
                continue
            if not is_clean(line):
                yield (row, None, None, None, "non_utf8") + no_fields
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if not isinstance(rec, dict):
                yield (row, None, None, None, "malformed_row") + no_fields
                continue
            records += 1
            if len(seen) < 1000 and (not found or len(unit_found) < len(units)):
                seen.update(map(str, rec))
            smiles = value(rec, cols.smiles)
            if smiles is None:
                yield (row, None, None, None, "missing_field") + no_fields
                continue
            found = True
            if not isinstance(smiles, str):
                yield (row, None, None, None, "malformed_row") + no_fields
                continue
            cid = value(rec, cols.id) if cols.id else None
            labels = [value(rec, name) for name in cols.labels] if cols.labels else None
            out = (row, smiles, None if cid is None else str(cid), labels, None)
            if units:
                fields = {name: value(rec, name) for name in units}
                unit_found.update(name for name, v in fields.items() if v is not None)
                out += (fields,)
            yield out
    shown = sorted(seen)[:40]
    more = " ..." if len(seen) > 40 else ""
    if records and not found:
        raise InputError(f"{path}: no record has a value for the SMILES key {cols.smiles!r}; its records have {shown}"
                         f"{more}")
    if records and len(unit_found) < len(units):
        missing = [name for name in units if name not in unit_found]
        raise InputError(f"{path}: no record has a value for the key(s) {missing} that --unit_template or "
                         f"--conformer_rank_by names; its records have {shown}{more}")


def _check_smiles_type(path: str, schema, cols: Columns) -> None:
    """A SMILES column must hold strings: one of another type is refused by name, not
    counted row by row as missing."""
    import pyarrow as pa

    field = schema.field(column_index(path, schema.names, cols.smiles, "SMILES"))
    kind = field.type.value_type if pa.types.is_dictionary(field.type) else field.type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
            or getattr(pa.types, "is_string_view", lambda t: False)(kind)):
        raise InputError(f"{path}: its SMILES column {field.name!r} holds {field.type}, not strings")


def _read_arrow_batches(path, batches, names: list[str], cols: Columns):
    s_name = names[column_index(path, names, cols.smiles, "SMILES")]
    i_name = names[column_index(path, names, cols.id, "id")] if cols.id else None
    l_names = [names[column_index(path, names, n, cols.role(n))] for n in cols.labels]
    row = 0
    for batch in batches:
        smiles = batch.column(s_name).to_pylist()
        ids = batch.column(i_name).to_pylist() if i_name else [None] * len(smiles)
        labels = [batch.column(n).to_pylist() for n in l_names]
        for j, smi in enumerate(smiles):
            row += 1
            if not isinstance(smi, str):
                yield row, None, None, None, "missing_field"
            else:
                cid = ids[j]
                yield (row, smi, None if cid is None else str(cid),
                       [col[j] for col in labels] if labels else None, None)


def _read_parquet(path, cols: Columns, chunk_rows: int):
    import pyarrow.parquet as pq

    with open_binary(path) as fh:
        pf = pq.ParquetFile(fh)
        names = pf.schema_arrow.names
        _check_smiles_type(path, pf.schema_arrow, cols)
        wanted = [cols.smiles] + ([cols.id] if cols.id else []) + list(cols.labels)
        resolved = sorted({names[column_index(path, names, w, "requested")] for w in wanted})
        yield from _read_arrow_batches(path, pf.iter_batches(batch_size=chunk_rows, columns=resolved), names, cols)


def _load_hf(path: str):
    if path.startswith("datasets:"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        import datasets

        name, _, config = path[len("datasets:"):].partition(":")
        try:
            return datasets.load_dataset(name, config or None)
        except Exception as exc:  # noqa: BLE001 - re-raised with the input named
            raise InputError(f"{path}: not found in the local HuggingFace cache ({exc})") from exc
    import datasets

    return datasets.load_from_disk(path)


def _read_hf(path, cols: Columns, chunk_rows: int):
    """Records of every split of a saved dataset; yields (label, records) per split."""
    ds = _load_hf(path)
    parts = [(None, ds)] if not hasattr(ds, "keys") else [(k, ds[k]) for k in sorted(ds.keys())]
    for split_name, part in parts:
        label = path if split_name is None else f"{path}[{split_name}]"
        table = part.data.table if hasattr(part.data, "table") else part.data
        if getattr(part, "_indices", None) is not None:
            part = part.flatten_indices()
            table = part.data.table
        _check_smiles_type(label, table.schema, cols)
        yield label, _read_arrow_batches(label, table.to_batches(max_chunksize=chunk_rows), table.schema.names, cols)


def _read_sdf(file_index: int, path: str, cols: Columns, chunk_rows: int):
    """The records of an SD file as chunks; at its end, a requested SD tag that no record
    had is refused (a misspelt ``--id-column`` / ``--label-columns``), naming the tags seen."""
    wanted = ([cols.id] if cols.id and cols.id != TITLE_TAG else []) + list(cols.labels) + \
        ([cols.rank] if cols.rank else [])
    seen: set[str] = set()
    missing = list(wanted)
    with open_sd(path) as fh:
        for chunk in _chunked(file_index, path, read_sd_records(fh), chunk_rows, kind="sdf"):
            if missing:  # scanned only until every requested tag has been seen
                seen |= sd_tags(chunk.smiles)
                missing = [tag for tag in wanted if resolve_tag(tag, seen) is None]
            yield chunk
    if missing:
        shown = sorted(seen)[:40]
        raise InputError(f"{path}: no record has the SD tag(s) {missing}; its records have {shown}"
                         f"{' ...' if len(seen) > 40 else ''} (the title line is {TITLE_TAG!r})")


def read_chunks(file_index: int, path: str, fmt: str, cols: Columns, chunk_rows: int,
                delimiter: str | None = None, has_header: bool | None = None):
    """Yield the records of one input as ``RawChunk``s; raise ``InputError`` naming it."""
    try:
        if fmt in ("csv", "tsv"):
            records = _read_delimited(path, cols, delimiter, "\t" if fmt == "tsv" else ",")
        elif fmt == "smi":
            records = _read_smi(path, bool(has_header))
        elif fmt == "jsonl":
            records = _read_jsonl(path, cols)
        elif fmt == "parquet":
            records = _read_parquet(path, cols, chunk_rows)
        elif fmt == "sdf":
            yield from _read_sdf(file_index, path, cols, chunk_rows)
            return
        elif fmt == "hf":
            for label, split_records in _read_hf(path, cols, chunk_rows):
                yield from _chunked(file_index, label, split_records, chunk_rows)
            return
        else:
            raise InputError(f"{path}: unknown input format {fmt!r}")
        yield from _chunked(file_index, path, records, chunk_rows)
    except InputError:
        raise
    except EOFError as exc:
        raise TruncatedInputError(f"{path}: the compressed stream ends before its end marker (cut short): "
                                  f"{exc}") from exc
    except (OSError, csv.Error, ValueError, ImportError) as exc:
        raise InputError(f"{path}: cannot read it: {type(exc).__name__}: {exc}") from exc
