"""A goal recipe checked and resolved before any process group starts: its stages, one
scorer per stage, what it refuses, and the recipe the agent trains under (the prior's
model and data)."""

from __future__ import annotations

import dataclasses
import sys

from ..errors import RecipeError
from ..recipe.sections import DataConfig, ModelConfig
from ..scoring import Scorer


def stages_of(goal) -> list[dict]:
    """The run's stages, checked: each {scoring, min_steps, max_steps, threshold}; a
    recipe with ``scoring`` alone is one stage without an end of its own."""
    if (goal.scoring is None) == (goal.stages is None):
        raise RecipeError("goal: give goal.scoring (one objective) or goal.stages (a list of them), not "
                          + ("both" if goal.scoring is not None else "neither"))
    if goal.scoring is not None:
        return [{"scoring": goal.scoring, "min_steps": 0, "max_steps": 0, "threshold": None}]
    if not isinstance(goal.stages, list) or not goal.stages:
        raise RecipeError("goal.stages: a non-empty list of {scoring, min_steps, max_steps, threshold}")
    out = []
    for i, st in enumerate(goal.stages):
        where = f"goal.stages[{i}]"
        if not isinstance(st, dict):
            raise RecipeError(f"{where}: an object with scoring, min_steps, max_steps, threshold")
        unknown = set(st) - {"scoring", "min_steps", "max_steps", "threshold"}
        if unknown:
            raise RecipeError(f"{where}: unknown keys {sorted(unknown)} (a stage has scoring, min_steps, max_steps, "
                              f"threshold)")
        if "scoring" not in st:
            raise RecipeError(f"{where}.scoring: missing")
        lo, hi = st.get("min_steps", 0), st.get("max_steps", 0)
        for key, v in (("min_steps", lo), ("max_steps", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise RecipeError(f"{where}.{key}: an integer >= 0, got {v!r}")
        if hi and lo > hi:
            raise RecipeError(f"{where}: min_steps {lo} > max_steps {hi}")
        th = st.get("threshold")
        if th is not None and (not isinstance(th, (int, float)) or isinstance(th, bool) or not 0 <= th <= 1):
            raise RecipeError(f"{where}.threshold: a score in [0, 1], got {th!r}")
        if not hi and th is None and i < len(goal.stages) - 1:
            raise RecipeError(f"{where}: a stage before the last needs max_steps or a threshold to end")
        out.append({"scoring": st["scoring"], "min_steps": lo, "max_steps": hi, "threshold": th})
    return out


def build_scorers(goal) -> list:
    """One ``molds.scoring.Scorer`` per stage (a bad definition is refused naming its key)."""
    stages = stages_of(goal)
    many = goal.stages is not None
    return [Scorer(st["scoring"], f"goal.stages[{i}].scoring" if many else "goal.scoring")
            for i, st in enumerate(stages)]


def check_goal(recipe, world_size: int) -> None:
    """What a goal run refuses before any process starts its group."""
    g = recipe.goal
    if recipe.parallel.engine not in ("ddp", "zero"):
        raise RecipeError(f"parallel.engine={recipe.parallel.engine}: a goal run trains its agent with ddp or zero "
                          f"(the pipeline engine does not sample)")
    if g.batch_size % world_size:
        raise RecipeError(f"goal.batch_size={g.batch_size} is not a multiple of the {world_size} ranks: each rank "
                          f"samples the same share")
    if recipe.trainer.max_time:
        raise RecipeError("trainer.max_time: a goal run is bounded by trainer.max_steps and goal.max_oracle_calls")
    if recipe.checkpoint.fork:
        raise RecipeError("checkpoint.fork: a goal run starts from goal.prior; to continue one, "
                          "--checkpoint.resume auto")
    if g.replay_samples and not g.replay_size:
        print("[molds] warning: goal.replay_samples is set but goal.replay_size=0: nothing is replayed",
              file=sys.stderr)


def goal_recipe(recipe, prior, world_size: int):
    """The recipe the agent trains under: the prior's model and manifest (said when the
    recipe's own differ), one micro-batch of the step's rows per rank."""
    notes = []
    model = ModelConfig(**prior.recipe["model"])
    if recipe.model != ModelConfig() and recipe.model != model:
        notes.append("the recipe's model section is replaced by the prior's (the agent is the prior's model)")
    manifest = prior.manifest.path
    if recipe.data != DataConfig():
        notes.append(f"the recipe's data section is replaced by the prior's (manifest {manifest}: its tokenizer); a "
                     f"goal run samples its own molecules")
    known = {f.name for f in dataclasses.fields(DataConfig)}
    data = DataConfig(**{k: v for k, v in prior.recipe["data"].items() if k in known})
    data = dataclasses.replace(data, manifest=manifest, micro_batch_size=recipe.goal.batch_size // world_size)
    trainer = dataclasses.replace(recipe.trainer, grad_accum=1, global_batch_size=0)
    return dataclasses.replace(recipe, model=model, data=data, trainer=trainer), notes
