"""A compressed input cut short (a broken download), in each compression the ETL reads:
by default the run stops naming the file, writes nothing but the failure report, and the
report accounts for every row read; with ``--on-truncated keep`` every complete row before
the cut is kept and the cut is one ``truncated_input`` rejection named in the manifest.
The rows before the cut are counted independently, by decompressing the cut file with the
format's own library up to where it fails."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import zlib

import pytest

from molds.preprocessing.readers import InputError

from .conftest import run_etl, sample_smiles

#: distinct molecules (repeated ones would compress into one long first block of zstd)
TEXT = ("smiles\n" + "\n".join(sample_smiles(8000, offset=2000)) + "\n").encode()


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=1).compress(data)


def _zstd_prefix(blob: bytes) -> bytes:
    import zstandard

    d = zstandard.ZstdDecompressor().decompressobj()
    return d.decompress(blob)


def _stdlib_prefix(make):
    def prefix(blob: bytes) -> bytes:
        return make().decompress(blob)
    return prefix


FORMATS = {"gz": (gzip.compress, _stdlib_prefix(lambda: zlib.decompressobj(31))),
           "bz2": (lambda d: bz2.compress(d, 1), _stdlib_prefix(bz2.BZ2Decompressor)),
           "xz": (lzma.compress, _stdlib_prefix(lzma.LZMADecompressor)), "zst": (_zstd, _zstd_prefix)}


def _cut(tmp_path, ext):
    compress, prefix = FORMATS[ext]
    blob = compress(TEXT)
    cut = blob[: int(len(blob) * 0.6)]
    path = tmp_path / f"mols.csv.{ext}"
    path.write_bytes(cut)
    readable = prefix(cut)
    assert 0 < len(readable) < len(TEXT) and TEXT.startswith(readable)
    complete_rows = readable.count(b"\n") - 1  # the header's line is no row
    return str(path), complete_rows


@pytest.mark.parametrize("ext", sorted(FORMATS))
def test_a_cut_input_stops_the_run_and_accounts_for_every_row_read(tmp_path, ext):
    path, complete = _cut(tmp_path, ext)
    with pytest.raises(InputError, match=rf"mols.csv.{ext}: the compressed stream ends before its end marker "
                                         rf"\(cut short\).* rows were read"):
        run_etl(str(tmp_path / "out"), [path])
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("out")) == ["out.failed-report.json",
                                                                             "out.failed-report.md"]
    rep = json.load(open(tmp_path / "out.failed-report.json"))
    assert rep["rows_in"] == rep["canonicalized"] + sum(rep["rejected"].values())
    # every complete row before the cut was read (and at most the one the cut went through)
    assert complete <= rep["rows_in"] <= complete + 1


@pytest.mark.parametrize("ext", sorted(FORMATS))
def test_on_truncated_keep_keeps_every_complete_row_before_the_cut(tmp_path, ext):
    path, complete = _cut(tmp_path, ext)
    m = run_etl(str(tmp_path / "out"), [path], on_truncated="keep")
    stats = m["stats"]
    assert stats["rejected"]["truncated_input"] == 1
    assert stats["rows_in"] == complete + 1  # the complete rows and the cut one
    assert stats["rows_in"] == stats["rows_out"] + stats["duplicates"] + sum(stats["rejected"].values())
    assert len(stats["truncated_inputs"]) == 1 and stats["truncated_inputs"][0].startswith(path + ":")


def test_zstd_frames_one_after_another_read_whole(tmp_path):
    """``zstd -c a b`` (and pzstd) write several frames: all are read, and no cut is seen."""
    half = TEXT.index(b"\n", len(TEXT) // 2) + 1
    path = tmp_path / "two.csv.zst"
    path.write_bytes(_zstd(TEXT[:half]) + _zstd(TEXT[half:]))
    m = run_etl(str(tmp_path / "out"), [str(path)])
    assert m["stats"]["rows_in"] == TEXT.count(b"\n") - 1 and "truncated_input" not in m["stats"]["rejected"]
