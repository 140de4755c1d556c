"""AdamW with decoupled weight decay (not on norms and biases) and linear warmup +
cosine decay, shared by every engine; and the optimizer state in canonical form.

The schedule is a pure function of the optimizer step, so a checkpoint stores only
that step; on resume the schedule is rebuilt from the (possibly changed) recipe
(``set_schedule``). Optimizer moments move to and from the canonical layout by
parameter name (``moments_of`` / ``load_moments``).
"""

from __future__ import annotations

import math

import torch


def param_groups(named_params, weight_decay: float, extra: dict | None = None) -> list[dict]:
    """Decay for matrices, none for vectors; ``extra`` keys are added to both groups."""
    decay, no_decay, seen = [], [], set()
    for _, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    if extra:
        for g in groups:
            g.update(extra)
    return [g for g in groups if g["params"]]


def adamw(groups: list[dict], optim, fused: bool | None = None) -> torch.optim.Optimizer:
    """torch AdamW, fused (one kernel over all parameters) unless told otherwise."""
    kwargs = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    if fused is not False:
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, ValueError):
            if fused:
                raise
    return torch.optim.AdamW(groups, **kwargs)


def build_optimizer(model: torch.nn.Module, optim, fused: bool | None = None) -> torch.optim.Optimizer:
    return adamw(param_groups(model.named_parameters(), optim.weight_decay), optim, fused)


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


def set_schedule(scheduler, optim, max_steps: int, position: int | None = None) -> None:
    """Make ``scheduler`` follow ``optim``'s schedule over ``max_steps``, at ``position``
    (the number of optimizer steps taken; default: where it is)."""
    n = len(scheduler.optimizer.param_groups)
    scheduler.base_lrs = [optim.lr] * n
    scheduler.lr_lambdas = [lr_lambda(optim, max_steps)] * n
    if position is not None:
        scheduler.last_epoch = position
    values = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, values):
        group["lr"] = lr
        group["initial_lr"] = optim.lr
    scheduler._last_lr = values


def adam_step_count(optimizer: torch.optim.Optimizer) -> int:
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def moments_of(param_slots, optimizer: torch.optim.Optimizer) -> dict:
    """AdamW's moments of an optimizer keyed by these parameters, by canonical name:
    {"exp_avg": {name: t}, "exp_avg_sq": {name: t}}."""
    out = {"exp_avg": {}, "exp_avg_sq": {}}
    for slot in param_slots:
        st = optimizer.state.get(slot.tensor)
        if st and "exp_avg" in st:
            for kind in out:
                out[kind].update(slot.split(st[kind].detach()))
    return out


def load_moments(param_slots, optimizer: torch.optim.Optimizer, moments: dict, step: int, where: str) -> None:
    """Set AdamW's state for these parameters from canonical moments (none saved before
    the first step: the state stays empty)."""
    fused = any(g.get("fused") for g in optimizer.param_groups)
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for slot in param_slots:
        p = slot.tensor
        if not any(k in moments["exp_avg"] for k in slot.keys()):
            if step:
                from ..errors import CheckpointError

                raise CheckpointError(f"{where}: no optimizer moments for {slot.name}")
            continue
        state = {"step": torch.tensor(float(step), dtype=scalar, device=p.device if fused else "cpu")}
        for kind in ("exp_avg", "exp_avg_sq"):
            state[kind] = slot.join(moments[kind], where).to(p.device, p.dtype).clone()
        optimizer.state[p] = state
