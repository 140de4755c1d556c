"""Every shipped recipe parses; bad values and impossible combinations fail before any
process group, naming the key; the DeepSpeed file and the recipe never silently disagree."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import typing

import pytest

from molds.errors import RecipeError
from molds.recipe.parse import SECTIONS, Recipe, deepspeed_config, parse_recipe, resolve_batching, validate

ROOT = os.path.join(os.path.dirname(__file__), "..")
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "**", "*.json"), recursive=True))
SMOKE = os.path.join(ROOT, "recipes", "smoke", "dense_ddp.json")


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: os.path.relpath(p, ROOT))
def test_shipped_recipe_parses_and_validates(path):
    recipe = parse_recipe(["--recipe", path])
    if recipe.goal.prior:  # a goal run: its model and data are its prior's; its objective is checked here
        from molds.goal.plan import build_scorers, check_goal

        check_goal(recipe, 2)
        assert len(build_scorers(recipe.goal)) >= 1
        return
    p = recipe.parallel
    world = p.pp_size * p.ep_size * (1 if p.ep_size > 1 else 2) if p.engine == "pipeline" else 2
    validate(recipe, world)
    if recipe.parallel.engine in ("zero", "pipeline"):
        assert recipe.parallel.ds_config is None or os.path.isfile(recipe.parallel.ds_config)
        cfg = deepspeed_config(recipe, world, bf16=False)
        b = resolve_batching(recipe, world)
        assert cfg["train_batch_size"] == b.global_batch == recipe.data.micro_batch_size * b.grad_accum * b.dp_size
        assert cfg["gradient_accumulation_steps"] == b.grad_accum
        assert cfg["zero_optimization"]["stage"] == recipe.parallel.zero_stage


def test_overrides_and_unknown_keys():
    recipe = parse_recipe(["--recipe", SMOKE, "--optim.lr", "1e-4", "--trainer.max_steps", "3"])
    assert recipe.optim.lr == 1e-4 and recipe.trainer.max_steps == 3
    with pytest.raises(RecipeError, match="learning_rate"):
        parse_recipe(["--recipe", SMOKE, "--optim.learning_rate", "1e-4"])
    with pytest.raises(RecipeError, match="trainer.max_steps"):
        parse_recipe(["--recipe", SMOKE, "--trainer.max_steps", "many"])
    assert parse_recipe(["--recipe", SMOKE, "--resume", "auto", "--fork=true"]).checkpoint.fork is True


def _numeric_fields():
    for section in SECTIONS:
        cls = type(getattr(Recipe(), section))
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            args = typing.get_args(kind)
            base = next((a for a in args if a is not type(None)), kind) if args else kind
            if base in (int, float):
                yield section, f.name, base


NUMERIC = list(_numeric_fields())


def test_every_numeric_field_declares_a_range():
    assert len(NUMERIC) > 40
    for section, name, _ in NUMERIC:
        cls = type(getattr(Recipe(), section))
        assert name in getattr(cls, "RANGES", {}), f"{section}.{name} has no declared range"


#: the numeric keys a recipe may set to 0, written from what each key means (not read from the
#: code's ranges): off, none, unset (derived from another key), or a value that is legal as it is
TAKES_ZERO = {
    # seeds; a machine with no GPU; no workers; no dropout, no extra tasks, no MoE
    "run.seed", "data.seed", "run.min_gpus", "data.num_workers", "model.dropout", "model.num_tasks",
    "model.num_experts", "model.moe_shared_expert_size", "model.moe_first_dense_layers",
    # off: shuffling window, masking, randomized spellings, skipped shards, early epoch stop, aux / z losses,
    # capacity limit, activation checkpoints, warm-up, weight decay, momentum terms, clipping
    "data.shuffle_window", "data.mlm_probability", "data.mask_span_mean", "data.randomized_smiles", "data.max_skipped_fraction",
    "data.stop_after_epoch", "model.moe_aux_loss_coef", "model.moe_z_loss_coef", "model.moe_capacity_factor",
    "parallel.activation_checkpoint_interval", "optim.warmup_steps", "optim.warmup_fraction", "optim.weight_decay",
    "optim.beta1", "optim.beta2", "optim.grad_clip",
    # derived when 0: MLP and expert widths, batch sizes, sample lengths
    "model.intermediate_size", "model.moe_expert_size", "model.decoder_layers", "trainer.global_batch_size",
    "trainer.grad_accum", "goal.max_tokens",
    # a legal value: ZeRO stage 0, learning rate 0 (a frozen run), decay to 0, no non-finite step tolerated
    "parallel.zero_stage", "optim.lr", "optim.min_lr_ratio", "trainer.max_nonfinite_steps",
    "optim.layer_decay",  # 0: only the heads learn
    # evaluation and checkpoints off or unbounded, sampling without top-k, no picture
    "eval.interval_steps", "eval.full_interval_steps", "eval.max_batches", "eval.top_k", "eval.grid",
    "logging.profile_steps",  # no profile
    "checkpoint.interval_steps", "checkpoint.interval_fraction", "checkpoint.average_last", "checkpoint.keep_last",
    # a goal run: the prior alone (sigma 0), no budget, no early stop, no replay, no floor, no penalty
    "goal.sigma", "goal.max_oracle_calls", "goal.likelihood_penalty", "goal.patience", "goal.replay_size",
    "goal.replay_samples", "goal.min_score", "goal.penalty",
}
#: the keys that take 10**15: counts only the data bounds (steps, epochs)
TAKES_HUGE = {"data.max_steps", "data.max_epochs", "data.stop_after_epoch"}


@pytest.mark.parametrize("section,name,kind", NUMERIC, ids=[f"{s}.{n}" for s, n, _ in NUMERIC])
def test_numeric_sweep_zero_negative_absurd(section, name, kind):
    key = f"{section}.{name}"
    for value in (0, -1, 10**15):  # no key takes a negative number
        value = kind(value)
        inside = key in TAKES_ZERO if value == 0 else key in TAKES_HUGE if value > 0 else False
        argv = ["--recipe", SMOKE, f"--{section}.{name}", str(value)]
        if inside:
            recipe = parse_recipe(argv)
            assert getattr(getattr(recipe, section), name) == value
        else:
            with pytest.raises(RecipeError, match=rf"{section}\.{name}=.*outside its range \["):
                parse_recipe(argv)


@pytest.mark.parametrize("overrides,key", [
    (["--parallel.engine", "pipeline", "--parallel.zero_stage", "2", "--parallel.pp_size", "2"], "zero_stage"),
    (["--model.num_experts", "6", "--parallel.ep_size", "4", "--parallel.engine", "pipeline",
      "--parallel.zero_stage", "1"], "ep_size"),
    (["--model.num_experts", "4", "--parallel.ep_size", "4", "--parallel.engine", "pipeline",
      "--parallel.zero_stage", "1"], "data-parallel size"),
    (["--model.num_experts", "4", "--parallel.ep_size", "2"], "parallel.engine=pipeline"),
    (["--model.num_experts", "2", "--model.moe_top_k", "3"], "moe_top_k"),
    (["--parallel.engine", "pipeline", "--parallel.zero_stage", "1", "--parallel.pp_size", "3"], "pp_size"),
    (["--trainer.global_batch_size", "6", "--trainer.grad_accum", "2"], "global_batch_size"),
    (["--trainer.global_batch_size", "3"], "global_batch_size"),
    (["--parallel.offload_params", "true"], "offload_params"),
    (["--data.seq_len", "4096"], "seq_len"),
    (["--model.hidden_size", "100", "--model.num_heads", "8"], "hidden_size"),
    (["--parallel.schedule", "dualpipev"], "schedule"),
    (["--parallel.engine", "pipeline", "--parallel.zero_stage", "1", "--parallel.pp_size", "2",
      "--optim.layer_decay", "0.8"], "needs parallel.zero_stage=0: each stage holds other blocks"),
    (["--parallel.engine", "pipeline", "--parallel.zero_stage", "1", "--parallel.pp_size", "2",
      "--parallel.schedule", "dualpipev", "--trainer.grad_accum", "3"], "trainer.grad_accum is 3"),
    (["--parallel.engine", "pipeline", "--parallel.zero_stage", "1", "--parallel.pp_size", "2",
      "--parallel.schedule", "dualpipev", "--trainer.grad_accum", "4", "--parallel.activation_checkpoint_interval",
      "1"], "activation_checkpoint_interval"),
    (["--checkpoint.fork", "true"], "fork"),
    (["--run.expect", '{"avx2": "validity 0.95"}'], "run.expect: unknown CPU class 'avx2'"),
])
def test_impossible_combinations_name_the_key(overrides, key):
    recipe = parse_recipe(["--recipe", SMOKE, *overrides])
    with pytest.raises(RecipeError, match=key):
        validate(recipe, 2)


def test_global_batch_counts_sequences_as_deepspeed_does():
    recipe = parse_recipe(["--recipe", SMOKE, "--data.micro_batch_size", "4", "--trainer.global_batch_size", "16",
                           "--trainer.grad_accum", "0"])
    b = resolve_batching(recipe, 2)
    assert (b.global_batch, b.grad_accum, b.dp_size) == (16, 2, 2)
    assert resolve_batching(parse_recipe(["--recipe", SMOKE, "--data.micro_batch_size", "4"]), 2).global_batch == 8


def test_ds_config_path_is_relative_to_the_recipe(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "ds.json").write_text('{"zero_optimization": {"overlap_comm": false}}')
    body = json.load(open(os.path.join(ROOT, "recipes", "smoke", "dense_zero2.json")))
    body["parallel"]["ds_config"] = "conf/ds.json"
    (tmp_path / "r.json").write_text(json.dumps(body))
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)  # not where the recipe is
        recipe = parse_recipe(["--recipe", str(tmp_path / "r.json")])
    finally:
        os.chdir(cwd)
    assert recipe.parallel.ds_config == str(tmp_path / "conf" / "ds.json")
    cfg = deepspeed_config(recipe, 2, bf16=False)
    assert cfg["zero_optimization"] == {"overlap_comm": False, "stage": 2}  # the file's key kept, the gap filled


@pytest.mark.parametrize("body,key", [
    ({"train_batch_size": 64}, "train_batch_size"),
    ({"gradient_accumulation_steps": 3}, "gradient_accumulation_steps"),
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage"),
    ({"gradient_clipping": 0.5}, "gradient_clipping"),
    ({"optimizer": {"type": "Adam"}}, "optimizer"),
    ({"scheduler": {"type": "WarmupLR"}}, "scheduler"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer"),
])
def test_ds_config_conflicts_name_both_sources(tmp_path, body, key):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps(body))
    recipe = parse_recipe(["--recipe", os.path.join(ROOT, "recipes", "smoke", "dense_zero2.json"),
                           "--parallel.ds_config", str(bad)])
    with pytest.raises(RecipeError, match=key) as err:
        deepspeed_config(recipe, 2, bf16=False)
    assert str(bad) in str(err.value)


def test_ds_config_that_agrees_is_accepted(tmp_path):
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
                                "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}))
    recipe = parse_recipe(["--recipe", os.path.join(ROOT, "recipes", "smoke", "dense_zero2.json"),
                           "--parallel.ds_config", str(good)])
    cfg = deepspeed_config(recipe, 2, bf16=False)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 1000 and cfg["train_batch_size"] == 8


def test_the_start_line_gives_a_step_in_the_unit_its_data_mode_batches_by():
    """Packed rows and fixed-shape buckets are counted in sequences; length-bucketed batches
    (the encoder-decoder's) in padded tokens, since their sequence count varies."""
    from molds.metrics.run_report import step_size

    packed = parse_recipe(["--recipe", SMOKE, "--data.micro_batch_size", "4", "--trainer.grad_accum", "3"])
    assert step_size(packed, resolve_batching(packed, 2)) == \
        "24 sequences (4 per micro-batch x 3 accumulation x 2 data-parallel)"
    bart = parse_recipe(["--recipe", os.path.join(ROOT, "recipes", "smoke", "bart_forward.json"),
                         "--data.max_tokens_per_batch", "1000", "--trainer.grad_accum", "3"])
    said = step_size(bart, resolve_batching(bart, 2))
    assert said.startswith("up to 6,000 padded tokens (1,000 per micro-batch x 3 accumulation x 2 data-parallel"), said
    assert "sequences (" not in said
    fixed = parse_recipe(["--recipe", os.path.join(ROOT, "recipes", "smoke", "bart_forward.json"),
                          "--data.fixed_shape", "true", "--data.micro_batch_size", "2"])
    assert step_size(fixed, resolve_batching(fixed, 1)).startswith("2 sequences (2 per micro-batch")


def test_a_warmup_as_long_as_the_run_is_said_with_the_rate_it_ends_at():
    from molds.engines.optim import lr_lambda
    from molds.metrics.run_report import warmup_warning
    from molds.recipe.budget import horizon_of

    for overrides, warned in ((["--optim.warmup_steps", "100000"], True), ([], False),
                              (["--trainer.max_steps", "5"], True), (["--optim.warmup_steps", "60"], True),
                              (["--optim.warmup_steps", "59"], False)):
        recipe = parse_recipe(["--recipe", SMOKE, *overrides])
        horizon = horizon_of(recipe.trainer)
        note = warmup_warning(recipe, horizon)
        assert (note is not None) == warned, overrides
        if warned:  # the figure it gives is the schedule's own last rate
            last = recipe.optim.lr * lr_lambda(recipe.optim, horizon)(horizon.max_steps - 1)
            assert f"to {last:.3g} at the last step" in note and "trainer.max_steps" in note, note
    timed = parse_recipe(["--recipe", SMOKE, "--trainer.max_steps", "null", "--trainer.max_time", "1m",
                          "--optim.warmup_fraction", "0.5"])
    assert warmup_warning(timed, horizon_of(timed.trainer)) is None
