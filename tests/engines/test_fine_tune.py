"""Pretrain, then fine-tune on labels: a fork from an encoder trained without property heads
(``model.num_tasks 0``) into one with them loads every weight of the checkpoint and starts
the heads from the new model's own seeded initialization; with ``fork_optimizer`` it is
refused in one line (the heads have no moments)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist.spawn import run_ranks
from tests.engines.test_encoder import _argv


def _restored(rank, world, argv, checkpoint):
    """(the engine's weights after the fine-tuning fork's restore, a fresh model's head
    weights built from the same recipe and seed), by canonical name."""
    from molds.checkpoint import restore
    from molds.checkpoint.state import canonical_state
    from molds.data.manifest import Manifest
    from molds.runtime.distributed import init_distributed
    from molds.engines import build_engine
    from molds.models import build_model
    from molds.models.loss import build_loss
    from molds.recipe.parse import parse_recipe
    from molds.chemistry.tokens import tokenizer_info
    from molds.checkpoint.resume import fine_tune_heads

    recipe = parse_recipe(argv)
    dist = init_distributed(need_group=recipe.parallel.engine == "zero")
    model = build_model(recipe.model, tokenizer_info(Manifest.load(recipe.data.manifest)), seed=recipe.run.seed)
    from molds.checkpoint import read_lineage

    fresh = fine_tune_heads(recipe, read_lineage(checkpoint), model)
    assert fresh is not None and fresh[2] == {"model.num_tasks": [0, 2]}
    heads = {k: v.clone() for k, v in fresh[1].items()}
    engine = build_engine(recipe, model, build_loss(recipe.model), dist)
    restore(checkpoint, engine, dist, optimizer=False, seed=recipe.run.seed, keep_schedule=False, fresh=fresh[:2])
    if recipe.parallel.zero_stage == 3:
        from molds.engines.zero import full_state

        from molds.checkpoint.state import slots

        weights, _ = full_state(engine.engine, slots(engine.model), keep=True)
    else:
        weights = canonical_state(engine.model)
    return weights, heads


@pytest.fixture(scope="module")
def pretrained(dataset, tmp_path_factory) -> str:
    """A run of an encoder trained without property heads (3 steps, MLM only)."""
    from molds.train import main

    pre = str(tmp_path_factory.mktemp("pretrain") / "run")
    main(_argv(dataset, pre, "ddp", 3, tasks=0))
    return pre


@pytest.mark.parametrize("engine,stage", [("ddp", 0), ("zero", 2), ("zero", 3)])
def test_a_fork_into_property_heads_keeps_the_pretrained_body(pretrained, dataset, tmp_path, engine, stage):
    from molds.checkpoint import resolve
    from molds.checkpoint.state import read_model

    checkpoint = resolve(pretrained)
    saved = read_model(checkpoint)
    assert not any(k.startswith("classifier.") for k in saved)
    argv = _argv(dataset, str(tmp_path / "fine"), engine, 2, tasks=2,
                 extra=["--parallel.zero_stage", str(max(stage, 1)) if engine == "zero" else "0",
                        "--checkpoint.resume", checkpoint, "--checkpoint.fork", "true"])
    weights, heads = run_ranks(_restored, 1, argv, checkpoint)[0]
    assert heads and all(k.startswith("classifier.") for k in heads)
    assert weights.keys() == saved.keys() | heads.keys()
    for k, v in saved.items():
        assert torch.equal(weights[k].float(), v.float()), k  # the body: the checkpoint's, exactly
    for k, v in heads.items():
        assert torch.equal(weights[k].float(), v.float()), k  # the heads: the new model's own initialization


def test_fine_tuning_trains_says_so_and_refuses_forked_moments(pretrained, dataset, tmp_path, capfd):
    from molds.errors import RecipeError
    from molds.train import main

    pre = pretrained
    capfd.readouterr()
    fine = str(tmp_path / "fine")
    result = main(_argv(dataset, fine, "ddp", 3, tasks=2,
                        extra=["--checkpoint.resume", pre, "--checkpoint.fork", "true", "--optim.layer_decay", "0.5"]))
    err = capfd.readouterr().err
    assert "fine-tuning fork: the property heads (classifier.*, label_*) start afresh" in err
    # 2 blocks: heads, block 1, block 0, embeddings
    assert "layer-wise learning rates (optim.layer_decay 0.5): 4 depths from lr x 1 down to lr x 0.125" in err
    assert "model.num_tasks 0 -> 2" in err
    import json

    lineage = json.load(open(os.path.join(result["checkpoint"], "lineage.json")))
    assert lineage["fresh_heads"]["changes"] == {"model.num_tasks": [0, 2]} and lineage["parent"]["step"] == 3
    with pytest.raises(RecipeError, match="fork_optimizer: the property heads change"):
        main(_argv(dataset, str(tmp_path / "fine2"), "ddp", 3, tasks=2,
                   extra=["--checkpoint.resume", pre, "--checkpoint.fork", "true",
                          "--checkpoint.fork_optimizer", "true"]))


@pytest.mark.parametrize("engine,stage", [("ddp", 0), ("zero", 2), ("zero", 3)])
def test_layer_wise_rates_scale_each_blocks_first_step(pretrained, dataset, tmp_path, engine, stage):
    """``optim.layer_decay 0.5`` on a 2-block encoder: Adam's first step moves each element
    with a gradient well above Adam's eps by the learning rate of its group (weight decay
    off, no warm-up, no clipping), so the
    largest change of each tensor is ``lr`` for the heads (the MLM head: it is in the
    pretrained checkpoint), ``lr``/2 for the last block, /4 for the first, /8 for the
    embeddings, written out here by name."""
    from molds.checkpoint import resolve
    from molds.checkpoint.state import read_model

    lr, decay = 1e-3, 0.5
    before = read_model(resolve(pretrained))
    argv = _argv(dataset, str(tmp_path / "fine"), engine, 1, tasks=2,
                 extra=["--parallel.zero_stage", str(max(stage, 1)) if engine == "zero" else "0",
                        "--checkpoint.resume", pretrained, "--checkpoint.fork", "true",
                        "--optim.layer_decay", str(decay), "--optim.warmup_steps", "0", "--optim.weight_decay", "0",
                        "--optim.grad_clip", "0"])
    from tests.engines.test_encoder import _train

    result = run_ranks(_train, 1, argv)[0]
    after = read_model(result["checkpoint"])

    def rate(name):
        if name.startswith("mlm.roberta.embeddings."):
            return lr * decay ** 3
        for block in (0, 1):
            if name.startswith(f"mlm.roberta.encoder.layer.{block}."):
                return lr * decay ** (2 - block)
        assert name.startswith("mlm.lm_head."), name
        return lr

    checked = set()
    for name, was in before.items():
        if name.endswith("key.bias"):  # softmax ignores it: its gradient is rounding noise, below Adam's eps
            continue
        moved = float((after[name].double() - was.double()).abs().max())
        assert moved == pytest.approx(rate(name), rel=1e-2), (name, moved, rate(name))
        checked.add(rate(name))
    assert len(checked) == 4  # every depth was seen


def test_a_seq2seq_decoders_blocks_learn_above_its_encoders():
    """Layer-wise rates of the encoder-decoder, written out by name: the shared and position
    embeddings lowest (the output layer is the token table), then the 2 encoder blocks, then
    the 2 decoder blocks, at lr x 0.5 ** (5 - depth): nothing sits above the last block."""
    from molds.engines.optim import param_groups
    from molds.models.seq2seq import Seq2SeqConfig, Seq2SeqModel

    model = Seq2SeqModel(Seq2SeqConfig(vocab_size=20, hidden_size=16, encoder_layers=2, decoder_layers=2,
                                       num_heads=2, intermediate_size=32, max_position_embeddings=64))

    def depth(name):
        for side, offset in (("model.encoder.layers.", 1), ("model.decoder.layers.", 3)):
            if name.startswith(side):
                return offset + int(name[len(side)])
        return 0 if "embed" in name or name == "model.shared.weight" else 5  # shared: the token table

    groups = param_groups(model.named_parameters(), 0.1, layer_decay=0.5, module=model)
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    assert groups[0]["lr_scale"] == 0.5  # the highest rate first: the rate the log shows
    seen = set()
    for name, p in model.named_parameters():
        assert scale[id(p)] == 0.5 ** (5 - depth(name)), name
        seen.add(depth(name))
    assert seen == {0, 1, 2, 3, 4}
