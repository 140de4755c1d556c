"""Token-level constants shared by the data plane, the models and the losses, and the
special-token ids of a tokenizer artifact (the one place that knows them)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ManifestError

IGNORE_INDEX = -100
"""Label of a position that carries no loss (padding, a molecule's first token, unmasked MLM tokens)."""


@dataclass(frozen=True)
class TokenizerInfo:
    """What the trainer, the models and export need of the ETL's tokenizer."""

    path: str  # the tokenizer directory (AutoTokenizer.from_pretrained loads it)
    vocab_size: int
    vocab_hash: str
    pad: int
    bos: int
    eos: int
    mask: int | None
    unk: int | None
    special_ids: tuple[int, ...]
    sep: int | None = None

    @property
    def first_regular(self) -> int:
        """The smallest id of an ordinary (non-special) token."""
        return max(self.special_ids) + 1

    @property
    def ids(self) -> dict:
        return {"pad": self.pad, "bos": self.bos, "eos": self.eos}


#: a bracket atom's element symbol: after the isotope, a two-letter element (``Cl``, ``Na``) or
#: one capital, or an aromatic one (``c``, ``nH``, ``se``); then what a bracket atom writes next
#: (chirality, hydrogens, charge, class, SELFIES' counts, the bracket's end: not ``[Branch1]``)
_BRACKET_ELEMENT = re.compile(r"\[\d*([A-Z][a-z]?|se|te|as|[bcnops])(?=[@H+\-:\d\]])")


def element_token(token: str, vocabulary) -> str | None:
    """The token of ``vocabulary`` that writes the bracket atom ``token``'s element alone, its
    aromaticity kept: ``[C@@H]`` and ``[13C]`` -> ``C``, ``[nH+]`` -> ``n``, ``[O-]`` -> ``O``,
    ``[Cl-]`` -> ``Cl``, SELFIES' ``[C@@H1]`` -> ``[C]``. None for a token that is no bracket
    atom, or whose element the vocabulary does not write alone (``[Na+]`` where no token is
    ``Na``)."""
    m = _BRACKET_ELEMENT.match(token)
    if m is None:
        return None
    symbol = m.group(1)
    return next((t for t in (symbol, f"[{symbol}]") if t != token and t in vocabulary), None)


def tokenizer_info(manifest) -> TokenizerInfo:
    """The manifest's tokenizer, its files checked against the manifest's vocab hash."""
    vocab = manifest.check_tokenizer()
    block = manifest.data["tokenizer"]
    names = block.get("special_tokens") or {}
    ids = {}
    for key in ("pad_token", "bos_token", "eos_token", "mask_token", "unk_token", "sep_token"):
        token = names.get(key)
        if token is not None:
            if token not in vocab:
                raise ManifestError(f"{manifest.path}: tokenizer.special_tokens.{key}={token!r} is not in the "
                                    f"tokenizer's vocabulary")
            ids[key] = vocab[token]
    missing = [k for k in ("pad_token", "bos_token", "eos_token") if k not in ids]
    if missing:
        raise ManifestError(f"{manifest.path}: tokenizer.special_tokens lacks {missing}")
    special = tuple(sorted({vocab[t] for t in names.values() if t in vocab}))
    return TokenizerInfo(path=manifest.tokenizer_path, vocab_size=len(vocab), vocab_hash=block.get("vocab_hash", ""),
                         pad=ids["pad_token"], bos=ids["bos_token"], eos=ids["eos_token"],
                         mask=ids.get("mask_token"), unk=ids.get("unk_token"), special_ids=special,
                         sep=ids.get("sep_token"))
