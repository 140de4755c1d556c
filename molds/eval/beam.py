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
a key/value cache per layer that holds each prompt's keys once for all its beams
(``PromptSharedCache``): reordering beams moves only what they generated, and a step reads
the prompt's keys once per input rather than once per beam.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from ..models.decoder import causal_attention

_LARGE = 1.0e9  # what transformers adds to a score to take it out of the race


class Steps(Protocol):
    def first(self) -> torch.Tensor:
        """Logits [inputs, vocab] of the first generated position."""

    def expand(self, beams: int) -> None:
        """Repeat every input's state ``beams`` times (rows input-major)."""

    def step(self, tokens: torch.Tensor, index: int) -> torch.Tensor:
        """Feed one token per row, the ``index``-th generated (0: the first); logits [rows, vocab]."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep the state rows ``rows``, in that order (each beam's parent; ``beams`` rows per
        input, input-major, each taken from a row of the same input). Fewer rows than held:
        the inputs whose search ended are dropped, the others keep their order."""


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
    inputs = list(range(n))  # the inputs still searched, by their index
    final: dict[int, tuple] = {}  # an input's kept hypotheses once its search ends
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
        fed = torch.gather(token, 1, nxt)
        if not bool(open_.all()):  # inputs whose search ended leave the batch: later steps run only the others
            for j in (~open_).nonzero().flatten().tolist():
                final[inputs[j]] = (done_scores[j], done_seqs[j], done_sum[j], done_len[j], done_kept[j])
            stay = open_.nonzero().flatten()
            inputs = [inputs[j] for j in stay.tolist()]
            running, seqs, fed, open_ = running[stay], seqs[stay], fed[stay], open_[stay]
            done_scores, done_seqs, done_sum = done_scores[stay], done_seqs[stay], done_sum[stay]
            done_len, done_kept = done_len[stay], done_kept[stay]
            rows = rows.view(-1, k)[stay].reshape(-1)
            n = len(inputs)
        steps.select(rows)
        logits = steps.step(fed.reshape(-1), t)
    for j, i in enumerate(inputs):
        final[i] = (done_scores[j], done_seqs[j], done_sum[j], done_len[j], done_kept[j])
    out = []
    for i in range(len(final)):
        scores, seqs_i, sums, lengths, kept = final[i]
        found = []
        for j in range(k):
            if not bool(kept[j]):
                continue
            ids = seqs_i[j, :int(lengths[j])].tolist()
            ended = ids[-1] == eos
            found.append(Hypothesis(ids[:-1] if ended else ids, float(scores[j]), float(sums[j]), ended))
        found.sort(key=lambda h: -h.score)
        out.append(found)
    return out


class PromptSharedCache:
    """One attention layer's keys and values in a causal decoder's beam search: the prompts'
    ([inputs, kv heads, S, D], written by the first call) shared by the beams of each input,
    then each beam's generated ones ([inputs x beams, kv heads, T, D]). A step's query
    attends to its input's prompt and its own beam's tokens: one softmax over both, in float32
    at least, as ``scaled_dot_product_attention`` computes it (query head h reads kv head
    h // (heads / kv heads))."""

    def __init__(self, pad: torch.Tensor | None = None):
        self.pad = pad if pad is not None and bool(pad.any()) else None  # [inputs]: each prompt's left pads
        self.prompt_k = self.prompt_v = self.pads = None
        self.k = self.v = None
        self.beams = 1

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.prompt_k is None:  # the prompts, causal within each
            dt = torch.promote_types(k.dtype, torch.float32)  # float32 (float64 for a float64 model)
            self.prompt_k, self.prompt_v = k.transpose(1, 2).to(dt), v.transpose(1, 2).to(dt)
            if self.pad is None:
                return causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
            at = torch.arange(q.shape[1], device=q.device)
            self.pads = at[None, :] < self.pad[:, None]  # [inputs, S]: keys no query reads
            # causal, and no pad key, except a pad query's own (its row then has a key: no NaN)
            allowed = (at[None, :] <= at[:, None])[None] & (~self.pads[:, None, :] | (at[None, :] == at[:, None])[None])
            with torch.autocast(q.device.type, enabled=False):
                out = F.scaled_dot_product_attention(q.transpose(1, 2).to(dt), self.prompt_k, self.prompt_v,
                                                     attn_mask=allowed[:, None], enable_gqa=True)
            return out.transpose(1, 2).to(q.dtype)
        if q.shape[1] != 1:
            raise ValueError("with a filled cache, decode one token at a time")
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        n, kv, s, d = self.prompt_k.shape
        rows, _, heads, _ = q.shape
        b, t = rows // n, self.k.shape[2]
        dt = self.prompt_k.dtype
        qg = q.reshape(n, b, kv, heads // kv, d).to(dt)
        own_k, own_v = self.k.reshape(n, b, kv, t, d).to(dt), self.v.reshape(n, b, kv, t, d).to(dt)
        with torch.autocast(q.device.type, enabled=False):  # float32 products at least, as causal_attention's
            prompt = torch.einsum("nbvgd,nvsd->nbvgs", qg, self.prompt_k)
            if self.pads is not None:
                prompt = prompt.masked_fill(self.pads[:, None, None, None, :], -float("inf"))
            scores = torch.cat([prompt, torch.einsum("nbvgd,nbvtd->nbvgt", qg, own_k)], dim=-1)
            w = torch.softmax(scores * d ** -0.5, dim=-1)
            out = (torch.einsum("nbvgs,nvsd->nbvgd", w[..., :s], self.prompt_v)
                   + torch.einsum("nbvgt,nbvtd->nbvgd", w[..., s:], own_v))
        return out.reshape(rows, 1, heads, d).to(q.dtype)

    def expand(self, beams: int) -> None:
        if self.k is not None:
            raise ValueError("expand before the first generated token")
        self.beams = beams

    def select(self, rows: torch.Tensor) -> None:
        """Beam rows follow their parents (rows of the same input: the prompts stay), and the
        prompts of inputs that left the search go."""
        if rows.numel() != self.prompt_k.shape[0] * self.beams:
            inputs = rows.view(-1, self.beams)[:, 0] // self.beams
            self.prompt_k, self.prompt_v = self.prompt_k.index_select(0, inputs), self.prompt_v.index_select(0, inputs)
            if self.pads is not None:
                self.pads = self.pads.index_select(0, inputs)
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, rows), self.v.index_select(0, rows)


class DecoderSteps:
    """A causal decoder (``model.decode`` with its key/value cache) completing prompts
    (``prompts`` [inputs, P]: bos and the source tokens, and a separator), left-padded to one
    length where ``pad`` [inputs] gives each one's pads: their keys are masked and each
    prompt's positions start at 0, so that it decodes as it would alone."""

    def __init__(self, model, prompts: torch.Tensor, pad: torch.Tensor | None = None):
        self.model, self.prompts = model, prompts
        self.offsets = pad if pad is not None and bool(pad.any()) else None
        self.cache = [PromptSharedCache(self.offsets) for _ in model.model.layers]

    def first(self) -> torch.Tensor:
        return self.model.decode(self.prompts, self.cache, 0, self.offsets)

    def expand(self, beams: int) -> None:
        for layer in self.cache:
            layer.expand(beams)
        if self.offsets is not None:  # a beam's row keeps its input's offset: select moves rows within an input
            self.offsets = self.offsets.repeat_interleave(beams)

    def step(self, tokens: torch.Tensor, index: int) -> torch.Tensor:
        return self.model.decode(tokens[:, None], self.cache, self.prompts.shape[1] + index, self.offsets)

    def select(self, rows: torch.Tensor) -> None:
        for layer in self.cache:
            layer.select(rows)
        if self.offsets is not None:
            self.offsets = self.offsets.index_select(0, rows)


class Seq2SeqSteps:
    """The encoder-decoder (``molds.models.seq2seq``): the sources encoded once (right padded,
    ``attention_mask`` marking their tokens), the decoder started at ``start`` (``<bos>``)
    with its self- and cross-attention caches; reordering beams moves only the self-attention
    keys (the beams of an input share its source)."""

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
        if rows.numel() != self.memory.shape[0]:  # inputs left: every part follows the rows kept
            self._each(lambda t: t.index_select(0, rows))
            return
        # a beam's parent is a row of the same input, whose source memory and cross-attention
        # keys are the same: only the decoder's own keys move
        for layer in self.cache:
            own = layer.get("self", {})
            for key in own:
                own[key] = own[key].index_select(0, rows)
