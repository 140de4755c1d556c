"""Predictions of a pair model (reaction prediction, retrosynthesis, Mol2Mol) and their
accuracy, as the field reports it: the top-k exact match of canonical molecules.

A decoder trained on a manifest of pairs completes the prompt ``BOS source SEP`` with the
target and ``EOS``; the encoder-decoder (``model.family: seq2seq``) encodes the source and
writes the target. ``predict`` runs the beam search (``molds.eval.beam``) on each source and
returns its best ``beams`` hypotheses. A hypothesis is read back as a side the way the ETL
reads one (``molds.chemistry.pairs.PairCanonicalizer.molecules``: each molecule canonicalized with the
manifest's options, the molecules sorted), so a prediction matches its target exactly when
it spells the same molecules in any order or spelling. One that does not parse is invalid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from ..chemistry import fingerprints, quiet_rdkit
from ..chemistry.canonical import ChemOptions
from ..chemistry.tasks import direction
from ..errors import MoldsError
from .beam import DecoderSteps, Hypothesis, Seq2SeqSteps, beam_search
from .sampling import ids_to_texts

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
    from ..chemistry.pairs import PairCanonicalizer, PairOptions  # here: molds-predict --help loads no RDKit

    info = manifest.pairs or {}
    return PairCanonicalizer(ChemOptions.of_manifest(manifest),
                             PairOptions(info.get("task", "forward"), info.get("reagents", "auto")))


def encoder_decoder(model) -> bool:
    """Is ``model`` the encoder-decoder (``molds.models.seq2seq``), which reads the source in
    its encoder, rather than a decoder completing a prompt?"""
    from ..models.seq2seq import Seq2SeqModel  # here: molds-predict --help loads no Triton

    return isinstance(model, Seq2SeqModel)


def fits(model, source_ids: list[int]) -> bool:
    """Does a source fit the model's positions: ``BOS source EOS`` in the encoder, or ``BOS
    source SEP`` and one target token in a decoder?"""
    return len(source_ids) + (2 if encoder_decoder(model) else 3) <= model.config.max_position_embeddings


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
    the order of ``sources``. Sources are searched ``batch_size`` at a time, shortest first,
    padded to the longest of their batch (its pads masked: each source decodes as it would
    alone). A decoder completes ``BOS source SEP`` (left-padded); the encoder-decoder encodes
    ``BOS source EOS`` (right-padded, as it was trained, ``molds.data.bucketing``) and
    decodes from ``BOS``."""
    device = next(model.parameters()).device
    seq2seq = encoder_decoder(model)
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out: list[list[Hypothesis] | None] = [None] * len(sources)
    forbid = forbidden_in_targets(specials)
    for lo in range(0, len(order), batch_size):
        chosen = order[lo:lo + batch_size]
        longest = max(len(sources[i]) for i in chosen)
        pads = [longest - len(sources[i]) for i in chosen]
        if seq2seq:
            ids = torch.tensor([[specials.bos, *sources[i], specials.eos] + [specials.pad] * p
                                for i, p in zip(chosen, pads)], dtype=torch.long, device=device)
            mask = torch.tensor([[1] * (longest + 2 - p) + [0] * p for p in pads], dtype=torch.long, device=device)
            steps = Seq2SeqSteps(model, ids, mask, specials.bos)
        else:
            ids = torch.tensor([[specials.pad] * p + [specials.bos, *sources[i], specials.sep]
                                for i, p in zip(chosen, pads)], dtype=torch.long, device=device)
            steps = DecoderSteps(model, ids, torch.tensor(pads, dtype=torch.long, device=device))
        found = beam_search(steps, beams=beams, eos=specials.eos, max_tokens=max_tokens,
                            length_penalty=length_penalty, early_stopping=early_stopping, forbid=forbid)
        for i, hyps in zip(chosen, found):
            out[i] = hyps
    return out


@torch.no_grad()
def generate_exported(hf_model, specials, source: list[int], *, beams: int, max_tokens: int,
                      length_penalty: float = 1.0) -> list[tuple[list[int], bool, float]]:
    """What transformers' ``generate(num_beams=beams)`` finds for one source on a model
    ``molds-export`` wrote, laid out as ``predict`` lays it out (``BOS source SEP`` for a
    decoder, ``BOS source EOS`` into the encoder-decoder): (tokens without the end token,
    ended, score) per beam, best first. The worked example of calling ``generate`` on an
    export, and the independent search ``predict`` is compared with."""
    seq2seq = bool(getattr(hf_model.config, "is_encoder_decoder", False))
    ids = torch.tensor([[specials.bos, *source, specials.eos if seq2seq else specials.sep]],
                       device=hf_model.device)
    out = hf_model.generate(ids, num_beams=beams, num_return_sequences=beams, max_new_tokens=max_tokens,
                            do_sample=False, length_penalty=length_penalty, early_stopping=False,
                            eos_token_id=specials.eos, pad_token_id=specials.pad, output_scores=True,
                            return_dict_in_generate=True,
                            # the encoder-decoder's export carries them in its generation config
                            **({} if seq2seq else {"suppress_tokens": list(forbidden_in_targets(specials))}))
    seqs = (out.sequences[:, 1:] if seq2seq else out.sequences[:, ids.shape[1]:]).tolist()
    ends = [(s[:s.index(specials.eos)], True) if specials.eos in s else (s, False) for s in seqs]
    return [(t, ended, score) for (t, ended), score in zip(ends, out.sequences_scores.tolist())]


def read_back(tokenizer, hypotheses: list[list[Hypothesis]], sides) -> list[list[Prediction]]:
    """Each hypothesis as a canonical side (``sides``: a ``PairCanonicalizer``), None when
    it did not end or does not parse."""
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


def distinct(preds: list[Prediction]) -> list[Prediction]:
    """The valid predictions of one beam list, each side once, in beam order: the candidates a
    chemist reads (two beams may spell one reactant set, as ``A.B`` and ``B.A``, or in two
    rootings after training on aligned spellings)."""
    seen: set[str] = set()
    out = []
    for p in preds:
        if p.side is not None and p.side not in seen:
            seen.add(p.side)
            out.append(p)
    return out


def vote(per_spelling: list[list[Prediction]], keep: int, alpha: float = 1.0) -> list[Prediction]:
    """Test-time augmentation's ranking (R-SMILES, Zhong et al. 2022) of one source's
    predictions from several of its spellings. In each spelling's list, the distinct valid
    sides in beam order, the k-th (from 0) voting 1 / (1 + ``alpha`` k); a side ranks by the
    best place it took in any spelling, then by its votes summed over the spellings, then by
    when it was first seen. The best ``keep``, each with its summed vote as its score and the
    text it was first seen as. Invalid hypotheses get no vote."""
    votes: dict[str, float] = {}
    best: dict[str, int] = {}
    first: dict[str, Prediction] = {}
    for preds in per_spelling:
        for place, p in enumerate(distinct(preds)):  # a side spelled twice votes once, at its first place
            votes[p.side] = votes.get(p.side, 0.0) + 1.0 / (1.0 + alpha * place)
            best[p.side] = min(best.get(p.side, place), place)
            first.setdefault(p.side, p)
    ranked = sorted(first, key=lambda side: (best[side], -votes[side]))  # stable: ties keep first-seen order
    return [Prediction(side, first[side].text, votes[side], True) for side in ranked[:keep]]


def topk_accuracy(predictions: list[list[Prediction]], targets: list[str], ks=TOP_KS) -> dict:
    """``top{k}``: the share of inputs whose target is among their first k distinct valid
    predictions (``distinct``: exact match of canonical sides; R-SMILES's count, where a beam
    that repeats an earlier reactant set or is no molecule takes no place);
    ``distinct_predictions``: their mean number per input; ``invalid_beams``: the share of
    all predictions that are no molecules (or never ended); ``invalid_top1``: the share of
    first predictions; ``top1_score``: the mean score of the first predictions."""
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    n = max(1, len(targets))
    kept = [distinct(preds) for preds in predictions]
    out = {}
    for k in ks:
        out[f"top{k}"] = sum(any(p.side == t for p in preds[:k]) for preds, t in zip(kept, targets)) / n
    out["distinct_predictions"] = sum(map(len, kept)) / n
    beams = [p for preds in predictions for p in preds]
    out["invalid_beams"] = sum(p.side is None for p in beams) / max(1, len(beams))
    out["invalid_top1"] = sum(not preds or preds[0].side is None for preds in predictions) / n
    firsts = [preds[0].score for preds in predictions if preds]
    out["top1_score"] = sum(firsts) / max(1, len(firsts))  # the model's confidence in its first beam
    out["inputs"] = len(targets)
    return out


@dataclass
class RoundTrip:
    """A retrosynthesis prediction given to a forward model: the forward model's first
    product (None: no molecule), its score, and whether it is the product asked for."""

    product: str | None
    score: float
    back: bool


def verifier(retro, forward) -> None:
    """Refuse, in one line, a round trip that is not retro then forward."""
    tasks = [(x.manifest.pairs or {}).get("task") for x in (retro, forward)]
    if tasks != ["retro", "forward"]:
        raise MoldsError(f"a round trip checks a retro model's predictions with a forward model: {retro.checkpoint} is "
                         f"{direction(retro.manifest.pairs)}, {forward.checkpoint} is {direction(forward.manifest.pairs)}")


def round_trip(forward, products: list[str], predictions: list[list[Prediction]], *, batch_size: int = 64,
               max_tokens: int = 0) -> list[list[RoundTrip | None]]:
    """Schwaller et al. (2020)'s check of retrosynthesis: each predicted set of reactants is
    given to a forward model (``forward``: ``open_checkpoint`` of a ``forward`` pair model,
    its own vocabulary and canonicalization), and its first prediction (greedy: one beam) is
    compared with the product. Per prediction: a ``RoundTrip``, or None where the prediction
    is no molecule or the forward model cannot read it (a token its vocabulary lacks, too
    long)."""
    fsides, tok, sp = sides_of(forward.manifest), forward.tokenizer, forward.specials
    jobs: dict[str, list[int]] = {}
    for preds in predictions:
        for p in preds:
            if p.side and p.side not in jobs:
                source, reason = fsides.source(p.side)
                ids = tok(source, add_special_tokens=False)["input_ids"] if reason is None else None
                if ids and sp.unk not in ids and fits(forward.model, ids):
                    jobs[p.side] = ids
    first: dict[str, Prediction] = {}
    if jobs:
        keys = list(jobs)
        longest = max(int(s.get("max_token_length", 0)) for s in forward.manifest.data["stats"]["splits"].values())
        budget = target_budget(max(len(v) for v in jobs.values()), longest,
                               forward.model.config.max_position_embeddings, max_tokens, encoder_decoder(forward.model))
        hyps = predict(forward.model, sp, [jobs[k] for k in keys], beams=1, max_tokens=budget, batch_size=batch_size)
        first = {k: preds[0] for k, preds in zip(keys, read_back(tok, hyps, fsides))}
    out = []
    for product, preds in zip(products, predictions):
        got = fsides.molecules(product)
        want = ".".join(got[0]) if not isinstance(got, str) else None
        out.append([None if p.side not in first else
                    RoundTrip(first[p.side].side, first[p.side].score,
                              want is not None and first[p.side].side == want) for p in preds])
    return out


def round_trip_accuracy(checks: list[list[RoundTrip | None]]) -> dict:
    """``round_trip_top1``: the share of inputs whose first prediction the forward model turns
    back into the product; ``round_trip_beams``: the share of all predictions that do (a
    prediction that is no molecule, or that the forward model cannot read, does not).
    ``molds-eval`` and ``molds-predict`` give it each input's distinct valid predictions
    (``distinct``), the candidates top-k counts."""
    n = max(1, len(checks))
    beams = [c for row in checks for c in row]
    return {"round_trip_top1": sum(bool(row) and row[0] is not None and row[0].back for row in checks) / n,
            "round_trip_beams": sum(c is not None and c.back for c in beams) / max(1, len(beams))}


def predict_augmented(loaded, sources: list[str], source_ids: list[list[int]], *, augment: int, beams: int,
                      longest_target: int, max_tokens: int = 0, length_penalty: float = 1.0, batch_size: int = 64,
                      seed: int = 0, sides=None) -> tuple[list[list[Prediction]], list[list[Prediction]], list[int], int]:
    """Test-time augmentation: each canonical source (``sources``, tokenized as ``source_ids``)
    and up to ``augment`` - 1 other spellings of it (``molds.chemistry.pairs.rooted_spellings``, drawn
    from ``seed``; a spelling with a token the vocabulary lacks or too long for the model is
    left out) are searched with ``beams`` beams, and each source's predictions are ranked by
    ``vote``. Returns (the voted predictions of each source, every spelling's own predictions,
    the spellings searched per source, the tokens a prediction could take)."""
    from ..chemistry.pairs import rooted_spellings  # here: molds-predict --help loads no RDKit

    sides = sides if sides is not None else sides_of(loaded.manifest)
    tok, sp, model = loaded.tokenizer, loaded.specials, loaded.model
    limit = model.config.max_position_embeddings
    seq2seq = encoder_decoder(model)
    rng = np.random.default_rng(seed)
    flat, owner = [], []
    for i, (text, ids) in enumerate(zip(sources, source_ids)):
        flat.append(list(ids))
        owner.append(i)
        for other in rooted_spellings(text, rng=rng, count=augment)[1:]:
            enc = tok(other, add_special_tokens=False)["input_ids"]
            if sp.unk not in enc and fits(model, enc):
                flat.append(enc)
                owner.append(i)
    budget = target_budget(max(len(x) for x in flat), longest_target, limit, max_tokens, seq2seq)
    raw = read_back(tok, predict(model, sp, flat, beams=beams, max_tokens=budget, length_penalty=length_penalty,
                                 batch_size=batch_size), sides)
    grouped: list[list[list[Prediction]]] = [[] for _ in sources]
    for i, preds in zip(owner, raw):
        grouped[i].append(preds)
    return [vote(g, beams) for g in grouped], raw, [len(g) for g in grouped], budget


def spread(total: int, num: int) -> list[int]:
    """``num`` positions of ``total`` rows, evenly spaced from the first (all of them when
    ``num`` >= ``total``). A split's shards are its length buckets, shortest first, so the
    first ``num`` rows would be its shortest pairs; evenly spaced rows take each bucket in its
    share, the same rows every time."""
    if num >= total:
        return list(range(total))
    return [(i * total) // num for i in range(num)]


def split_pairs(manifest, split: str, num: int) -> list[dict]:
    """``num`` pairs of a split (all when it holds no more), evenly spread over it in the
    manifest's order (``spread``): compound_id, source_smiles, target_smiles,
    source_token_ids, target_length."""
    import pyarrow.parquet as pq  # here: molds-predict --help loads no pyarrow

    shards = manifest.shards(split)
    wanted = spread(sum(s.num_rows for s in shards), max(0, num))
    rows: list[dict] = []
    columns = ["compound_id", "source_smiles", "target_smiles", "source_token_ids", "target_length"]
    first, j = 0, 0
    for shard in shards:
        end = first + shard.num_rows
        take = []
        while j < len(wanted) and wanted[j] < end:
            take.append(wanted[j] - first)
            j += 1
        if take:
            table = pq.read_table(shard.path, columns=columns)
            rows.extend(table.take(take).to_pylist() if len(take) < table.num_rows else table.to_pylist())
        first = end
    return rows


def rows_budget(rows: list[dict], model, asked: int = 0) -> int:
    """``target_budget`` for the pairs ``split_pairs`` read, predicted by ``model``."""
    return target_budget(max(len(r["source_token_ids"]) for r in rows), max(r["target_length"] for r in rows),
                         model.config.max_position_embeddings, asked, encoder_decoder(model))


@quiet_rdkit
def similarity_to_source(predictions: list[list[Prediction]], sources: list[str]) -> dict:
    """Mol2Mol: over the valid first predictions, the mean Tanimoto similarity (Morgan radius
    2, 2,048 bits) to the source, the share that return the source, and the mean change of
    logP (Crippen), QED and molecular weight from the source to the prediction (signed, and
    absolute as ``abs_delta_*``)."""
    from rdkit import Chem, DataStructs  # here: molds-predict --help loads no RDKit
    from rdkit.Chem import QED, Crippen, Descriptors  # here: molds-predict --help loads no RDKit

    gen = fingerprints.morgan(2, 2048)
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
                   length_penalty: float = 1.0, batch_size: int = 64, augment: int = 1, seed: int = 0,
                   verify=None) -> dict:
    """Top-k accuracy of a pair checkpoint (``open_checkpoint``'s result) on ``num`` pairs of
    ``split``: its beams' canonical sides against each target. With ``augment`` > 1, each
    source is also searched in ``augment`` - 1 other spellings and its predictions are
    ranked by their votes (``predict_augmented``); ``invalid_beams`` then counts over every
    spelling's beams, and ``top1_score`` is the first prediction's vote."""
    m = loaded.manifest
    info = m.pairs
    if verify is not None:
        verifier(loaded, verify)  # before the search: a wrong pair of models costs nothing
    rows = split_pairs(m, split, num)
    if not rows:
        raise ValueError(f"{m.path} has no pairs in split {split!r}")
    ks = tuple(k for k in TOP_KS if k <= beams)
    targets = [r["target_smiles"] for r in rows]
    if augment > 1:
        preds, raw, counts, max_tokens = predict_augmented(
            loaded, [r["source_smiles"] for r in rows], [r["source_token_ids"] for r in rows], augment=augment,
            beams=beams, longest_target=max(r["target_length"] for r in rows), max_tokens=max_tokens,
            length_penalty=length_penalty, batch_size=batch_size, seed=seed)
        flat = [p for ps in raw for p in ps]
        accuracy = {**topk_accuracy(preds, targets, ks), "augment": augment,
                    "spellings_per_source": sum(counts) / len(counts),
                    "invalid_beams": sum(p.side is None for p in flat) / max(1, len(flat))}
    else:
        max_tokens = rows_budget(rows, loaded.model, max_tokens)
        hyps = predict(loaded.model, loaded.specials, [r["source_token_ids"] for r in rows], beams=beams,
                       max_tokens=max_tokens, length_penalty=length_penalty, batch_size=batch_size)
        preds = read_back(loaded.tokenizer, hyps, sides_of(m))
        accuracy = topk_accuracy(preds, targets, ks)
    report = {"task": info.get("task"), "split": split, "beams": beams, "max_tokens": max_tokens,
              "length_penalty": length_penalty, **accuracy}
    if verify is not None:  # a forward model checks each retro prediction (round trip)
        report.update(round_trip_accuracy(round_trip(verify, [r["source_smiles"] for r in rows],
                                                     [distinct(p) for p in preds], batch_size=batch_size)),
                      verified_with=os.path.abspath(verify.checkpoint))
    if info.get("task") == "mol2mol":
        report.update(similarity_to_source(preds, [r["source_smiles"] for r in rows]))
    report["examples"] = [{"source": r["source_smiles"], "target": r["target_smiles"],
                           "predictions": [p.side or p.text for p in ps[:3]]} for r, ps in zip(rows[:10], preds)]
    return report
