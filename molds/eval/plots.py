"""Pictures of a property model's predictions: ROC curves (classification, one per task, from
scikit-learn's ``roc_curve``) or a parity plot per task (regression: prediction against label,
in the labels' units, with the diagonal). ``molds-eval`` writes them beside ``eval.md``
(``roc.png`` / ``parity.png``) and the training's full evaluations put them in TensorBoard
(``eval/roc`` / ``eval/parity``). Missing labels are left out, as in the metrics."""

from __future__ import annotations

import io
import math

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from sklearn.metrics import roc_auc_score, roc_curve


def roc_points(labels, scores, names) -> dict:
    """{task: {"fpr": [...], "tpr": [...], "auroc": float}} for every task whose labels are 0/1
    and hold both classes (scikit-learn's ``roc_curve``, intermediate points dropped); a task
    with other labels has no curve, as it has no AUROC in the metrics."""
    out = {}
    y, s = np.asarray(labels, float), np.asarray(scores, float)
    for t, name in enumerate(names):
        seen = ~np.isnan(y[:, t])
        if not np.isin(y[seen, t], (0.0, 1.0)).all() or len(np.unique(y[seen, t])) < 2:
            continue
        fpr, tpr, _ = roc_curve(y[seen, t], s[seen, t])
        out[name] = {"fpr": [round(float(v), 6) for v in fpr], "tpr": [round(float(v), 6) for v in tpr],
                     "auroc": float(roc_auc_score(y[seen, t], s[seen, t]))}
    return out


def _figure(panels: int):
    import matplotlib  # loaded only when a picture is drawn (it is not needed to train or score)

    matplotlib.use("Agg", force=False)
    cols = min(panels, 4)
    rows = math.ceil(panels / cols)
    fig = Figure(figsize=(3.6 * cols, 3.4 * rows), dpi=100)
    return fig, [fig.add_subplot(rows, cols, i + 1) for i in range(panels)]


def property_figure(labels, preds, names, task_type: str):
    """(name, matplotlib Figure) of a split's predictions, or None when no task can be drawn."""
    y, p = np.asarray(labels, float), np.asarray(preds, float)
    if task_type == "classification":
        curves = roc_points(y, p, names)
        if not curves:
            return None
        fig, (ax,) = _figure(1)
        for name, c in curves.items():
            ax.plot(c["fpr"], c["tpr"], lw=1.2, label=f"{name} {c['auroc']:.3f}")
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC (AUROC)", xlim=(0, 1),
               ylim=(0, 1.01))
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        return "roc", fig
    drawn = [(t, n) for t, n in enumerate(names) if (~np.isnan(y[:, t])).any()]
    if not drawn:
        return None
    fig, axes = _figure(len(drawn))
    for ax, (t, name) in zip(axes, drawn):
        seen = ~np.isnan(y[:, t])
        yt, pt = y[seen, t], p[seen, t]
        lo, hi = float(min(yt.min(), pt.min())), float(max(yt.max(), pt.max()))
        ax.scatter(yt, pt, s=6, alpha=0.6)
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
        rmse = float(np.sqrt(np.mean((yt - pt) ** 2)))
        ax.set(xlabel=f"{name} (label)", ylabel=f"{name} (predicted)", title=f"{name}: RMSE {rmse:.3g}, n={len(yt)}")
    fig.tight_layout()
    return "parity", fig


def figure_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def figure_rgb(fig) -> np.ndarray:
    """The figure as an H x W x 3 uint8 array (what TensorBoard's image summary takes)."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
