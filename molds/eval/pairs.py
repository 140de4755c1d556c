"""Predictions of a pair model (reaction prediction, retrosynthesis, Mol2Mol) and their
accuracy, as the field reports it: the top-k exact match of canonical molecules.

A decoder trained on a manifest of pairs completes the prompt ``BOS source SEP`` with the
target and ``EOS``; the encoder-decoder (``model.family: seq2seq``) encodes the source and
writes the target. ``predict`` runs the beam search (``molds.eval.beam``) on each source and
returns its best ``beams`` hypotheses. A hypothesis is read back as a side the way the ETL
reads one (``molds.pairs.PairCanonicalizer.molecules``: each molecule canonicalized with the
manifest's options, the molecules sorted), so a prediction matches its target exactly when
it spells the same molecules in any order or spelling. One that does not parse is invalid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .beam import DecoderSteps, Hypothesis, Seq2SeqSteps, beam_search

TOP_KS = (1, 3, 5, 10)


@dataclass
class Prediction:
    """One hypothesis read back: its canonical side (None: invalid), its text and score."""

    side: str | None
    text: str
    score: float
    ended: bool


def sides_of(manifest):
    """The ``PairCanonicalizer`` that reads a side as the manifest's ETL wrote its pairs (its
    canonicalization options, task and reagent policy)."""
    from ..chem import ChemOptions
    from ..pairs import PairCanonicalizer, PairOptions

    info = manifest.pairs or {}
    return PairCanonicalizer(ChemOptions.of_manifest(manifest),
                             PairOptions(info.get("task", "forward"), info.get("reagents", "auto")))


def encoder_decoder(model) -> bool:
    """Is ``model`` the encoder-decoder (``molds.models.seq2seq``), which reads the source in
    its encoder, rather than a decoder completing a prompt?"""
    from ..models.seq2seq import Seq2SeqModel

    return isinstance(model, Seq2SeqModel)


def target_budget(longest_source: int, longest_target: int, limit: int, asked: int = 0,
                  encoder_decoder: bool = False) -> int:
    """Tokens a prediction may take: ``asked``, else 1.5 x the longest target + 8; never past
    the model's ``limit`` positions: after the longest prompt (BOS source SEP) for a decoder,
    after the decoder's start token for the encoder-decoder."""
    budget = asked or int(1.5 * longest_target) + 8
    return max(1, min(budget, limit - 1 if encoder_decoder else limit - longest_source - 2))


def forbidden_in_targets(specials) -> tuple[int, ...]:
    """Tokens a target never holds (BOS, SEP, PAD, MASK, UNK): never chosen by the search."""
    return tuple(sorted({t for t in (specials.bos, specials.sep, specials.pad, specials.mask, specials.unk)
                         if t is not None}))


@torch.no_grad()
def predict(model, specials, sources: list[list[int]], *, beams: int, max_tokens: int, length_penalty: float = 1.0,
            batch_size: int = 64, early_stopping: str = "heuristic") -> list[list[Hypothesis]]:
    """The best ``beams`` hypotheses of each source (its token ids, without BOS and SEP), in
    the order of ``sources``. Sources of one length are searched together. A decoder completes
    ``BOS source SEP``; the encoder-decoder encodes ``BOS source EOS`` (as it was trained,
    ``molds.data.bucketing``) and decodes from ``BOS``."""
    device = next(model.parameters()).device
    seq2seq = encoder_decoder(model)
    by_length: dict[int, list[int]] = {}
    for i, src in enumerate(sources):
        by_length.setdefault(len(src), []).append(i)
    out: list[list[Hypothesis] | None] = [None] * len(sources)
    forbid = forbidden_in_targets(specials)
    for length in sorted(by_length):
        order = by_length[length]
        for lo in range(0, len(order), batch_size):
            chosen = order[lo:lo + batch_size]
            if seq2seq:
                ids = torch.tensor([[specials.bos, *sources[i], specials.eos] for i in chosen], dtype=torch.long,
                                   device=device)
                steps = Seq2SeqSteps(model, ids, torch.ones_like(ids), specials.bos)
            else:
                steps = DecoderSteps(model, torch.tensor([[specials.bos, *sources[i], specials.sep] for i in chosen],
                                                         dtype=torch.long, device=device))
            found = beam_search(steps, beams=beams, eos=specials.eos, max_tokens=max_tokens,
                                length_penalty=length_penalty, early_stopping=early_stopping, forbid=forbid)
            for i, hyps in zip(chosen, found):
                out[i] = hyps
    return out


def read_back(tokenizer, hypotheses: list[list[Hypothesis]], sides) -> list[list[Prediction]]:
    """Each hypothesis as a canonical side (``sides``: a ``PairCanonicalizer``), None when
    it did not end or does not parse."""
    from .sampling import ids_to_texts

    out = []
    for hyps in hypotheses:
        texts = ids_to_texts(tokenizer, [h.ids if h.ended else None for h in hyps])
        row = []
        for h, text in zip(hyps, texts):
            side = None
            if text:
                got = sides.molecules(text)
                if not isinstance(got, str) and got[0]:
                    side = ".".join(got[0])
            row.append(Prediction(side, text or "", h.score, h.ended))
        out.append(row)
    return out


def topk_accuracy(predictions: list[list[Prediction]], targets: list[str], ks=TOP_KS) -> dict:
    """``top{k}``: the share of inputs whose target is among their first k predictions
    (exact match of canonical sides); ``invalid_beams``: the share of all predictions that
    are no molecules (or never ended); ``invalid_top1``: the share of first predictions;
    ``top1_score``: the mean score of the first predictions."""
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    n = max(1, len(targets))
    out = {}
    for k in ks:
        out[f"top{k}"] = sum(any(p.side == t for p in preds[:k]) for preds, t in zip(predictions, targets)) / n
    beams = [p for preds in predictions for p in preds]
    out["invalid_beams"] = sum(p.side is None for p in beams) / max(1, len(beams))
    out["invalid_top1"] = sum(not preds or preds[0].side is None for preds in predictions) / n
    firsts = [preds[0].score for preds in predictions if preds]
    out["top1_score"] = sum(firsts) / max(1, len(firsts))  # the model's confidence in its first beam
    out["inputs"] = len(targets)
    return out


def split_pairs(manifest, split: str, num: int) -> list[dict]:
    """The first ``num`` pairs of a split, in the manifest's order: compound_id, source_smiles,
    target_smiles, source_token_ids, target_length."""
    import pyarrow.parquet as pq

    rows: list[dict] = []
    columns = ["compound_id", "source_smiles", "target_smiles", "source_token_ids", "target_length"]
    for shard in manifest.shards(split):
        if len(rows) >= num:
            break
        rows.extend(pq.read_table(shard.path, columns=columns).slice(0, num - len(rows)).to_pylist())
    return rows


def rows_budget(rows: list[dict], model, asked: int = 0) -> int:
    """``target_budget`` for the pairs ``split_pairs`` read, predicted by ``model``."""
    return target_budget(max(len(r["source_token_ids"]) for r in rows), max(r["target_length"] for r in rows),
                         model.config.max_position_embeddings, asked, encoder_decoder(model))


def similarity_to_source(predictions: list[list[Prediction]], sources: list[str]) -> dict:
    """Mol2Mol: over the valid first predictions, the mean Tanimoto similarity (Morgan radius
    2, 2,048 bits) to the source, the share that return the source, and the mean change of
    logP (Crippen), QED and molecular weight from the source to the prediction (signed, and
    absolute as ``abs_delta_*``)."""
    from rdkit import Chem, DataStructs
    from rdkit.Chem import QED, Crippen, Descriptors, rdFingerprintGenerator

    gen = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    props = {"logp": Crippen.MolLogP, "qed": QED.qed, "mw": Descriptors.MolWt}
    sims, same, deltas = [], 0, {k: [] for k in props}
    for preds, src in zip(predictions, sources):
        if not preds or preds[0].side is None:
            continue
        a, b = Chem.MolFromSmiles(preds[0].side), Chem.MolFromSmiles(src)
        if a is None or b is None:
            continue
        sims.append(DataStructs.TanimotoSimilarity(gen.GetFingerprint(a), gen.GetFingerprint(b)))
        same += preds[0].side == src
        for k, f in props.items():
            deltas[k].append(f(a) - f(b))
    n = max(1, len(sims))
    out = {"similarity_to_source": sum(sims) / n, "returns_source": same / n, "scored": len(sims)}
    for k, d in deltas.items():
        out[f"delta_{k}"] = sum(d) / n
        out[f"abs_delta_{k}"] = sum(abs(x) for x in d) / n
    return out


def evaluate_pairs(loaded, split: str, *, num: int = 1000, beams: int = 10, max_tokens: int = 0,
                   length_penalty: float = 1.0, batch_size: int = 64) -> dict:
    """Top-k accuracy of a pair checkpoint (``open_checkpoint``'s result) on ``num`` pairs of
    ``split``: its beams' canonical sides against each target."""
    m = loaded.manifest
    info = m.pairs
    rows = split_pairs(m, split, num)
    if not rows:
        raise ValueError(f"{m.path} has no pairs in split {split!r}")
    max_tokens = rows_budget(rows, loaded.model, max_tokens)
    hyps = predict(loaded.model, loaded.specials, [r["source_token_ids"] for r in rows], beams=beams,
                   max_tokens=max_tokens, length_penalty=length_penalty, batch_size=batch_size)
    preds = read_back(loaded.tokenizer, hyps, sides_of(m))
    ks = tuple(k for k in TOP_KS if k <= beams)
    report = {"task": info.get("task"), "split": split, "beams": beams, "max_tokens": max_tokens,
              "length_penalty": length_penalty, **topk_accuracy(preds, [r["target_smiles"] for r in rows], ks)}
    if info.get("task") == "mol2mol":
        report.update(similarity_to_source(preds, [r["source_smiles"] for r in rows]))
    report["examples"] = [{"source": r["source_smiles"], "target": r["target_smiles"],
                           "predictions": [p.side or p.text for p in ps[:3]]} for r, ps in zip(rows[:10], preds)]
    return report
