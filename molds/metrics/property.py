"""Property-prediction metrics, per task and macro-averaged, with missing labels masked.

Classification: AUROC and AUPRC (average precision) from scikit-learn; BEDROC with
alpha = 20 (Truchon & Bayly 2007) and the enrichment factor at 1 % from RDKit's
``rdkit.ML.Scoring``. Regression: RMSE, MAE and Spearman's rho (SciPy). A label is
missing where it is NaN; a task whose evaluated labels hold a single class has no
ranking metric (None) and is left out of the macro average, which reports how many
tasks it averaged.
"""

from __future__ import annotations

import math

import numpy as np
from rdkit.ML.Scoring.Scoring import CalcBEDROC, CalcEnrichment
from scipy.stats import spearmanr
from sklearn.metrics import average_precision_score, roc_auc_score


def _ranked(scores: np.ndarray, labels: np.ndarray) -> list[list[float]]:
    """RDKit's scoring input: [score, is_active] rows, best score first."""
    order = np.argsort(-scores, kind="stable")
    return [[float(scores[i]), float(labels[i])] for i in order]


def bedroc(scores, labels, alpha: float = 20.0) -> float:
    return float(CalcBEDROC(_ranked(np.asarray(scores, float), np.asarray(labels, float)), 1, alpha))


def enrichment_factor(scores, labels, fraction: float = 0.01) -> float:
    return float(CalcEnrichment(_ranked(np.asarray(scores, float), np.asarray(labels, float)), 1, [fraction])[0])


def _macro(per_task: dict, keys) -> dict:
    out = {}
    for k in keys:
        vals = [m[k] for m in per_task.values() if m.get(k) is not None and not math.isnan(m[k])]
        out[k] = float(np.mean(vals)) if vals else None
        out[f"{k}_tasks"] = len(vals)
    return out


def _tasks(labels, outputs, task_names):
    """(name, labels, outputs) of every task, its missing (NaN) labels dropped."""
    y, o = np.asarray(labels, float), np.asarray(outputs, float)
    if y.ndim == 1:
        y, o = y[:, None], o[:, None]
    names = task_names or [f"task{t}" for t in range(y.shape[1])]
    for t, name in enumerate(names):
        seen = ~np.isnan(y[:, t])
        yield name, y[seen, t], o[seen, t]


def classification_metrics(labels, scores, task_names=None) -> dict:
    """``labels`` [N, T] in {0, 1, NaN}; ``scores`` [N, T] (probabilities or logits)."""
    per_task = {}
    for name, yt, st in _tasks(labels, scores, task_names):
        m = {"n": len(yt), "positives": int((yt == 1).sum())}
        if not np.isin(yt, (0.0, 1.0)).all():
            m.update(auroc=None, auprc=None, bedroc20=None, ef1=None, note="labels are not 0/1")
        elif 0 < yt.sum() < len(yt):
            m.update(auroc=float(roc_auc_score(yt, st)), auprc=float(average_precision_score(yt, st)),
                     bedroc20=bedroc(st, yt, 20.0), ef1=enrichment_factor(st, yt, 0.01))
        else:
            m.update(auroc=None, auprc=None, bedroc20=None, ef1=None)
        per_task[name] = m
    return {"per_task": per_task, "macro": _macro(per_task, ("auroc", "auprc", "bedroc20", "ef1"))}


def regression_metrics(labels, preds, task_names=None) -> dict:
    per_task = {}
    for name, yt, pt in _tasks(labels, preds, task_names):
        m = {"n": len(yt)}
        if len(yt):
            err = pt - yt
            m.update(rmse=float(np.sqrt(np.mean(err ** 2))), mae=float(np.mean(np.abs(err))))
            m["spearman"] = float(spearmanr(yt, pt).statistic) if len(yt) > 1 and np.std(yt) > 0 else None
        else:
            m.update(rmse=None, mae=None, spearman=None)
        per_task[name] = m
    return {"per_task": per_task, "macro": _macro(per_task, ("rmse", "mae", "spearman"))}


def mean_std(reports: list[dict]) -> dict:
    """Seeds' flat metric dicts -> {key: {"mean", "std", "values"}} for every numeric key."""
    out = {}
    for key in reports[0]:
        vals = [r.get(key) for r in reports]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None for v in vals):
            arr = np.asarray(vals, float)
            out[key] = {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0,
                        "values": [float(v) for v in arr]}
    return out
