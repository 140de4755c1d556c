"""Evaluation during training: ``eval.interval_steps`` (smoke) and ``eval.full_interval_steps``.

Runs on every rank inside the training loop; the metrics land as ``eval/*`` scalars in
TensorBoard and ``metrics.jsonl``. Decoders: loss and perplexity, sampled molecules'
metrics, a grid image of them, their SMILES and length histograms. Pair models (a decoder or
the encoder-decoder on a manifest of pairs): loss and perplexity, and the top-k accuracy of
their beams. Encoders: masked-token
loss and perplexity, and in full evaluations the property metrics (macro AUROC, AUPRC,
BEDROC, EF@1 %, or RMSE, MAE, Spearman) on the split's labels. At the end: the run's
hparams with the final metrics.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from molds.checkpoint.state import load_canonical
from molds.chemistry.features import feature_set
from molds.chemistry.representation import of_manifest
from molds.errors import RecipeError
from molds.eval.evaluate import split_token_lengths
from molds.eval.pairs import TOP_KS, predict, read_back, rows_budget, sides_of, split_pairs, topk_accuracy
from molds.eval.sampling import default_max_tokens, forbidden_tokens, ids_to_texts, sample_ids, texts_to_smiles
from molds.models import build_model
from molds.runtime.distributed import all_have, all_reduce_sum, gather_objects

from .scoring import property_predictions, property_report, split_data_config, split_loss


class TrainingEvaluator:
    """``eval.*`` during training, on every rank (ranks agree on every forward, so it is
    safe under ZeRO-3): loss / perplexity on the split, and for decoders samples drawn by
    all ranks, gathered and scored on rank 0. Full evaluations add the metrics against
    the training split and the pictures (grid, text, length histogram)."""

    def __init__(self, recipe, engine, dist, manifest, specials, log):
        self.recipe, self.engine, self.dist, self.manifest, self.specials, self.log = (
            recipe, engine, dist, manifest, specials, log)
        ev = recipe.eval
        self.enabled = bool(ev.interval_steps or ev.full_interval_steps)
        if self.enabled and not manifest.shards(ev.split):
            raise ValueError(f"eval.split={ev.split!r}: {manifest.path} has no rows in that split")
        self.family = recipe.model.family
        self.pairs = manifest.pairs is not None and self.family in ("decoder", "seq2seq")
        if self.enabled and self.pairs and recipe.parallel.engine == "zero" and recipe.parallel.zero_stage == 3:
            raise RecipeError("eval on pairs searches beams with the whole model on every rank; ZeRO-3 partitions "
                              "it: set eval.interval_steps and eval.full_interval_steps to 0 and score the "
                              "checkpoints with molds-eval, or train with zero_stage 2")
        self.tokenizer = None
        self.train_lengths = None
        self.final: dict = {}
        self.verified = False

    def due(self, step: int) -> str | None:
        ev = self.recipe.eval
        if not self.enabled:
            return None
        if ev.full_interval_steps and step % ev.full_interval_steps == 0:
            return "full"
        if ev.interval_steps and step % ev.interval_steps == 0:
            return "smoke"
        return None

    def _agree(self, flag: bool) -> bool:
        return all_have(flag, self.dist)

    def _any(self, flag: bool) -> bool:
        return not all_have(not flag, self.dist)

    def run(self, step: int, kind: str) -> dict:
        ev, model, dist = self.recipe.eval, self.engine.model, self.dist
        forward = self.engine.eval_forward
        was_training = model.training if model is not None else True
        if model is not None:
            model.eval()
        values = {}
        try:
            # encoders: the masked-token loss alone (label losses are scored as metrics below)
            extra = ({"mlm_probability": self.recipe.data.mlm_probability or 0.15, "with_labels": False}
                     if self.family == "encoder" else {})
            # the split's shards are checked (data.verify) at the first evaluation only
            extra["verify"] = "off" if self.verified else self.recipe.data.verify
            cfg = split_data_config(dataclasses.asdict(self.recipe.data), self.recipe.data.manifest, ev.split, **extra)
            topo = self.engine.topology
            features = feature_set(self.recipe.model.molecule_features) if self.family == "encoder" else ""
            total, count = split_loss(forward, self.family, cfg, rank=topo.dp_rank, world=topo.dp_size,
                                      max_batches=ev.max_batches, device=dist.device, any_have=self._any,
                                      features=features)
            self.verified = True
            if topo.pp_size > 1 and topo.pp_rank != topo.pp_size - 1:
                total = count = 0.0  # the last stage of each pipeline holds the loss
            total, count = all_reduce_sum([total, count], dist)
            if count:
                values["eval/loss"] = total / count
                values["eval/perplexity"] = math.exp(min(total / count, 50.0))
            samples = predictions = beams = None
            if self.pairs:
                beams = gather_objects(self._predict_pairs(kind), dist)
            elif self.family == "decoder" and (model is not None or hasattr(self.engine, "gather_weights")):
                samples = self._sample(ev.full_samples if kind == "full" else ev.samples, step)
                samples = [s for part in gather_objects(samples, dist) for s in part]
            elif kind == "full" and self.recipe.model.num_tasks:
                cfg = split_data_config(dataclasses.asdict(self.recipe.data), self.recipe.data.manifest, ev.split,
                                   mlm_probability=0.0, with_labels=True, verify="off")
                predictions = gather_objects(property_predictions(
                    forward, cfg, rank=topo.dp_rank, world=topo.dp_size, device=dist.device, any_have=self._any,
                    features=features),
                    dist)
        finally:
            if model is not None:
                model.train(was_training)
        if dist.is_main and samples is not None:
            values.update(self._score(samples, step, kind))
        if dist.is_main and beams is not None:
            values.update(self._score_pairs(beams, kind, step))
        if dist.is_main and predictions is not None:
            values.update(self._score_properties(predictions, step))
        self.log.scalars(step, values)
        if kind == "full":
            self.final = values
        return values

    def _predict_pairs(self, kind: str) -> list:
        """This rank's share of the split's first pairs, each with its beams read back as
        canonical sides: (predictions, target) pairs. A smoke evaluation decodes greedily."""
        if self.tokenizer is None:
            from transformers import AutoTokenizer  # here: a rank that only trains loads no transformers

            self.tokenizer = AutoTokenizer.from_pretrained(self.specials.path, local_files_only=True)
        ev, dist = self.recipe.eval, self.dist
        rows = split_pairs(self.manifest, ev.split, ev.full_samples if kind == "full" else ev.samples)
        mine = rows[dist.rank::dist.world_size]
        if not mine:
            return []
        model = self.engine.model if self.engine.model is not None else self._gathered_model()
        max_tokens = rows_budget(rows, model)  # every rank the same
        with self.engine.autocast():
            hyps = predict(model, self.specials, [r["source_token_ids"] for r in mine],
                           beams=ev.beams if kind == "full" else 1, max_tokens=max_tokens, batch_size=32)
        return list(zip(read_back(self.tokenizer, hyps, sides_of(self.manifest)), [r["target_smiles"] for r in mine]))

    def _score_pairs(self, parts: list, kind: str, step: int) -> dict:
        found = [x for part in parts for x in part]
        if not found:
            return {}
        beams = self.recipe.eval.beams if kind == "full" else 1
        ks = tuple(k for k in TOP_KS if k <= beams)
        acc = topk_accuracy([p for p, _ in found], [t for _, t in found], ks)
        shown = "\n".join(f"    {t}  <-  {(p[0].side or '(invalid)') if p else '(none)'}" for p, t in found[:32])
        self.log.text("eval/predictions", shown, step)
        return {f"eval/{k}": v for k, v in acc.items() if k != "inputs"}

    def _score_properties(self, parts: list, step: int) -> dict:
        from molds.eval.plots import (  # here: a rank that only trains loads no matplotlib or scikit-learn
            figure_rgb, property_figure,
        )

        parts = [(y, p) for y, p in parts if len(y)]
        if not parts:
            return {}
        labels, preds = np.concatenate([y for y, _ in parts]), np.concatenate([p for _, p in parts])
        report = property_report(labels, preds, dataclasses.asdict(self.recipe.model), self.manifest)
        macro = report["macro"]
        figure = property_figure(labels, preds, list(report["per_task"]), self.recipe.model.task_type)
        if figure is not None:
            self.log.image("eval/roc" if figure[0] == "roc" else "eval/parity", figure_rgb(figure[1]), step)
        return {f"eval/{k}": v for k, v in macro.items() if not k.endswith("_tasks") and v is not None}

    def _sample(self, total: int, step: int) -> list:
        """(text, SMILES, hit the length limit) of each sample: what the tokens spell, the
        molecule it decodes to, and whether it never ended."""
        if self.tokenizer is None:
            from transformers import AutoTokenizer  # here: a rank that only trains loads no transformers

            self.tokenizer = AutoTokenizer.from_pretrained(self.specials.path, local_files_only=True)
        ev, dist = self.recipe.eval, self.dist
        per_rank = max(1, -(-total // dist.world_size))
        model = self.engine.model if self.engine.model is not None else self._gathered_model()
        with self.engine.autocast():
            ids = sample_ids(model, per_rank, bos=self.specials.bos, eos=self.specials.eos,
                             max_tokens=default_max_tokens(self.manifest, self.recipe.model.max_position_embeddings),
                             temperature=ev.temperature, top_k=ev.top_k, batch_size=min(per_rank, 1024),
                             seed=self.recipe.run.seed * 1000003 + step * 101 + dist.rank, device=dist.device,
                             stop_together=self._agree,
                             forbid=forbidden_tokens(dataclasses.asdict(self.recipe), self.specials))
        texts = ids_to_texts(self.tokenizer, ids)
        return list(zip(texts, texts_to_smiles(texts, of_manifest(self.manifest)), [i is None for i in ids]))

    def _gathered_model(self):
        """An engine whose ranks each hold a part of the model (the pipeline's stages):
        the whole single-device model, built on every rank from the gathered weights for
        this evaluation's samples and dropped after it (so each rank holds the whole model
        while it samples)."""
        weights = self.engine.gather_weights()
        model = build_model(self.recipe.model, self.specials, seed=self.recipe.run.seed)
        load_canonical(model, weights, "the pipeline's gathered stages")
        return model.to(self.dist.device).eval()

    def _score(self, samples: list, step: int, kind: str) -> dict:
        from molds.metrics.distribution import (  # here: a rank that only trains loads no RDKit or SciPy
            reference_properties,
        )
        from molds.metrics.generation import (  # here: a rank that only trains loads no RDKit
            generation_metrics, parse_samples, unique_at,
        )

        ev = self.recipe.eval
        texts, smiles = [t for t, _, _ in samples], [s for _, s, _ in samples]
        if kind == "smoke":
            parsed = parse_samples(smiles, self.manifest)
            canon = [p["canonical"] for p in parsed if p is not None]
            return {"eval/validity": len(canon) / len(smiles), "eval/unique": unique_at(canon, len(canon))}
        # the FCD and property references are the same molecules at every evaluation (a
        # fixed draw of the split), so that their figures over a run are a trajectory
        m = generation_metrics(smiles, self.manifest, fcd_reference=ev.split if ev.fcd else None, seed=step,
                               properties=reference_properties(self.manifest, ev.split))
        values = {f"eval/{k.replace('@', '_at_')}": v for k, v in m.items()
                  if isinstance(v, float) and k not in ("unique@1k", "unique@10k")}
        for name, h in m.get("histograms", {}).items():
            self.log.binned(f"eval/property/{name}", h["edges"], h["samples"], step)
            self.log.binned(f"eval/reference/{name}", h["edges"], h["reference"], step)
        values["eval/hit_length_limit"] = sum(hit for _, _, hit in samples) / len(samples)
        values["eval/unfinished_or_special"] = sum(t is None for t in texts) / len(texts)
        values["eval/decodable"] = sum(s is not None for s in smiles) / len(smiles)
        self._pictures(texts, smiles, step)
        return values

    def _pictures(self, texts: list, smiles: list, step: int) -> None:
        self.log.molecules("eval/samples_grid", smiles, step, self.recipe.eval.grid)
        shown = "\n".join(f"    {s if s else '(unfinished, or holds a special token)'}" for s in smiles[:64])
        self.log.text("eval/samples", shown, step)
        lengths = [len(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts if t]
        self.log.histogram("eval/sample_token_length", lengths, step)
        if self.train_lengths is None:  # up to ~20k training lengths, every shard in proportion
            self.train_lengths = split_token_lengths(self.manifest, "train")
        self.log.histogram("eval/train_token_length", self.train_lengths, step)
