"""``eval.json`` and ``eval.md``: an evaluation report, written atomically."""

from __future__ import annotations

import json
import os

from ..runtime.atomic import write_bytes, write_text


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):  # a description beside the figures (fcd_reference: "test (2000 molecules)")
        return v
    return f"{v:.0f}" if float(v).is_integer() and abs(v) > 1 else f"{v:.4f}"


def markdown(report: dict) -> str:
    source = (f"- samples: {report['samples_file']}" if report.get("samples_file")
              else f"- checkpoint(s): {report.get('checkpoint')}\n- model: {report.get('family')}")
    lines = [f"# molds-eval: {report.get('split')} split", "", source, f"- manifest: {report.get('manifest')}"]
    if "loss" in report:
        lines.append(f"- {report['split']} loss {report['loss']:.4f}, perplexity {report['perplexity']:.3f}")
    lines += ["", "| metric | value |", "|---|---|"]
    for key, val in report["metrics"].items():
        if isinstance(val, dict) and len(val["values"]) > 1:
            shown = f"{_fmt(val['mean'])} ± {val['std']:.4f} (n={len(val['values'])})"
        else:
            shown = _fmt(val["mean"] if isinstance(val, dict) else val)
        lines.append(f"| {key} | {shown} |")
    if report.get("property"):
        first = next(iter(report["property"]["per_task"].values()))
        lines += ["", "| task | n | " + " | ".join(k for k in first if k != "n") + " |"]
        for task, vals in report["property"]["per_task"].items():
            cells = [("n/a" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v))
                     for k, v in vals.items() if k != "n"]
            lines.append(f"| {task} | {vals['n']} | " + " | ".join(cells) + " |")
    for picture in report.get("figures") or []:
        lines += ["", f"![{picture[:-4]}]({picture})"]
    if report.get("examples"):
        lines += ["", "First samples (valid or not): " + ", ".join(f"`{s}`" for s in report["examples"][:10])]
    return "\n".join(lines) + "\n"


def write_report(out: str, report: dict) -> None:
    """``eval.json``, ``eval.md`` and a property model's picture (``roc.png`` or
    ``parity.png``, linked from ``eval.md``). A report over training seeds (``molds-eval
    --recipe``) has one picture per seed (``roc-seed0.png``, ...). Pictures leave the report."""
    os.makedirs(out, exist_ok=True)
    drawn = []
    figure = report.pop("_figure", None)
    if figure is not None:
        drawn.append((f"{figure[0]}.png", figure[1]))
    seeds = report.get("training_seeds") or []
    for i, each in enumerate(report.get("per_seed") or []):
        figure = each.pop("_figure", None) if isinstance(each, dict) else None
        if figure is not None and i < len(seeds):
            drawn.append((f"{figure[0]}-seed{seeds[i]}.png", figure[1]))
    if drawn:
        from .plots import figure_png  # here: molds-eval --help loads no matplotlib or scikit-learn

        for name, fig in drawn:
            write_bytes(os.path.join(out, name), figure_png(fig))
        report["figures"] = [name for name, _ in drawn]
    write_text(os.path.join(out, "eval.json"), json.dumps(report, indent=2))
    write_text(os.path.join(out, "eval.md"), markdown(report))


def flat_metrics(report: dict) -> dict:
    return {k: (v["mean"] if isinstance(v, dict) else v) for k, v in report["metrics"].items()}
