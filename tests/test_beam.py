"""molds.eval.beam: beam search held to an exhaustive search over every sequence of a tiny
model (scored from full forward passes, no cache), and to transformers' own
``generate(num_beams=k)`` on the model's Hugging Face export."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from molds.eval.beam import DecoderSteps, beam_search
from molds.models.decoder import CausalDecoder, DecoderConfig

BOS, EOS = 0, 1


def tiny(vocab: int, seed: int, scale: float = 3.0) -> CausalDecoder:
    torch.manual_seed(seed)
    model = CausalDecoder(DecoderConfig(vocab_size=vocab, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1))
    with torch.no_grad():  # sharper distributions than the default init, so that the search matters
        model.lm_head.weight.mul_(scale)
    return model.eval().double()


def logprob(model, prompt: list[int], generated: list[int], forbid=()) -> float:
    """Summed log-probability of ``generated`` after ``prompt``, from one full forward pass."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids)["logits"].double()[0]
    logp = torch.log_softmax(logits, dim=-1)
    total = 0.0
    for i, tok in enumerate(generated):
        if tok in forbid:
            return -math.inf
        total += float(logp[len(prompt) - 1 + i, tok])
    return total


def exhaustive(model, prompt, vocab, max_tokens, length_penalty, forbid=()):
    """Every sequence the search can return: ending with EOS within ``max_tokens``, or of
    ``max_tokens`` tokens without one; scored as the search scores them."""
    out = []
    body = [t for t in range(vocab) if t != EOS]
    for n in range(max_tokens):
        for seq in itertools.product(body, repeat=n):
            lp = logprob(model, prompt, [*seq, EOS], forbid)
            out.append((lp / (n + 1) ** length_penalty, list(seq), True))
    for seq in itertools.product(body, repeat=max_tokens):
        lp = logprob(model, prompt, list(seq), forbid)
        out.append((lp / max_tokens ** length_penalty, list(seq), False))
    return sorted([o for o in out if o[0] > -1e8], key=lambda o: -o[0])


@pytest.mark.parametrize("seed,length_penalty", [(0, 1.0), (1, 0.6), (2, 0.0), (3, 2.0)])
def test_a_wide_beam_finds_the_exhaustive_top_k(seed, length_penalty):
    vocab, max_tokens, k = 4, 3, 8  # at most 2 x 3 x ... live prefixes: 2k covers every continuation
    model = tiny(vocab, seed)
    prompts = [[BOS, 2, 3], [BOS, 3, 3], [BOS, 2, 2]]
    got = beam_search(DecoderSteps(model, torch.tensor(prompts)), beams=k, eos=EOS, max_tokens=max_tokens,
                      length_penalty=length_penalty, early_stopping="never", forbid=(BOS,))
    for prompt, hyps in zip(prompts, got):
        want = exhaustive(model, prompt, vocab, max_tokens, length_penalty, forbid=(BOS,))[:k]
        assert [(h.ids, h.ended) for h in hyps] == [(w[1], w[2]) for w in want]
        assert [h.score for h in hyps] == pytest.approx([w[0] for w in want], abs=1e-9)
        for h in hyps:  # the summed log-probability is the sequence's, as a full pass gives it
            assert h.logprob == pytest.approx(logprob(model, prompt, h.ids + ([EOS] if h.ended else [])), abs=1e-9)


def test_inputs_in_one_batch_decode_as_alone():
    model = tiny(6, 4, scale=1.5)
    prompts = torch.tensor([[BOS, 2, 3, 4], [BOS, 5, 5, 2], [BOS, 3, 2, 2]])
    together = beam_search(DecoderSteps(model, prompts), beams=4, eos=EOS, max_tokens=6)
    for i in range(3):
        alone = beam_search(DecoderSteps(model, prompts[i:i + 1]), beams=4, eos=EOS, max_tokens=6)[0]
        assert [(h.ids, h.ended) for h in together[i]] == [(h.ids, h.ended) for h in alone]
        assert [h.score for h in together[i]] == pytest.approx([h.score for h in alone], abs=1e-9)


class TableSteps:
    """A model stand-in for the search: each input's next-token logits depend on the input and
    the step only (a fixed random table), and input i's end token is far likelier than any
    other at step ``stop[i]`` and far less likely before it: its search ends there. Records how
    many rows each step selects."""

    def __init__(self, inputs: list[int], stop: list[int], vocab: int = 6):
        self.inputs, self.stop, self.vocab, self.rows = torch.tensor(inputs), stop, vocab, []

    def _logits(self, t: int) -> torch.Tensor:
        out = []
        for i in self.inputs.tolist():
            row = torch.randn(self.vocab, generator=torch.Generator().manual_seed(100 * i + t), dtype=torch.float64)
            row[EOS] = 8.0 if t == self.stop[i] else -8.0
            out.append(row)
        return torch.stack(out)

    def first(self):
        return self._logits(0)

    def expand(self, beams):
        self.inputs = self.inputs.repeat_interleave(beams)

    def step(self, tokens, index):
        return self._logits(index + 1)

    def select(self, rows):
        self.rows.append(rows.numel())
        self.inputs = self.inputs.index_select(0, rows)


@pytest.mark.parametrize("early_stopping", ["heuristic", "first"])
def test_inputs_leave_the_batch_when_their_search_ends(early_stopping):
    """Four inputs whose searches end at steps 2, 6, 1 and 4: each leaves the batch then
    (later steps select fewer rows), and each finds what it finds searched alone."""
    stop, beams = [2, 6, 1, 4], 3
    steps = TableSteps([0, 1, 2, 3], stop)
    together = beam_search(steps, beams=beams, eos=EOS, max_tokens=9, early_stopping=early_stopping)
    # the first token (step 0) for all four; input 2 ends at step 1, 0 at 2, 3 at 4, 1 at 6
    assert steps.rows == [4 * beams, 3 * beams, 2 * beams, 2 * beams, beams, beams], steps.rows
    for i in range(4):
        alone = beam_search(TableSteps([i], stop), beams=beams, eos=EOS, max_tokens=9,
                            early_stopping=early_stopping)[0]
        assert [(h.ids, h.ended) for h in together[i]] == [(h.ids, h.ended) for h in alone], i
        assert [h.score for h in together[i]] == [h.score for h in alone]
        assert all(h.ended and len(h.ids) == stop[i] for h in alone[:1]), alone


def test_prompts_of_other_lengths_in_one_batch_decode_as_alone():
    """Left-padded prompts of four lengths searched together (their pads masked, their
    positions from 0) find the hypotheses and scores each finds alone; when an input leaves
    the batch, its prompt's keys go and the others' next logits are unchanged."""
    model = tiny(7, 5, scale=1.5)
    pad_id, beams = 6, 3
    prompts = [[BOS, 2, 3], [BOS, 5, 5, 2, 4, 4], [BOS, 3], [BOS, 4, 2, 2, 3]]
    longest = max(map(len, prompts))
    pads = torch.tensor([longest - len(p) for p in prompts])
    padded = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])
    together = beam_search(DecoderSteps(model, padded, pads), beams=beams, eos=EOS, max_tokens=8)
    for i, p in enumerate(prompts):
        alone = beam_search(DecoderSteps(model, torch.tensor([p])), beams=beams, eos=EOS, max_tokens=8)[0]
        assert [(h.ids, h.ended) for h in together[i]] == [(h.ids, h.ended) for h in alone], i
        assert [h.score for h in together[i]] == pytest.approx([h.score for h in alone], abs=1e-9)
    # one step of all four, then input 0 dropped (rows of inputs 1-3, in a new beam order)
    with torch.no_grad():
        steps = DecoderSteps(model, padded, pads)
        steps.first()
        steps.expand(beams)
        steps.step(torch.tensor([2, 3, 4] * 4), 0)
        rows = torch.tensor([4, 3, 5, 6, 6, 8, 11, 9, 10])
        steps.select(rows)
        got = steps.step(torch.tensor([5, 2, 3, 4, 2, 2, 3, 3, 5]), 1)
        rest = DecoderSteps(model, padded[1:], pads[1:])
        rest.first()
        rest.expand(beams)
        rest.step(torch.tensor([2, 3, 4] * 3), 0)
        rest.select(rows - beams)
        want = rest.step(torch.tensor([5, 2, 3, 4, 2, 2, 3, 3, 5]), 1)
    assert torch.allclose(got, want, atol=1e-12)


def test_sources_of_other_lengths_predicted_together_as_alone():
    """``molds.eval.pairs.predict`` batches sources of several lengths (an encoder-decoder's
    right-padded and masked): each gets the hypotheses it gets alone."""
    from molds.eval.pairs import predict
    from tests.test_seq2seq import SPECIALS, tiny as tiny_seq2seq

    model = tiny_seq2seq(3).double()
    specials = SimpleNamespace(**vars(SPECIALS), sep=None, mask=None)
    sources = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [6], [7, 7, 9, 20, 21]]
    together = predict(model, specials, sources, beams=3, max_tokens=7)
    for i, src in enumerate(sources):
        alone = predict(model, specials, [src], beams=3, max_tokens=7)[0]
        assert [(h.ids, h.ended) for h in together[i]] == [(h.ids, h.ended) for h in alone], i
        assert [h.score for h in together[i]] == pytest.approx([h.score for h in alone], abs=1e-9)


@pytest.mark.parametrize("length_penalty", [0.0, 0.8, 3.0])
@pytest.mark.parametrize("early_stopping,hf", [("heuristic", False), ("never", "never"), ("first", True)])
def test_the_same_top_k_as_transformers_generate(early_stopping, hf, length_penalty):
    """The same hypotheses, scores and number of model calls (the search stops at the same step)."""
    from molds.export import hf_decoder

    model = tiny(5, 3, scale=1.5).float()  # a small vocabulary: the end token is likely, searches stop early
    specials = SimpleNamespace(bos=BOS, eos=EOS, pad=4)
    twin = hf_decoder(model, specials).eval()
    prompt = torch.tensor([[BOS, 2, 3, 2], [BOS, 3, 3, 2]])
    k, max_tokens = 3, 9
    steps = CountingSteps(model, prompt)
    ours = beam_search(steps, beams=k, eos=EOS, max_tokens=max_tokens,
                       length_penalty=length_penalty, early_stopping=early_stopping)
    calls = []
    hook = twin.register_forward_hook(lambda *_: calls.append(1))
    out = twin.generate(prompt, attention_mask=torch.ones_like(prompt), num_beams=k, num_return_sequences=k,
                        max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=hf, do_sample=False,
                        eos_token_id=EOS, pad_token_id=4, output_scores=True, return_dict_in_generate=True)
    hook.remove()
    assert steps.calls == len(calls)  # both stop at the same step: when no running beam can improve
    seqs = out.sequences[:, prompt.shape[1]:].tolist()
    for i in range(prompt.shape[0]):
        theirs = []
        for row, score in zip(seqs[i * k:(i + 1) * k], out.sequences_scores[i * k:(i + 1) * k].tolist()):
            ended = EOS in row
            theirs.append((row[:row.index(EOS)] if ended else row, ended, score))
        assert [(h.ids, h.ended) for h in ours[i]] == [(t[0], t[1]) for t in theirs]
        assert [h.score for h in ours[i]] == pytest.approx([t[2] for t in theirs], abs=1e-4)


class CountingSteps(DecoderSteps):
    """The decoder's steps, counting the model calls."""

    calls = 0

    def first(self):
        self.calls += 1
        return super().first()

    def step(self, tokens, index):
        self.calls += 1
        return super().step(tokens, index)


def test_bad_arguments_are_refused():
    model = tiny(4, 0)
    with pytest.raises(ValueError, match="beams and max_tokens"):
        beam_search(DecoderSteps(model, torch.tensor([[BOS]])), beams=0, eos=EOS, max_tokens=3)
    with pytest.raises(ValueError, match="early_stopping"):
        beam_search(DecoderSteps(model, torch.tensor([[BOS]])), beams=2, eos=EOS, max_tokens=3, early_stopping="x")
