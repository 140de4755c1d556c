"""The checkpoints of a property fine-tuning chosen by their validation score
(``molds-average RUN OUT --best K``, and ``benchmarks/moleculenet.py``).

Each complete checkpoint of the run is scored on a split of its own manifest (the
validation split by default) as ``molds-eval`` scores it: macro ROC-AUC over the tasks for
classification heads (higher is better), macro RMSE in the labels' units for regression
(lower is better). The K best are the ones ``molds-average`` then averages (K = 1: the
best checkpoint alone, early stopping as Chemprop and most fine-tuning scripts do it).

Why an average of the few best rather than the best one: a fine-tuning set's validation
split is small (ESOL's 111 molecules), so the single best of ten checkpoints is partly
chosen by the split's noise; the mean of the weights of the three best, snapshots of one
run from one pretrained encoder, scored better than the best one on every MoleculeNet set
measured when the checkpoints were chosen on one half of the validation split and scored
on the other (docs/benchmarks/moleculenet.md). A choice on the test split is never made
here: the split is whatever the caller names, and the benchmark names ``valid``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..errors import MoldsError


@dataclass
class Choice:
    """Scores of a run's checkpoints on a split, best first."""
    metric: str  # "roc_auc" or "rmse"
    split: str
    scores: list = field(default_factory=list)  # (checkpoint, score), best first; a score is None where undefined

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "roc_auc"

    def ranked(self, scores: list) -> "Choice":
        """This choice with ``scores`` ((checkpoint, score or None), in step order) best first:
        of equal scores the later checkpoint (trained longer), unscored ones last."""
        sign = -1.0 if self.higher_is_better else 1.0
        order = sorted(range(len(scores)), key=lambda i: (scores[i][1] is None, sign * (scores[i][1] or 0.0), -i))
        self.scores = [scores[i] for i in order]
        return self

    @property
    def scored(self) -> list[str]:
        """The checkpoints with a score, best first."""
        return [c for c, s in self.scores if s is not None]

    def best(self, k: int) -> list[str]:
        """The ``k`` best checkpoints, in step order."""
        if k < 1:
            raise MoldsError(f"--best must be >= 1 (got {k})")
        scored = self.scored
        if len(scored) < k:
            why = (f" (a classification task needs both classes in the {self.split} split; choose by --last N "
                   f"instead)" if not scored else "")
            raise MoldsError(f"{k} checkpoints asked for by their {self.split} {self.metric}, but "
                             f"{len(scored)} of {len(self.scores)} have one{why}")
        chosen = set(scored[:k])
        return [c for c, _ in sorted(self.scores, key=lambda cs: os.path.basename(cs[0])) if c in chosen]

    def record(self, k: int) -> dict:
        """What the averaged checkpoint's lineage keeps of the choice."""
        return {"split": self.split, "metric": self.metric, "best": k,
                "scores": {os.path.basename(c): s for c, s in self.scores}}


def score_checkpoints(run: str, *, split: str = "valid") -> Choice:
    """Every complete checkpoint of the property run ``run`` scored on ``split`` of its manifest
    (a score is None where the split scores no task: a classification split without both
    classes of any task). Refuses a run whose model has no property heads, in one line."""
    from ..checkpoint import checkpoints_dir, complete_checkpoints, open_checkpoint  # here: --help loads no torch
    from ..models.loss import build_loss  # here: molds-average --help loads no torch or Triton
    from .scoring import (  # here: molds-average --help loads no torch
        model_forward, property_predictions, property_report, split_data_config,
    )

    root = os.path.normpath(run)
    found = complete_checkpoints(checkpoints_dir(root) if os.path.isdir(checkpoints_dir(root)) else root)
    if not found:
        raise MoldsError(f"{run}: no complete checkpoint to choose from")
    choice, scores = None, []
    for ckpt in found:
        loaded = open_checkpoint(ckpt)
        model_cfg = loaded.recipe["model"]
        if loaded.family != "encoder" or not model_cfg.get("num_tasks"):
            raise MoldsError(f"{ckpt}: --best chooses checkpoints by a property model's {split} ROC-AUC or "
                             f"RMSE; this is a {loaded.family} model without property heads (average its last "
                             f"checkpoints with --last N)")
        if not loaded.manifest.shards(split):
            raise MoldsError(f"{loaded.manifest.path} has no rows in split {split!r} to choose checkpoints by")
        metric = "roc_auc" if model_cfg["task_type"] == "classification" else "rmse"
        if choice is None:
            choice = Choice(metric=metric, split=split)
        elif metric != choice.metric:
            raise MoldsError(f"{ckpt}: its heads are {model_cfg['task_type']}, the run's first checkpoint's are not")
        cfg = split_data_config(loaded.recipe["data"], loaded.manifest.path, split, mode="bucketed",
                                with_labels=True, mlm_probability=0.0)
        y, p = property_predictions(model_forward(loaded.model, build_loss(model_cfg)), cfg,
                                    features=loaded.model.config.molecule_features)
        macro = property_report(y, p, model_cfg, loaded.manifest)["macro"]
        value = macro.get("auroc" if metric == "roc_auc" else "rmse")
        scores.append((ckpt, None if value is None or not math.isfinite(value) else float(value)))
    return choice.ranked(scores)
