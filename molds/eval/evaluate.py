"""What a checkpoint knows about chemistry (the library behind ``molds-eval``).

A decoder is scored on the split's next-token loss / perplexity and on sampled
molecules (``molds.metrics.generation``: validity, uniqueness, novelty against the
manifest's training split, diversity, scaffold novelty, filters, FCD to the split with
``fcd``), one sample set per seed. An encoder with property heads is scored on the
split's labels (``molds.metrics.property``), an MLM-only encoder on its masked-token
loss. ``evaluate_samples`` scores a file of SMILES from elsewhere the same way. Seeds
are reported as mean and standard deviation.
"""

from __future__ import annotations

import csv
import gzip
import math
import os

from ..chemistry.representation import of_manifest
from ..data.manifest import Manifest
from ..errors import MoldsError


def moses_reference(manifest, split: str, reference: tuple[str, list[str]] | None = None):
    """The reference set of MOSES's similarity metrics: a SMILES file's (name, SMILES) as
    ``_reference_file`` reads it (MOSES's own test.csv, one SMILES per line or a CSV with a
    SMILES column), or the whole ``split``."""
    from ..metrics.generation import ReferenceSet, reference_smiles  # here: molds-eval --help loads no RDKit or pyarrow

    if reference:
        return ReferenceSet(reference[1])
    return ReferenceSet(reference_smiles(manifest, split, limit=1 << 30))


def smiles_cells(path: str, what: str, *, need_column: bool, column: str | None = None) -> tuple[bool, list[str]]:
    """The cells of a SMILES file, gzipped or not (MOSES ships test.csv.gz): a ``.csv`` /
    ``.tsv`` by its SMILES column (``column``, matched exactly, else but for case; None: a
    column called SMILES in any case, else the first column, or refused with
    ``need_column``), any other file by its lines; each cell stripped, an empty one ''.
    Returns (whether it was a table, the cells). molds-eval's and molds-score's reader."""
    plain = (path[:-3] if path.endswith(".gz") else path).lower()
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as fh:
            if not plain.endswith((".csv", ".tsv")):
                return False, [line.strip() for line in fh]
            rows = csv.reader(fh, delimiter="\t" if plain.endswith(".tsv") else ",")
            header = next(rows, None)
            if header is None:
                raise MoldsError(f"{path}: no {what}")
            names = [h.strip() for h in header]
            wanted = column if column is not None else "smiles"
            match = [i for i, h in enumerate(names) if h == wanted] or \
                [i for i, h in enumerate(names) if h.lower() == wanted.lower()]
            if len(match) != 1 and column is not None:
                found = "columns that match" if match else "no column"
                raise MoldsError(f"{path}: {found} {column!r} (its header is {header}); give --smiles_column")
            if len(match) != 1 and need_column:
                raise MoldsError(f"{path}: a {plain.rsplit('.', 1)[-1]} file of {what} needs "
                                 f"{'one' if match else 'a'} SMILES column; its header is {header}")
            col = match[0] if len(match) == 1 else 0
            return True, [r[col].strip() if len(r) > col else "" for r in rows if r]
    except UnicodeDecodeError as exc:
        raise MoldsError(f"{path}: not UTF-8 text ({exc})") from exc
    except (OSError, EOFError) as exc:
        raise MoldsError(f"{path}: cannot read {what} ({exc})") from exc


def read_smiles_file(path: str) -> list[str]:
    """A reference set: the SMILES of a CSV column, or the first field of each line of a
    ``.smi`` (a name may follow); empty rows skipped."""
    table, cells = smiles_cells(path, "SMILES", need_column=False)
    return [c if table else c.split()[0] for c in cells if c]


def read_samples_file(path: str) -> list:
    """Samples, one per line, or a ``.csv`` / ``.tsv`` by its SMILES column (what MOSES's
    scripts and many tools write). Every line or row is a sample, an empty one a sample that
    failed (None): none is dropped, so validity counts the failures."""
    _, cells = smiles_cells(path, "samples", need_column=True)
    if not cells:
        raise MoldsError(f"{path}: no samples")
    return [c or None for c in cells]


def _reference_file(path: str | None):
    """(name, SMILES) of ``--reference``, or None."""
    return (path, read_smiles_file(path)) if path else None


def split_token_lengths(manifest, split: str, limit: int = 20000):
    """Token lengths of up to ``limit`` rows of ``split`` (a uniform draw over its rows)."""
    import numpy as np  # here: molds-eval --help loads no NumPy

    from ..metrics.generation import draw_rows  # here: molds-eval --help loads no RDKit or pyarrow

    return np.asarray(draw_rows(manifest, split, "token_length", limit, seed=0), dtype=float)


def evaluate_checkpoint(checkpoint: str, *, manifest_dir: str | None = None, split: str = "test",
                        num: int = 10000, seeds=(0,), temperature: float = 1.0, top_k: int = 0,
                        max_batches: int = 0, fcd: bool = False, batch_size: int = 512, moses: bool = False,
                        reference_file: str | None = None, conformers: bool = False, beams: int = 10,
                        augment: int = 1, verify_with: str | None = None) -> dict:
    import numpy as np  # here: molds-eval --help loads no NumPy

    from ..checkpoint import open_checkpoint  # here: molds-eval --help loads no torch or NumPy
    from ..metrics.distribution import (  # here: molds-eval --help loads no torch or RDKit
        histogram, reference_properties,
    )
    from ..metrics.property import mean_std  # here: molds-eval --help loads no RDKit or scikit-learn
    from ..models.loss import build_loss  # here: molds-eval --help loads no torch or Triton
    from .sampling import (  # here: molds-eval --help loads no torch or NumPy
        default_max_tokens, forbidden_tokens, ids_to_texts, sample_ids, texts_to_smiles,
    )
    from .scoring import (  # here: molds-eval --help loads no torch or Triton
        model_forward, property_predictions, property_report, split_data_config, split_loss,
    )

    loaded = open_checkpoint(checkpoint, manifest_dir)
    m = loaded.manifest
    report = {"checkpoint": os.path.abspath(loaded.checkpoint), "manifest": m.path, "split": split,
              "family": loaded.family, "step": loaded.lineage.get("step")}
    if not m.shards(split):
        raise MoldsError(f"{m.path} has no rows in split {split!r}")
    model_cfg = loaded.recipe["model"]
    forward = model_forward(loaded.model, build_loss(model_cfg))
    if verify_with and m.pairs is None:
        raise MoldsError(f"--verify_with checks a retro model's predictions; {loaded.checkpoint} is no pair model")
    if m.pairs is not None:  # a pair model (a decoder, or the encoder-decoder): its loss, and the top-k of its beams
        from .pairs import evaluate_pairs  # here: molds-eval --help loads no torch or NumPy

        cfg = split_data_config(loaded.recipe["data"], m.path, split,
                                mode="bucketed" if loaded.family == "seq2seq" else "packed")
        total, count = split_loss(forward, loaded.family, cfg, max_batches=max_batches)
        report["loss"] = total / count
        report["perplexity"] = math.exp(min(report["loss"], 50.0))
        report["pairs"] = evaluate_pairs(loaded, split, num=num, beams=beams, batch_size=min(batch_size, 64),
                                         augment=augment, seed=seeds[0],
                                         verify=open_checkpoint(verify_with) if verify_with else None)
        scored = ("top", "invalid", "similarity", "returns", "delta", "abs_delta", "round_trip")
        report["metrics"] = {k: v for k, v in report["pairs"].items() if k.startswith(scored)}
    elif loaded.family == "decoder":
        from ..metrics.generation import generation_metrics  # here: molds-eval --help loads no RDKit or pyarrow

        cfg = split_data_config(loaded.recipe["data"], m.path, split, mode="packed")
        total, count = split_loss(forward, "decoder", cfg, max_batches=max_batches)
        report["loss"] = total / count
        report["perplexity"] = math.exp(min(report["loss"], 50.0))
        max_tokens = default_max_tokens(m, model_cfg["max_position_embeddings"])
        representation = of_manifest(m)
        ref_file = _reference_file(reference_file)  # read once, for both
        reference = moses_reference(m, split, ref_file) if moses or ref_file else None
        properties = reference_properties(m, split, reference=ref_file)
        ref_lengths = split_token_lengths(m, split)
        per_seed = []
        for seed in seeds:
            ids = sample_ids(loaded.model, num, bos=loaded.specials.bos, eos=loaded.specials.eos,
                             max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed,
                             batch_size=batch_size, forbid=forbidden_tokens(loaded.recipe, loaded.specials))
            texts = ids_to_texts(loaded.tokenizer, ids)
            smiles = texts_to_smiles(texts, representation)
            metrics = generation_metrics(smiles, m, fcd_reference=split if fcd else None, seed=seed,
                                         moses_reference=reference, properties=properties)
            metrics["hit_length_limit"] = sum(i is None for i in ids) / len(ids)
            lengths = np.asarray([len(i) for i in ids if i is not None], dtype=float)
            if len(lengths) and len(ref_lengths):
                metrics.setdefault("histograms", {})["token_length"] = histogram(lengths, ref_lengths, integer=True)
            metrics["unfinished_or_special"] = sum(t is None for t in texts)
            metrics["decodable"] = sum(s is not None for s in smiles) / len(smiles)
            if conformers:
                metrics.update(_conformer_metrics(texts, representation))
            per_seed.append(metrics)
            report.setdefault("examples", [s for s in smiles if s][:20])
        report["sampling"] = {"num": num, "temperature": temperature, "top_k": top_k, "max_tokens": max_tokens,
                              "seeds": list(seeds), "representation": representation.name,
                              "softmax": "float32 (whatever the model's precision)"}
        report["per_seed"] = per_seed
        report["metrics"] = mean_std(per_seed)
    elif loaded.family == "seq2seq":  # pretrained by denoising: the loss of writing each masked molecule whole
        cfg = split_data_config(loaded.recipe["data"], m.path, split, mode="bucketed")
        total, count = split_loss(forward, "seq2seq", cfg, max_batches=max_batches)
        report["loss"] = total / count
        report["metrics"] = {"denoising_loss": total / count, "denoising_perplexity": math.exp(min(total / count, 50.0))}
    elif model_cfg["num_tasks"]:
        cfg = split_data_config(loaded.recipe["data"], m.path, split, mode="bucketed", with_labels=True,
                                mlm_probability=0.0)
        y, p = property_predictions(forward, cfg, features=loaded.model.config.molecule_features)
        report["property"] = property_report(y, p, model_cfg, m)
        from .plots import property_figure, roc_points  # here: molds-eval --help loads no matplotlib or scikit-learn

        names = list(report["property"]["per_task"])
        if model_cfg["task_type"] == "classification":
            report["property"]["roc"] = roc_points(y, p, names)
        report["_figure"] = property_figure(y, p, names, model_cfg["task_type"])
        report["metrics"] = {k: v for k, v in report["property"]["macro"].items() if not k.endswith("_tasks")}
    else:
        prob = loaded.recipe["data"].get("mlm_probability") or 0.15
        cfg = split_data_config(loaded.recipe["data"], m.path, split, mode="bucketed", mlm_probability=prob,
                                with_labels=False)
        total, count = split_loss(forward, "encoder", cfg, max_batches=max_batches)
        report["metrics"] = {"mlm_loss": total / count, "mlm_perplexity": math.exp(min(total / count, 50.0))}
    return report


def _conformer_metrics(texts: list, representation) -> dict:
    if representation.name != "conformer":
        raise MoldsError(f"--conformers: the model spells {representation.name}, not conformer units "
                         f"(molds-preprocess --conformers etkdg or --unit-template)")
    from ..chemistry.conformers import conformer_metrics  # here: molds-eval --help loads no RDKit or NumPy

    return conformer_metrics(texts)


def evaluate_samples(path: str, manifest_dir: str, *, split: str = "test", fcd: bool = False, moses: bool = False,
                     reference_file: str | None = None, conformers: bool = False) -> dict:
    """Generation metrics of a SMILES file (another tool's samples, say) against a manifest;
    with ``conformers``, a file of conformer units (``molds-sample --raw``), scored as
    molecules (their SMILES) and as conformers."""
    from ..metrics.distribution import reference_properties  # here: molds-eval --help loads no torch or RDKit
    from ..metrics.generation import generation_metrics  # here: molds-eval --help loads no RDKit or pyarrow

    lines = read_samples_file(path)
    m = Manifest.load(manifest_dir)
    m.require_molecules("molds-eval --samples")
    smiles = lines
    if conformers:
        from .sampling import texts_to_smiles  # here: molds-eval --help loads no torch or NumPy

        smiles = texts_to_smiles(lines, of_manifest(m))
    ref_file = _reference_file(reference_file)  # read once, for both
    reference = moses_reference(m, split, ref_file) if moses or ref_file else None
    metrics = generation_metrics(smiles, m, fcd_reference=split if fcd else None, moses_reference=reference,
                                 properties=reference_properties(m, split, reference=ref_file))
    if conformers:
        metrics.update(_conformer_metrics(lines, of_manifest(m)))
    histograms = metrics.pop("histograms", {})
    return {"checkpoint": None, "samples_file": os.path.abspath(path), "manifest": m.path, "split": split,
            "family": "samples", "metrics": metrics, "histograms": histograms,
            "examples": [s for s in smiles if s][:20]}
