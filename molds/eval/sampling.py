"""Sampling molecules from a causal decoder (the library behind ``molds-sample``).

Every sample starts from the beginning-of-sequence token and is decoded with a
key/value cache (``CausalDecoder.decode``) until its end token or ``max_tokens``; one
that never ends is reported as unfinished (None: invalid for the metrics, an empty line
in the output file). Sampling is seeded: the same checkpoint, seed and settings give the
same molecules. The same function samples during training, on every rank at once:
``stop_together`` lets ranks agree on when a batch is finished, so that under ZeRO-3
(where each forward gathers parameters collectively) no rank leaves early.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


@torch.no_grad()
def sample_ids(model, num: int, *, bos: int, eos: int, max_tokens: int, temperature: float = 1.0, top_k: int = 0,
               batch_size: int = 512, seed: int = 0, device=None,
               stop_together: Callable[[bool], bool] | None = None,
               forbid: Sequence[int] = (), prefix: Sequence[int] = ()) -> list[list[int] | None]:
    """``num`` token-id lists (without bos/eos), or None for a sample that never ended.
    Tokens in ``forbid`` are never drawn (their probability goes to the others). Every
    sample starts with the tokens of ``prefix`` (constrained generation: they are read
    after bos in one causal step, then ``max_tokens`` more are drawn); the lists returned
    include them."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    device = device or next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = len(model.model.layers)
    out: list[list[int] | None] = []
    while len(out) < num:
        n = min(batch_size, num - len(out))
        cache = [{} for _ in range(layers)]
        start = torch.tensor([[bos, *prefix]], dtype=torch.long, device=device).expand(n, -1)
        logits = model.decode(start, cache, 0)
        done = torch.zeros(n, dtype=torch.bool, device=device)
        steps = []
        for t in range(max_tokens):
            logits = logits.float() / temperature
            if forbid:
                logits[:, list(forbid)] = float("-inf")
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).squeeze(1)
            nxt = nxt.masked_fill(done, eos)
            steps.append(nxt)
            done |= nxt == eos
            finished = bool(done.all())
            if (stop_together(finished) if stop_together else finished) or t == max_tokens - 1:
                break
            logits = model.decode(nxt[:, None], cache, len(prefix) + t + 1)
        ids = torch.stack(steps, 1).tolist()
        for row in ids:
            out.append([*prefix, *row[:row.index(eos)]] if eos in row else None)
    return out


def forbidden_tokens(recipe: dict, specials) -> tuple[int, ...]:
    """What a decoder trained under ``recipe`` must not sample: the marker that started its
    randomized-SMILES training rows (``data.randomized_marker``), so that what it samples
    follows its canonical-SMILES rows."""
    data = recipe.get("data") or {}
    if (data.get("randomized_smiles") or 0) > 0 and data.get("randomized_marker", "sep") == "sep" \
            and specials.sep is not None:
        return (specials.sep,)
    return ()


def ids_to_texts(tokenizer, samples: list[list[int] | None]) -> list[str | None]:
    """What each sample's tokens spell (SMILES, SELFIES, SAFE: the manifest's representation);
    None for an unfinished sample or one holding a special token (<pad>, <mask>, ... inside
    a molecule is not a molecule)."""
    special = set(tokenizer.all_special_ids)
    return [None if ids is None or special.intersection(ids) else tokenizer.decode(ids).replace(" ", "")
            for ids in samples]


def texts_to_smiles(texts: list[str | None], representation=None, canonical: bool = False) -> list[str | None]:
    """The SMILES each text decodes to through ``representation`` (``molds.chemistry.representation``;
    None: the texts are SMILES); None where it decodes to none. With ``canonical`` (samples
    written out for a user) decoded SMILES come out RDKit-canonical, as the ETL wrote the
    training molecules (the ``selfies`` decoder writes Kekulé SMILES, SAFE's joins fragments
    in its own order); one RDKit cannot parse is kept as decoded, so evaluation counts it
    invalid. Scoring canonicalizes on its own (``parse_samples``), so it asks for none.
    SMILES texts stay as the model wrote them."""
    if representation is None or representation.name == "smiles":
        return list(texts)
    if not canonical:
        return [None if t is None else representation.decode(t) for t in texts]
    from rdkit import Chem, rdBase  # here: molds-sample --help loads no RDKit

    def canonical(smiles: str | None) -> str | None:
        mol = Chem.MolFromSmiles(smiles) if smiles else None
        return Chem.MolToSmiles(mol) if mol is not None else smiles

    with rdBase.BlockLogs():
        return [None if t is None else canonical(representation.decode(t)) for t in texts]


def ids_to_smiles(tokenizer, samples: list[list[int] | None], representation=None) -> list[str | None]:
    """Decoded SMILES of token-id samples (through the representation, when not SMILES)."""
    return texts_to_smiles(ids_to_texts(tokenizer, samples), representation)


def default_max_tokens(manifest, model_max_positions: int) -> int:
    """Room for the longest training molecule plus a margin, within the model's positions."""
    lengths = manifest.length_range("train")
    longest = (lengths[1] if lengths else 0) or model_max_positions
    return max(1, min(model_max_positions - 1, int(longest * 1.5) + 8))
