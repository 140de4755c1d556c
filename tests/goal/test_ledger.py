"""The goal run's pieces without a model: the augmented-likelihood loss against a hand
computation, the ledger's budget, cache, filter and memory, and PMO's AUC against hand
sums."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from molds.chemistry.tokens import IGNORE_INDEX
from molds.goal.ledger import INVALID, NEW, OVER_BUDGET, REPEAT, Ledger, pmo_auc
from molds.models.loss import AugmentedLikelihoodLoss, sequence_log_likelihood


def _cfg(**kw):
    base = dict(max_oracle_calls=0, diversity_filter="identical_murcko", bucket_size=2, min_score=0.4, penalty=0.0,
                replay_size=3, replay_samples=2, top_k=4, replay_weighting="uniform")
    base.update(kw)
    return SimpleNamespace(**base)


def test_augmented_likelihood_loss_equals_a_hand_computation():
    torch.manual_seed(0)
    vocab = 5
    logits = torch.randn(2, 4, vocab, dtype=torch.float64)
    ids = torch.tensor([[0, 3, 2, 1], [0, 4, 1, 0]])  # row 1: bos, 4, eos, then one padding slot
    doc = torch.tensor([[0, 0, 0, 0], [0, 0, 0, -1]])
    labels = ids.masked_fill(doc < 0, IGNORE_INDEX)
    prior = torch.tensor([-3.0, -2.5], dtype=torch.float64)
    score = torch.tensor([0.7, 0.2], dtype=torch.float64)
    weight = torch.tensor([1.0, 0.0], dtype=torch.float64)
    batch = {"labels": labels, "document_ids": doc, "prior_logp": prior, "score": score, "weight": weight,
             "norm": torch.tensor(1.5, dtype=torch.float64)}

    def logp(row, length):  # sum over the molecule's tokens after bos of log softmax
        total = 0.0
        for t in range(length - 1):
            z = logits[row, t].tolist()
            m = max(z)
            lse = m + math.log(sum(math.exp(v - m) for v in z))
            total += z[int(ids[row, t + 1])] - lse
        return total

    want_lp = [logp(0, 4), logp(1, 3)]
    got_lp = sequence_log_likelihood({"logits": logits}, batch)
    assert got_lp.tolist() == pytest.approx(want_lp, abs=1e-12)
    sigma = 10.0
    want = sum(w * (p + sigma * s - a) ** 2 for w, p, s, a in zip([1, 0], [-3.0, -2.5], [0.7, 0.2], want_lp)) / 1.5
    got = AugmentedLikelihoodLoss(sigma)({"logits": logits}, batch)
    assert float(got) == pytest.approx(want, rel=1e-12)
    # with the original REINVENT's regularizer: + penalty x (-1 / log P_agent) per row
    penalty = 5e3
    want_p = sum(w * ((p + sigma * s - a) ** 2 - penalty / a)
                 for w, p, s, a in zip([1, 0], [-3.0, -2.5], [0.7, 0.2], want_lp)) / 1.5
    got_p = AugmentedLikelihoodLoss(sigma, likelihood_penalty=penalty)({"logits": logits}, batch)
    assert float(got_p) == pytest.approx(want_p, rel=1e-12) and float(got_p) > float(got)
    # a sequence the agent is sure of (log P = 0) gives a large, finite term
    sure = {"logits": torch.full((1, 2, vocab), -1e9, dtype=torch.float64)}
    sure["logits"][0, :, 1] = 0.0
    one = {"labels": torch.tensor([[0, 1]]), "document_ids": torch.tensor([[0, 0]]),
           "prior_logp": torch.tensor([-1.0], dtype=torch.float64), "score": torch.tensor([0.0], dtype=torch.float64),
           "norm": torch.tensor(1.0, dtype=torch.float64)}
    assert math.isfinite(float(AugmentedLikelihoodLoss(0.0, likelihood_penalty=penalty)(sure, one)))
    # the fused-head form (hidden states of the real tokens and the head's weight) gives the same
    hidden = torch.randn(2, 4, 3, dtype=torch.float64)
    head = torch.randn(vocab, 3, dtype=torch.float64)
    real = torch.nonzero(doc.reshape(-1) >= 0).squeeze(1)
    fused = {"hidden": hidden.reshape(-1, 3)[real], "token_index": real, "lm_head_weight": head}
    torch.testing.assert_close(sequence_log_likelihood(fused, batch),
                               sequence_log_likelihood({"logits": hidden @ head.T}, batch), rtol=1e-12, atol=1e-12)


def test_the_ledger_counts_each_new_molecule_once_and_stops_at_the_budget():
    led = Ledger(_cfg(max_oracle_calls=3))
    st = led.classify(["CCO", None, "CCO", "c1ccccc1", "CCN", "CCC"])
    assert st == [NEW, INVALID, REPEAT, NEW, NEW, OVER_BUDGET]
    led.record(["CCO", "c1ccccc1", "CCN"], [0.5, 0.9, 0.1], ["", "c1ccccc1", ""], step=1)
    assert led.calls == 3 and led.spent
    assert led.classify(["CCO", "CCCC"]) == [REPEAT, OVER_BUDGET]
    assert led.history == [0.5, 0.9, 0.1]
    assert led.top_mean(2) == pytest.approx(0.7)


def test_the_diversity_filter_penalizes_a_full_scaffold_bucket_and_the_memory_keeps_the_best():
    led = Ledger(_cfg(bucket_size=2, penalty=0.25))
    new = ["c1ccccc1C", "c1ccccc1CC", "c1ccccc1CCC", "C1CCCCC1", "CCO"]
    scaf = ["c1ccccc1", "c1ccccc1", "c1ccccc1", "C1CCCCC1", ""]
    filtered = led.record(new, [0.8, 0.9, 1.0, 0.3, 0.5], scaf, step=1)
    # the third benzene fills a full bucket: 1.0 x 0.25; 0.3 is below min_score: no bucket
    assert filtered == [0.8, 0.9, 0.25, 0.3, 0.5]
    assert led.buckets == {"c1ccccc1": 2, "": 1}
    assert led.memory == [["c1ccccc1CC", 0.9], ["c1ccccc1C", 0.8], ["CCO", 0.5]]  # replay_size 3
    assert [b[0] for b in led.best] == ["c1ccccc1CCC", "c1ccccc1CC", "c1ccccc1C", "CCO"]  # raw scores, top 4
    # replay: the same draw for the same (seed, step), from the memory
    assert led.replay(0, 5) == led.replay(0, 5) and len(led.replay(0, 5)) == 2
    state = led.state_dict()
    again = Ledger(_cfg(bucket_size=2, penalty=0.25))
    again.load_state_dict(__import__("json").loads(__import__("json").dumps(state)), "test")
    assert again.state_dict() == state
    led.next_stage()
    assert led.cache == {} and led.memory == [] and led.buckets == {} and led.calls == 5 and len(led.best) == 4


def test_a_malformed_ledger_is_refused_naming_the_checkpoint():
    from molds.errors import CheckpointError

    led = Ledger(_cfg())
    state = led.state_dict()
    state["calls"] = 7
    with pytest.raises(CheckpointError, match="ckpt-x.*7 calls but 0 scores"):
        led.load_state_dict(state, "ckpt-x")


def test_pmo_auc_equals_hand_sums():
    # k=2, read every 2 calls; budget 6; five calls made
    h = [0.2, 0.4, 0.1, 0.9, 0.5]
    # n=2: top2 of [.2,.4] = .3; n=4: top2 of [.2,.4,.1,.9] = .65; n=5 (end): top2 = (.9+.5)/2 = .7
    area = 2 * (0.3 + 0) / 2 + 2 * (0.65 + 0.3) / 2 + 1 * (0.7 + 0.65) / 2 + (6 - 5) * 0.7
    assert pmo_auc(h, 6, k=2, freq=2) == pytest.approx(area / 6)
    # a run that spends its budget exactly on a multiple of freq
    h = [0.5, 0.5, 1.0, 1.0]
    area = 2 * (0.5 + 0) / 2 + 2 * (1.0 + 0.5) / 2
    assert pmo_auc(h, 4, k=2, freq=2) == pytest.approx(area / 4)
    # fewer than k calls: the mean of those there are
    assert pmo_auc([0.6], 1, k=10, freq=100) == pytest.approx(0.3)
    assert pmo_auc([], 100) == 0.0


def test_a_recipe_saved_before_the_goal_section_existed_resumes_unchanged():
    """A checkpoint's recipe from before a section was added: its keys count as their
    defaults, so a resume sees no change, and a set value is still a change."""
    import os

    from molds.checkpoint.resume import recipe_changes
    from molds.recipe.parse import parse_recipe

    path = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "smoke", "dense_ddp.json")
    now = parse_recipe(["--recipe", path]).to_dict()
    old = {k: v for k, v in now.items() if k != "goal"}
    assert recipe_changes(old, now) == {}
    changed = parse_recipe(["--recipe", path, "--goal.sigma", "5"]).to_dict()
    assert recipe_changes(old, changed) == {"goal.sigma": [128.0, 5.0]}


def test_pmo_auc_equals_mol_opts_prefix_by_prefix_reading():
    """Against the definition read literally (each prefix sorted anew, as mol_opt's top_auc
    does), on random histories that stop early, end on a multiple of freq, or run over."""
    import random

    def literal(history, budget, k=10, freq=100):
        n = min(len(history), budget)
        area, prev, called = 0.0, 0.0, 0
        for idx in range(freq, n, freq):
            top = sorted(history[:idx], reverse=True)[:k]
            now = sum(top) / len(top)
            area += freq * (now + prev) / 2
            prev, called = now, idx
        top = sorted(history[:n], reverse=True)[:k]
        now = sum(top) / len(top)
        area += (n - called) * (now + prev) / 2 + (budget - n) * now
        return area / budget

    rng = random.Random(0)
    for n, budget in ((57, 1000), (1000, 1000), (2345, 2000), (5, 10), (300, 300)):
        h = [rng.random() ** 3 for _ in range(n)]
        assert pmo_auc(h, budget) == pytest.approx(literal(h, budget), rel=1e-12)


def test_the_best_scores_and_the_stall_count_travel_with_the_ledger():
    from molds.goal.loop import _repeated_in_batch

    led = Ledger(_cfg(diversity_filter="none"))
    led.record(["C", "CC", "CCC"], [0.2, 0.9, 0.5], ["", "", ""], 1)
    assert led.top_scores(2) == [0.9, 0.5] and led.top_scores(10) == [0.9, 0.5, 0.2]
    led.stall = 3
    again = Ledger(_cfg(diversity_filter="none"))
    again.load_state_dict(led.state_dict(), "ckpt")
    assert again.stall == 3 and again.top_scores(3) == led.top_scores(3)
    state = led.state_dict()
    del state["stall"]  # a ledger saved before goal.patience existed
    again.load_state_dict(state, "ckpt")
    assert again.stall == 0
    # goal.unique_batch: the first sample of each molecule over the gathered batch trains
    assert _repeated_in_batch(["C", None, "CC", "C", None, "CC", "O"]) == [False, False, False, True, False, True,
                                                                           False]


def test_score_weighted_replay_draws_in_proportion_to_the_scores_without_replacement():
    """goal.replay_weighting score (the original REINVENT's experience replay): over many
    steps, each remembered molecule is replayed about as often as sequential draws in
    proportion to the scores, without replacement, would replay it; uniform stays uniform."""
    import itertools

    memory = [["A", 0.9], ["B", 0.6], ["C", 0.3], ["D", 0.1], ["E", 0.0]]

    def shares(weighting, draws=2, steps=20000):
        led = Ledger(_cfg(replay_size=5, replay_samples=draws, replay_weighting=weighting))
        led.memory = [list(m) for m in memory]
        counts = {m[0]: 0 for m in memory}
        for step in range(steps):
            picked = led.replay(0, step)
            assert len(picked) == draws and len({p[0] for p in picked}) == draws  # without replacement
            for smi, _ in picked:
                counts[smi] += 1
        return {k: v / steps for k, v in counts.items()}

    # exact inclusion probabilities of 2 sequential weighted draws without replacement
    w = {m[0]: m[1] + 1e-10 for m in memory}
    total = sum(w.values())
    want = {k: 0.0 for k in w}
    for a, b in itertools.permutations(w, 2):
        p = w[a] / total * w[b] / (total - w[a])
        want[a] += p
        want[b] += p
    got = shares("score")
    assert all(abs(got[k] - want[k]) < 0.02 for k in w), (got, want)
    assert got["E"] < 0.001  # a zero score is all but never replayed
    flat = shares("uniform", steps=5000)
    assert all(abs(v - 0.4) < 0.03 for v in flat.values()), flat
