"""The recipe as a whole: sections, command-line parsing, and the checks that run
before any process group starts.

``--recipe FILE`` loads a JSON recipe; every field can then be overridden
(``--optim.lr 1e-4``); ``--print_config`` prints the resolved recipe. Unknown keys,
wrong types, values outside a field's declared range and impossible combinations are
``RecipeError``s naming the keys involved (one line, no usage dump).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
from dataclasses import dataclass, field

from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from ..errors import RecipeError
from .budget import parse_duration
from .goal import GoalConfig
from .sections import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    KernelsConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainerConfig,
)

SECTIONS = ("run", "data", "model", "parallel", "kernels", "optim", "trainer", "eval", "checkpoint", "logging",
            "goal")
SHORT_FORMS = {"--resume": "--checkpoint.resume", "--fork": "--checkpoint.fork"}


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
    goal: GoalConfig = field(default_factory=GoalConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


HELP_EPILOG = """\
Resume and fork:
  --resume auto              continue the run in run.output_dir from its latest checkpoint
                             (short for --checkpoint.resume auto; or give a checkpoint or run directory)
  --fork true                start a new run from a checkpoint's weights (--checkpoint.fork true)
  --run.overwrite true       start over in an output directory that holds an earlier run
  --debug                    show tracebacks of user errors (also MOLDS_DEBUG=1)
"""


def build_parser(prog: str = "molds-train"):
    # no value in a recipe may name something to import (jsonargparse's class_path)
    set_parsing_settings(docstring_parse_attribute_docstrings=True, import_path_denylist=["*"])
    parser = ArgumentParser(prog=prog, description="Train a chemical language model from a JSON recipe.",
                            default_env=False, exit_on_error=False, epilog=HELP_EPILOG, allow_abbrev=False)
    parser.add_argument("--recipe", action=ActionConfigFile, help="JSON recipe (recipes/*.json).")
    defaults = Recipe()
    for name in SECTIONS:
        parser.add_class_arguments(type(getattr(defaults, name)), name, fail_untyped=True, sub_configs=True)
    return parser


@functools.cache
def _recipe_parser():
    """``build_parser()``, built once a process: building it reads every section's source for its
    keys' help (0.2-0.4 s on 2 cores), and a process parses recipes again and again (``molds-eval
    --recipe`` one per seed, the tests hundreds); parsing leaves the parser as it was."""
    return build_parser()


def expand_short_forms(argv: list[str]) -> list[str]:
    out = []
    for a in argv:
        key, eq, value = a.partition("=")
        out.append(SHORT_FORMS[key] + eq + value if key in SHORT_FORMS else a)
    return out


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def parse_recipe(argv: list[str] | None = None) -> Recipe:
    """The recipe from ``argv`` (``--recipe FILE`` and overrides); ranges checked."""
    argv = expand_short_forms(list(sys.argv[1:] if argv is None else argv))
    for i, a in enumerate(argv):
        if a == "--recipe" and i + 1 < len(argv):
            check_recipe_file(argv[i + 1])
        elif a.startswith("--recipe="):
            check_recipe_file(a.split("=", 1)[1])
        elif "class_path" in a or "init_args" in a:
            raise RecipeError(f"{a}: a recipe names values, not classes (class_path / init_args are refused)")
    parser = _recipe_parser()
    try:
        ns = parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise RecipeError(_one_line(exc)) from None
    except (OSError, ValueError) as exc:  # an unreadable or malformed recipe file
        raise RecipeError(f"--recipe: {_one_line(exc)}") from None
    values = ns.as_dict()
    recipe = Recipe(**{name: type(getattr(Recipe(), name))(**values[name]) for name in SECTIONS})
    recipe.parallel.ds_config = _resolve_ds_config(recipe.parallel.ds_config, argv)
    check_ranges(recipe)
    return recipe


def check_recipe_file(path: str) -> None:
    """A recipe file is a JSON object of known sections holding known keys: anything else
    (a typo, a section molds does not have, a class_path) is refused, naming it."""
    try:
        with open(path, encoding="utf-8") as fh:
            body = json.load(fh)
    except FileNotFoundError:
        raise RecipeError(f"--recipe {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise RecipeError(f"--recipe {path}: not readable JSON ({_one_line(exc)})") from None
    if not isinstance(body, dict):
        raise RecipeError(f"{path}: a recipe is a JSON object with sections {', '.join(SECTIONS)}")
    defaults = Recipe()
    for section, values in body.items():
        if section not in SECTIONS:
            raise RecipeError(f"{path}: unknown section {section!r} (sections: {', '.join(SECTIONS)})")
        if not isinstance(values, dict):
            raise RecipeError(f"{path}: section {section!r} must be an object of keys")
        known = {f.name for f in dataclasses.fields(type(getattr(defaults, section)))}
        for key in values:
            if key in ("class_path", "init_args", "dict_kwargs"):
                raise RecipeError(f"{path}: {section}.{key}: a recipe names values, not classes")
            if key not in known:
                raise RecipeError(f"{path}: unknown key {section}.{key}")


def _resolve_ds_config(path: str | None, argv: list[str]) -> str | None:
    """A relative ``parallel.ds_config`` is relative to the recipe file that set it, or to
    the working directory when the command line set it."""
    if not path or os.path.isabs(path):
        return path
    set_on_command_line = any(a.split("=")[0] == "--parallel.ds_config" for a in argv)
    if not set_on_command_line:
        for recipe_file in reversed(recipe_files(argv)):
            try:
                with open(recipe_file, encoding="utf-8") as fh:
                    if (json.load(fh).get("parallel") or {}).get("ds_config") == path:
                        return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(recipe_file)), path))
            except (OSError, ValueError, AttributeError):
                continue
    return os.path.abspath(path)


def check_ranges(recipe: Recipe) -> None:
    """Every numeric field within its section's declared range."""
    for section in SECTIONS:
        cfg = getattr(recipe, section)
        for key, (lo, hi) in getattr(type(cfg), "RANGES", {}).items():
            value = getattr(cfg, key)
            if value is None:
                continue
            bad = isinstance(value, float) and not math.isfinite(value)
            bad = bad or (lo is not None and value < lo) or (hi is not None and value > hi)
            if bad:
                span = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
                raise RecipeError(f"{section}.{key}={value!r} is outside its range {span}")


def data_parallel_size(recipe: Recipe, world_size: int) -> int:
    if recipe.parallel.engine == "pipeline":
        return world_size // max(1, recipe.parallel.pp_size)
    return world_size


@dataclass(frozen=True)
class Batching:
    """Sizes of one optimizer step."""

    global_batch: int  # sequences per step over all data-parallel ranks (DeepSpeed's train_batch_size)
    grad_accum: int  # micro-batches per step on each rank
    dp_size: int
    micro_batch: int  # sequences per micro-batch


def resolve_batching(recipe: Recipe, world_size: int) -> Batching:
    """The global batch (in sequences) and accumulation consistent with the world size."""
    dp = data_parallel_size(recipe, world_size)
    t, micro = recipe.trainer, recipe.data.micro_batch_size
    per_step = micro * dp  # sequences per accumulation step
    if t.global_batch_size and t.grad_accum:
        if t.global_batch_size != per_step * t.grad_accum:
            raise RecipeError(f"trainer.global_batch_size={t.global_batch_size} must equal data.micro_batch_size "
                              f"({micro}) x trainer.grad_accum ({t.grad_accum}) x data-parallel size ({dp}) = "
                              f"{per_step * t.grad_accum}")
        return Batching(t.global_batch_size, t.grad_accum, dp, micro)
    if t.global_batch_size:
        if t.global_batch_size % per_step:
            raise RecipeError(f"trainer.global_batch_size={t.global_batch_size} sequences is not a multiple of "
                              f"data.micro_batch_size ({micro}) x data-parallel size ({dp}) = {per_step}")
        return Batching(t.global_batch_size, t.global_batch_size // per_step, dp, micro)
    accum = t.grad_accum or 1
    return Batching(per_step * accum, accum, dp, micro)


def validate(recipe: Recipe, world_size: int) -> Batching:
    """The checks that need no process group; returns the step's batching."""
    check_ranges(recipe)
    p, m, d = recipe.parallel, recipe.model, recipe.data
    unknown = sorted(set(recipe.run.expect) - {"bf16-native", "fp32-only"})
    if unknown:  # jsonargparse does not check a Dict's Literal keys
        raise RecipeError(f"run.expect: unknown CPU class {unknown[0]!r} (the classes: 'bf16-native', 'fp32-only')")
    if p.engine == "pipeline" and p.zero_stage >= 2:
        raise RecipeError(f"parallel.zero_stage={p.zero_stage} cannot be combined with parallel.engine=pipeline "
                          f"(DeepSpeed pipelines support ZeRO stage 0 or 1)")
    if recipe.optim.layer_decay < 1.0 and p.engine == "pipeline" and p.zero_stage > 0:
        # DeepSpeed's ZeRO-1 reduces each parameter group's norm across the stages, group by group
        raise RecipeError(f"optim.layer_decay={recipe.optim.layer_decay:g} with parallel.engine=pipeline needs "
                          f"parallel.zero_stage=0: each stage holds other blocks, so other parameter groups, and "
                          f"ZeRO-1 needs the same groups on every stage (or use the ddp or zero engine)")
    if p.offload_params and not (p.engine == "zero" and p.zero_stage == 3):
        raise RecipeError("parallel.offload_params needs parallel.engine=zero with parallel.zero_stage=3")
    if p.offload_optimizer and p.engine != "zero":
        raise RecipeError("parallel.offload_optimizer needs parallel.engine=zero")
    if world_size % p.pp_size:
        raise RecipeError(f"parallel.pp_size={p.pp_size} does not divide the world size {world_size}")
    if p.engine != "pipeline" and p.pp_size != 1:
        raise RecipeError("parallel.pp_size > 1 needs parallel.engine=pipeline")
    if p.engine != "pipeline" and p.schedule != "1f1b":
        raise RecipeError("parallel.schedule applies to parallel.engine=pipeline")
    batching = resolve_batching(recipe, world_size)
    if p.schedule == "dualpipev":
        accum = batching.grad_accum
        if accum < 2 * p.pp_size:
            raise RecipeError(f"parallel.schedule=dualpipev needs at least 2 x parallel.pp_size = {2 * p.pp_size} "
                              f"micro-batches per step; trainer.grad_accum is {accum}")
        if p.activation_checkpoint_interval:
            raise RecipeError("parallel.activation_checkpoint_interval applies to parallel.schedule=1f1b (dualpipev "
                              "runs its chunks in steps and keeps their activations)")
        if m.num_layers + 3 < 2 * p.pp_size:
            raise RecipeError(f"parallel.schedule=dualpipev cuts the model into 2 x parallel.pp_size = "
                              f"{2 * p.pp_size} stages: model.num_layers={m.num_layers} is too few")
    check_kernels(recipe)
    dp = batching.dp_size
    if m.num_experts:
        if m.family != "decoder":
            raise RecipeError("model.num_experts > 0 needs model.family=decoder")
        if m.num_experts % p.ep_size:
            raise RecipeError(f"parallel.ep_size={p.ep_size} does not divide model.num_experts={m.num_experts}")
        if dp % p.ep_size:
            raise RecipeError(f"parallel.ep_size={p.ep_size} does not divide the data-parallel size {dp} "
                              f"(world size {world_size} / parallel.pp_size {p.pp_size})")
        if m.moe_top_k > m.num_experts:
            raise RecipeError(f"model.moe_top_k={m.moe_top_k} exceeds model.num_experts={m.num_experts}")
        if m.moe_first_dense_layers >= m.num_layers:
            raise RecipeError(f"model.moe_first_dense_layers={m.moe_first_dense_layers} leaves no MoE layer in "
                              f"model.num_layers={m.num_layers}")
    elif p.ep_size != 1:
        raise RecipeError("parallel.ep_size > 1 needs model.num_experts > 0")
    if p.ep_size > 1 and p.engine != "pipeline":
        raise RecipeError("parallel.ep_size > 1 needs parallel.engine=pipeline (it drives expert parallelism; "
                          "use parallel.pp_size=1 for expert parallelism alone)")
    if p.engine == "pipeline":
        if m.family != "decoder":
            raise RecipeError("parallel.engine=pipeline trains model.family=decoder")
        if m.num_layers < p.pp_size:
            raise RecipeError(f"model.num_layers={m.num_layers} is fewer than parallel.pp_size={p.pp_size} stages")
        if d.mode != "packed":
            raise RecipeError("parallel.engine=pipeline needs fixed-shape micro-batches: data.mode=packed")
    if m.family == "decoder" and d.mode != "packed":
        raise RecipeError("model.family=decoder trains on data.mode=packed")
    if m.family in ("encoder", "seq2seq") and d.mode != "bucketed":
        raise RecipeError(f"model.family={m.family} trains on data.mode=bucketed")
    if m.decoder_layers and m.family != "seq2seq":
        raise RecipeError(f"model.decoder_layers={m.decoder_layers} applies to model.family=seq2seq (the "
                          f"encoder-decoder)")
    if d.mask_span_mean and m.family != "seq2seq":
        raise RecipeError(f"data.mask_span_mean={d.mask_span_mean} (denoising pretraining) applies to "
                          f"model.family=seq2seq")
    if m.family == "seq2seq":
        if d.max_length > m.max_position_embeddings:
            raise RecipeError(f"data.max_length={d.max_length} exceeds model.max_position_embeddings="
                              f"{m.max_position_embeddings}")
        if d.max_tokens_per_batch < d.max_length:
            raise RecipeError(f"data.max_tokens_per_batch={d.max_tokens_per_batch} is smaller than "
                              f"data.max_length={d.max_length}: the longest pair would not fit a batch")
    if m.hidden_size % m.num_heads:
        raise RecipeError(f"model.hidden_size={m.hidden_size} is not a multiple of model.num_heads={m.num_heads}")
    if m.family == "decoder" and m.num_heads % m.num_kv_heads:
        raise RecipeError(f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads={m.num_kv_heads}")
    if m.molecule_features != "none" and not (m.family == "encoder" and m.num_tasks):
        raise RecipeError(f"model.molecule_features={m.molecule_features} is read by an encoder's property heads: it "
                          f"needs model.family=encoder and model.num_tasks > 0")
    if m.family == "encoder":
        if m.num_tasks and not d.with_labels:
            raise RecipeError("model.num_tasks > 0 needs data.with_labels=true")
        if not m.num_tasks and d.mlm_probability <= 0:
            raise RecipeError("an encoder with model.num_tasks=0 needs data.mlm_probability > 0 (nothing to learn)")
        if d.max_length > m.max_position_embeddings:
            raise RecipeError(f"data.max_length={d.max_length} exceeds model.max_position_embeddings="
                              f"{m.max_position_embeddings}")
        if not d.fixed_shape and d.max_tokens_per_batch < d.max_length:
            raise RecipeError(f"data.max_tokens_per_batch={d.max_tokens_per_batch} is smaller than "
                              f"data.max_length={d.max_length}: the longest molecule would not fit a batch")
    if d.mode == "packed" and d.seq_len > m.max_position_embeddings:
        raise RecipeError(f"data.seq_len={d.seq_len} exceeds model.max_position_embeddings="
                          f"{m.max_position_embeddings}")
    if d.on_bad_shard == "skip" and d.verify != "eager":
        raise RecipeError("data.on_bad_shard=skip needs data.verify=eager (every rank must skip the same shards)")
    check_horizon(recipe)
    if recipe.checkpoint.fork and not recipe.checkpoint.resume:
        raise RecipeError("checkpoint.fork needs checkpoint.resume: the checkpoint to fork from")
    if recipe.checkpoint.fork_optimizer and not recipe.checkpoint.fork:
        raise RecipeError("checkpoint.fork_optimizer applies with checkpoint.fork=true")
    if not d.manifest:
        raise RecipeError("data.manifest: give the directory written by molds-preprocess")
    return batching


def check_horizon(recipe: Recipe) -> None:
    """A run's length is steps or a time budget; one warm-up knob; an average that can be made."""
    t, o, c = recipe.trainer, recipe.optim, recipe.checkpoint
    if t.max_time is not None:
        try:
            seconds = parse_duration(t.max_time)
        except ValueError as exc:
            raise RecipeError(f"trainer.max_time: {exc}") from None
        if seconds <= 0:
            raise RecipeError(f"trainer.max_time={t.max_time!r} must be longer than zero")
        if t.max_steps is not None:
            raise RecipeError(f"trainer.max_time={t.max_time!r} and trainer.max_steps={t.max_steps} both set: a run "
                              f"trains for a number of steps or for a time, not both")
    if o.warmup_steps is not None and o.warmup_fraction:
        raise RecipeError(f"optim.warmup_steps={o.warmup_steps} and optim.warmup_fraction={o.warmup_fraction} both "
                          f"set: give one")
    if t.max_time is not None and o.warmup_steps:
        raise RecipeError("optim.warmup_steps with trainer.max_time: a budgeted run warms up over a fraction of its "
                          "time (optim.warmup_fraction)")
    if c.average_last > 1 and not (c.interval_steps or c.interval_fraction):
        raise RecipeError(f"checkpoint.average_last={c.average_last} needs checkpoints during the run "
                          f"(checkpoint.interval_steps or checkpoint.interval_fraction)")
    if c.average_last and c.keep_last and c.keep_last < c.average_last:
        raise RecipeError(f"checkpoint.keep_last={c.keep_last} keeps fewer checkpoints than checkpoint.average_last="
                          f"{c.average_last} averages (0 keeps all)")


def check_kernels(recipe: Recipe) -> None:
    """The ``kernels`` switches fit the model, and no FP8 option is set without FP8."""
    k, family = recipe.kernels, recipe.model.family
    if family != "decoder":
        for key in ("fp8", "triton", "compile_regions"):
            if getattr(k, key):
                raise RecipeError(f"kernels.{key} applies to model.family=decoder (model.family={family} has no "
                                  f"kernel converters)")
    if not k.fp8:
        unused = [f"kernels.{key}" for key, default in (("fp8_recipe", "blockwise"), ("fp8_lm_head", False),
                                                         ("fp8_router", False), ("fp8_pow2_scales", False),
                                                         ("fp8_grad_format", "e5m2"), ("fp8_products", "all"),
                                                         ("fp8_experts", False))
                  if getattr(k, key) != default]
        if unused:
            raise RecipeError(f"{', '.join(unused)} applies with kernels.fp8=true (it is off)")
    if k.fp8 and k.fp8_recipe != "blockwise":
        for key in ("fp8_lm_head", "fp8_router"):
            if getattr(k, key):
                raise RecipeError(f"kernels.{key} applies to kernels.fp8_recipe=blockwise (molds' own FP8); "
                                  f"torchao's {k.fp8_recipe} recipe converts the decoder's linears only")
        if k.fp8_experts and not recipe.model.num_experts:
            raise RecipeError("kernels.fp8_experts applies to MoE models (model.num_experts is 0)")
        widths = (recipe.model.hidden_size, recipe.model.moe_expert_size or recipe.model.intermediate_size)
        if k.fp8_experts and any(w % 16 for w in widths):
            raise RecipeError(f"kernels.fp8_experts: torchao's FP8 grouped GEMM needs model.hidden_size and the "
                              f"experts' width (model.moe_expert_size, or intermediate_size) to be multiples of 16 "
                              f"(they are {widths[0]} and {widths[1]})")
        if k.fp8_recipe == "rowwise" and k.fp8_grad_format != "e4m3":
            raise RecipeError("kernels.fp8_recipe=rowwise casts gradients to e4m3 (torchao's row-wise recipe): "
                              "set kernels.fp8_grad_format to e4m3, or use the tensorwise or blockwise recipe for "
                              "e5m2 gradients")
    if k.fp8 and k.fp8_experts and k.fp8_recipe != "rowwise":
        why = ("the block-wise recipe converts the experts with the linears (kernels.fp8_products chooses among them)"
               if k.fp8_recipe == "blockwise" else f"torchao's FP8 grouped GEMM is row-wise; fp8_recipe={k.fp8_recipe}")
        raise RecipeError(f"kernels.fp8_experts applies to kernels.fp8_recipe=rowwise: {why}")
    if k.fused_backend != "auto" and not k.triton:
        raise RecipeError(f"kernels.fused_backend={k.fused_backend} applies with kernels.triton=true (it is off)")
    if k.fp8_lm_head and k.triton:
        raise RecipeError("kernels.fp8_lm_head cannot combine with kernels.triton: the fused LM head + loss runs "
                          "the head in the run's precision")
    if k.fp8_router and not recipe.model.num_experts:
        raise RecipeError("kernels.fp8_router needs a mixture-of-experts model (model.num_experts > 0)")


def recipe_files(argv: list[str]) -> list[str]:
    """The ``--recipe`` files of a command line, in order."""
    files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--recipe"]
    return files + [a.split("=", 1)[1] for a in argv if a.startswith("--recipe=")]


def check_machine(recipe: Recipe, argv: list[str]) -> None:
    """A recipe sized for GPUs (``run.min_gpus``) stops at once on a machine with fewer,
    naming its CPU twin (``recipes/smoke/`` beside it, of the same name)."""
    need = recipe.run.min_gpus
    if not need:
        return
    import torch  # here: molds-eval --help loads no torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= need:
        return
    files = recipe_files(argv)
    source = files[-1] if files else "this recipe"
    twin = os.path.join(os.path.dirname(source), "smoke", os.path.basename(source)) if files else None
    hint = (f"on this machine run its smoke twin: deepspeed --num_gpus 4 molds/train.py --recipe {twin}"
            if twin and os.path.isfile(twin) else "it has no smoke twin in recipes/smoke/")
    raise RecipeError(f"{source} is sized for {need} GPUs per machine (run.min_gpus) and this machine has {have}; "
                      f"{hint}")


def _get(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _put(cfg: dict, dotted: str, value) -> None:
    node = cfg
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def deepspeed_config(recipe: Recipe, world_size: int, bf16: bool, batching: Batching | None = None) -> dict:
    """The DeepSpeed JSON the recipe names, completed from the recipe: a key the file
    leaves out is filled in; a key it sets to another value than the recipe's is refused,
    naming both sources. ``batching``: the step's, when already resolved (molds.recipe.plan)."""
    path = recipe.parallel.ds_config
    cfg: dict = {}
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                cfg = json.load(fh)
        except FileNotFoundError:
            raise RecipeError(f"parallel.ds_config: no file {path}") from None
        except ValueError as exc:
            raise RecipeError(f"parallel.ds_config: {path} is not valid JSON ({exc})") from None
        if not isinstance(cfg, dict):
            raise RecipeError(f"parallel.ds_config: {path} must hold a JSON object")
    source = path or "the DeepSpeed config"
    for key, owner in (("optimizer", "optim.*"), ("scheduler", "optim.* (warmup + cosine)")):
        if key in cfg:
            raise RecipeError(f"{source}: remove {key!r}: molds builds it from the recipe's {owner}")
    if _get(cfg, "fp16.enabled"):
        raise RecipeError(f"{source}: fp16 is not supported; use trainer.precision (bf16 or fp32)")
    b = batching or resolve_batching(recipe, world_size)
    p = recipe.parallel
    derived = [
        ("train_micro_batch_size_per_gpu", b.micro_batch, "data.micro_batch_size"),
        ("gradient_accumulation_steps", b.grad_accum, "trainer.grad_accum"),
        ("train_batch_size", b.global_batch, "trainer.global_batch_size"),
        ("zero_optimization.stage", p.zero_stage, "parallel.zero_stage"),
        ("gradient_clipping", recipe.optim.grad_clip, "optim.grad_clip"),
        ("bf16.enabled", bf16, "trainer.precision"),
    ]
    for key, wanted, recipe_key in (("zero_optimization.offload_optimizer", p.offload_optimizer,
                                      "parallel.offload_optimizer"),
                                     ("zero_optimization.offload_param", p.offload_params, "parallel.offload_params")):
        block = _get(cfg, key)
        in_file = isinstance(block, dict) and block.get("device") not in (None, "none")
        if block is None:
            if wanted:
                _put(cfg, key, {"device": "cpu"})
        elif in_file != wanted:
            raise RecipeError(f"{source} sets {key}={block!r} but the recipe gives {recipe_key}={wanted}; "
                              f"remove it from the file or make the two agree")
    for key, value, recipe_key in derived:
        have = _get(cfg, key)
        if have is None or have == "auto":
            _put(cfg, key, value)
        elif have != value:
            raise RecipeError(f"{source} sets {key}={have!r} but the recipe gives {recipe_key} -> {value!r}; "
                              f"remove it from the file or make the two agree")
    if bf16:
        cfg["bf16"].setdefault("check_grad_overflow", True)  # a non-finite gradient skips the step (counted)
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("steps_per_print", 10**9)
    cfg.setdefault("wall_clock_breakdown", False)
    return cfg
