"""The map stage: raw chunks in, canonical rows out, hashed and spilled to disk by shuffle
bucket (``preprocessing.stages`` holds what follows: reduce, finalize, assemble).

Each worker process (the local engine's, or a Ray actor) builds one ``MapStage`` and hands
it the ``RawChunk``s its reader made. Per row: the label values and the conformer rank
parsed, the molecule canonicalized by RDKit (a SMILES, or the molecule RDKit read from an
SD record), its text in the manifest's representation made and checked, and every refusal
counted under its reason. Kept rows are spilled in Arrow IPC files sorted by shuffle bucket.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import numpy as np
import pyarrow as pa

from molds.chemistry import quiet_rdkit
from molds.chemistry.canonical import Canonicalizer, Molecule
from molds.data.sdf import Misaligned, SDRecordParser
from .readers import RawChunk, is_clean
from .stages import BUCKET_SHIFT, GROUP_SALT, StageOptions, Stats, hash64, spill_sorted
from .tokenizer import GRAMMARS, counts_of_codes, token_codes

_SD_BATCH = 64  # SD records one RDKit supplier reads, each canonicalized as soon as it is read
MISSING_LABELS = frozenset({"", "na", "nan", "n/a", "null", "none", "-", "?"})


class MapStage:
    """Canonicalizes raw chunks and spills rows, sorted by shuffle bucket, to disk."""

    def __init__(self, options: StageOptions, work_dir: str, name: str, spill_rows: int = 200_000):
        self.options, self.work_dir, self.name, self.spill_rows = options, work_dir, name, spill_rows
        self.canonicalize = Canonicalizer(options.chem)
        self.pairs = None  # --task: reactions or molecule pairs, each side canonicalized
        if options.pairs is not None:
            from molds.chemistry.pairs import PairCanonicalizer

            self.pairs = PairCanonicalizer(options.chem, options.pairs)
        # values read after the labels: the pair's target (--target_column), the row's split (--split_column)
        self._extras = int(options.pair_target) + int(options.split_from == "column")
        self._file_splits: dict[str, int | None] = {}
        self._sd_parser = None
        self.represent = None
        if options.representation != "smiles":
            from molds.chemistry.representation import get

            self.represent = get(options.representation, **dict(options.representation_options))
        # --conformers sd: an SD row's unit is made of the molecule read from it, coordinates and all
        self._sd_units = bool(getattr(self.represent, "from_sd", False))
        self._rank_key = options.columns.rank if options.columns else None  # --conformer_rank_by
        self.grammar = GRAMMARS[options.representation]
        self.stats = Stats()
        self.tokens = Counter()
        self.spills: list[tuple[str, np.ndarray]] = []
        self._written = 0
        self._cols = self._empty()

    def _empty(self) -> dict:
        return {k: [] for k in ("order", "raw_smiles", "canonical_smiles", "text", "scaffold", "dedupe_key",
                                "compound_id", "source", "labels", "rank", "source_smiles", "target_smiles",
                                "product", "given_split")}

    def process(self, chunk: RawChunk) -> tuple[int, int]:
        """Returns (rows, rejected) of this chunk, for progress reporting."""
        opts, stats, cols = self.options, self.stats, self._cols
        rejected_before = sum(stats.rejected.values())
        accepted = []
        sdf = chunk.kind == "sdf"
        sd_rows = self._sd_rows(chunk) if sdf else None  # pos -> its outcome, every SD record with bytes
        for pos, row in enumerate(chunk.rows):
            source = f"{chunk.path}:{row} (record {chunk.records[pos]})" if sdf else f"{chunk.path}:{row}"
            stats.rows_in += 1
            raw = chunk.smiles[pos]
            if raw is None:
                stats.reject(chunk.reasons.get(pos, "missing_field"), source, None)
                continue
            values, given = chunk.labels[pos], None
            if self._extras:
                values, extras = self._peel(values)
            if opts.split_from:
                given = self._given_split(chunk.path, extras if self._extras else [])
                if given is None:
                    stats.reject("bad_split", source, extras[-1] if opts.split_from == "column" else chunk.path)
                    continue
            if sdf:
                outcome = sd_rows[pos]
            elif self.pairs is not None:
                outcome = self._pair_row(raw, chunk.ids[pos], values, extras[0] if opts.pair_target else None)
            else:
                outcome = self._smiles_row(raw, chunk.ids[pos], values, chunk.units[pos] if chunk.units else None)
            reason, kept, repaired = outcome
            if repaired:  # an SD record read after a repair (blank lines before the header): counted
                stats.sd_repaired += 1
            if reason is not None:
                stats.reject(reason, source, kept)
                continue
            raw, mol, cid, labels, text, rank = kept
            accepted.append(((chunk.file_index << 40) | row, raw or mol.canonical, mol, cid or source, source, labels,
                             text, rank, given))
        if self.canonicalize.cxsmiles:
            stats.cxsmiles += self.canonicalize.cxsmiles
            self.canonicalize.cxsmiles = 0
        if opts.check_regex and accepted:
            accepted = self._check_regex(accepted)
        for order, raw, mol, cid, source, labels, text, rank, given in accepted:
            cols["order"].append(order)
            cols["raw_smiles"].append(raw)
            if self.pairs is not None:  # a Pair: deduplicated by its key, the pair itself
                cols["canonical_smiles"].append(mol.key)
                cols["dedupe_key"].append(mol.key)
                cols["source_smiles"].append(mol.source)
                cols["target_smiles"].append(mol.target)
                cols["product"].append(mol.product)
            else:
                cols["canonical_smiles"].append(mol.canonical)
                cols["dedupe_key"].append(mol.dedupe_key)
            cols["given_split"].append(given)
            cols["text"].append(text)
            cols["scaffold"].append(mol.scaffold)
            cols["compound_id"].append(cid)
            cols["source"].append(source)
            cols["labels"].append(labels)
            cols["rank"].append(rank)
        if len(cols["order"]) >= self.spill_rows:
            self.flush()
        return len(chunk), sum(stats.rejected.values()) - rejected_before

    def _smiles_row(self, raw: str, cid, label_values, unit=None) -> tuple:
        """One SMILES row's outcome, shaped as an SD record's (see ``_sd_rows``); ``unit``:
        the record's ``--unit_template`` fields."""
        labels = self._labels(label_values)
        if labels is False:
            return "bad_label", label_values, False
        rank = self._rank((unit or {}).get(self._rank_key)) if self._rank_key else None
        if rank is False:
            return "bad_conformer_rank", f"{self._rank_key} = {(unit or {}).get(self._rank_key)!r}", False
        mol = self.canonicalize(raw)
        if not isinstance(mol, Molecule):
            return mol, raw, False
        reason, text = self._text(mol, unit)
        if reason is not None:
            return reason, text, False
        return None, (raw, mol, cid, labels, text, rank), False

    def _peel(self, values) -> tuple:
        """(the label values, the values read after them: target, split)."""
        n = self.options.num_labels
        if values is None:  # a format without columns (.smi): nothing was read after the labels
            return None, [None] * self._extras
        return (list(values[:n]) if n else None), list(values[n:])

    def _given_split(self, path: str, extras: list) -> int | None:
        """``--split given``: the row's split (0, 1, 2), or None when nothing names one."""
        from .split import split_of_file, split_of_value

        if self.options.split_from == "column":
            return split_of_value(extras[-1])
        if path not in self._file_splits:
            self._file_splits[path] = split_of_file(path)
        return self._file_splits[path]

    def _pair_row(self, raw: str, cid, label_values, target) -> tuple:
        """One pair row's outcome, shaped as ``_smiles_row``'s, with a ``molds.chemistry.pairs.Pair`` for
        the molecule: a reaction SMILES, or (with ``--target_column``) a source and ``target``."""
        labels = self._labels(label_values)
        if labels is False:
            return "bad_label", label_values, False
        if self.options.pair_target:
            if target is not None and not isinstance(target, str):
                return "malformed_row", f"{raw} (target {target!r}: not a string)", False
            pair = self.pairs.pair(raw, target or "")
            raw = f"{raw}>>{target or ''}"
        else:
            pair = self.pairs.reaction(raw)
        if isinstance(pair, str):
            return pair, raw, False
        return None, (raw, pair, cid, labels, None, None), False

    def _rank(self, value):
        """A conformer's ``--conformer_rank_by`` number, or False when it is missing or no number."""
        parsed = parse_labels([value], self.options.decimal)
        return False if parsed is None or parsed[0] != parsed[0] else parsed[0]  # NaN: missing

    def _labels(self, values):
        """The row's labels (None without label columns), or False for a bad label."""
        if not self.options.num_labels:
            return None
        labels = parse_labels(values, self.options.decimal)
        return False if labels is None else labels

    def _text(self, mol: Molecule, unit=None) -> tuple:
        """(None, the representation's string or None for SMILES), or (reason, the example
        the report shows: the canonical SMILES, with what is wrong when the refusal says).
        ``unit``: what the input gives of the row's conformer (see ``_represent``)."""
        if self.represent is None:
            return None, None
        text, reason = self._represent(mol.canonical, unit)
        if reason is None:
            return None, text
        return reason, mol.canonical if text is None else f"{mol.canonical} ({text})"

    def _sd_rows(self, chunk: RawChunk) -> dict:
        """pos -> ``(reason, example, repaired)`` or ``(None, (raw, Molecule, id, labels,
        text), repaired)`` for every SD record of the chunk that has bytes. RDKit reads
        ``_SD_BATCH`` records through one supplier, and each molecule is canonicalized as soon
        as it is read (used and freed while in cache, as a bare RDKit loop does); when the
        supplier turns out not to have given one molecule per record, what was made of the
        batch is dropped and its records are read one at a time (``SDRecordParser.read_each``)."""
        parser = self._sd()
        readable = [pos for pos, data in enumerate(chunk.smiles) if data is not None]
        out = {}
        for start in range(0, len(readable), _SD_BATCH):
            batch = readable[start:start + _SD_BATCH]
            records, lines = [chunk.smiles[p] for p in batch], [chunk.rows[p] for p in batch]
            notes = self.stats.notes.copy()  # the representation's counts, kept only for what is kept
            try:
                done = [self._sd_row(parsed) for parsed in parser.stream(records, lines)]
            except Misaligned:
                self.stats.notes = notes
                done = [self._sd_row(parsed) for parsed in parser.read_each(records, lines)]
            out.update(zip(batch, done))
        return out

    def _sd_row(self, parsed: tuple) -> tuple:
        """One SD record's outcome (see ``_sd_rows``) from ``SDRecordParser``'s result."""
        mol, title, cid, label_values = parsed
        if isinstance(mol, str):
            return mol, title, False  # RDKit's message, the line made absolute
        repaired = title is not None
        if not all(v is None or is_clean(v) for v in (cid, *(label_values or ()))):
            # an id or label tag whose bytes are not UTF-8: refused whole, as the CSV path
            # refuses such a row (not as a bad label)
            return "non_utf8", self._sd().title(mol), repaired
        rank_value = None
        if self._rank_key:  # the parser reads the rank tag after the label tags
            *label_values, rank_value = label_values
        labels = self._labels(label_values)
        if labels is False:
            return "bad_label", label_values, repaired
        rank = self._rank(rank_value) if self._rank_key else None
        if rank is False:
            return "bad_conformer_rank", f"{self._sd().title(mol)} ({self._rank_key} = {rank_value!r})", repaired
        raw = self._sd_raw(mol)
        molecule = self.canonicalize.from_mol(mol, check_length=True, keep_mol=self._sd_units)
        if not isinstance(molecule, Molecule):
            return molecule, self._sd().title(mol), repaired
        reason, text = self._text(molecule, molecule.mol)
        molecule.mol = None  # not held past its unit
        if reason is not None:
            return reason, text, repaired
        return None, (raw, molecule, cid, labels, text, rank), repaired

    def _sd(self):
        """The SD record parser (RDKit), built at the first SD chunk."""
        if self._sd_parser is None:
            columns = self.options.columns
            tags = (columns.labels + ((columns.rank,) if columns.rank else ())) if columns else ()
            self._sd_parser = SDRecordParser(columns.id if columns else None, tags)
        return self._sd_parser

    def _sd_raw(self, mol) -> str | None:
        """``raw_smiles`` of an SD row: RDKit's SMILES of the record as read, before
        standardization; ``None`` (= the canonical SMILES) when nothing changes it."""
        chem = self.options.chem
        if chem.standardizes or not chem.keep_stereo:
            return self.canonicalize._chem.MolToSmiles(mol)
        return None

    @quiet_rdkit
    def _represent(self, canonical: str, unit=None) -> tuple[str | None, str | None]:
        """The row in the manifest's representation, decoded back and compared with its
        canonical SMILES: (text, None) or (None or what to show for the refusal, reason);
        ``unit``: the record's ``--unit_template`` fields (a dict), or the RDKit molecule read
        from an SD record with its coordinates (``--conformers sd``)."""
        if unit is None:
            text, reason = self.represent.encode(canonical)
        elif isinstance(unit, dict):
            text, reason = self.represent.encode_fields(canonical, unit)
        else:
            text, reason = self.represent.encode_mol(canonical, unit)
        if self.represent.notes:  # counts that are no refusal (conformers: mmff_unparameterized)
            self.stats.notes.update(self.represent.notes)
            self.represent.notes.clear()
        if reason is not None:
            return text, reason
        Chem = self.canonicalize._chem
        decoded = self.represent.decode(text)
        mol = Chem.MolFromSmiles(decoded) if decoded else None
        if mol is None or Chem.MolToSmiles(mol) != canonical:
            return None, f"{self.represent.name}_roundtrip"
        return text, None

    def _check_regex(self, accepted: list) -> list:
        """Reject rows whose text (canonical SMILES, or the representation's string) the
        tokenizer regex does not cover, and count the tokens of the rest, in one batch pass
        over the chunk."""
        if self.pairs is not None:  # both sides are tokenized, each alone
            tc = token_codes([side for a in accepted for side in (a[2].source, a[2].target)], self.grammar)
            both = tc.covered.reshape(-1, 2).all(axis=1)
            self.tokens.update(counts_of_codes(tc, np.repeat(both, 2)))
            for a, ok in zip(accepted, both.tolist()):
                if not ok:
                    self.stats.reject("tokenizer_roundtrip", a[4], a[1])
            return [a for a, ok in zip(accepted, both.tolist()) if ok]
        tc = token_codes([a[6] if a[6] is not None else a[2].canonical for a in accepted], self.grammar)
        covered = tc.covered.tolist()
        for a, ok in zip(accepted, covered):
            if not ok:
                self.stats.reject("tokenizer_roundtrip", a[4], a[1])
        self.tokens.update(counts_of_codes(tc, tc.covered))
        return [a for a, ok in zip(accepted, covered) if ok]

    def flush(self) -> None:
        cols = self._cols
        if not cols["order"]:
            return
        opts = self.options
        seed = opts.seed
        row_hash = hash64(cols["canonical_smiles"], seed)
        if opts.split in ("random", "given"):  # a pair's product side; a molecule
            group_src = cols["product"] if self.pairs is not None else cols["dedupe_key"]
        else:
            group_src = cols["scaffold"]
        group_hash = hash64(group_src, seed ^ GROUP_SALT)
        if opts.two_stage:
            shuffle_hash = hash64(cols["dedupe_key"], seed)
        else:
            shuffle_hash = group_hash
        table = pa.table({
            "order": pa.array(cols["order"], pa.int64()),
            "raw_smiles": pa.array(cols["raw_smiles"], pa.string()),
            "canonical_smiles": pa.array(cols["canonical_smiles"], pa.string()),
            "scaffold": pa.array(cols["scaffold"], pa.string()),
            "compound_id": pa.array(cols["compound_id"], pa.string()),
            "source": pa.array(cols["source"], pa.string()),
            "row_hash": pa.array(row_hash),
            "group_hash": pa.array(group_hash),
            "bucket": pa.array((shuffle_hash >> BUCKET_SHIFT).astype(np.uint16)),
        })
        if opts.chem.dedupe_key != "canonical":
            table = table.append_column("dedupe_key", pa.array(cols["dedupe_key"], pa.string()))
        if opts.num_labels:
            table = table.append_column("labels", pa.array(cols["labels"], pa.list_(pa.float32())))
        if self.represent is not None:
            table = table.append_column("text", pa.array(cols["text"], pa.string()))
        if self._rank_key:
            table = table.append_column("rank", pa.array(cols["rank"], pa.float64()))
        if self.pairs is not None:
            table = table.append_column("source_smiles", pa.array(cols["source_smiles"], pa.string()))
            table = table.append_column("target_smiles", pa.array(cols["target_smiles"], pa.string()))
            table = table.append_column("target_hash", pa.array(hash64(cols["target_smiles"], seed)))
        if opts.split_from:
            table = table.append_column("given_split", pa.array(cols["given_split"], pa.int8()))
        self._cols = self._empty()
        path = os.path.join(self.work_dir, f"spill-{self.name}-{self._written}.arrow")
        self._written += 1
        self.spills.append(spill_sorted(table, path))


_LABEL_MAX = 3.4028234663852886e38  # float32's largest: labels are stored as float32


def parse_labels(values: list, decimal: str = ".") -> list[float] | None:
    """Raw label values to floats; missing markers (and a NaN value) become NaN; None if any
    is garbage or not finite as the float32 it is stored as (``inf``, ``1e39``: a loss over it
    is not finite). ``decimal`` ``,``: one comma is the decimal mark, and a value with a
    ``.`` is garbage."""
    out = []
    for v in values:
        if v is None:
            out.append(math.nan)
        elif isinstance(v, (bool, int, float)):
            value = float(v)
            if abs(value) > _LABEL_MAX:
                return None
            out.append(value)
        else:
            text = str(v).strip()
            if text.lower() in MISSING_LABELS:
                out.append(math.nan)
                continue
            if decimal != ".":
                if "." in text or text.count(decimal) > 1:
                    return None
                text = text.replace(decimal, ".")
            try:
                value = float(text)
            except ValueError:
                return None
            if abs(value) > _LABEL_MAX:
                return None
            out.append(value)
    return out
