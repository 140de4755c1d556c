"""The recipe as a whole: sections, command-line parsing, and the checks that run
before any process group starts.

``--recipe FILE`` loads a JSON recipe; every field can then be overridden
(``--optim.lr 1e-4``); ``--print_config`` prints the resolved recipe. Unknown keys and
wrong types are jsonargparse errors naming the key; impossible combinations are
``RecipeError``s naming the keys involved.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from .config import (CheckpointConfig, DataConfig, EvalConfig, KernelsConfig, LoggingConfig, ModelConfig,
                     OptimConfig, ParallelConfig, RunConfig, TrainerConfig)

SECTIONS = ("run", "data", "model", "parallel", "kernels", "optim", "trainer", "eval", "checkpoint", "logging")


class RecipeError(ValueError):
    """An impossible combination of recipe keys (the message names them)."""


@dataclass
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def build_parser():
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(prog="molds-train", description="Train a chemical language model from a JSON recipe.",
                            default_env=False)
    parser.add_argument("--recipe", action=ActionConfigFile, help="JSON recipe (recipes/*.json).")
    defaults = Recipe()
    for name in SECTIONS:
        parser.add_class_arguments(type(getattr(defaults, name)), name, fail_untyped=True, sub_configs=True)
    return parser


def parse_recipe(argv: list[str] | None = None) -> Recipe:
    import sys

    parser = build_parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    ns = ns.as_dict()
    recipe = Recipe(**{name: type(getattr(Recipe(), name))(**ns[name]) for name in SECTIONS})
    return recipe


def data_parallel_size(recipe: Recipe, world_size: int) -> int:
    if recipe.parallel.engine == "pipeline":
        return world_size // max(1, recipe.parallel.pp_size)
    return world_size


def resolve_batching(recipe: Recipe, world_size: int) -> tuple[int, int]:
    """(global batch in micro-batches, accumulation steps) consistent with the world size."""
    dp = data_parallel_size(recipe, world_size)
    t = recipe.trainer
    if t.global_batch_size and t.grad_accum:
        if t.global_batch_size != t.grad_accum * dp:
            raise RecipeError(f"trainer.global_batch_size={t.global_batch_size} must equal trainer.grad_accum "
                              f"({t.grad_accum}) x data-parallel size ({dp})")
        return t.global_batch_size, t.grad_accum
    if t.global_batch_size:
        if t.global_batch_size % dp:
            raise RecipeError(f"trainer.global_batch_size={t.global_batch_size} (in micro-batches) is not a "
                              f"multiple of the data-parallel size {dp}")
        return t.global_batch_size, t.global_batch_size // dp
    accum = t.grad_accum or 1
    return accum * dp, accum


def validate(recipe: Recipe, world_size: int) -> None:
    """The checks that need no process group."""
    p, m = recipe.parallel, recipe.model
    if p.engine == "pipeline" and p.zero_stage >= 2:
        raise RecipeError(f"parallel.zero_stage={p.zero_stage} cannot be combined with parallel.engine=pipeline "
                          f"(DeepSpeed pipelines support ZeRO stage 0 or 1)")
    if p.engine == "zero" and not 0 <= p.zero_stage <= 3:
        raise RecipeError(f"parallel.zero_stage must be 0-3, got {p.zero_stage}")
    if p.offload_params and not (p.engine == "zero" and p.zero_stage == 3):
        raise RecipeError("parallel.offload_params needs parallel.engine=zero with parallel.zero_stage=3")
    if p.offload_optimizer and p.engine != "zero":
        raise RecipeError("parallel.offload_optimizer needs parallel.engine=zero")
    if p.pp_size < 1 or world_size % p.pp_size:
        raise RecipeError(f"parallel.pp_size={p.pp_size} does not divide the world size {world_size}")
    if p.engine != "pipeline" and p.pp_size != 1:
        raise RecipeError("parallel.pp_size > 1 needs parallel.engine=pipeline")
    if p.num_experts:
        if p.num_experts % p.ep_size:
            raise RecipeError(f"parallel.ep_size={p.ep_size} does not divide parallel.num_experts={p.num_experts}")
        if world_size % p.ep_size:
            raise RecipeError(f"parallel.ep_size={p.ep_size} does not divide the world size {world_size}")
    elif p.ep_size != 1:
        raise RecipeError("parallel.ep_size > 1 needs parallel.num_experts > 0")
    if p.engine in ("pipeline",) or p.num_experts or p.schedule != "1f1b" or recipe.kernels.fp8 or recipe.kernels.triton:
        raise RecipeError("the pipeline engine, MoE, DualPipeV and the FP8/Triton kernels are not built yet; "
                          "use parallel.engine ddp or zero with a dense model")
    if m.family == "decoder" and recipe.data.mode != "packed":
        raise RecipeError("model.family=decoder trains on data.mode=packed")
    if m.family == "encoder" and recipe.data.mode != "bucketed":
        raise RecipeError("model.family=encoder trains on data.mode=bucketed")
    ev = recipe.eval
    if ev.interval_steps < 0 or ev.full_interval_steps < 0:
        raise RecipeError("eval.interval_steps and eval.full_interval_steps must be >= 0")
    if ev.temperature <= 0:
        raise RecipeError(f"eval.temperature={ev.temperature} must be > 0")
    if ev.samples < 1 or ev.full_samples < 1 or ev.top_k < 0 or ev.max_batches < 0:
        raise RecipeError("eval.samples and eval.full_samples must be >= 1, eval.top_k and eval.max_batches >= 0")
    if m.family == "encoder" and recipe.kernels.compile_regions:
        raise RecipeError("kernels.compile_regions applies to model.family=decoder (the encoder is HF's RoBERTa)")
    if m.family == "encoder":
        if m.num_tasks and not recipe.data.with_labels:
            raise RecipeError("model.num_tasks > 0 needs data.with_labels=true")
        if not m.num_tasks and recipe.data.mlm_probability <= 0:
            raise RecipeError("an encoder with model.num_tasks=0 needs data.mlm_probability > 0 (nothing to learn)")
        if recipe.data.max_length > m.max_position_embeddings:
            raise RecipeError(f"data.max_length={recipe.data.max_length} exceeds model.max_position_embeddings="
                              f"{m.max_position_embeddings}")
    if recipe.data.mode == "packed" and recipe.data.seq_len > m.max_position_embeddings:
        raise RecipeError(f"data.seq_len={recipe.data.seq_len} exceeds model.max_position_embeddings="
                          f"{m.max_position_embeddings}")
    if not recipe.data.manifest:
        raise RecipeError("data.manifest: give the directory written by molds-preprocess")
    resolve_batching(recipe, world_size)


def deepspeed_config(recipe: Recipe, world_size: int, bf16: bool) -> dict:
    """The DeepSpeed JSON named by the recipe, with its batch fields derived from the
    recipe so the two cannot disagree."""
    path = recipe.parallel.ds_config
    cfg = {}
    if path:
        if not os.path.exists(path):
            raise RecipeError(f"parallel.ds_config: no file {path}")
        with open(path) as fh:
            cfg = json.load(fh)
    global_batch, accum = resolve_batching(recipe, world_size)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key in cfg and cfg[key] not in ("auto",):
            raise RecipeError(f"{path}: remove {key!r}; molds derives batch sizes from the recipe")
    micro = recipe.data.micro_batch_size
    cfg.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum,
               train_batch_size=micro * global_batch)
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = recipe.parallel.zero_stage
    if recipe.parallel.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if recipe.parallel.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    cfg["gradient_clipping"] = recipe.optim.grad_clip
    cfg["bf16"] = {"enabled": bf16}
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("steps_per_print", 10**9)
    cfg.setdefault("wall_clock_breakdown", False)
    return cfg
