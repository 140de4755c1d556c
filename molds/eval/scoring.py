"""Scoring a split with a model: its loss, and its property predictions.

Used by ``molds-eval`` (one process, a model opened from a checkpoint) and by the
evaluation during training (every rank, through the engine's ``eval_forward``): both
pass a ``forward(batch) -> outputs with "loss"`` callable, so neither needs to know
how the model is driven. With ``any_have`` (a collective: does any rank still have a
batch?) a rank whose share of the split has run out goes on with a stand-in batch
until every rank is done, which keeps ZeRO-3's parameter gathers in step.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from ..chemistry.features import feature_names
from ..chemistry.tokens import IGNORE_INDEX
from ..data.loader import MoleculeLoader, batch_tensors
from ..models.loss import has_targets
from ..recipe.sections import DataConfig


def split_data_config(recipe_data: dict, manifest_dir: str, split: str, **over):
    """The recipe's data section (a dict) set to read ``split`` once, in order, in-process,
    as the manifest wrote it (no randomized SMILES: scores are on canonical molecules)."""
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    cfg = DataConfig(**{k: v for k, v in recipe_data.items() if k in fields})
    return dataclasses.replace(cfg, manifest=manifest_dir, split=split, shuffle=False, max_epochs=1, max_steps=None,
                               stop_after_epoch=None, num_workers=0, randomized_smiles=0.0,
                               **over)


def model_forward(model, loss_fn, autocast=None):
    """``forward(batch)`` for a plain module: its outputs plus the batch's loss."""
    def forward(batch: dict) -> dict:
        with torch.no_grad(), (autocast or contextlib.nullcontext)():
            out = model(**batch)
            if has_targets(batch):
                out["loss"] = loss_fn(out, batch)
        return out

    return forward


def _stand_in(family: str, specials, device, features: str = "") -> dict:
    """A two-token batch for a rank whose share has run out; its loss is not counted."""
    ids = torch.tensor([[specials.bos, specials.eos]], device=device)
    if family == "decoder":
        return {"input_ids": ids, "labels": ids, "position_ids": torch.tensor([[0, 1]], device=device),
                "document_ids": torch.zeros_like(ids)}
    if family == "seq2seq":
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "decoder_input_ids": ids[:, :1],
                "labels": ids[:, 1:]}
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mlm_labels": torch.full_like(ids, -100)}
    if features:  # property heads that read molecule features
        out["features"] = torch.zeros((1, len(feature_names(features))), device=device)
    return out


def _batches(data_cfg, family: str, *, rank: int, world: int, max_batches: int, device, any_have,
             features: str = ""):
    """(loader batch or None, tensors on ``device``) for this rank's share of a split;
    ``features``: the model's ``molecule_features``, which its batches hold."""
    loader = MoleculeLoader(data_cfg, rank=rank, world_size=world, features=features)
    it = iter(loader)
    done = 0
    while not max_batches or done < max_batches:
        b = next(it, None)
        if not (any_have(b is not None) if any_have else b is not None):
            return
        yield b, (batch_tensors(b, device) if b is not None else _stand_in(family, loader.specials, device, features))
        done += 1


@torch.no_grad()
def split_loss(forward, family: str, data_cfg, *, rank: int = 0, world: int = 1, max_batches: int = 0,
               device="cpu", any_have=None, features: str = "") -> tuple[float, float]:
    """(summed loss over predicted tokens, number of predicted tokens) of this rank's
    share of a split; the shares of all ranks cover the split once."""
    total = count = 0.0
    for b, batch in _batches(data_cfg, family, rank=rank, world=world, max_batches=max_batches, device=device,
                             any_have=any_have, features=features):
        loss = forward(batch)["loss"]
        if b is None:
            continue
        if family in ("decoder", "seq2seq"):
            # the positions the loss scores: each molecule's next tokens (a pair's completion only),
            # or a target and its EOS
            n = int((batch["labels"] != IGNORE_INDEX).sum())
        else:
            n = int((batch["mlm_labels"] != IGNORE_INDEX).sum())
        if n:
            total += float(loss) * n
            count += n
    return total, count


@torch.no_grad()
def property_predictions(forward, data_cfg, *, rank: int = 0, world: int = 1, device="cpu", any_have=None,
                         features: str = ""):
    """(labels [N, T] with NaN, predictions [N, T]) over this rank's share of a labelled split."""
    ys, ps = [], []
    for b, batch in _batches(data_cfg, "encoder", rank=rank, world=world, max_batches=0, device=device,
                             any_have=any_have, features=features):
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "mlm_labels", "label_mask")}
        pred = forward(inputs)["predictions"].float().cpu().numpy()
        if b is None:
            continue
        y = b["labels"].numpy().astype(float)
        y[~b["label_mask"].numpy().astype(bool)] = np.nan
        ys.append(y)
        ps.append(pred)
    if not ys:
        return np.zeros((0, 0)), np.zeros((0, 0))
    return np.concatenate(ys), np.concatenate(ps)


def property_report(labels, preds, model_cfg: dict, manifest) -> dict:
    from ..metrics.property import (  # here: a rank that only trains loads no RDKit or scikit-learn
        classification_metrics, regression_metrics,
    )

    names = manifest.label_columns or None
    if model_cfg["task_type"] == "classification":
        return classification_metrics(labels, preds, names)
    return regression_metrics(labels, preds, names)
