"""zstd inputs (``.zst``): every byte before a cut kept, and the cut said.

fsspec reads ``.zst`` through zstandard's ``stream_reader``, which ends quietly at a cut:
a CSV cut in half read as 0 of its 80,007 bytes, with no error (zstandard 0.25), so a
broken download would have been preprocessed as a smaller set. molds counts a cut
(``truncated_input``, ``--on-truncated``) as it does for gzip, bz2 and xz, whose readers
raise ``EOFError`` there. This reader does the same: zstandard's ``decompressobj`` over the
raw stream, every decoded byte handed on, ``EOFError`` when the stream ends inside a
frame. Frames may follow one another (``zstd -c a b``, pzstd's output); a frame's
checksum, when it has one, is checked by zstandard.
"""

from __future__ import annotations

import io

from .inflate import _CUT, _IN


class _Unzstd(io.RawIOBase):
    """The decompressed bytes of a zstd stream (one frame or several)."""

    def __init__(self, raw):
        import zstandard  # an optional dependency: read only for a .zst input

        self._raw = raw
        self._new = zstandard.ZstdDecompressor().decompressobj
        self._d = self._new()
        self._in_frame = False  # the current frame has taken input and not ended
        self._out, self._pos = b"", 0
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._pos >= len(self._out):
            if self._done:
                return 0
            chunk = self._raw.read(_IN)
            if not chunk:
                self._done = True
                if self._in_frame:
                    raise EOFError(_CUT)
                return 0
            self._out, self._pos = self._decode(chunk), 0
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def _decode(self, data: bytes) -> bytes:
        parts = []
        while data:
            parts.append(self._d.decompress(data))
            if self._d.eof:  # a frame ended: what follows starts the next one
                data = self._d.unused_data
                self._d, self._in_frame = self._new(), False
            else:
                data, self._in_frame = b"", True
        return b"".join(parts)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


def open_zstd(raw) -> io.BufferedReader:
    """A buffered reader of the zstd stream ``raw`` (a binary file object)."""
    return io.BufferedReader(_Unzstd(raw), buffer_size=_IN)
