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
                        extra=["--checkpoint.resume", pre, "--checkpoint.fork", "true"]))
    err = capfd.readouterr().err
    assert "fine-tuning fork: the property heads (classifier.*, label_*) start afresh" in err
    assert "model.num_tasks 0 -> 2" in err
    import json

    lineage = json.load(open(os.path.join(result["checkpoint"], "lineage.json")))
    assert lineage["fresh_heads"]["changes"] == {"model.num_tasks": [0, 2]} and lineage["parent"]["step"] == 3
    with pytest.raises(RecipeError, match="fork_optimizer: the property heads change"):
        main(_argv(dataset, str(tmp_path / "fine2"), "ddp", 3, tasks=2,
                   extra=["--checkpoint.resume", pre, "--checkpoint.fork", "true",
                          "--checkpoint.fork_optimizer", "true"]))
