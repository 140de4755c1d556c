"""``parallel.engine=ddp``: torch DistributedDataParallel (plain module on one process).

Gradient accumulation skips the all-reduce on all but the last micro-batch (no_sync);
buckets are views into the gradients (gradient_as_bucket_view); static_graph when there
is no accumulation (PyTorch does not allow it with no_sync); optional torch.compile.
"""

from __future__ import annotations

import contextlib

import torch

from .optim import build_optimizer, build_scheduler


def autocast_dtype(precision: str, device: torch.device):
    if precision == "bf16" or (precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()):
        return torch.bfloat16
    return None


class DDPEngine:
    name = "ddp"

    def __init__(self, recipe, model: torch.nn.Module, dist):
        self.recipe, self.dist = recipe, dist
        self.model = model.to(dist.device)
        module = self.model
        if dist.distributed:
            from torch.nn.parallel import DistributedDataParallel

            from ..recipe import resolve_batching

            # static_graph cannot be combined with no_sync (a PyTorch limitation): only
            # without gradient accumulation
            static = recipe.parallel.static_graph and resolve_batching(recipe, dist.world_size)[1] == 1
            module = DistributedDataParallel(
                module, device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
                bucket_cap_mb=recipe.parallel.ddp_bucket_mb, gradient_as_bucket_view=True,
                static_graph=static)
        if recipe.parallel.compile:
            module = torch.compile(module)
        self.module = module
        self.optimizer = build_optimizer(self.model, recipe.optim)
        self.scheduler = build_scheduler(self.optimizer, recipe.optim, recipe.trainer.max_steps)
        self.dtype = autocast_dtype(recipe.trainer.precision, dist.device)

    def _autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=self.dtype)

    def train_step(self, micro_batches: list[dict]) -> dict:
        n = len(micro_batches)
        total = torch.zeros((), device=self.dist.device)
        for i, mb in enumerate(micro_batches):
            sync = not self.dist.distributed or i == n - 1
            ctx = contextlib.nullcontext() if sync else self.module.no_sync()
            with ctx:
                with self._autocast():
                    loss = self.module(**mb)["loss"]
                (loss / n).backward()
            total += loss.detach()
        clip = self.recipe.optim.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": float(total) / n, "grad_norm": float(grad_norm), "lr": lr}

    # checkpoint: rank 0 writes the (replicated) model and optimizer
    def save(self, directory: str) -> None:
        import json
        import os

        from safetensors.torch import save_model

        if self.dist.is_main:
            save_model(self.model, os.path.join(directory, "model.safetensors"))
            torch.save(self.optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))
            with open(os.path.join(directory, "scheduler.json"), "w") as fh:
                json.dump(self.scheduler.state_dict(), fh)

    def load(self, directory: str) -> None:
        import json
        import os

        from safetensors.torch import load_model

        load_model(self.model, os.path.join(directory, "model.safetensors"), device=str(self.dist.device))
        state = torch.load(os.path.join(directory, "optimizer.pt"), map_location=self.dist.device, weights_only=True)
        self.optimizer.load_state_dict(state)
        with open(os.path.join(directory, "scheduler.json")) as fh:
            self.scheduler.load_state_dict(json.load(fh))
