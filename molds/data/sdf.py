"""SDF / MOL input: V2000 and V3000 records, streamed, every record accounted.

ChEMBL, PubChem and vendor catalogues ship structures as SD files (often gzipped, several
GB) with labels as SD properties. Two halves, so the expensive half runs in parallel:

- ``read_sd_records`` (the reader, in the driver): splits the byte stream at ``$$$$``
  lines (LF, CRLF, or a lone CR throughout, as classic Mac OS wrote them) in large blocks (a regex over each block, no per-line Python loop), keeping each
  record's first line and number. It never parses chemistry. A record larger than
  ``MAX_RECORD_BYTES`` (a file that is not SDF, or a record without its ``$$$$``) is
  skipped up to the next ``$$$$`` without being held, so memory stays bounded by the chunk
  size on any file. A compressed stream that ends early yields the partial record it cut as
  ``truncated_input``.
- ``SDRecordParser`` (in the workers): a chunk's records through RDKit's forward SD
  supplier (``Chem.ForwardSDMolSupplier`` over a ``BytesIO``: RDKit's own molblock and
  SD-property parsing), checked to give one molecule per record, else read one record at a
  time (a misread record can swallow the next one otherwise),
  the id from an SD tag or the title line, the labels from SD tags. A record RDKit refuses
  is read again unsanitized under ``rdBase.CaptureErrorLog`` to name the reason and keep
  RDKit's own message (which names the line, made absolute here).

Records travel between the two as their bytes (SD files are ASCII in their structure,
their property values may be anything); the Ray engine carries them through Arrow as
``latin-1`` text, a lossless stand-in, and turns them back into the exact bytes.
"""

from __future__ import annotations

import io
import re

from ..chemistry import quiet_rdkit

MAX_RECORD_BYTES = 8 << 20  # a larger record is refused (``record_too_large``) without being held
TITLE_TAG = "_Name"  # --id-column _Name: the record's title line (RDKit's name for it)
_BLOCK = 1 << 20
# The record separator line, found with the newline before it: a pattern that starts with a
# literal is searched for by that literal (fast), where ``^...`` under re.M is tried at every
# byte (10x slower on SD files: ~5 us a record). The line end after it is a lookahead, so that
# it can be the newline before the next separator (an empty record). ``read_sd_records``
# scans ``b"\n" + buf``, so a separator on the buffer's first line is found too.
_END = re.compile(rb"\n\$\$\$\$[ \t\r]*(?=\n)")
_TAG = re.compile(rb"^>[^<\n]*<([^>\n]*)>", re.M)  # a data header line: ">  <TAG>  (n)"
_RDKIT_LINE = re.compile(r" on line ?(\d+)")  # RDKit writes both "on line 7" and "on line7"
_PADDING = b" \t\r\n\x00\x1a"  # NUL bytes and Ctrl-Z (DOS's end of file): ``padding``, not a record
_PAD_START = (b"\x00", b"\x1a")
LEADING_BLANK_LINES = "sdf_leading_blank_lines"  # a count in the manifest: records read after dropping them


def read_sd_records(fh):
    """Yield ``(first line, record number, record bytes or None, reason or None)`` for every
    record of an SD byte stream ``fh``. ``reason`` is ``empty_record``, ``record_too_large``,
    ``padding`` (nothing but NUL bytes or Ctrl-Z; its bytes are given) or ``truncated_input``;
    a stream that ends without a final ``$$$$`` ends with that record (a single ``.mol``
    file is one). ``EOFError`` from a cut-short archive is
    re-raised after the record it cut is yielded."""
    buf = b""
    line = 1  # the line the record in ``buf`` starts on
    number = 0
    skipping = None  # the first line of an over-long record whose bytes are being dropped
    # read1: one read of the decompressor at a time. A buffered read(n) gathers n bytes over
    # several, and a cut-short archive's EOFError then throws away everything it gathered.
    read = getattr(fh, "read1", fh.read)
    ended = False
    cr_only = None  # lines ended by a lone CR (classic Mac OS files): read as LF, decided on the first bytes
    while not ended:
        try:
            block = read(_BLOCK)
        except EOFError:
            if buf.strip() or skipping is not None:
                yield (line if skipping is None else skipping), number + 1, None, "truncated_input"
            raise
        if cr_only is None:  # undecided while no LF and no CR before the last byte has come
            if b"\n" in block:
                cr_only = False
            elif b"\r" in (buf + block).rstrip(b"\r"):
                cr_only = True
                buf = buf.replace(b"\r", b"\n")  # no record came out of it yet: no LF in it
        if cr_only:
            block = block.replace(b"\r", b"\n")
        if not block:
            ended = True
            if not buf or buf.endswith(b"\n"):
                break
            block = b"\n"  # a last $$$$ line without its line end
        buf += block
        start = 0
        # the separator lines complete in this buffer, with their \n: in buf's offsets, the
        # match in ``b"\n" + buf`` starts at the separator line and ends after its \n
        for m in _END.finditer(b"\n" + buf):
            end = m.end()
            number += 1
            if skipping is not None:
                yield skipping, number, None, "record_too_large"
                skipping = None
            elif m.start() - start < 64 and not buf[start:m.start()].strip():
                yield line, number, None, "empty_record"
            elif buf[start:start + 1] in _PAD_START and not buf[start:m.start()].strip(_PADDING):
                yield line, number, buf[start:end], "padding"
            else:
                yield line, number, buf[start:end], None
            line += buf.count(b"\n", start, end)
            start = end
        buf = buf[start:]
        if len(buf) > MAX_RECORD_BYTES:  # no separator in sight: drop the bytes, remember where it began
            if skipping is None:
                skipping = line
            cut = buf.rfind(b"\n") + 1  # keep the last partial line: it may be the start of a $$$$ line,
            line += buf.count(b"\n", 0, cut)  # unless it is too long for one ("x": not a line start)
            buf = buf[cut:] if len(buf) - cut <= 16 else b"x"
    if skipping is not None:
        yield skipping, number + 1, None, "record_too_large"
    elif buf.strip() and not buf.strip(_PADDING):  # NUL bytes or Ctrl-Z after the last record
        yield line, number + 1, buf, "padding"
    elif buf.strip():
        yield line, number + 1, buf, None


def sd_tags(records: list) -> set[str]:
    """The SD tags that occur in these records (to refuse a tag that no record has)."""
    found = _TAG.findall(b"\n".join(data for data in records if data is not None))
    return {t.decode("latin-1").strip() for t in set(found)}


def resolve_tag(wanted: str, present) -> str | None:
    """``wanted`` exactly, else its unique case-insensitive match among ``present``."""
    if wanted in present:
        return wanted
    folded = [t for t in present if t.lower() == wanted.strip().lower()]
    return folded[0] if len(folded) == 1 else None


class Misaligned(Exception):
    """A supplier over several records gave more or fewer molecules than records."""


_END_OF_SUPPLY = object()


class SDRecordParser:
    """SD records (bytes) to ``(mol or reason, message, id, raw label values)`` each.

    ``message`` is RDKit's own complaint for a refused record (its line made absolute),
    else None, or ``LEADING_BLANK_LINES`` for a record read after dropping blank lines
    before its header (``title`` gives the title line); ``id`` is the id tag's value (or the title
    for ``_Name``), ``None`` when absent or empty; label values are the tags' strings, ``None`` when the record lacks one
    (missing, as in the CSV path).
    """

    def __init__(self, id_tag: str | None, label_tags: tuple[str, ...]):
        from rdkit import Chem, rdBase  # RDKit: loaded where SD records are parsed, not to split them

        self.Chem, self.rdBase = Chem, rdBase
        self.id_tag, self.label_tags = id_tag, tuple(label_tags)

    def _supplier(self, data: bytes, sanitize: bool = True):
        return self.Chem.ForwardSDMolSupplier(io.BytesIO(data), sanitize=sanitize, removeHs=sanitize)

    def _read(self, data: bytes) -> list:
        try:
            return list(self._supplier(data))
        except Exception:  # noqa: BLE001 - RDKit raises on some malformed input: refused records
            return []

    def stream(self, records: list[bytes], first_lines: list[int]):
        """The records of a batch, read by one supplier, each result handed on as soon as the
        supplier has read its molecule (so the caller uses it, and frees it, while it is in
        cache, the way a bare RDKit loop runs). The molecules are the records' when there
        are as many as records: RDKit splits at the same $$$$ lines, and a record it
        misreads can only swallow the next one (an empty record followed by another: it
        reads the next title as the empty one's counts line), never split one, so equal
        counts mean aligned. That is known only at the end: when the supplier runs out
        early, gives more molecules than records, or raises, ``Misaligned`` is raised, and
        the caller drops what it made of this batch and calls ``read_each``."""
        try:
            supplier = iter(self._supplier(b"".join(records)))
            for data, line in zip(records, first_lines):
                with self.rdBase.BlockLogs():  # not across the yield: the caller's own code keeps its log
                    mol = next(supplier)
                yield self._result(data, line, mol)
            with self.rdBase.BlockLogs():
                extra = next(supplier, _END_OF_SUPPLY)
        except Exception as exc:  # noqa: BLE001 - StopIteration (fewer molecules) or RDKit's error
            raise Misaligned from exc
        if extra is not _END_OF_SUPPLY:
            raise Misaligned

    @quiet_rdkit
    def read_each(self, records: list[bytes], first_lines: list[int]) -> list[tuple]:
        """The records of a batch, each read by a supplier of its own."""
        return [self._result(data, line, next(iter(self._read(data)), None))
                for data, line in zip(records, first_lines)]

    @quiet_rdkit
    def _result(self, data: bytes, line: int, mol) -> tuple:
        note = None
        if mol is None:
            shifted = _without_leading_blank_lines(data)
            if shifted is not None:
                mol = next(iter(self._read(shifted)), None)
                note = LEADING_BLANK_LINES if mol is not None else None
        if mol is None:
            reason, message = self._classify(data, line)
            return reason, message, None, None
        return mol, note, self._prop(mol, self.id_tag), [self._prop(mol, t) for t in self.label_tags]

    def title(self, mol) -> str:
        """The record's title line (for the report's examples of refused rows)."""
        return self._prop(mol, TITLE_TAG) or ""

    def _prop(self, mol, tag):
        if tag is None:
            return None
        name = tag if tag == TITLE_TAG else resolve_tag(tag, mol.GetPropNames())
        if name is None or not mol.HasProp(name):
            return None
        try:
            value = mol.GetProp(name)
        except UnicodeDecodeError as exc:  # bytes that are not UTF-8 in a property value: kept as
            # lone surrogates (the CSV path's surrogateescape), so the row is refused as non_utf8
            # and the report spells the bytes
            value = bytes(exc.object).decode("utf-8", "surrogateescape")
        except RuntimeError:
            return "\udcff"
        return value.strip() or None  # fixed-width writers pad values (and titles) with spaces, as CSV cells are stripped

    def _classify(self, data: bytes, first_line: int) -> tuple[str, str]:
        """Why RDKit refused a record: a second, unsanitized read under a log capture."""
        Chem = self.Chem
        with self.rdBase.CaptureErrorLog() as capture:
            try:
                raw = next(iter(self._supplier(data, sanitize=False)), None)
            except Exception:  # noqa: BLE001
                raw = None
            if raw is None:
                return "sdf_parse_error", _message(capture.messages, first_line)
            try:
                Chem.SanitizeMol(raw)
            except Chem.AtomValenceException:
                return "valence_error", _message(capture.messages, first_line)
            except Chem.KekulizeException:
                return "kekulize_error", _message(capture.messages, first_line)
            except Exception:  # noqa: BLE001
                return "sanitize_error", _message(capture.messages, first_line)
        return "sanitize_error", _message(capture.messages, first_line)


def _without_leading_blank_lines(data: bytes) -> bytes | None:
    """A record with blank lines before its three header lines (writers that put an empty
    line after each ``$$$$``), without them; None when it has none, or when dropping them
    does not put a V2000 / V3000 counts line on line 4. Only a record RDKit refused is
    tried: a blank title line on its own is valid and read as it is."""
    if not data.startswith((b"\n", b"\r\n")):
        return None
    lines = data.split(b"\n", 64)
    for i in range(4, min(len(lines), 64)):
        if lines[i].rstrip().endswith((b"V2000", b"V3000")):
            k = i - 3  # the counts line is the header's fourth line
            if any(ln.strip() for ln in lines[:k]):
                return None
            return b"\n".join(lines[k:])
    return None


def _message(log: str, first_line: int) -> str:
    """RDKit's first error line without its time stamp, 'on line N' made a line of the file."""
    lines = [ln.split("] ", 1)[-1].strip() for ln in (log or "").splitlines() if ln.strip()]
    lines = [ln for ln in lines if "moving to the beginning of the next molecule" not in ln]
    if not lines:
        return "RDKit could not read the record"
    return _RDKIT_LINE.sub(lambda m: f" on line {first_line + int(m.group(1)) - 1}", lines[0])
