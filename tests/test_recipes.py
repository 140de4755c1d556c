"""Every shipped recipe parses; impossible combinations fail before any process group."""

from __future__ import annotations

import glob
import os

import pytest

from molds.recipe import RecipeError, deepspeed_config, parse_recipe, resolve_batching, validate

ROOT = os.path.join(os.path.dirname(__file__), "..")
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "**", "*.json"), recursive=True))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: os.path.relpath(p, ROOT))
def test_shipped_recipe_parses_and_validates(path):
    recipe = parse_recipe(["--recipe", path])
    validate(recipe, 2)
    if recipe.parallel.engine == "zero":
        cfg = deepspeed_config(recipe, 2, bf16=False)
        global_batch, accum = resolve_batching(recipe, 2)
        assert cfg["train_batch_size"] == recipe.data.micro_batch_size * global_batch
        assert cfg["gradient_accumulation_steps"] == accum
        assert cfg["zero_optimization"]["stage"] == recipe.parallel.zero_stage


def test_overrides_and_unknown_keys():
    path = os.path.join(ROOT, "recipes", "smoke", "dense_ddp.json")
    recipe = parse_recipe(["--recipe", path, "--optim.lr", "1e-4", "--trainer.max_steps", "3"])
    assert recipe.optim.lr == 1e-4 and recipe.trainer.max_steps == 3
    with pytest.raises(SystemExit):
        parse_recipe(["--recipe", path, "--optim.learning_rate", "1e-4"])
    with pytest.raises(SystemExit):
        parse_recipe(["--recipe", path, "--trainer.max_steps", "many"])


@pytest.mark.parametrize("overrides,key", [
    (["--parallel.engine", "pipeline", "--parallel.zero_stage", "3", "--parallel.pp_size", "2"], "zero_stage"),
    (["--parallel.num_experts", "6", "--parallel.ep_size", "4"], "ep_size"),
    (["--trainer.global_batch_size", "6", "--trainer.grad_accum", "2"], "global_batch_size"),
    (["--trainer.global_batch_size", "3"], "global_batch_size"),
    (["--parallel.offload_params", "true"], "offload_params"),
    (["--data.seq_len", "4096"], "seq_len"),
])
def test_impossible_combinations_name_the_key(overrides, key):
    path = os.path.join(ROOT, "recipes", "smoke", "dense_ddp.json")
    recipe = parse_recipe(["--recipe", path, *overrides])
    with pytest.raises(RecipeError, match=key):
        validate(recipe, 2)


def test_ds_config_must_not_repeat_batch_sizes(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"train_batch_size": 64}')
    recipe = parse_recipe(["--recipe", os.path.join(ROOT, "recipes", "smoke", "dense_zero2.json"),
                           "--parallel.ds_config", str(bad)])
    with pytest.raises(RecipeError, match="train_batch_size"):
        deepspeed_config(recipe, 2, bf16=False)
