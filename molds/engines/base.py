"""The engine contract: ``Engine`` (a ``typing.Protocol``), ``StepResult``, ``Topology``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Topology:
    """Where this process sits: data-, pipeline- and expert-parallel rank and size."""

    world_size: int = 1
    rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class StepResult:
    """One optimizer step. ``skipped``: the gradients were not finite and the optimizer
    did not step (the trainer's non-finite policy decides what happens next)."""

    loss: float
    grad_norm: float
    lr: float
    skipped: bool = False
    extras: dict = field(default_factory=dict)  # tag -> float, or list of floats (a histogram)


@runtime_checkable
class Engine(Protocol):
    name: str
    topology: Topology
    #: the single-device module (for sampling); None where no rank holds the whole model
    model: object

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        """Forward, backward and (unless gradients are not finite) one optimizer step
        over this rank's micro-batches; every rank calls it with the same count."""

    def eval_forward(self, batch: dict) -> dict:
        """Model outputs and the batch's ``loss`` without gradients (every rank calls it)."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision context training uses (for evaluation and sampling)."""

    def extras(self) -> dict:
        """Engine-specific scalars since the last call (``moe/*``, ``pipeline/*``), the
        same on every rank (a collective: the trainer calls it at logging steps)."""

    def save(self, directory: str) -> None:
        """Write the canonical state into ``directory`` (a collective: every rank calls it)."""

    def load(self, directory: str, *, optimizer: bool = True, weights: dict | None = None) -> None:
        """Read the canonical state from ``directory`` (weights; optimizer and schedule
        unless ``optimizer`` is False). ``weights``: the canonical weights to load instead
        of ``directory``'s (a fine-tuning fork's: new property heads, the rest the
        checkpoint's)."""

    def set_lr_schedule(self, optim, horizon, position: int | None = None) -> None:
        """Use this learning-rate schedule from now on (a resume may change it) over
        ``horizon`` (steps, or a ``molds.recipe.budget.Horizon``), at ``position`` optimizer steps
        (default: where the engine is)."""


class ScheduledEngine:
    """What every engine shares: its ``self.scheduler`` takes a new schedule the same way."""

    def set_lr_schedule(self, optim, horizon, position: int | None = None) -> None:
        from .optim import set_schedule  # here: molds-schedule --help loads no torch or NumPy

        set_schedule(self.scheduler, optim, horizon, position)


class WholeModelEngine(ScheduledEngine):
    """An engine whose every rank holds the whole model (``self.model``; ddp, zero)."""

    def extras(self) -> dict:
        """``moe/*`` of the model, summed over all ranks."""
        import torch  # here: molds-schedule --help loads no torch

        from ..models.moe import collect_stats, moe_layers  # here: molds-schedule --help loads no torch or Triton

        group = torch.distributed.group.WORLD if self.dist.distributed else None
        return collect_stats(moe_layers(self.model), group=group)
