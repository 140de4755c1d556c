"""The gzip reader (``molds/data/inflate.py``) against the stdlib's ``gzip.GzipFile``:
the same bytes, the same errors, and a stream cut short gives every byte before the cut,
with ISA-L and with zlib underneath."""

from __future__ import annotations

import gzip
import io
import random
from functools import lru_cache

import pytest

from molds.data import inflate


@pytest.fixture(params=["isal", "zlib"])
def backend(request, monkeypatch):
    if request.param == "zlib":
        import zlib

        monkeypatch.setattr(inflate, "_zlib", zlib)
    elif inflate.backend() != "isal":
        pytest.skip("isal is not installed")
    assert inflate.backend() == request.param
    return request.param


def _payload() -> bytes:
    rng = random.Random(0)
    lines = [f"C{'C' * rng.randrange(40)}O {rng.random():.6f}\n".encode() for _ in range(60000)]
    return rng.randbytes(30000) + b"".join(lines)  # incompressible bytes, then text (~1.8 MB)


def _read(fh, size) -> tuple[bytes, str | None]:
    out = []
    try:
        while True:
            block = fh.read1(size) if size else fh.read(65536)
            if not block:
                break
            out.append(block)
    except (EOFError, OSError) as exc:
        return b"".join(out), type(exc).__name__
    return b"".join(out), None


@lru_cache(maxsize=1)
def _cases() -> dict:
    data = gzip.compress(_payload())
    return {
        "whole": data,
        "empty file": b"",
        "members": gzip.compress(b"a\n") + gzip.compress(b"") + data,
        "zero padding": data + b"\0" * 100,
        "trailing garbage": data + b"xy",
        "one stray byte": data + b"x",
        "cut in the data": data[: len(data) // 2],
        "cut in the second member": data + data[:1000],
        "cut in the header": data[:5],
        "cut in a member of zeros": (lambda z: z[: len(z) * 3 // 5])(gzip.compress(bytes(20 << 20))),
        "not gzip": b"plain text\n" * 10,
    }


@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("size", [0, 4096, 1 << 20])
def test_the_same_bytes_and_errors_as_gzip(backend, case, size):
    data = _cases()[case]
    got = _read(inflate.open_gzip(io.BytesIO(data)), size)
    want = _read(gzip.GzipFile(fileobj=io.BytesIO(data)), size)
    assert got == want


class _Unseekable(io.RawIOBase):
    def __init__(self, data):
        self._f = io.BytesIO(data)

    def readable(self):
        return True

    def readinto(self, b):
        return self._f.readinto(b)


@pytest.mark.parametrize("seekable", [True, False])
def test_every_byte_before_a_cut_wherever_it_falls(backend, seekable):
    """ISA-L holds back the last byte or two before some cuts; the reader gives them too
    (zlib inflates the cut member again, or runs throughout on a stream that cannot seek)."""
    data = _cases()["whole"]
    rng = random.Random(1)
    for cut in sorted(rng.sample(range(20, len(data) - 8), 60)):
        raw = io.BytesIO(data[:cut]) if seekable else io.BufferedReader(_Unseekable(data[:cut]))
        got = _read(inflate.open_gzip(raw), 1 << 16)
        assert got == _read(gzip.GzipFile(fileobj=io.BytesIO(data[:cut])), 1 << 16), cut


def test_a_corrupt_member_is_refused_as_gzip_refuses_it(backend):
    data = bytearray(gzip.compress(_payload()))
    data[-6] ^= 1  # the CRC-32
    for opener in (inflate.open_gzip, lambda raw: gzip.GzipFile(fileobj=raw)):
        with pytest.raises(gzip.BadGzipFile):
            _ = opener(io.BytesIO(bytes(data))).read()


def test_every_sd_record_before_a_cut_is_read(backend, hostile_sdf, tmp_path):
    """A multi-MB SD file cut short: the splitter gets every record the stdlib gives before
    the cut, and the cut record (fsspec's isal.igzip drops up to one read's worth here)."""
    from molds.data.sdf import read_sd_records

    paths, _, _ = hostile_sdf
    good = open(paths[0], "rb").read()
    blob = gzip.compress(good * max(1, (4 << 20) // len(good)))
    cut = blob[: len(blob) * 3 // 5]

    def records(fh):
        out = []
        try:
            for rec in read_sd_records(fh):
                out.append(rec)
        except EOFError:
            out.append("EOFError")
        return out

    want = records(gzip.GzipFile(fileobj=io.BytesIO(cut)))
    assert want[-1] == "EOFError" and want[-2][3] == "truncated_input" and len(want) > 100
    assert records(inflate.open_gzip(io.BytesIO(cut))) == want


def test_the_etl_opens_gz_inputs_with_it_and_rewinds_after_the_head(backend, tmp_path):
    from molds.data.inputs import open_at_start as _open_at_start, open_binary as _open_binary, open_text as _open_text

    path = tmp_path / "x.csv.gz"
    text = "smiles\n" + "".join(f"C{'C' * (i % 30)}O\n" for i in range(20000))
    path.write_bytes(gzip.compress(text.encode()))
    fh = _open_binary(str(path))
    assert isinstance(fh.raw, inflate._Inflate)
    fh, head = _open_at_start(str(path))
    assert head == b"smil" and fh.read() == text.encode()
    with _open_text(str(path)) as t:
        assert t.read() == text
