"""Input files as molds reads them: the ETL (``molds-preprocess``) and ``molds-predict``.

A file's format from its name (``detect_format``); its bytes decompressed by its name
(gzip by ``inflate``, zstd by ``unzstd``: every byte before a cut, and the cut said; bz2
and xz by fsspec); its text decoded as UTF-8 with or without a byte-order mark, or UTF-16 /
UTF-32 by theirs (``open_text``); CSV / TSV records with the line each starts on, Excel's
``sep=`` line honoured (``delimited_lines``); a column found by its name, else but for case
(``column_index``). One reader for both, so that a file the ETL took is a file
``molds-predict`` takes, and the other way round.
"""

from __future__ import annotations

import csv
import io
import itertools
import os
import re
import sys

import fsspec

from ..errors import InputError  # a problem with an input file as a whole (names the file)
from .inflate import open_gzip

COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
FORMATS = {
    ".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".smi": "smi", ".smiles": "smi", ".txt": "smi",
    ".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
    ".sdf": "sdf", ".sd": "sdf", ".mol": "sdf",
}


def detect_format(path: str, forced: str = "auto") -> str:
    if forced != "auto":
        return forced
    if path.startswith("datasets:"):
        return "hf"
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if names & {"dataset_info.json", "state.json", "dataset_dict.json"}:
            return "hf"
        raise InputError(f"input {path!r} is a directory but not a saved HuggingFace dataset")
    stem = path.lower()
    for ext in COMPRESSIONS:
        if stem.endswith(ext):
            stem = stem[: -len(ext)]
    for ext, fmt in FORMATS.items():
        if stem.endswith(ext):
            return fmt
    raise InputError(
        f"input {path!r}: cannot tell its format from the name; pass --input_format "
        f"(one of csv, tsv, smi, sdf, parquet, jsonl, hf)"
    )


def open_binary(path: str):
    """The file's bytes, decompressed (by its name: .gz .bz2 .xz .zst); gzip by
    ``inflate.open_gzip`` (ISA-L, every byte before a cut), zstd by ``unzstd.open_zstd``
    (a cut said, where fsspec's reader ends quietly), bz2 and xz by fsspec."""
    compression = next((c for ext, c in COMPRESSIONS.items() if path.lower().endswith(ext)), None)
    if compression == "gzip":
        return open_gzip(fsspec.open(path, "rb").open())
    if compression == "zstd":
        try:
            from .unzstd import open_zstd  # zstandard: an optional dependency, for .zst inputs alone
        except ImportError:
            raise InputError(f"input {path!r}: reading zstd needs the zstandard package (pip install zstandard)") \
                from None
        return open_zstd(fsspec.open(path, "rb").open())
    return fsspec.open(path, "rb", compression=compression).open()


_TEXT_BOMS = ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
              (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))


def _bom_encoding(head: bytes) -> str | None:
    """UTF-16 / UTF-32 by the byte-order mark a file starts with, else None."""
    return next((enc for bom, enc in _TEXT_BOMS if head.startswith(bom)), None)


def open_at_start(path: str):
    """``(binary stream at its start, its first 4 bytes)``: the head is read from the stream
    that is then read (seeked back), not from a second open (a second request for an HTTP
    input), unless the stream cannot seek."""
    fh = open_binary(path)
    head = fh.read(4)
    if fh.seekable():  # local, gzip and fsspec remote files: back to the start, no second open
        fh.seek(0)
    else:
        fh.close()
        fh = open_binary(path)
    return fh, head


def open_text(path: str):
    """UTF-8 (with or without a BOM), or UTF-16 / UTF-32 when the file starts with their BOM
    (Excel's "Unicode text" export is UTF-16 with tabs). surrogateescape keeps undecodable
    bytes as lone surrogates: the row is then rejected as non_utf8 instead of the whole file
    failing."""
    fh, head = open_at_start(path)
    encoding = _bom_encoding(head) or "utf-8-sig"
    return io.TextIOWrapper(fh, encoding=encoding, errors="surrogateescape", newline="")


class _Utf8Bytes:
    """A UTF-16 / UTF-32 text stream read as the UTF-8 bytes the SD splitter and RDKit
    take (undecodable units pass through surrogateescape, so a record that holds them is
    refused as non_utf8, as in the text path). Line ends are kept as written."""

    def __init__(self, fh, encoding: str):
        self._text = io.TextIOWrapper(fh, encoding=encoding, errors="surrogateescape", newline="")

    def read(self, n: int = -1) -> bytes:
        return self._text.read(n).encode("utf-8", "surrogateescape")

    read1 = read

    def close(self) -> None:
        self._text.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_sd(path: str):
    """An SD file as bytes: a UTF-8 byte-order mark (Windows tools write one) is dropped, so
    that it does not become part of the first record's title (an id read from ``_Name``);
    UTF-16 / UTF-32 files (marked by their BOM) are read through as UTF-8."""
    fh, head = open_at_start(path)
    encoding = _bom_encoding(head)
    if encoding is not None:
        return _Utf8Bytes(fh, encoding)
    if head.startswith(b"\xef\xbb\xbf"):
        fh.read(3)
    return fh


_PADDING = " \t\r\n\x00\x1a\udc80"  # NUL (also as the CSV reader's stand-in), Ctrl-Z, whitespace


def is_padding(text: str) -> bool:
    """A line of nothing but NUL bytes or Ctrl-Z (with whitespace): ``padding``, not a record."""
    return bool(text.strip()) and not text.strip(_PADDING)


def is_clean(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\0" not in text


def matching_column(path: str, names: list[str], wanted: str) -> int | None:
    """Index of the one name that is ``wanted`` (exactly, else but for case), None for none;
    two that match are refused (which one holds the data is not for molds to guess)."""
    found = [i for i, h in enumerate(names) if h == wanted]
    if not found:
        found = [i for i, h in enumerate(names) if h.lower() == wanted.strip().lower()]
    if len(found) > 1:
        raise InputError(f"{path}: {len(found)} columns match {wanted!r} (columns "
                         f"{', '.join(str(i + 1) for i in found)} of {names}); rename one, or name the other "
                         f"exactly if they differ in case")
    return found[0] if found else None


#: what ``molds-preprocess`` is told for a file whose header seems split by this character
ETL_DELIMITER_HINTS = ((";", "--delimiter ';'"), ("|", "--delimiter '|'"), ("\t", "--input_format tsv"),
                       (",", "--input_format csv"))


def column_index(path: str, header: list[str], wanted: str, what: str = "label",
                 hints: tuple = ETL_DELIMITER_HINTS) -> int:
    """Index of column ``wanted`` (``matching_column``), else refused naming the columns (and,
    for a header of one column that another character splits, the caller's option of
    ``hints`` that reads it so)."""
    names = [h.strip() for h in header]
    found = matching_column(path, names, wanted)
    if found is not None:
        return found
    hint = ""
    if len(names) == 1:  # a single column: the file is likely split by another character
        for sep, how in hints:
            cells = [c.strip().lower() for c in names[0].split(sep)]
            if len(cells) > 1 and wanted.strip().lower() in cells:
                hint = f" (its header is split by {sep!r}: pass {how})"
                break
    raise InputError(f"{path}: no {what} column {wanted!r}; the file has columns {names}{hint}")


_EXCEL_SEP = re.compile(r'"?sep=(.)"?\1*', re.IGNORECASE)  # Excel's hint line: ``sep=;`` before the header


def delimited_lines(path: str, delimiter: str | None = None, default: str | None = None):
    """A CSV / TSV input as the ETL reads it: yields ``(line, fields)``, the header first, then
    each record, with the line of the file it starts on; nothing for an empty file.
    ``delimiter`` as asked (None: ``default``, else a tab for ``.tsv``/``.tab`` names and a
    comma for others, or the one an Excel ``sep=X`` first line names, which is then skipped).
    Decoding as ``open_text``; a NUL byte is kept as a lone surrogate (the row is refused as
    ``non_utf8``)."""
    if default is None:
        default = "\t" if detect_format(path) == "tsv" else ","
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open_text(path) as fh:
        lines = (line.replace("\0", "\udc80") if "\0" in line else line for line in fh)
        first = next(lines, None)
        if first is None:
            return
        hint = _EXCEL_SEP.fullmatch(first.rstrip("\r\n"))  # not strip(): ``sep=<tab>``
        skipped = 0
        if hint is not None:
            if delimiter is not None and delimiter != hint.group(1):
                raise InputError(f"{path}: its first line {first.strip()!r} (Excel's delimiter hint) says the "
                                 f"fields are separated by {hint.group(1)!r}, but --delimiter is {delimiter!r}")
            delimiter, skipped = hint.group(1), 1
        else:
            lines = itertools.chain([first], lines)
        reader = csv.reader(lines, delimiter=delimiter or default)
        while True:
            line = reader.line_num + 1 + skipped  # the line this record starts on (the header is line 1)
            record = next(reader, None)
            if record is None:
                return
            yield line, record
