"""``parallel.engine=ddp``: torch DistributedDataParallel (plain module on one process).

Gradient accumulation skips the all-reduce on all but the last micro-batch (no_sync);
buckets are views into the gradients (gradient_as_bucket_view); static_graph when there
is no accumulation (PyTorch does not allow it with no_sync); optional torch.compile.
A step whose gradient norm is not finite (the norm is taken after the all-reduce, so
every rank sees the same) is not applied: no optimizer or schedule step, gradients
dropped, ``StepResult.skipped`` set.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.nn.parallel import DistributedDataParallel

from ..checkpoint.state import (
    canonical_state,
    load_canonical,
    read_model,
    read_optimizer,
    slots,
    write_model,
    write_optimizer,
)
from ..models.loss import has_targets
from ..models.moe import set_aux_loss_scale
from .base import StepResult, Topology, WholeModelEngine
from .optim import adam_step_count, build_optimizer, build_scheduler, load_moments, moments_of, set_schedule


class DDPEngine(WholeModelEngine):
    name = "ddp"

    def __init__(self, recipe, model: torch.nn.Module, loss_fn, dist, plan):
        self.recipe, self.dist, self.loss_fn, self.plan = recipe, dist, loss_fn, plan
        self.model = model.to(dist.device)
        self.topology = Topology(world_size=dist.world_size, rank=dist.rank, dp_size=dist.world_size,
                                 dp_rank=dist.rank)
        module = self.model
        if dist.distributed:
            # static_graph cannot be combined with no_sync (a PyTorch limitation): only
            # without gradient accumulation
            static = recipe.parallel.static_graph and plan.micro_batches == 1
            module = DistributedDataParallel(
                module, device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
                bucket_cap_mb=recipe.parallel.ddp_bucket_mb, gradient_as_bucket_view=True,
                static_graph=static)
        if recipe.parallel.compile:
            module = torch.compile(module)
        self.module = module
        self.optimizer = build_optimizer(self.model, recipe.optim)
        self.scheduler = build_scheduler(self.optimizer, recipe.optim, plan.horizon)
        self.dtype = plan.dtype
        set_aux_loss_scale(self.model, 1.0 / plan.micro_batches)

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=self.dtype)

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        n = len(micro_batches)
        total = torch.zeros((), device=self.dist.device, dtype=torch.float64)
        for i, mb in enumerate(micro_batches):
            sync = not self.dist.distributed or i == n - 1
            ctx = contextlib.nullcontext() if sync else self.module.no_sync()
            with ctx:
                with self.autocast():
                    loss = self.loss_fn(self.module(**mb), mb)
                (loss / n).backward()
            total += loss.detach()
        clip = self.recipe.optim.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")))
        lr = self.scheduler.get_last_lr()[0]
        loss = float(total) / n
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss=loss, grad_norm=grad_norm, lr=lr, skipped=skipped)

    @torch.no_grad()
    def eval_forward(self, batch: dict) -> dict:
        with self.autocast():
            out = self.model(**batch)
            if has_targets(batch):
                out["loss"] = self.loss_fn(out, batch)
        return out

    # checkpoint: the replicated model and optimizer, written by rank 0
    def _param_slots(self):
        return [s for s in slots(self.model) if isinstance(s.tensor, torch.nn.Parameter)]

    def save(self, directory: str) -> None:
        if not self.dist.is_main:
            return
        write_model(directory, canonical_state(self.model))
        write_optimizer(directory, moments_of(self._param_slots(), self.optimizer),
                        {"optimizer_step": adam_step_count(self.optimizer),
                         "scheduler_step": self.scheduler.last_epoch})

    def load(self, directory: str, *, optimizer: bool = True, weights: dict | None = None) -> None:
        load_canonical(self.model, read_model(directory) if weights is None else weights, directory)
        if optimizer:
            moments, meta = read_optimizer(directory)
            load_moments(self._param_slots(), self.optimizer, moments, int(meta["optimizer_step"]), directory)
            set_schedule(self.scheduler, self.recipe.optim, self.plan.horizon,
                         int(meta["scheduler_step"]))
