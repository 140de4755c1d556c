"""A property model's predictions for molecules given as text (``molds-predict`` on an encoder
with property heads, and ``benchmarks/moleculenet.py``).

Each input is read as the checkpoint's ETL read its training molecules (the manifest's
canonicalization options) and spelled in its vocabulary; the model reads ``<bos> tokens
<eos>`` as its training batches held them, cut to the recipe's ``data.max_length`` as
training cut a longer molecule. With ``augment`` K > 1 the prediction is the mean over the
canonical spelling and K - 1 restricted randomized ones (atoms renumbered at random; those
with a token outside the vocabulary are skipped, and counted), in the form the model was
trained on them (after ``<sep>`` when the recipe marked randomized spellings so).
Classification heads give probabilities (the sigmoid of the logit), regression heads values
in the labels' own units.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..chemistry.canonical import Canonicalizer, ChemOptions, Molecule
from ..chemistry.features import molecule_features
from ..data.randomize import restricted_variants


@dataclass
class PropertyPredictions:
    tasks: list[str]
    values: dict = field(default_factory=dict)  # input index -> [T] predictions
    notes: dict = field(default_factory=dict)  # input index -> why it has none (or what was done to it)
    canonical: dict = field(default_factory=dict)  # input index -> its canonical SMILES
    spellings: int = 0  # spellings read in all
    spellings_skipped: int = 0  # randomized spellings with a token outside the vocabulary
    truncated: int = 0  # inputs longer than data.max_length, cut as training cut them


def task_names(loaded) -> list[str]:
    """The label columns the heads were trained on (the manifest's), else task0, task1, ..."""
    n = int(loaded.recipe["model"].get("num_tasks") or 0)
    names = loaded.manifest.label_columns
    return names if len(names) == n else [f"task{t}" for t in range(n)]


def _rows(loaded, texts: list[str]) -> list[list[int] | None]:
    sp = loaded.specials
    enc = loaded.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return [None if (not ids or sp.unk in ids) else ids for ids in enc]


@torch.no_grad()
def predict_properties(loaded, smiles: list[str], *, augment: int = 1, seed: int = 0,
                       max_tokens_per_batch: int = 8192, cache_features: bool = False) -> PropertyPredictions:
    """``loaded``'s predictions for ``smiles`` (the mean over ``augment`` spellings of each).
    ``cache_features``: heads that read molecule features keep each molecule's in this process,
    for a caller that scores the same molecules with several checkpoints."""
    data = loaded.recipe.get("data") or {}
    limit = int(data.get("max_length") or loaded.model.config.max_position_embeddings)
    limit = min(limit, loaded.model.config.max_position_embeddings)
    sp = loaded.specials
    marked = (data.get("randomized_marker", "sep") == "sep" and float(data.get("randomized_smiles") or 0) > 0
              and sp.sep is not None)
    out = PropertyPredictions(task_names(loaded))
    canon = Canonicalizer(ChemOptions.of_manifest(loaded.manifest))
    for i, raw in enumerate(smiles):
        m = canon(raw or "")
        if isinstance(m, Molecule):
            out.canonical[i] = m.canonical
        else:
            out.notes[i] = m
    order = sorted(out.canonical)
    canonical_ids = _rows(loaded, [out.canonical[i] for i in order])
    rows: list[tuple[int, list[int]]] = []  # (input index, model row)
    for i, ids in zip(order, canonical_ids):
        if ids is None:
            out.notes[i] = "unknown_token"
            continue
        row = [sp.bos, *ids, sp.eos]
        if len(row) > limit:
            out.truncated += 1
            out.notes[i] = f"truncated to {limit} tokens"
        rows.append((i, row[:limit]))
        if augment > 1:
            variants = restricted_variants(out.canonical[i], [seed * 1_000_003 + k for k in range(1, augment)])
            texts = [v for v in variants if v]
            for ids_v in _rows(loaded, texts):
                if ids_v is None:
                    out.spellings_skipped += 1
                    continue
                row = [sp.bos, *([sp.sep] if marked else []), *ids_v, sp.eos]
                rows.append((i, row[:limit]))
            out.spellings_skipped += len(variants) - len(texts)
    out.spellings = len(rows)
    model = loaded.model.eval()
    kind = getattr(loaded.model.config, "molecule_features", "")
    features = {}
    if kind:  # heads that read molecule features: the canonical molecule's, for each of its spellings
        scored = sorted({i for i, _ in rows})
        features = dict(zip(scored, molecule_features([out.canonical[i] for i in scored], kind,
                                                      cache=cache_features)))
    regression = loaded.recipe["model"].get("task_type") == "regression"
    sums: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    by_length = sorted(range(len(rows)), key=lambda r: len(rows[r][1]))
    start = 0
    while start < len(by_length):
        width = len(rows[by_length[start]][1])
        end = start + 1
        while end < len(by_length) and (end - start + 1) * len(rows[by_length[end]][1]) <= max_tokens_per_batch:
            end += 1
        batch = [rows[r] for r in by_length[start:end]]
        width = max(len(r[1]) for r in batch)
        ids = torch.full((len(batch), width), sp.pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for b, (_, row) in enumerate(batch):
            ids[b, :len(row)] = torch.tensor(row)
            mask[b, :len(row)] = 1
        extra = {"features": torch.from_numpy(np.stack([features[i] for i, _ in batch]))} if kind else {}
        pred = model(input_ids=ids, attention_mask=mask, **extra)["predictions"].float()
        pred = (pred if regression else torch.sigmoid(pred)).numpy()
        for b, (i, _) in enumerate(batch):
            sums[i] = sums.get(i, 0.0) + pred[b].astype(np.float64)
            counts[i] = counts.get(i, 0) + 1
        start = end
    out.values = {i: sums[i] / counts[i] for i in sums}
    return out
