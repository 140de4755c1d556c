"""SMILES (and SELFIES, SAFE) tokenizers the ETL trains and saves as HuggingFace fast tokenizers.

``regex``: the atom-level SMILES regex of Schwaller et al. (2019, "Molecular
Transformer"): bracket atoms, two-letter halogens, %nn ring closures, bonds and
branches are one token each (SAFE strings too: their attachment points are ring-closure
digits); for SELFIES one token per bracket symbol. The vocabulary comes from the corpus itself.
``bpe``: HF ``tokenizers`` byte-pair encoding trained on the corpus' canonical SMILES.
A path: an existing HF tokenizer directory, used as is.

The saved directory loads with ``transformers.AutoTokenizer.from_pretrained``. For the
regex kind the ETL counts and encodes whole batches with ``token_codes`` (one C-level
substitution of the multi-character tokens, then numpy over one code per token: ~5x the
speed of ``re.findall`` with a dict lookup per token, which made ~60M Python strings on
MOSES); tests prove it gives the tokens of ``split_smiles`` and the ids of the saved HF
tokenizer.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from typing import NamedTuple

import numpy as np

from molds.chemistry.representation import CONFORMER_PATTERN, SELFIES_PATTERN, SMILES_PATTERN as SMILES_REGEX

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


# Batch tokenizing. Every regex token but the ``multi`` ones is one ASCII character;
# ``token_codes`` replaces each multi-character token with a private-use character (one per
# distinct token in the batch), so afterwards one character is one token. At any position the
# alternatives of ``multi`` and of the pattern that can start there are tried in the same
# order, so the tokens are those of ``findall``; a bracket token may not hold the space that
# joins the batch (canonical SMILES and SELFIES never do), so no token spans two rows.
_PLACEHOLDER = 0xF0000  # first code point of Unicode's supplementary private use area A
_LAST_PLACEHOLDER = 0x10FFFF  # the last code point
_PRIVATE = re.compile("[\U000F0000-\U0010FFFF]")


class Grammar(NamedTuple):
    """A token regex (``pattern``) with its multi-character alternatives (``multi``, in the
    pattern's order) and a table of the ASCII characters that are tokens alone."""

    pattern: str
    token: re.Pattern
    multi: re.Pattern
    single: np.ndarray

    @classmethod
    def of(cls, pattern: str, multi: str) -> "Grammar":
        token = re.compile(pattern)
        single = np.array([ch != 32 and token.fullmatch(chr(ch)) is not None for ch in range(128)])
        return cls(pattern, token, re.compile(multi), single)


SMILES = Grammar.of(SMILES_REGEX, r"\[[^\] ]+]|%\([0-9]+\)|%[0-9]{2}|Br|Cl")  # SMILES and SAFE
SELFIES = Grammar.of(SELFIES_PATTERN, r"\[[^\] ]+]")
CONFORMER = Grammar.of(CONFORMER_PATTERN, SMILES.multi.pattern)  # SMILES, tags, numbers, ',' and ';'
GRAMMARS = {"smiles": SMILES, "safe": SMILES, "selfies": SELFIES, "conformer": CONFORMER}


class _OutOfPlaceholders(Exception):
    pass


class TokenCodes(NamedTuple):
    """One code per token of a batch: an ASCII code point for a one-character token, else
    ``_PLACEHOLDER + k`` for ``multi[k]``; characters no token covers are left out, as
    ``findall`` skips them."""

    codes: np.ndarray  # uint32, all rows' tokens back to back
    lengths: np.ndarray  # int32 tokens per row
    covered: np.ndarray  # bool per row: its tokens concatenate back to the whole text
    multi: list


def token_codes(texts: list[str], grammar: Grammar = SMILES) -> TokenCodes:
    """The regex tokens of every text, as codes (see ``TokenCodes``)."""
    if not texts:
        return TokenCodes(np.zeros(0, np.uint32), np.zeros(0, np.int32), np.zeros(0, bool), [])
    joined = " ".join(texts)
    if joined.count(" ") != max(0, len(texts) - 1) or _PRIVATE.search(joined):
        return _token_codes_per_row(texts, grammar)  # a space or private-use character: not for the fast path
    multi: dict[str, str] = {}

    def placeholder(m):
        tok = m.group()
        ch = multi.get(tok)
        if ch is None:
            if len(multi) > _LAST_PLACEHOLDER - _PLACEHOLDER:
                raise _OutOfPlaceholders
            ch = multi[tok] = chr(_PLACEHOLDER + len(multi))
        return ch

    try:
        substituted = grammar.multi.sub(placeholder, joined)
    except _OutOfPlaceholders:  # over 131,072 distinct multi-character tokens in one batch
        return _token_codes_per_row(texts, grammar)
    cp = np.frombuffer((substituted + " ").encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    border = cp == 32
    keep = border | (cp >= _PLACEHOLDER) | grammar.single[np.minimum(cp, 127)] & (cp < 128)
    row_of = np.cumsum(border) - border  # row index of every character
    dropped = np.bincount(row_of[~keep], minlength=len(texts))[:len(texts)]
    cp, border = cp[keep], border[keep]
    lengths = np.diff(np.flatnonzero(border), prepend=-1) - 1
    return TokenCodes(cp[~border], lengths.astype(np.int32), dropped == 0, list(multi))


def _token_codes_per_row(texts: list[str], grammar: Grammar = SMILES) -> TokenCodes:
    multi: dict[str, int] = {}
    codes, lengths, covered = [], [], []
    for text in texts:
        toks = grammar.token.findall(text)
        for t in toks:
            codes.append(ord(t) if len(t) == 1 else _PLACEHOLDER + multi.setdefault(t, len(multi)))
        lengths.append(len(toks))
        covered.append(sum(map(len, toks)) == len(text))
    return TokenCodes(np.array(codes, dtype=np.uint32), np.array(lengths, dtype=np.int32),
                      np.array(covered, dtype=bool), list(multi))


def counts_of_codes(tc: TokenCodes, rows: np.ndarray | None = None) -> Counter:
    """Token frequencies of a ``token_codes`` batch (only the rows where ``rows`` is true)."""
    codes = tc.codes if rows is None else tc.codes[np.repeat(rows, tc.lengths)]
    values, counts = np.unique(codes, return_counts=True)
    return Counter({(chr(v) if v < _PLACEHOLDER else tc.multi[v - _PLACEHOLDER]): int(c)
                    for v, c in zip(values.tolist(), counts.tolist())})


def count_tokens(smiles_list: list[str], grammar: Grammar = SMILES) -> Counter:
    """Token frequencies of a batch."""
    return counts_of_codes(token_codes(smiles_list, grammar))


def vocab_from_counts(counts: Counter, extra=(), base: dict[str, int] | None = None) -> dict[str, int]:
    """Specials first (or the ``base`` vocabulary, its ids unchanged), then the tokens not yet
    in it by falling frequency, ties by the token text, then the ``extra`` tokens not counted,
    in text order."""
    vocab = dict(base) if base is not None else {tok: i for i, tok in enumerate(SPECIAL_TOKENS.values())}
    following = max(vocab.values(), default=-1) + 1
    for tok in [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))] + sorted(extra):
        if tok not in vocab:
            vocab[tok] = following
            following += 1
    if following > MAX_VOCAB:
        raise ValueError(f"vocabulary of {following} tokens does not fit uint16 ids")
    return vocab


def regex_vocabulary(path: str) -> tuple[dict[str, int], str] | None:
    """(token -> id, the splitting pattern) of the tokenizer directory ``path`` when molds' ETL
    wrote it with the regex kind (a word-level vocabulary split by one of ``GRAMMARS``'
    patterns, every special token at its usual id), which a new corpus can extend; None for
    any other tokenizer (BPE, a Hugging Face model's)."""
    try:
        with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as fh:
            spec = json.load(fh)
    except (OSError, ValueError):
        return None
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    pattern = (pre.get("pattern") or {}).get("Regex") if pre.get("type") == "Split" else None
    vocab = model.get("vocab")
    if model.get("type") != "WordLevel" or not isinstance(vocab, dict) or pattern is None:
        return None
    if any(vocab.get(tok) != i for i, tok in enumerate(SPECIAL_TOKENS.values())):
        return None
    return (vocab, pattern) if any(g.pattern == pattern for g in GRAMMARS.values()) else None


_TETRAHEDRAL = re.compile(r"@@?(?!@|TH|AL|SP|TB|OH)")  # @ and @@, not @TH1, @SP2, ...
_RING_NUMBER = re.compile(r"%\(([0-9]+)\)|%([0-9]{2})|([1-9])")


def respelling_tokens(tokens) -> set[str]:
    """The SMILES tokens another spelling of the same molecules may need beside ``tokens``:
    the other bond direction (``/`` and ``\\``), the other tetrahedral tag of each bracket atom
    (``[C@H]`` and ``[C@@H]``) and every ring number up to the highest seen, at least 9. A
    canonical writer uses only some of each pair: MOSES's canonical SMILES hold ``/`` but no
    ``\\``, and a rooted or randomized spelling of the same molecule (``--randomized-variants``,
    ``data.randomized_smiles``) may need the other."""
    tokens = set(tokens)
    extra = set()
    if tokens & {"/", "\\"}:
        extra |= {"/", "\\"}
    top = 0
    for tok in tokens:
        if tok.startswith("[") and _TETRAHEDRAL.search(tok):
            extra.add(_TETRAHEDRAL.sub(lambda m: "@" if m.group(0) == "@@" else "@@", tok, count=1))
        ring = _RING_NUMBER.fullmatch(tok)
        if ring:
            top = max(top, int(next(g for g in ring.groups() if g)))
    if top:
        extra |= {str(i) for i in range(1, 10)} | {f"%{i}" for i in range(10, min(top, 99) + 1)}
    return extra - tokens


def _post_processor(vocab: dict[str, int]):
    from tokenizers import processors

    bos, eos, sep = SPECIAL_TOKENS["bos_token"], SPECIAL_TOKENS["eos_token"], SPECIAL_TOKENS["sep_token"]
    return processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {sep} $B:1 {eos}:1",
        special_tokens=[(t, vocab[t]) for t in (bos, eos, sep)],
    )


def build_regex_tokenizer(vocab: dict[str, int], grammar: Grammar = SMILES):
    """A ``tokenizers.Tokenizer``: regex pre-split, word-level vocabulary, exact decoding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(grammar.pattern), behavior="isolated")
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
    """Encodes a batch of SMILES with the regex vocabulary: ``token_codes``, then a table
    from code to id (characters no token covers are skipped, as ``findall`` does, so such
    a row fails ``roundtrip_ok``)."""

    def __init__(self, vocab: dict[str, int], grammar: Grammar = SMILES):
        self.vocab, self.grammar = dict(vocab), grammar
        self.unk_id = vocab[SPECIAL_TOKENS["unk_token"]]
        self.itos = [None] * (max(vocab.values()) + 1)
        for tok, i in vocab.items():
            self.itos[i] = tok
        self._ascii = np.array([vocab.get(chr(c), self.unk_id) for c in range(128)], dtype=np.uint16)
        self._texts = np.array([t if t is not None else "" for t in self.itos], dtype=object)

    def token_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def encode_batch(self, smiles_list: list[str]):
        """Returns (flat ids as numpy uint16, lengths as numpy int32)."""
        tc = token_codes(smiles_list, self.grammar)
        multi = np.array([self.vocab.get(t, self.unk_id) for t in tc.multi], dtype=np.uint16)
        one_char = tc.codes < 128
        ids = np.empty(len(tc.codes), dtype=np.uint16)
        ids[one_char] = self._ascii[tc.codes[one_char]]
        ids[~one_char] = multi[tc.codes[~one_char] - _PLACEHOLDER]
        return ids, tc.lengths

    def roundtrip_ok(self, flat, lengths, texts: list[str]):
        """Boolean mask: decoding row i's ids gives back ``texts[i]`` exactly.

        Vectorized: the decoded rows equal the texts iff the concatenations are equal
        and every row has the same character length; only on a mismatch are rows
        compared one by one.
        """
        itos = self.itos
        decoded_all = "".join(self._texts[flat].tolist())
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

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

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
    """``("regex", vocab, grammar name)`` or ``("hf", tokenizer.json path, unk id)``; built in the worker."""
    if spec[0] == "regex":
        return RegexEncoder(spec[1], GRAMMARS[spec[2]])
    return HFEncoder(spec[1], spec[2])
