"""AdamW with decoupled weight decay (not on norms, biases, embeddings' tied copies)
and linear warmup + cosine decay: shared by every engine."""

from __future__ import annotations

import math

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, optim, fused: bool | None = None) -> torch.optim.Optimizer:
    """torch AdamW, fused (one kernel over all parameters) unless told otherwise."""
    groups = param_groups(model, optim.weight_decay)
    kwargs = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    if fused is not False:
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, ValueError):
            if fused:
                raise
    return torch.optim.AdamW(groups, **kwargs)


def lr_lambda(optim, max_steps: int):
    def f(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        span = max(1, max_steps - optim.warmup_steps)
        progress = min(1.0, (step - optim.warmup_steps) / span)
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_scheduler(optimizer, optim, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, max_steps))
