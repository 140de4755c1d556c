"""Engines: how a model is driven across ranks. One file each; chosen here, explicitly.

Every engine implements ``Engine`` (a ``typing.Protocol``; ``tests/engines`` checks each
one against it): it takes micro-batches and returns a ``StepResult`` whose ``extras``
the logger writes under their own prefixes (``moe/*``, ``pipeline/*``), evaluates
batches under its own autocast, saves and loads the canonical checkpoint state
(``molds.checkpoint.state``: full fp32 weights and optimizer moments by parameter name,
whatever the engine or the number of ranks), and says which ranks it runs on
(``Topology``). The data loader shards by the data-parallel rank the topology gives.

May import the packages below it in molds' stack: ``errors``, ``runtime``, ``chemistry``,
``recipe``, ``data``, ``models``, ``kernels``, ``checkpoint``.
"""

from __future__ import annotations

from .base import Engine, StepResult, Topology

__all__ = ["Engine", "StepResult", "Topology", "build_engine"]


def build_engine(recipe, model, loss_fn, dist, plan=None) -> Engine:
    """The engine the plan (``molds.recipe.plan``: the recipe resolved once at start) names; a
    caller without one (a test, a benchmark) gets it resolved here."""
    if plan is None:
        from ..recipe.plan import plan_for  # here: molds-schedule --help loads no torch or NumPy

        plan = plan_for(recipe, dist)
    name = plan.engine
    if name == "ddp":
        from .ddp import DDPEngine  # here: molds-schedule --help loads no torch or Triton

        return DDPEngine(recipe, model, loss_fn, dist, plan)
    if name == "zero":
        from .zero import ZeroEngine  # here: a rank that only trains loads no DeepSpeed

        return ZeroEngine(recipe, model, loss_fn, dist, plan)
    if name == "pipeline" and plan.schedule == "dualpipev":
        from .dualpipev import DualPipeVEngine  # here: a rank that only trains loads no DeepSpeed

        return DualPipeVEngine(recipe, model, loss_fn, dist, plan)
    if name == "pipeline":
        from .pipeline import PipelineEngine  # here: a rank that only trains loads no DeepSpeed

        return PipelineEngine(recipe, model, loss_fn, dist, plan)
    raise ValueError(f"parallel.engine={name!r}: no such engine (ddp, zero, pipeline)")
