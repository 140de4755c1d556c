"""Length-grouped, token-budget batches for encoders, property prediction and the
encoder-decoder's pairs.

Molecules are gathered in pools of ``pool_size``, sorted by length, cut into batches
whose padded size (rows x longest; for pairs, rows x (longest source + longest target))
stays within ``max_tokens_per_batch``, and the
batches of a pool are emitted in a seeded random order: HuggingFace's length-grouped
sampler, with a token budget instead of a fixed count. ``fixed_shape`` gives every
batch ``batch_size`` rows padded (or truncated) to ``fixed_length``, as a pipeline
engine needs.

MLM masking (BERT: 15 % of molecule tokens; 80 % <mask>, 10 % random, 10 % kept; never
BOS/EOS/padding) is drawn from a generator seeded by (seed, step, virtual rank), so a
resumed run masks exactly as an uninterrupted one.
"""

from __future__ import annotations

import numpy as np

from ..chemistry.tokens import IGNORE_INDEX
from .plan import _rng


class Bucketer:
    def __init__(self, source, *, max_tokens_per_batch: int, pool_size: int, max_length: int,
                 fixed_shape: bool = False, batch_size: int = 32, fixed_length: int = 0, too_long: str = "truncate"):
        self.source, self.max_tokens, self.pool_size = source, max_tokens_per_batch, pool_size
        self.max_length = max_length
        self.fixed_shape, self.batch_size = fixed_shape, batch_size
        self.fixed_length = fixed_length or max_length
        self.too_long = too_long
        self.truncated = 0
        self.truncated_tokens = 0
        self.rejected = 0
        if not fixed_shape and max_tokens_per_batch < max_length:
            raise ValueError(f"data.max_tokens_per_batch ({max_tokens_per_batch}) is smaller than "
                             f"data.max_length ({max_length}): a longest molecule would not fit a batch")

    def _length(self, gid: int) -> int:
        unit, row = self.source.molecule(gid)
        a, b = unit.span(row)
        return b - a

    def _encoder_width(self, gid: int) -> int:
        """A pair's encoder row, ``<bos> source <eos>``: its prompt's length (``<bos> source
        <sep>``); the decoder's row is the rest of the pair."""
        unit, row = self.source.molecule(gid)
        return int(unit.prompt[row])

    def make_batches(self, gids: np.ndarray, seed_key: tuple) -> list[np.ndarray]:
        """One pool of gids -> batches of gids, in the order they are to be emitted."""
        limit = self.fixed_length if self.fixed_shape else self.max_length
        lengths = np.array([self._length(g) for g in gids.tolist()], dtype=np.int64)
        too_long = lengths > limit
        if too_long.any():
            if self.too_long == "reject":
                self.rejected += int(too_long.sum())
                gids, lengths = gids[~too_long], lengths[~too_long]
            else:
                self.truncated += int(too_long.sum())
                self.truncated_tokens += int((lengths[too_long] - limit).sum())
                lengths = np.minimum(lengths, limit)
        order = np.argsort(lengths, kind="stable")
        gids, lengths = gids[order], lengths[order]
        batches = []
        if self.fixed_shape:
            batches = [gids[i:i + self.batch_size] for i in range(0, len(gids), self.batch_size)]
        elif self.source.pairs:  # two padded rows each: rows x (longest source + longest target)
            enc = np.array([self._encoder_width(g) for g in gids.tolist()], dtype=np.int64)
            start, widest_enc, widest_dec = 0, 0, 0
            for i in range(len(gids)):
                e, d = max(widest_enc, enc[i]), max(widest_dec, lengths[i] - enc[i])
                if (i - start + 1) * (e + d) > self.max_tokens:
                    batches.append(gids[start:i])
                    start, e, d = i, enc[i], lengths[i] - enc[i]
                widest_enc, widest_dec = e, d
            if start < len(gids):
                batches.append(gids[start:])
        else:
            start = 0
            for i in range(len(gids)):
                if (i - start + 1) * lengths[i] > self.max_tokens:
                    batches.append(gids[start:i])
                    start = i
            if start < len(gids):
                batches.append(gids[start:])
        perm = _rng(*seed_key).permutation(len(batches))
        return [batches[i] for i in perm]

    def collate(self, gids: np.ndarray, mlm: dict | None, mask_key: tuple, with_labels: bool) -> dict:
        if self.source.pairs:
            return self.collate_pairs(gids)
        limit = self.fixed_length if self.fixed_shape else self.max_length
        pieces = []
        for gid in gids.tolist():
            unit, row = self.source.molecule(gid)
            a, b = unit.span(row)
            pieces.append((unit, row, unit.tokens[a:min(b, a + limit)]))
        width = self.fixed_length if self.fixed_shape else max(len(p[2]) for p in pieces)
        rows = self.batch_size if self.fixed_shape else len(pieces)
        pad = self.source.pad_id
        input_ids = np.full((rows, width), pad, dtype=np.int64)
        attention = np.zeros((rows, width), dtype=np.int64)
        for i, (_, _, toks) in enumerate(pieces):
            input_ids[i, :len(toks)] = toks
            attention[i, :len(toks)] = 1
        real = int(attention.sum())
        out = {"input_ids": input_ids, "attention_mask": attention, "gids": np.asarray(gids, np.int64),
               "stats": {"tokens": rows * width, "real_tokens": real, "molecules": len(pieces),
                         "length_sq_sum": int((attention.sum(1) ** 2).sum()),
                         "padding_ratio": 1.0 - real / (rows * width)}}
        if with_labels:
            width_l = pieces[0][0].labels.shape[1] if pieces else 0
            labels = np.full((rows, width_l), np.nan, dtype=np.float32)
            for i, (unit, row, _) in enumerate(pieces):
                labels[i] = unit.labels[row]
            out["labels"] = np.nan_to_num(labels, nan=0.0)
            out["label_mask"] = ~np.isnan(labels)
        if pieces and pieces[0][0].features is not None:
            features = np.zeros((rows, pieces[0][0].features.shape[1]), dtype=np.float32)
            for i, (unit, row, _) in enumerate(pieces):
                features[i] = unit.features[row]
            out["features"] = features
        if mlm is not None and mlm.get("span_mean"):
            return denoising_batch([p[2] for p in pieces], out, mask_key, pad=self.source.pad_id, **mlm)
        if mlm is not None:
            out.update(mask_tokens(input_ids, attention, mask_key, **mlm))
            out["stats"]["mlm_tokens"] = real  # the MLM head reads every token of a masked batch
        return out

    def collate_pairs(self, gids: np.ndarray) -> dict:
        """Pairs for the encoder-decoder (``encoder_decoder_batch``): the encoder reads
        ``<bos> source <eos>``, the decoder ``<bos> target`` scored on ``target <eos>``. Each row
        of the source is ``<bos> source <sep> target <eos>`` with its prompt length."""
        bos, eos = self.source.bos_id, self.source.eos_id
        sources, targets = [], []
        for gid in gids.tolist():
            unit, row = self.source.molecule(gid)
            a, b = unit.span(row)
            p = int(unit.prompt[row])
            sources.append(np.concatenate([[bos], unit.tokens[a + 1:a + p - 1], [eos]]))
            targets.append(np.concatenate([[bos], unit.tokens[a + p:b]]))  # the target and its EOS
        return encoder_decoder_batch(sources, targets, gids, self.source.pad_id)


def mask_tokens(input_ids: np.ndarray, attention: np.ndarray, key: tuple, *, probability: float, mask_id: int,
                vocab_size: int, first_regular_id: int, special_ids: tuple) -> dict:
    """BERT masking, deterministic in ``key``. Returns masked ``input_ids`` and ``mlm_labels``."""
    rng = _rng(*key)
    candidates = attention.astype(bool) & ~np.isin(input_ids, np.asarray(special_ids))
    chosen = candidates & (rng.random(input_ids.shape) < probability)
    labels = np.where(chosen, input_ids, IGNORE_INDEX)
    roll = rng.random(input_ids.shape)
    masked = input_ids.copy()
    masked[chosen & (roll < 0.8)] = mask_id
    random_pos = chosen & (roll >= 0.8) & (roll < 0.9)
    masked[random_pos] = rng.integers(first_regular_id, vocab_size, size=int(random_pos.sum()))
    return {"input_ids": masked, "mlm_labels": labels}


def span_mask(tokens: np.ndarray, rng, *, probability: float, span_mean: float, special_ids) -> np.ndarray:
    """bool [len(tokens)]: the tokens BART's text infilling hides in one molecule. Spans of
    Poisson(``span_mean``) tokens (at least one) start at random molecule tokens (never BOS, EOS
    or another special token) until ``round(probability x molecule tokens)`` are hidden; the
    last span is cut to that count, and spans may meet or overlap."""
    candidates = np.flatnonzero(~np.isin(tokens, np.asarray(special_ids)))
    want = int(round(len(candidates) * probability))
    hidden = np.zeros(len(tokens), dtype=bool)
    placed = tries = 0
    while placed < want and tries < 16 * len(candidates):  # bounded: each try hides at least its start, or meets
        tries += 1
        length = max(1, int(rng.poisson(span_mean)))
        start = int(rng.integers(0, len(candidates)))
        for pos in candidates[start:start + length].tolist():
            if placed == want:
                break
            if not hidden[pos]:
                hidden[pos] = True
                placed += 1
    return hidden


def denoising_batch(molecules: list, plain: dict, key: tuple, *, probability: float, span_mean: float, mask_id: int,
                    special_ids, pad: int, **_) -> dict:
    """Denoising pairs of molecules (``BOS t1 .. tn EOS`` each) for the encoder-decoder, right
    padded: the encoder reads the molecule with each run of hidden tokens replaced by one
    ``<mask>`` (``span_mask``), the decoder reads ``BOS t1 .. tn`` and is scored on ``t1 .. tn
    EOS``. Drawn from a generator seeded by ``key`` (seed, step, virtual rank), so a resumed run
    masks as an uninterrupted one does."""
    rng = _rng(*key)
    sources = []
    for toks in molecules:
        toks = np.asarray(toks, dtype=np.int64)
        hidden = span_mask(toks, rng, probability=probability, span_mean=span_mean, special_ids=special_ids)
        starts = hidden & ~np.concatenate([[False], hidden[:-1]])  # the first token of each hidden run
        src = np.where(starts, mask_id, toks)[~hidden | starts]
        sources.append(src)
    return encoder_decoder_batch(sources, molecules, plain["gids"], pad)


def encoder_decoder_batch(sources: list, targets: list, gids, pad: int) -> dict:
    """Right-padded encoder-decoder rows: ``input_ids`` and ``attention_mask`` from each source
    (its tokens as the encoder reads them), ``decoder_input_ids`` each target but its last
    token, ``labels`` each target but its first (IGNORE on padding). Statistics: tokens with
    padding, real tokens, and what the model's FLOPs count (``Seq2SeqModel.flops_coefficients``):
    source and target tokens, the sum of s^2 (encoder attention) and the sum of t^2 + t s
    (decoder self- and cross-attention)."""
    rows = len(sources)
    s_w = max(len(x) for x in sources)
    t_w = max(len(t) for t in targets) - 1
    input_ids = np.full((rows, s_w), pad, dtype=np.int64)
    attention = np.zeros((rows, s_w), dtype=np.int64)
    decoder_input_ids = np.full((rows, t_w), pad, dtype=np.int64)
    labels = np.full((rows, t_w), IGNORE_INDEX, dtype=np.int64)
    for i, (src, tgt) in enumerate(zip(sources, targets)):
        input_ids[i, :len(src)] = src
        attention[i, :len(src)] = 1
        decoder_input_ids[i, :len(tgt) - 1] = tgt[:-1]
        labels[i, :len(tgt) - 1] = tgt[1:]
    s_len, t_len = attention.sum(1), (labels != IGNORE_INDEX).sum(1)
    real = int(s_len.sum() + t_len.sum())
    total = rows * (s_w + t_w)
    return {"input_ids": input_ids, "attention_mask": attention, "decoder_input_ids": decoder_input_ids,
            "labels": labels, "gids": np.asarray(gids, np.int64),
            "stats": {"tokens": total, "real_tokens": real, "molecules": rows,
                      "source_tokens": int(s_len.sum()), "target_tokens": int(t_len.sum()),
                      "source_sq_sum": int((s_len ** 2).sum()), "decoder_sq_sum": int((t_len ** 2 + t_len * s_len).sum()),
                      "padding_ratio": 1.0 - real / total}}
