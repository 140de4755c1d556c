"""AdamW with decoupled weight decay (not on norms and biases) and linear warmup +
cosine decay, shared by every engine; and the optimizer state in canonical form.

The schedule is a pure function of the optimizer step (with a time budget, of the
fraction of it spent: ``molds.recipe.budget``), so a checkpoint stores only that; on resume the
schedule is rebuilt from the (possibly changed) recipe (``set_schedule``). Optimizer moments move to and from the canonical layout by
parameter name (``moments_of`` / ``load_moments``).
"""

from __future__ import annotations

import math
import re

import torch

from ..errors import CheckpointError
from ..recipe.budget import Horizon


#: a block's index in a parameter's canonical name: ``model.layers.3.``, ``encoder.layer.3.``
_BLOCK = re.compile(r"(?:^|\.)layers?\.(\d+)\.")


def layer_depths(names, blocks: dict | None = None, embeddings=()) -> tuple[dict, int]:
    """Each parameter's depth from its canonical name, and the top depth: 0 for the
    embeddings (``embeddings``' names, a name with ``embed`` outside any block), 1 + the block index for a block's
    (the stacks one after another, a decoder's after its encoder's), the top for everything
    after the last block (final norms, the LM and property heads). ``blocks``: {stack
    prefix: block count} when ``names`` are not all of the model's (a pipeline stage's);
    else counted from the names."""
    names = list(names)
    counts = dict(blocks or {})
    if blocks is None:
        for n in names:
            m = _BLOCK.search(n)
            if m:
                counts[n[:m.start()]] = max(counts.get(n[:m.start()], 0), int(m.group(1)) + 1)
    offset, top = {}, 0
    for prefix in sorted(counts, key=lambda p: ("decoder" in p, p)):
        offset[prefix], top = top, top + counts[prefix]
    top += 1
    depths = {}
    for n in names:
        m = _BLOCK.search(n)
        if m and n[:m.start()] in offset:
            depths[n] = offset[n[:m.start()]] + int(m.group(1)) + 1
        else:
            depths[n] = 0 if "embed" in n or n in embeddings else top
    return depths, top


def param_groups(named_params, weight_decay: float, extra: dict | None = None, layer_decay: float = 1.0,
                 blocks: dict | None = None, rename=None, module: torch.nn.Module | None = None) -> list[dict]:
    """Decay for matrices, none for vectors; ``extra`` keys are added to every group.
    ``layer_decay`` below 1: layer-wise learning rates, each group's ``lr_scale`` =
    ``layer_decay`` ** (top depth - the parameters' depth) (``layer_depths`` of the canonical
    names: ``rename`` maps the module's names to them; ``blocks`` as there; the tables of
    ``module``'s ``nn.Embedding`` layers are embeddings whatever their name); the groups at
    full rate first."""
    named = []
    seen = set()
    tables = {id(p) for m in module.modules() if isinstance(m, torch.nn.Embedding)
              for p in m.parameters()} if module is not None else set()
    embeddings = set()
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        named.append((rename(name) if rename and layer_decay < 1.0 else name, p))
        if id(p) in tables:
            embeddings.add(named[-1][0])
    depths, top = layer_depths([n for n, _ in named], blocks, embeddings) if layer_decay < 1.0 else ({}, 0)
    buckets: dict = {}
    for name, p in named:
        depth = depths.get(name, top)
        buckets.setdefault((-depth, p.ndim < 2), []).append(p)
    groups = []
    for (neg_depth, vector), params in sorted(buckets.items()):
        group = {"params": params, "weight_decay": 0.0 if vector else weight_decay,
                 "name": ("no_decay" if vector else "decay") + (f"_depth{-neg_depth}" if layer_decay < 1.0 else "")}
        if layer_decay < 1.0:
            group["lr_scale"] = layer_decay ** (top + neg_depth)
        groups.append(group | (extra or {}))
    return groups


def adamw(groups: list[dict], optim, fused: bool | None = None) -> torch.optim.Optimizer:
    """torch AdamW, fused (one kernel over all parameters) unless told otherwise."""
    kwargs = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    for g in groups:  # layer-wise rates: the scheduler's base rate of each group is its own
        if "lr_scale" in g:
            g["lr"] = optim.lr * g["lr_scale"]
    if fused is not False:
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, ValueError):
            if fused:
                raise
    return torch.optim.AdamW(groups, **kwargs)


def build_optimizer(model: torch.nn.Module, optim, fused: bool | None = None) -> torch.optim.Optimizer:
    return adamw(param_groups(model.named_parameters(), optim.weight_decay, layer_decay=optim.layer_decay,
                              module=model), optim, fused)


def warmup_steps(optim, max_steps: int) -> int:
    """The warm-up in steps: ``optim.warmup_steps``, or ``warmup_fraction`` of the steps, or 100."""
    if optim.warmup_steps is not None:
        return optim.warmup_steps
    return round(optim.warmup_fraction * max_steps) if optim.warmup_fraction else 100


def lr_lambda(optim, horizon):
    """The learning-rate factor at a step: linear warm-up, then cosine decay to
    ``min_lr_ratio``. ``horizon``: the run's steps (an int, or a ``molds.recipe.budget.Horizon``
    counting steps), or a Horizon with a time budget, whose spent fraction then drives
    both the warm-up (``warmup_fraction``) and the decay (the step is not used)."""
    def decay(progress: float) -> float:
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    if isinstance(horizon, Horizon) and horizon.timed:
        warm = optim.warmup_fraction

        def by_time(step: int) -> float:
            x = horizon.fraction
            if warm and x < warm:
                return x / warm
            return decay((x - warm) / (1 - warm))

        return by_time
    max_steps = horizon.max_steps if isinstance(horizon, Horizon) else horizon
    warm_steps = warmup_steps(optim, max_steps)

    def by_step(step: int) -> float:
        if warm_steps and step < warm_steps:
            return (step + 1) / warm_steps
        return decay((step - warm_steps) / max(1, max_steps - warm_steps))

    return by_step


def build_scheduler(optimizer, optim, horizon):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, horizon))


def set_schedule(scheduler, optim, horizon, position: int | None = None) -> None:
    """Make ``scheduler`` follow ``optim``'s schedule over ``horizon`` (steps, or a
    ``molds.recipe.budget.Horizon``), at ``position`` (the number of optimizer steps taken;
    default: where it is)."""
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [optim.lr * g.get("lr_scale", 1.0) for g in groups]
    scheduler.lr_lambdas = [lr_lambda(optim, horizon)] * len(groups)
    if position is not None:
        scheduler.last_epoch = position
    values = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr, base in zip(groups, values, scheduler.base_lrs):
        group["lr"] = lr
        group["initial_lr"] = base
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
                raise CheckpointError(f"{where}: no optimizer moments for {slot.name}")
            continue
        state = {"step": torch.tensor(float(step), dtype=scalar, device=p.device if fused else "cpu")}
        for kind in ("exp_avg", "exp_avg_sq"):
            state[kind] = slot.join(moments[kind], where).to(p.device, p.dtype).clone()
        optimizer.state[p] = state
