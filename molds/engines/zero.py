"""``parallel.engine=zero``: DeepSpeed ZeRO stage 0-3, optional CPU offload.

The DeepSpeed config comes from ``parallel.ds_config`` with its batch fields derived
from the recipe (molds.recipe.deepspeed_config). DeepSpeed scales the loss for
accumulation and steps the optimizer at the accumulation boundary itself. Checkpoints
are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import torch

from ..recipe import deepspeed_config
from .ddp import autocast_dtype
from .optim import build_optimizer, build_scheduler


def _safe_globals():
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def _load_weights_only(engine) -> None:
    """DeepSpeed's checkpoint engine unpickles with weights_only=False; ours loads with
    weights_only=True, allowing only the three DeepSpeed classes its files contain."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    ce = engine.checkpoint_engine
    if not isinstance(ce, TorchCheckpointEngine):
        return
    allowed = _safe_globals()

    def load(path: str, map_location=None):
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    ce.load = load


class ZeroEngine:
    name = "zero"

    def __init__(self, recipe, model: torch.nn.Module, dist):
        import deepspeed

        self.recipe, self.dist = recipe, dist
        bf16 = autocast_dtype(recipe.trainer.precision, dist.device) is not None
        cfg = deepspeed_config(recipe, dist.world_size, bf16)
        if recipe.parallel.offload_optimizer:
            cfg.setdefault("zero_force_ds_cpu_optimizer", False)
        optimizer = build_optimizer(model, recipe.optim)
        scheduler = build_scheduler(optimizer, recipe.optim, recipe.trainer.max_steps)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg, dist_init_required=False)
        self.model = self.engine.module
        self.ds_config = cfg
        _load_weights_only(self.engine)

    def train_step(self, micro_batches: list[dict]) -> dict:
        total = 0.0
        lr = self.scheduler.get_last_lr()[0]
        for mb in micro_batches:
            loss = self.engine(**mb)["loss"]
            self.engine.backward(loss)
            self.engine.step()
            total += float(loss.detach())
        norm = self.engine.get_global_grad_norm()
        return {"loss": total / len(micro_batches), "grad_norm": float(norm) if norm is not None else float("nan"),
                "lr": lr}

    def save(self, directory: str) -> None:
        self.engine.save_checkpoint(directory, tag="deepspeed", save_latest=False)

    def load(self, directory: str) -> None:
        path, _ = self.engine.load_checkpoint(directory, tag="deepspeed")
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory}")
