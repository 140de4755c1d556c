"""gzip inputs, decompressed by ISA-L when it is installed, every byte before a cut kept.

Decompression is the largest part of the reader's work on a gzipped SD file: 3.6-5.1 us a
record of the 5.8-6.5 the driver spends reading and splitting it (stdlib ``gzip``, 2-core
AMD EPYC), on the cores the workers parse on. ISA-L (``isal``, the python-isal package)
inflates the same stream in 1.3-2.9 us. fsspec already picks ``isal.igzip`` for ``.gz``
when it is installed, but ``IGzipFile`` loses data at a cut: a read that meets the end of
a cut-short stream raises ``EOFError`` and drops what it had inflated (up to the size
asked for: 349 of 10,022 SD records on a file cut in half, read 1 MiB at a time). molds
keeps every record before a cut and counts the cut (``truncated_input``), so this module
does not use it.

What is here is the stdlib's own design (``gzip._GzipReader``: a raw reader under
``io.BufferedReader``) around a ``decompressobj(wbits=31)``, ISA-L's when installed
(``isal.isal_zlib``, zlib's API), else zlib's. The decompressor checks each member's
header and trailer (CRC-32, length); members follow one another (``cat a.gz b.gz``,
bgzip); zero padding after a member is skipped and anything else after one is refused as
the stdlib refuses it. A stream cut short gives every byte up to the cut, then
``EOFError``, as ``gzip.GzipFile`` does. ISA-L holds back the last byte or two before a
cut (it has not the bits to finish the symbol yet, where zlib emits it), which could turn
the last complete record into the cut one, so at a cut the member is inflated once more
by zlib for those bytes (the input is read again: the rare case pays, not every read); a
stream that cannot be read again is inflated by zlib throughout.
"""

from __future__ import annotations

import gzip
import io
import zlib

try:  # ISA-L's inflate (python-isal: manylinux / macOS / Windows wheels)
    from isal import isal_zlib as _zlib
except ImportError:  # the same API and results, about 2-4x slower
    _zlib = zlib

_IN = 1 << 17  # compressed bytes read at a time (the stdlib reads 128 KiB too)
_MAGIC = b"\x1f\x8b"
_CUT = "Compressed file ended before the end-of-stream marker was reached"


def backend() -> str:
    """Which inflate runs: ``isal`` or ``zlib`` (``benchmarks/etl.py`` reports it)."""
    return "zlib" if _zlib is zlib else "isal"


class _Inflate(io.RawIOBase):
    """The decompressed bytes of a gzip stream (one member or several)."""

    def __init__(self, raw):
        self._raw = raw
        # a stream that cannot be read again cannot have its cut re-read: zlib throughout
        self._lib = _zlib if raw.seekable() else zlib
        self._rewind()

    def _rewind(self) -> None:
        self._d = self._lib.decompressobj(31)
        self._input = b""  # compressed bytes the decompressor has not taken yet
        self._pos = 0
        self._read = 0  # bytes read from the raw stream
        self._member = (0, 0)  # where the current member starts: in the raw stream, in the output
        self._tail = None  # at a cut: the bytes zlib inflates past what ISA-L gave, then EOFError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._raw.seekable()

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Back to the start (``inputs.open_at_start`` reads the head, then rewinds); nothing else."""
        target = offset if whence == io.SEEK_SET else self._pos + offset if whence == io.SEEK_CUR else None
        if target == self._pos:
            return self._pos
        if target != 0:
            raise io.UnsupportedOperation("a gzip stream rewinds to its start only")
        self._raw.seek(0)
        self._rewind()
        return 0

    def _fill(self) -> bytes:
        block = self._raw.read(_IN)
        self._read += len(block)
        return block

    def readinto(self, b) -> int:
        if not len(b):
            return 0
        if self._tail is not None:
            return self._give(b, self._from_tail(len(b)))
        while True:
            if self._d.eof and not self._next_member():
                return 0
            if not self._input:
                self._input = self._fill()
            ended = not self._input
            try:  # at the end of the input too: output held back by the size limit comes out
                out = self._d.decompress(self._input, len(b))
            except self._lib.error as exc:
                raise gzip.BadGzipFile(f"corrupt gzip data: {exc}") from None
            self._input = self._d.unconsumed_tail
            if out:
                return self._give(b, out)
            if ended and not self._d.eof:
                if not self._read:  # an empty .gz is empty, as for gzip.GzipFile
                    return 0
                if self._lib is zlib:
                    raise EOFError(_CUT)
                self._tail = self._exact_tail()
                return self._give(b, self._from_tail(len(b)))
            # a header, or a member's trailer: no output yet, go on

    def _give(self, b, out: bytes) -> int:
        b[:len(out)] = out
        self._pos += len(out)
        return len(out)

    def _from_tail(self, n: int) -> bytes:
        out, self._tail = self._tail[:n], self._tail[n:]
        if not out:
            raise EOFError(_CUT)
        return out

    def _exact_tail(self) -> bytes:
        """The bytes of the cut member past those given so far, inflated again by zlib."""
        start, began = self._member
        self._raw.seek(start)
        d, out, skip = zlib.decompressobj(31), [], self._pos - began
        block = b""
        while True:
            if not block:
                block = self._raw.read(_IN)
            try:  # a bounded piece at a time, however well the member compresses
                data = d.decompress(block, _IN * 8)
            except zlib.error as exc:
                raise gzip.BadGzipFile(f"corrupt gzip data: {exc}") from None
            if not block and not data:
                return b"".join(out)
            block = d.unconsumed_tail
            if skip >= len(data):
                skip -= len(data)
                continue
            out.append(data[skip:])
            skip = 0

    def _next_member(self) -> bool:
        """After a member: skip zero padding; True when another member follows, False at
        the end of the file. Other bytes are refused, as ``gzip.GzipFile`` refuses them."""
        rest = self._d.unused_data  # all of the input after the member (the unconsumed tail may repeat it)
        while True:
            rest = rest.lstrip(b"\0")
            if len(rest) >= len(_MAGIC):
                break
            more = self._fill()
            if not more:
                if rest:
                    raise gzip.BadGzipFile(f"Not a gzipped file ({rest!r})")
                return False
            rest += more
        if not rest.startswith(_MAGIC):
            raise gzip.BadGzipFile(f"Not a gzipped file ({rest[:2]!r})")
        self._d = self._lib.decompressobj(31)
        self._input = rest
        self._member = (self._read - len(rest), self._pos)
        return True

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


def open_gzip(raw) -> io.BufferedReader:
    """A binary file object over the gzip stream ``raw`` (any readable binary file object:
    local, fsspec, HTTP); closing it closes ``raw``."""
    return io.BufferedReader(_Inflate(raw), buffer_size=1 << 16)
