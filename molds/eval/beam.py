"""Batched beam search, for every model family (the decoder on a prompt, the encoder-decoder
on its source): the k most likely completions of each input, with their scores.

It searches as transformers' ``generate(num_beams=k)`` does (5.x), so that a model exported
to transformers decodes to the same top k:

- each step scores every continuation of the k running beams of an input by its summed
  log-probability (``log_softmax`` in float32) and takes the best 2k;
- of those, a continuation that ends (the end token, or the length limit) and ranks among
  the first k becomes a finished hypothesis, scored by its log-probability divided by its
  length (generated tokens, the end token included) to the power ``length_penalty``; the
  best k finished hypotheses are kept;
- the best k continuations that did not end run on;
- an input stops when no running beam can beat its worst kept hypothesis
  (``early_stopping``: ``"heuristic"``, transformers' default, compares the best running
  beam at its current length; ``"never"`` at the longest length it could reach, which
  makes a wide enough beam exhaustive; ``"first"`` stops once k hypotheses are kept);
- ``forbid``: tokens never chosen (their log-probability set to a large negative number,
  not renormalized, as transformers' ``suppress_tokens`` does).

A model plugs in through four calls (``Steps``): the logits of the first generated position
for each input, the cache grown to k rows per input, one step for every row, and the cache
rows reordered to follow their beams' parents. ``DecoderSteps`` is the causal decoder's, with
its key/value cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

_LARGE = 1.0e9  # what transformers adds to a score to take it out of the race


class Steps(Protocol):
    def first(self) -> torch.Tensor:
        """Logits [inputs, vocab] of the first generated position."""

    def expand(self, beams: int) -> None:
        """Repeat every input's state ``beams`` times (rows input-major)."""

    def step(self, tokens: torch.Tensor, index: int) -> torch.Tensor:
        """Feed one token per row, the ``index``-th generated (0: the first); logits [rows, vocab]."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep the state rows ``rows``, in that order (each beam's parent)."""


@dataclass
class Hypothesis:
    ids: list[int]  # the generated tokens, without the end token
    score: float  # log-probability / length ** length_penalty
    logprob: float  # summed log-probability of the tokens (and of the end token, when it ended)
    ended: bool  # False: cut at the length limit without an end token


@torch.no_grad()
def beam_search(steps: Steps, *, beams: int, eos: int, max_tokens: int, length_penalty: float = 1.0,
                early_stopping: str = "heuristic", forbid: Sequence[int] = ()) -> list[list[Hypothesis]]:
    """The best ``beams`` hypotheses of each input, best first."""
    if beams < 1 or max_tokens < 1:
        raise ValueError("beams and max_tokens must be at least 1")
    if early_stopping not in ("heuristic", "never", "first"):
        raise ValueError(f"early_stopping must be heuristic, never or first, got {early_stopping!r}")
    logits = steps.first()
    n, vocab = logits.shape
    device = logits.device
    dtype = torch.promote_types(logits.dtype, torch.float32)  # scores in float32 (float64 for a float64 model)
    k = beams
    steps.expand(k)
    logits = logits.repeat_interleave(k, dim=0)
    running = torch.full((n, k), -_LARGE, device=device, dtype=dtype)
    running[:, 0] = 0.0  # one live beam per input at the start
    seqs = torch.zeros(n, k, max_tokens, dtype=torch.long, device=device)
    done_seqs = torch.zeros(n, k, max_tokens, dtype=torch.long, device=device)
    done_scores = torch.full((n, k), -_LARGE, device=device, dtype=dtype)
    done_sum = torch.zeros(n, k, device=device, dtype=dtype)
    done_len = torch.zeros(n, k, dtype=torch.long, device=device)
    done_kept = torch.zeros(n, k, dtype=torch.bool, device=device)
    open_ = torch.ones(n, dtype=torch.bool, device=device)  # an input whose search may still improve
    keep = min(2 * k, k * vocab)
    top_k = torch.arange(keep, device=device) < k
    for t in range(max_tokens):
        logp = torch.log_softmax(logits.to(dtype), dim=-1)
        if forbid:
            logp[:, list(forbid)] = -float("inf")
            logp = logp.clamp(min=-_LARGE)
        acc = (running.reshape(-1, 1) + logp).reshape(n, k * vocab)
        cand, index = torch.topk(acc, keep, dim=1)
        parent, token = index // vocab, index % vocab
        cand_seqs = torch.gather(seqs, 1, parent[:, :, None].expand(-1, -1, max_tokens)).clone()
        cand_seqs[:, :, t] = token
        ends = (token == eos) | (t + 1 == max_tokens)
        # finished: an ending continuation among the first k, while the input's search is open
        norm = cand / float(t + 1) ** length_penalty
        norm = norm - (~(ends & top_k[None, :])).to(dtype) * _LARGE
        norm = norm - (~open_).to(dtype)[:, None] * _LARGE
        merged = torch.cat([done_scores, norm], 1)
        best = torch.topk(merged, k, dim=1).indices
        done_scores = torch.gather(merged, 1, best)
        done_seqs = torch.gather(torch.cat([done_seqs, cand_seqs], 1), 1, best[:, :, None].expand(-1, -1, max_tokens))
        done_sum = torch.gather(torch.cat([done_sum, cand], 1), 1, best)
        done_len = torch.gather(torch.cat([done_len, torch.full_like(parent, t + 1)], 1), 1, best)
        done_kept = torch.gather(torch.cat([done_kept, ends & top_k[None, :] & open_[:, None]], 1), 1, best)
        # running: the best k continuations that did not end
        live = cand - ends.to(dtype) * _LARGE
        nxt = torch.topk(live, k, dim=1).indices
        running = torch.gather(live, 1, nxt)
        seqs = torch.gather(cand_seqs, 1, nxt[:, :, None].expand(-1, -1, max_tokens))
        rows = (torch.gather(parent, 1, nxt) + torch.arange(n, device=device)[:, None] * k).reshape(-1)
        # may an input still improve? (transformers' early-stop heuristic)
        if early_stopping == "never" and length_penalty > 0.0:
            longest = max_tokens
        else:
            longest = t + 1
        best_running = running[:, 0] / float(longest) ** length_penalty
        worst_kept = torch.where(done_kept.all(dim=1), done_scores.min(dim=1).values,
                                 torch.full_like(best_running, -_LARGE))
        open_ &= best_running > worst_kept
        if early_stopping == "first":
            open_ &= ~done_kept.all(dim=1)
        if t + 1 == max_tokens or not bool(open_.any()):
            break
        steps.select(rows)
        logits = steps.step(torch.gather(token, 1, nxt).reshape(-1), t)
    out = []
    for i in range(n):
        found = []
        for j in range(k):
            if not bool(done_kept[i, j]):
                continue
            length = int(done_len[i, j])
            ids = done_seqs[i, j, :length].tolist()
            ended = ids[-1] == eos
            found.append(Hypothesis(ids[:-1] if ended else ids, float(done_scores[i, j]), float(done_sum[i, j]),
                                    ended))
        found.sort(key=lambda h: -h.score)
        out.append(found)
    return out


class DecoderSteps:
    """A causal decoder (``model.decode`` with its key/value cache) completing prompts of
    one length (``prompts`` [inputs, P]: bos and the source tokens, and a separator)."""

    def __init__(self, model, prompts: torch.Tensor):
        self.model, self.prompts = model, prompts
        self.cache = [{} for _ in model.model.layers]

    def first(self) -> torch.Tensor:
        return self.model.decode(self.prompts, self.cache, 0)

    def expand(self, beams: int) -> None:
        for layer in self.cache:
            for key in layer:
                layer[key] = layer[key].repeat_interleave(beams, dim=0)

    def step(self, tokens: torch.Tensor, index: int) -> torch.Tensor:
        return self.model.decode(tokens[:, None], self.cache, self.prompts.shape[1] + index)

    def select(self, rows: torch.Tensor) -> None:
        for layer in self.cache:
            for key in layer:
                layer[key] = layer[key].index_select(0, rows)


class Seq2SeqSteps:
    """The encoder-decoder (``molds.models.seq2seq``): the sources encoded once (right padded,
    ``attention_mask`` marking their tokens), the decoder started at ``start`` (``<bos>``)
    with its self- and cross-attention caches."""

    def __init__(self, model, sources: torch.Tensor, attention_mask: torch.Tensor, start: int):
        from ..models.seq2seq import _key_mask  # here: molds-predict --help loads no Triton

        self.model = model
        self.memory = model.encode(sources, attention_mask)
        self.mask = _key_mask(attention_mask, self.memory.dtype)
        self.start = torch.full((sources.shape[0], 1), start, dtype=torch.long, device=sources.device)
        self.cache = model.new_cache()

    def first(self) -> torch.Tensor:
        return self.model.decode(self.start, self.memory, self.mask, self.cache, 0)

    def _each(self, fn) -> None:
        self.memory, self.mask = fn(self.memory), fn(self.mask)
        for layer in self.cache:
            for part in layer.values():
                for key in part:
                    part[key] = fn(part[key])

    def expand(self, beams: int) -> None:
        self._each(lambda t: t.repeat_interleave(beams, dim=0))

    def step(self, tokens: torch.Tensor, index: int) -> torch.Tensor:
        return self.model.decode(tokens[:, None], self.memory, self.mask, self.cache, index + 1)

    def select(self, rows: torch.Tensor) -> None:
        self._each(lambda t: t.index_select(0, rows))
