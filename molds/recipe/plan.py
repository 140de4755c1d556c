"""The recipe resolved once, at the start of a run, into what the engine reads.

``resolve_plan(recipe, world_size)`` runs before any process group starts: it is the
recipe's last check (``molds.recipe.parse.validate``) and fixes the step's batching, the
layout sizes and the schedule. ``Plan.on_device`` adds what needs the device: the
precision ``trainer.precision`` comes to there, and with it the DeepSpeed config
(ds_configs/ completed from the recipe). ``train.py`` hands the plan to the engine, and
the engines read batching, precision, the DeepSpeed config and the schedule from it
rather than calling back into ``molds.recipe``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..runtime.distributed import all_reduce_sum
from .budget import horizon_of
from .parse import Batching, deepspeed_config, validate
from .precision import gemm_shape, resolve_precision


@dataclass(frozen=True)
class Plan:
    world_size: int
    engine: str  # ddp | zero | pipeline
    schedule: str  # 1f1b | dualpipev (engine pipeline)
    batching: Batching  # sequences per step, micro-batches per step per rank, data-parallel size
    pp_size: int
    ep_size: int
    device: str | None = None  # set by on_device
    dtype: torch.dtype | None = None  # what the run computes in (None: float32)
    precision: object = None  # molds.recipe.precision.Precision: the measurement behind dtype
    horizon: object = None  # molds.recipe.budget.Horizon: steps or a time budget, and where the run is
    ds_config: dict | None = None  # the DeepSpeed config (engines zero and pipeline)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.batching.grad_accum

    def on_device(self, recipe, dist, resumed_dtype: str | None = None) -> "Plan":
        """The plan completed for this rank's device (``dist``: molds.runtime.distributed's, whose
        ranks agree on the measurement): its precision and DeepSpeed config.
        ``resumed_dtype``: what the checkpoint a resume continues computed in (its lineage's
        ``plan.dtype``), which ``trainer.precision=auto`` keeps."""
        def mean_over_ranks(values):
            return [v / dist.world_size for v in all_reduce_sum(values, dist)]

        precision = resolve_precision(recipe.trainer.precision, dist.device, gemm_shape(recipe), mean_over_ranks,
                                      resumed=resumed_dtype)
        dtype = precision.dtype
        cfg = None
        if self.engine in ("zero", "pipeline"):
            cfg = deepspeed_config(recipe, self.world_size, dtype is not None, batching=self.batching)
        return dataclasses.replace(self, device=str(dist.device), dtype=dtype, precision=precision, ds_config=cfg)

    def summary(self) -> dict:
        """What the checkpoint lineage records of it."""
        b = self.batching
        return {"engine": self.engine, "schedule": self.schedule, "world_size": self.world_size,
                "dp_size": b.dp_size, "pp_size": self.pp_size, "ep_size": self.ep_size,
                "global_batch": b.global_batch, "micro_batches": b.grad_accum, "micro_batch": b.micro_batch,
                "horizon": self.horizon.describe() if self.horizon is not None else None,
                "dtype": str(self.dtype).removeprefix("torch.") if self.dtype else "float32"}


def resolve_plan(recipe, world_size: int) -> Plan:
    """Check the recipe for ``world_size`` ranks (no process group needed) and resolve it."""
    batching = validate(recipe, world_size)
    p = recipe.parallel
    return Plan(world_size=world_size, engine=p.engine, schedule=p.schedule if p.engine == "pipeline" else "none",
                batching=batching, pp_size=p.pp_size, ep_size=p.ep_size, horizon=horizon_of(recipe.trainer))


def plan_for(recipe, dist) -> Plan:
    """The plan for ranks that already exist (``dist``: molds.runtime.distributed's): what a
    benchmark or a test that builds an engine itself hands it."""
    return resolve_plan(recipe, dist.world_size).on_device(recipe, dist)
