"""The encoder-decoder family (molds/models/seq2seq.py): BART's architecture, held to
transformers' ``BartForConditionalGeneration`` with the same weights (the export), on right
padded batches, and its cached step-by-step decoding to its own full forward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from molds.models.seq2seq import Seq2SeqConfig, Seq2SeqModel

SPECIALS = SimpleNamespace(pad=0, unk=1, bos=2, eos=3)


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=23, hidden_size=32, encoder_layers=2, decoder_layers=2, num_heads=4, intermediate_size=48,
               max_position_embeddings=40, dropout=0.0)
    cfg.update(kw)
    model = Seq2SeqModel(Seq2SeqConfig(**cfg))
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if "layer_norm" in name or "layernorm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 23, (3, 9), generator=g)
    src_mask = torch.ones_like(src)
    src_mask[1, 6:] = 0  # right padded sources
    src_mask[2, 4:] = 0
    src = src.masked_fill(src_mask == 0, SPECIALS.pad)
    tgt = torch.randint(4, 23, (3, 7), generator=g)
    tgt[:, 0] = SPECIALS.bos
    return src, src_mask, tgt


@pytest.mark.parametrize("scale_embedding", [False, True])
def test_logits_equal_transformers_bart_with_the_same_weights(scale_embedding):
    from molds.export import hf_bart

    model = tiny(scale_embedding=scale_embedding).double()
    twin = hf_bart(model.float(), SPECIALS).double().eval()
    model = model.double()
    src, src_mask, tgt = batch()
    ours = model(src, attention_mask=src_mask, decoder_input_ids=tgt)["logits"]
    with torch.no_grad():
        theirs = twin(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)


def test_padding_does_not_reach_the_real_tokens():
    model = tiny().double()
    src, src_mask, tgt = batch()
    full = model(src, attention_mask=src_mask, decoder_input_ids=tgt)["logits"]
    for i in range(3):
        n = int(src_mask[i].sum())
        alone = model(src[i:i + 1, :n], decoder_input_ids=tgt[i:i + 1])["logits"]
        torch.testing.assert_close(full[i:i + 1], alone, rtol=1e-10, atol=1e-10)


def test_cached_decoding_equals_the_full_forward():
    model = tiny().double()
    src, src_mask, tgt = batch()
    full = model(src, attention_mask=src_mask, decoder_input_ids=tgt)["logits"]
    memory = model.encode(src, src_mask)
    from molds.models.seq2seq import _key_mask

    mask = _key_mask(src_mask, memory.dtype)
    cache = model.new_cache()
    for t in range(tgt.shape[1]):
        step = model.decode(tgt[:, t:t + 1], memory, mask, cache, t)
        torch.testing.assert_close(step, full[:, t], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("length_penalty,early_stopping,hf", [(1.0, "heuristic", False), (0.6, "never", "never"),
                                                             (0.0, "heuristic", False)])
def test_beam_search_finds_what_bart_generate_finds(length_penalty, early_stopping, hf):
    from molds.eval.beam import Seq2SeqSteps, beam_search
    from molds.export import hf_bart

    model = tiny(3, vocab_size=8)
    with torch.no_grad():  # the end token likely (the bias travels with the export): searches end early
        model.final_logits_bias[0, SPECIALS.eos] = 4.0
    twin = hf_bart(model, SPECIALS).eval()
    g = torch.Generator().manual_seed(5)
    src = torch.randint(4, 8, (3, 6), generator=g)
    mask = torch.ones_like(src)
    mask[2, 4:] = 0
    src = src.masked_fill(mask == 0, SPECIALS.pad)
    k, max_tokens = 3, 8
    ours = beam_search(Seq2SeqSteps(model, src, mask, SPECIALS.bos), beams=k, eos=SPECIALS.eos,
                       max_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping)
    out = twin.generate(src, attention_mask=mask, num_beams=k, num_return_sequences=k, max_new_tokens=max_tokens,
                        length_penalty=length_penalty, early_stopping=hf, do_sample=False, no_repeat_ngram_size=0,
                        decoder_start_token_id=SPECIALS.bos, eos_token_id=SPECIALS.eos, pad_token_id=SPECIALS.pad,
                        output_scores=True, return_dict_in_generate=True)
    seqs = out.sequences[:, 1:].tolist()  # after the decoder's start token
    for i in range(src.shape[0]):
        theirs = []
        for row, score in zip(seqs[i * k:(i + 1) * k], out.sequences_scores[i * k:(i + 1) * k].tolist()):
            ended = SPECIALS.eos in row
            theirs.append((row[:row.index(SPECIALS.eos)] if ended else row, ended, score))
        assert [(h.ids, h.ended) for h in ours[i]] == [(t[0], t[1]) for t in theirs]
        assert [h.score for h in ours[i]] == pytest.approx([t[2] for t in theirs], abs=1e-4)
    if length_penalty == 0.0:  # raw log-probabilities: hypotheses that end are among the best
        assert any(h.ended for hyps in ours for h in hyps)


def test_a_narrow_encoder_decoder_learns_to_copy_as_the_decoder_does():
    """Copying, most of what reaction prediction asks, learned in as few steps as by the
    decoder family on the same sequences and optimizer (``benchmarks/copy_probe.py``, here
    narrower and shorter): with BART's fixed ``init_std`` 0.02 at this width it was not
    learned at all in these steps."""
    import argparse

    from benchmarks.copy_probe import train

    args = argparse.Namespace(steps=300, length=16, vocab=16, hidden=64, layers=2, heads=4, batch=32, lr=2e-3,
                              warmup=30, threshold=0.1, log_every=10, seed=0)
    decoder, ours = train("decoder", args), train("seq2seq", args)
    assert decoder["steps_to_copy"] is not None, decoder["curve"]  # the reference learns it in these steps
    assert ours["steps_to_copy"] is not None and ours["steps_to_copy"] <= 2 * decoder["steps_to_copy"], (
        ours["curve"], decoder["steps_to_copy"])


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from tests.data.conftest import pair_manifest

    return pair_manifest(tmp_path_factory.mktemp("s2s-pairs"), 300, "forward")


def _loader(manifest, **over):
    from molds.data.loader import MoleculeLoader
    from molds.recipe.sections import DataConfig

    options = dict(manifest=manifest, mode="bucketed", max_length=160, max_tokens_per_batch=640, bucket_pool=50,
                   too_long="reject", max_epochs=1, seed=3)
    return MoleculeLoader(DataConfig(**{**options, **over}))


def test_pair_batches_hold_each_pairs_sides_as_the_shards_do(pairs):
    """``data.mode: bucketed`` on a pair manifest: each row is the encoder's ``<bos> source <eos>``
    (its attention mask), the decoder's ``<bos> target`` and the labels ``target <eos>``, right
    padded, read back against the shard's token columns, within the token budget; every pair of
    the split once an epoch."""
    import pyarrow.parquet as pq

    from molds.chemistry.tokens import IGNORE_INDEX
    from molds.data.manifest import Manifest

    m = Manifest.load(pairs)
    rows = [r for s in m.shards("train") for r in pq.read_table(s.path).to_pylist()]  # in gid order
    ld = _loader(pairs)
    sp = ld.specials
    seen = []
    for b in ld:
        assert b["stats"]["tokens"] == b["input_ids"].numel() + b["decoder_input_ids"].numel()
        # the token budget counts both padded sides: rows x (longest source + longest target)
        assert b["stats"]["tokens"] <= 640, b["stats"]
        for i, gid in enumerate(b["gids"].tolist()):
            src, tgt = rows[gid]["source_token_ids"], rows[gid]["target_token_ids"]
            n, t = len(src) + 2, len(tgt) + 1
            assert b["input_ids"][i, :n].tolist() == [sp.bos, *src, sp.eos]
            assert b["attention_mask"][i].tolist() == [1] * n + [0] * (b["input_ids"].shape[1] - n)
            assert set(b["input_ids"][i, n:].tolist()) <= {sp.pad}
            assert b["decoder_input_ids"][i, :t].tolist() == [sp.bos, *tgt]
            assert b["labels"][i].tolist() == [*tgt, sp.eos] + [IGNORE_INDEX] * (b["labels"].shape[1] - t)
        seen += b["gids"].tolist()
        rejected = b["stats"]["rejected"]
    # pairs longer than data.max_length (BOS source SEP target EOS, the decoder's count) are left out, counted
    fits = [g for g, r in enumerate(rows) if len(r["source_token_ids"]) + len(r["target_token_ids"]) + 3 <= 160]
    assert sorted(seen) == fits and rejected == len(rows) - len(fits) > 0


def test_the_loss_is_barts_own_on_the_same_batch(pairs):
    """``Seq2SeqLoss`` on molds' logits equals the loss transformers' BART computes from the same
    weights and batch (``labels=``: cross entropy over the labels that are not -100)."""
    from molds.export import hf_bart
    from molds.models import build_model
    from molds.models.loss import build_loss

    ld = _loader(pairs)
    section = {"family": "seq2seq", "hidden_size": 32, "num_layers": 2, "decoder_layers": 1, "num_heads": 4,
               "max_position_embeddings": 160, "dropout": 0.0}
    model = build_model(section, ld.specials, seed=1).double().eval()
    twin = hf_bart(model, ld.specials).double().eval()
    assert model.config.decoder_layers == 1 and model.config.intermediate_size == 128
    loss_fn = build_loss(section)
    for b, _ in zip(ld, range(3)):
        inputs = {k: b[k] for k in ("input_ids", "attention_mask", "decoder_input_ids", "labels")}
        ours = loss_fn(model(**inputs), inputs)
        theirs = twin(**inputs).loss
        assert float(ours) == pytest.approx(float(theirs), rel=1e-10)


def test_a_seq2seq_recipe_is_refused_on_molecules_and_its_misuses_by_key(pairs, tmp_path):
    from molds.errors import RecipeError
    from molds.recipe.parse import parse_recipe, validate
    from molds.train import main
    from tests.data.conftest import _build

    def check(argv):
        validate(parse_recipe(argv), 1)

    base = ["--model.family", "seq2seq", "--data.mode", "bucketed", "--data.too_long", "reject",
            "--run.output_dir", str(tmp_path / "r"), "--trainer.max_steps", "1", "--logging.progress", "false"]
    with pytest.raises(RecipeError, match="data.mode=bucketed"):
        check([*base, "--data.manifest", pairs, "--data.mode", "packed"])
    with pytest.raises(RecipeError, match="data.too_long=truncate would cut the targets"):
        main([*base, "--data.manifest", pairs, "--data.too_long", "truncate"])
    with pytest.raises(RecipeError, match="data.mask_span_mean=3.0 .* applies to model.family=seq2seq"):
        check([*base, "--data.manifest", pairs, "--model.family", "encoder", "--data.mask_span_mean", "3",
               "--data.mlm_probability", "0.15"])
    with pytest.raises(RecipeError, match="model.decoder_layers=2 applies to model.family=seq2seq"):
        check([*base, "--data.manifest", pairs, "--model.family", "decoder", "--data.mode", "packed",
                      "--model.decoder_layers", "2"])
    with pytest.raises(RecipeError, match="kernels.triton applies to model.family=decoder"):
        check([*base, "--data.manifest", pairs, "--kernels.triton", "true"])
    (tmp_path / "mols").mkdir()
    molecules = _build(tmp_path / "mols")
    with pytest.raises(RecipeError, match="holds molecules, not pairs"):
        main([*base, "--data.manifest", molecules])
    with pytest.raises(RecipeError, match="data.mlm_probability does not apply"):  # an encoder on pairs
        main([*base, "--data.manifest", pairs, "--model.family", "encoder", "--data.mlm_probability", "0.15"])


@pytest.fixture(scope="module")
def molecules(tmp_path_factory):
    from tests.data.conftest import _build

    return _build(tmp_path_factory.mktemp("s2s-mols"))


def _infills(masked: list, tokens: list, mask: int) -> bool:
    """Does ``masked`` spell ``tokens`` when each ``mask`` stands for one or more tokens? (A
    table over prefixes, linear in each side, so a wrong masking fails rather than hangs.)"""
    n, m = len(masked), len(tokens)
    can = [[False] * (m + 1) for _ in range(n + 1)]  # can[i][j]: masked[:i] spells tokens[:j]
    can[0][0] = True
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            if masked[i - 1] == mask:
                can[i][j] = can[i - 1][j - 1] or can[i][j - 1]
            else:
                can[i][j] = can[i - 1][j - 1] and masked[i - 1] == tokens[j - 1]
    return can[n][m]


MEAN_RUN = {}  # (probability, span_mean) -> hidden tokens per <mask>, over the batches read


@pytest.mark.parametrize("probability,span_mean", [(0.15, 3.0), (0.3, 1.0), (0.3, 6.0)])
def test_denoising_batches_hide_the_share_asked_each_run_one_mask(molecules, probability, span_mean):
    """``data.mask_span_mean`` (BART's text infilling): the decoder reads ``<bos> molecule`` and
    is scored on ``molecule <eos>`` (the shard's tokens); the encoder reads the molecule with
    round(p x its tokens) of them hidden, each run of hidden tokens one ``<mask>``: the masked
    text, a mask standing for one or more tokens, spells the molecule, and undoes to it."""
    import pyarrow.parquet as pq

    from molds.chemistry.tokens import IGNORE_INDEX
    from molds.data.manifest import Manifest

    m = Manifest.load(molecules)
    rows = [r["token_ids"] for s in m.shards("train") for r in pq.read_table(s.path, columns=["token_ids"]).to_pylist()]
    ld = _loader(molecules, too_long="truncate", max_length=128, max_tokens_per_batch=2048,
                 mlm_probability=probability, mask_span_mean=span_mean, max_steps=8)
    sp = ld.specials
    runs = hidden_total = 0
    for b in ld:
        for i, gid in enumerate(b["gids"].tolist()):
            mol = rows[gid][:126]
            t = len(mol) + 1
            assert b["decoder_input_ids"][i, :t].tolist() == [sp.bos, *mol]
            assert b["labels"][i].tolist() == [*mol, sp.eos] + [IGNORE_INDEX] * (b["labels"].shape[1] - t)
            src = b["input_ids"][i][b["attention_mask"][i] == 1].tolist()
            assert src[0] == sp.bos and src[-1] == sp.eos
            masks = src.count(sp.mask)
            hidden = len(mol) - (len(src) - 2 - masks)
            assert hidden == round(probability * len(mol)) and masks >= 1
            assert not any(a == b == sp.mask for a, b in zip(src, src[1:]))  # a run is one mask, runs are apart
            assert _infills(src[1:-1], mol, sp.mask)
            runs, hidden_total = runs + masks, hidden_total + hidden
    MEAN_RUN[(probability, span_mean)] = hidden_total / runs
    again = _loader(molecules, too_long="truncate", max_length=128, max_tokens_per_batch=2048,
                    mlm_probability=probability, mask_span_mean=span_mean, max_steps=2)
    first = next(iter(_loader(molecules, too_long="truncate", max_length=128, max_tokens_per_batch=2048,
                              mlm_probability=probability, mask_span_mean=span_mean, max_steps=2)))
    assert next(iter(again))["input_ids"].equal(first["input_ids"])  # drawn from (seed, step, rank): repeatable


def test_longer_spans_hide_longer_runs(molecules):
    """At the same share, a larger ``mask_span_mean`` hides fewer, longer runs: Poisson(1) spans
    (at least one token) average under two tokens a mask; Poisson(6) ones, cut by the share
    and the molecule's end, several."""
    for key in ((0.3, 1.0), (0.3, 6.0)):
        if key not in MEAN_RUN:
            test_denoising_batches_hide_the_share_asked_each_run_one_mask(molecules, *key)
    assert MEAN_RUN[(0.3, 1.0)] < 2.0 < 3.0 < MEAN_RUN[(0.3, 6.0)]


def test_denoising_pretraining_forks_into_a_pair_task(tmp_path):
    """Chemformer's path: the encoder-decoder pretrains by denoising molecules tokenized with the
    pair task's vocabulary (``molds-preprocess --tokenizer PAIRS/tokenizer``: a molecule
    vocabulary lacks what reactions spell, ``.`` and reagent ions), then the pair task forks
    from its weights (``checkpoint.fork``). A fork at learning rate 0 ends with the
    pretrained weights, so the pair run starts from them; ``molds-eval`` scores the pretrained
    checkpoint's denoising loss, the fork's top-k."""
    import csv
    import gzip
    import json
    import os

    import torch
    from safetensors.torch import load_file

    from molds.eval.evaluate import evaluate_checkpoint
    from molds.preprocessing.config import PreprocessConfig
    from molds.preprocessing.pipeline import run
    from molds.train import main
    from tests.data.conftest import REACTIONS, _build

    with gzip.open(REACTIONS, "rt") as fh:
        body = list(csv.reader(fh))[:301]
    with open(tmp_path / "reactions.csv", "w", newline="") as fh:
        csv.writer(fh).writerows(body)
    pairs = str(tmp_path / "pairs")
    run(PreprocessConfig(input=[str(tmp_path / "reactions.csv")], output=pairs,
                         smiles_column="reactants>reagents>production", id_column="id", task="forward", workers=1,
                         progress=False))
    (tmp_path / "mols").mkdir()
    molecules = _build(tmp_path / "mols", tokenizer=os.path.join(pairs, "tokenizer"))
    model = ["--model.family", "seq2seq", "--model.hidden_size", "32", "--model.num_layers", "2",
             "--model.num_heads", "4", "--model.max_position_embeddings", "160", "--model.dropout", "0.0"]
    common = [*model, "--data.mode", "bucketed", "--data.max_length", "160", "--data.max_tokens_per_batch", "1280",
              "--data.bucket_pool", "64", "--data.too_long", "reject", "--trainer.precision", "fp32",
              "--logging.progress", "false", "--logging.interval_steps", "1", "--eval.interval_steps", "0"]
    pre = main([*common, "--data.manifest", molecules, "--data.mlm_probability", "0.15",
                "--data.mask_span_mean", "3", "--trainer.max_steps", "8", "--optim.lr", "3e-3",
                "--run.output_dir", str(tmp_path / "pre")])
    losses = [json.loads(x)["train/loss"] for x in open(tmp_path / "pre" / "metrics.jsonl") if "train/loss" in x]
    assert len(losses) == 8 and losses[-1] < losses[0]
    report = evaluate_checkpoint(pre["checkpoint"], split="valid", max_batches=2)
    assert report["family"] == "seq2seq" and report["metrics"]["denoising_loss"] > 0
    fork = main([*common, "--data.manifest", pairs, "--checkpoint.resume", pre["checkpoint"],
                 "--checkpoint.fork", "true", "--trainer.max_steps", "1", "--optim.lr", "0", "--optim.weight_decay", "0",
                 "--run.output_dir", str(tmp_path / "fork")])
    a = load_file(os.path.join(pre["checkpoint"], "model.safetensors"))
    b = load_file(os.path.join(fork["checkpoint"], "model.safetensors"))
    # the molecules' vocabulary is the pairs' with what the molecules spell beside (grown from
    # it): the fork keeps the rows of the pairs' tokens
    pairs_vocab = json.load(open(os.path.join(pairs, "manifest.json")))["tokenizer"]["vocab_size"]
    assert a.keys() == b.keys()
    for k in a:
        axes = [d for d in range(a[k].dim()) if a[k].shape[d] != b[k].shape[d]]
        assert axes == [] or len(axes) == 1 and b[k].shape[axes[0]] == pairs_vocab, k
        assert torch.equal(a[k].narrow(axes[0], 0, pairs_vocab) if axes else a[k], b[k]), k
    assert set(evaluate_checkpoint(fork["checkpoint"], split="test", num=4, beams=3)["metrics"]) >= {"top1", "top3"}
