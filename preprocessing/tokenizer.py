"""SMILES tokenizers the ETL trains and saves as HuggingFace fast tokenizers.

``regex``: the atom-level SMILES regex of Schwaller et al. (2019, "Molecular
Transformer"): bracket atoms, two-letter halogens, %nn ring closures, bonds and
branches are one token each. The vocabulary comes from the corpus itself.
``bpe``: HF ``tokenizers`` byte-pair encoding trained on the corpus' canonical SMILES.
A path: an existing HF tokenizer directory, used as is.

The saved directory loads with ``transformers.AutoTokenizer.from_pretrained``. For the
regex kind the ETL encodes with ``RegexEncoder`` (plain ``re`` over a whole batch at once,
several times faster than per-string calls); tests prove it gives the same ids as the
saved HF tokenizer.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter

SMILES_REGEX = (
    r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$"
    r"|%\([0-9]+\)|%[0-9]{2}|[0-9])"
)
_TOKEN = re.compile(SMILES_REGEX)
_COVERED = re.compile(f"(?:{SMILES_REGEX})*")

# Special tokens, in id order: ids 0..5 in every tokenizer this ETL trains.
SPECIAL_TOKENS = {
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "mask_token": "<mask>",
    "sep_token": "<sep>",
}
MAX_VOCAB = 65535  # token ids are stored as uint16


def split_smiles(smiles: str) -> list[str]:
    """Atom-level tokens of one SMILES string."""
    return _TOKEN.findall(smiles)


def regex_covers(smiles: str) -> bool:
    """True when the regex tokens concatenate back to exactly ``smiles``."""
    return _COVERED.fullmatch(smiles) is not None


def count_tokens(smiles_list: list[str]) -> Counter:
    """Token frequencies of a batch: one regex pass over the joined batch."""
    return Counter(_TOKEN.findall(" ".join(smiles_list)))


def vocab_from_counts(counts: Counter) -> dict[str, int]:
    """Specials first, then tokens by falling frequency, ties by the token text."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS.values())}
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if tok not in vocab:
            vocab[tok] = len(vocab)
    if len(vocab) > MAX_VOCAB:
        raise ValueError(f"vocabulary of {len(vocab)} tokens does not fit uint16 ids")
    return vocab


def _post_processor(vocab: dict[str, int]):
    from tokenizers import processors

    bos, eos, sep = SPECIAL_TOKENS["bos_token"], SPECIAL_TOKENS["eos_token"], SPECIAL_TOKENS["sep_token"]
    return processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {sep} $B:1 {eos}:1",
        special_tokens=[(t, vocab[t]) for t in (bos, eos, sep)],
    )


def build_regex_tokenizer(vocab: dict[str, int]):
    """A ``tokenizers.Tokenizer``: regex pre-split, word-level vocabulary, exact decoding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(SMILES_REGEX), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = _post_processor(vocab)
    return tok


def train_bpe_tokenizer(smiles_iter, vocab_size: int):
    """Byte-pair encoding over the characters of canonical SMILES (HF ``tokenizers``).

    No pre-tokenizer: merges may cross atom boundaries, as in ChemBERTa's BPE; every
    character seen in the corpus is in the initial alphabet, so nothing seen is unknown.
    """
    from tokenizers import Tokenizer, decoders, models, trainers

    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        limit_alphabet=10_000,
        show_progress=False,
    )
    tok.train_from_iterator(smiles_iter, trainer=trainer)
    if tok.get_vocab_size() > MAX_VOCAB:
        raise ValueError("BPE vocabulary does not fit uint16 ids")
    tok.post_processor = _post_processor(tok.get_vocab())
    return tok


def save_tokenizer(tok, directory: str, model_max_length: int = 2048) -> None:
    """Save as a fast-tokenizer directory that ``AutoTokenizer.from_pretrained`` loads.

    Written with ``tokenizers`` alone (tokenizer.json + tokenizer_config.json), so the
    ETL does not pay for importing ``transformers``.
    """
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS.values()])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "padding_side": "right",
        **SPECIAL_TOKENS,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    with open(os.path.join(directory, "special_tokens_map.json"), "w", encoding="utf-8") as fh:
        json.dump(SPECIAL_TOKENS, fh, indent=2)


def load_external_tokenizer(path: str):
    """An existing local HF tokenizer directory, as a ``tokenizers.Tokenizer``."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"--tokenizer {path!r} is neither 'regex', 'bpe' nor an existing tokenizer directory"
        )
    fast = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(fast, "is_fast", False):
        raise ValueError(f"tokenizer at {path} is not a fast (Rust) tokenizer")
    if len(fast) > MAX_VOCAB:
        raise ValueError(f"tokenizer at {path} has {len(fast)} tokens; ids must fit uint16")
    return fast


class RegexEncoder:
    """Encodes a batch of SMILES with the regex vocabulary, in a few C-level passes.

    The batch is joined with spaces (never part of a canonical SMILES); one ``findall``
    over the whole string gives every token, and the spaces mark the molecule borders.
    """

    _BATCH_TOKEN = re.compile(SMILES_REGEX[:-1] + "| )")

    def __init__(self, vocab: dict[str, int]):
        self.vocab = dict(vocab)
        self.unk_id = vocab[SPECIAL_TOKENS["unk_token"]]
        self.itos = [None] * (max(vocab.values()) + 1)
        for tok, i in vocab.items():
            self.itos[i] = tok

    def encode_batch(self, smiles_list: list[str]):
        """Returns (flat ids as numpy uint16, lengths as numpy int32)."""
        import numpy as np

        get, unk = self.vocab.get, self.unk_id
        tokens = self._BATCH_TOKEN.findall(" ".join(smiles_list) + " ")
        ids = np.fromiter((-1 if t == " " else get(t, unk) for t in tokens), dtype=np.int64, count=len(tokens))
        borders = np.flatnonzero(ids < 0)
        lengths = np.diff(borders, prepend=-1) - 1
        return ids[ids >= 0].astype(np.uint16), lengths.astype(np.int32)

    def roundtrip_ok(self, flat, lengths, texts: list[str]):
        """Boolean mask: decoding row i's ids gives back ``texts[i]`` exactly.

        Vectorized: the decoded rows equal the texts iff the concatenations are equal
        and every row has the same character length; only on a mismatch are rows
        compared one by one.
        """
        import numpy as np

        itos = self.itos
        decoded_all = "".join([itos[i] for i in flat.tolist()])
        tok_chars = np.fromiter((len(t) if t is not None else 0 for t in itos), np.int64, count=len(itos))
        per_tok = tok_chars[flat.astype(np.int64)]
        bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        cum = np.concatenate([[0], np.cumsum(per_tok)])
        decoded_len = cum[bounds[1:]] - cum[bounds[:-1]]
        text_len = np.fromiter((len(t) for t in texts), np.int64, count=len(texts))
        ok = decoded_len == text_len
        if ok.all() and decoded_all == "".join(texts):
            return ok
        starts = np.concatenate([[0], np.cumsum(decoded_len)])
        return np.array([decoded_all[starts[i]:starts[i + 1]] == t for i, t in enumerate(texts)], dtype=bool)


class HFEncoder:
    """The same interface over any ``tokenizers.Tokenizer`` file (BPE, external)."""

    def __init__(self, tokenizer_file: str, unk_id: int | None):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(tokenizer_file)
        self.unk_id = -1 if unk_id is None else unk_id

    def encode_batch(self, smiles_list: list[str]):
        import itertools

        import numpy as np

        encs = self.tok.encode_batch(smiles_list, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) for e in encs), dtype=np.int32, count=len(encs))
        flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=np.int64, count=int(lengths.sum()))
        return flat.astype(np.uint16), lengths

    def roundtrip_ok(self, flat, lengths, texts: list[str]):
        import numpy as np

        bounds = np.concatenate([[0], np.cumsum(lengths)])
        ids = flat.tolist()
        decoded = self.tok.decode_batch([ids[bounds[i]:bounds[i + 1]] for i in range(len(texts))],
                                        skip_special_tokens=False)
        return np.fromiter((d == t for d, t in zip(decoded, texts)), dtype=bool, count=len(texts))


def make_encoder(spec: tuple):
    """``("regex", vocab)`` or ``("hf", tokenizer.json path, unk id)``; built in the worker."""
    if spec[0] == "regex":
        return RegexEncoder(spec[1])
    return HFEncoder(spec[1], spec[2])
