"""Randomized-SMILES augmentation in the data plane (``data.randomized_smiles``).

Arus-Pous et al. (2019, J. Cheminform. 11:71) showed that a SMILES language model trained
on a new randomized SMILES of each molecule every epoch generalizes better than one trained
on the canonical string: it cannot learn a molecule by heart from one fixed spelling. Their
"restricted" form (atoms renumbered at random, then RDKit's ordinary non-canonical writer,
which keeps RDKit's branch preferences) is the one they recommend and the one built here.

The manifest stays the data contract (canonical SMILES, tokenized once by the ETL): a
randomized molecule is written and tokenized when its row group is loaded, with the
manifest's own tokenizer. Which molecules are rewritten, and the atom order of each, comes
from (seed, epoch, shard, row group, row), so it does not depend on ranks or workers and a
resume reads exactly the batches an uninterrupted run reads.

RDKit writes and the tokenizers library encodes; what is done here is only the choice and
the splice into the loaded unit's flat token array.

Written at load, a randomized molecule costs the training process ~0.2 ms of RDKit and
tokenizer time; on a 2-core CPU recipe that is several per cent of every step, spent on
the cores that train. ``molds-preprocess --randomized-variants K`` writes K randomized
spellings of every training molecule once, tokenized, into the shards
(``randomized_token_ids``); the loader then only picks one (``data.randomized_from``):
molecule m in epoch e reads variant (offset_m + e) mod K, offset_m drawn from (seed, shard,
row group, row), so a molecule meets K different spellings before any repeats.
"""

from __future__ import annotations

import sys

import fsspec
import numpy as np
import pyarrow.compute as pc
from rdkit import Chem, rdBase
from tokenizers import Tokenizer

from ..errors import ManifestError
from .plan import Unit, _rng

_SALT = 0x5A11E5
_VARIANT_SALT = 0x5A11E6
#: the column ``molds-preprocess --randomized-variants`` writes: per molecule, K token lists
VARIANTS_COLUMN = "randomized_token_ids"
#: a manifest whose molecules the randomizer mostly cannot rewrite (RDKit or the vocabulary
#: refuses them) is refused rather than trained on canonically without anyone noticing:
#: more than this many fallbacks in one process, and more than this fraction of its choices
MAX_FALLBACKS, MAX_FALLBACK_FRACTION = 100, 0.01


def _parse(smiles: str):
    """``smiles`` as an RDKit molecule ready to write, or None. The input is a canonical
    SMILES (RDKit's own output), so full sanitization would only recompute what the string
    states: without stereo marks, the ring and valence caches are enough for the writer and
    give the same strings at ~4x the speed of ``MolFromSmiles`` (checked against it in
    tests/data/test_randomized_variants.py). With stereo marks (``@ / \\``), RDKit's stereo
    perception needs the sanitized molecule, so those take the full path."""
    with rdBase.BlockLogs():  # RDKit's notes on the training log, once per spelling ("not removing hydrogen
        # atom without neighbors" for each salt's [H+]), say nothing the ETL did not; an unreadable one counts
        if "@" in smiles or "/" in smiles or "\\" in smiles:
            mol = Chem.MolFromSmiles(smiles)
        else:
            mol = Chem.MolFromSmiles(smiles, sanitize=False)
            if mol is not None:
                try:
                    mol.UpdatePropertyCache(strict=True)
                    Chem.FastFindRings(mol)
                except Exception:  # RDKit's valence errors: let the full parser decide
                    mol = Chem.MolFromSmiles(smiles)
    if mol is None or mol.GetNumAtoms() == 0:
        return None
    return mol


def restricted_variants(smiles: str, seeds=None, *, rng=None, count: int = 0) -> list[str | None]:
    """Restricted randomized SMILES of ``smiles`` (atoms renumbered by a random permutation,
    then RDKit's non-canonical writer): one per seed in ``seeds`` (the permutation drawn from
    that seed), or ``count`` drawn from ``rng``; all None if RDKit cannot read it. The
    molecule is parsed once for all of them."""
    n_out = len(seeds) if seeds is not None else count
    mol = _parse(smiles)
    if mol is None:
        return [None] * n_out
    n = mol.GetNumAtoms()
    orders = ([np.random.default_rng(int(s)).permutation(n) for s in seeds] if seeds is not None
              else [rng.permutation(n) for _ in range(count)])
    return [Chem.MolToSmiles(Chem.RenumberAtoms(mol, o.tolist()), canonical=False) for o in orders]


def randomized_smiles(smiles: str, seed: int) -> str | None:
    """A restricted randomized SMILES of ``smiles`` (None if RDKit cannot read it)."""
    return restricted_variants(smiles, [seed])[0]


class Randomizer:
    """Rewrites a fraction of a loaded unit's molecules as randomized SMILES."""

    def __init__(self, probability: float, seed: int, tokenizer_path: str, *, bos_id: int, eos_id: int,
                 unk_id: int | None, marker_id: int | None, stored: int = 0, vocab_size: int | None = None):
        if not 0.0 < probability <= 1.0:
            raise ValueError(f"randomized SMILES probability must be in (0, 1], got {probability}")
        self.probability, self.seed = float(probability), int(seed)
        self.tokenizer_file = tokenizer_path.rstrip("/") + "/tokenizer.json"  # local path or fsspec URI
        self.bos_id, self.eos_id, self.unk_id, self.marker_id = bos_id, eos_id, unk_id, marker_id
        self.stored = int(stored)  # K variants per molecule in the shards (0: written here with RDKit)
        self.vocab_size = vocab_size
        self._tokenizer = None
        self.rewritten = 0  # molecules read in a randomized form (loads of this process)
        self.fallbacks = 0  # chosen molecules kept canonical: RDKit or the vocabulary could not take them
        self._last_fallback = ""  # where the latest of them was, for the error past the bound

    @property
    def column(self) -> str:
        """The shard column a unit's rewrite reads."""
        return VARIANTS_COLUMN if self.stored else "canonical_smiles"

    def __getstate__(self):  # DataLoader workers open their own tokenizer
        state = dict(self.__dict__)
        state["_tokenizer"] = None
        return state

    def _encode(self, strings: list[str]) -> list[list[int]]:
        if self._tokenizer is None:
            with fsspec.open(self.tokenizer_file, "r", encoding="utf-8") as fh:
                self._tokenizer = Tokenizer.from_str(fh.read())
        return [e.ids for e in self._tokenizer.encode_batch(strings, add_special_tokens=False)]

    def choose(self, unit: Unit, epoch: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows to rewrite, atom-order seed of each) for one unit in one epoch."""
        rng = _rng(self.seed, epoch, _SALT, unit.shard, unit.row_group)
        draw = rng.random(n)
        seeds = rng.integers(0, 2**63 - 1, n, dtype=np.int64)
        rows = np.flatnonzero(draw < self.probability)
        return rows, seeds[rows]

    def rewrite(self, unit: Unit, epoch: int, tokens: np.ndarray, offsets: np.ndarray, column, where: str = ""):
        """``tokens``/``offsets`` (BOS .. EOS per molecule, back to back) with the chosen
        molecules replaced by BOS [marker] randomized tokens EOS. ``column`` is the unit's
        ``self.column``: canonical SMILES (a list of str) or the stored variants (a pyarrow
        list<list<int>> array); ``where`` names the shard in errors."""
        n = len(offsets) - 1
        rows, seeds = self.choose(unit, epoch, n)
        if len(rows) == 0:
            return tokens, offsets
        if self.stored:
            pieces = self._stored_pieces(unit, epoch, rows, column, where)
        else:
            pieces = self._written_pieces(unit, rows, seeds, column)
        self.rewritten += len(pieces)
        self._check_bound()
        if not pieces:
            return tokens, offsets
        parts = [pieces[i] if i in pieces else tokens[offsets[i]:offsets[i + 1]] for i in range(n)]
        lengths = np.fromiter((len(p) for p in parts), np.int64, n)
        return np.concatenate(parts).astype(np.int32, copy=False), np.concatenate([[0], np.cumsum(lengths)])

    def _head(self) -> list[int]:
        return [self.bos_id] + ([self.marker_id] if self.marker_id is not None else [])

    def _written_pieces(self, unit: Unit, rows: np.ndarray, seeds: np.ndarray, canonical: list) -> dict:
        texts, kept = [], []
        for row, seed in zip(rows.tolist(), seeds.tolist()):
            text = randomized_smiles(canonical[row], seed) if canonical[row] else None
            if text is None:
                self._fallback(unit, row, canonical[row], "RDKit cannot read it")
                continue
            texts.append(text)
            kept.append(row)
        head = self._head()
        pieces = {}
        for row, text, ids in zip(kept, texts, self._encode(texts)):
            if not ids or (self.unk_id is not None and self.unk_id in ids):
                self._fallback(unit, row, canonical[row], f"its randomized form {text!r} has tokens outside the "
                                                          f"vocabulary")
                continue
            pieces[row] = np.asarray(head + ids + [self.eos_id], np.int32)
        return pieces

    def _stored_pieces(self, unit: Unit, epoch: int, rows: np.ndarray, variants, where: str) -> dict:
        """Variant (offset + epoch) mod K of each chosen row, from the shard's column."""
        k, n = self.stored, len(variants)
        counts = pc.list_value_length(variants).fill_null(-1).to_numpy(zero_copy_only=False)
        if not np.array_equal(counts, np.full(n, k)):
            raise ManifestError(f"{where}: row group {unit.row_group}: column {VARIANTS_COLUMN} does not hold "
                                f"{k} variants in every row, as the manifest says")
        inner = variants.flatten()  # n x k token lists, row-major
        lengths = pc.list_value_length(inner).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        flat = inner.flatten().to_numpy(zero_copy_only=False)
        if self.vocab_size is not None and len(flat) and int(flat.max()) >= self.vocab_size:
            raise ManifestError(f"{where}: row group {unit.row_group}: column {VARIANTS_COLUMN} holds token id "
                                f"{int(flat.max())}, outside the tokenizer's {self.vocab_size} ids")
        starts = np.concatenate([[0], np.cumsum(lengths)])
        offset = _rng(self.seed, _VARIANT_SALT, unit.shard, unit.row_group).integers(0, k, n)
        head, pieces = np.asarray(self._head(), np.int32), {}
        for row in rows.tolist():
            j = row * k + (int(offset[row]) + epoch) % k
            ids = flat[starts[j]:starts[j + 1]]
            if len(ids) == 0:  # the ETL could not write this spelling (it counted it)
                self._fallback(unit, row, "", f"variant {(int(offset[row]) + epoch) % k} is empty in the shard")
                continue
            pieces[row] = np.concatenate([head, ids.astype(np.int32), [self.eos_id]]).astype(np.int32)
        return pieces

    def _fallback(self, unit: Unit, row: int, smiles: str, why: str) -> None:
        self.fallbacks += 1
        if self.fallbacks <= 5:
            print(f"[molds] data.randomized_smiles: row {unit.first_row + row} of shard #{unit.shard} is read in "
                  f"its canonical form ({smiles!r}): {why} ({self.fallbacks} so far in this process)",
                  file=sys.stderr)
        self._last_fallback = f"row {unit.first_row + row} of shard #{unit.shard}, {smiles!r}: {why}"

    def _check_bound(self) -> None:
        """Once per unit, after its rewrites are counted (a check inside the unit's loop would
        see its failures before its successes)."""
        chosen = self.rewritten + self.fallbacks
        if self.fallbacks > MAX_FALLBACKS and self.fallbacks > MAX_FALLBACK_FRACTION * chosen:
            raise ManifestError(
                f"data.randomized_smiles: {self.fallbacks} of the {chosen} molecules chosen so far could not be "
                f"rewritten (last: {self._last_fallback}); more than {MAX_FALLBACK_FRACTION:.0%} means the "
                f"manifest's tokenizer ({self.tokenizer_file}) does not fit randomized SMILES: set "
                f"data.randomized_smiles to 0 or rebuild the manifest")
