"""``parallel.engine=zero``: DeepSpeed ZeRO stage 0-3, optional CPU offload.

The DeepSpeed config comes from ``parallel.ds_config`` completed from the recipe
(``molds.recipe.parse.deepspeed_config``). DeepSpeed scales the loss for accumulation and
steps the optimizer at the accumulation boundary itself; a non-finite gradient norm
makes it skip the step (``skipped_steps``; for bf16 molds turns the check on), which
is reported as ``StepResult.skipped``.

Checkpoints are the canonical state (``molds.checkpoint.state``), not DeepSpeed's own
files: the full fp32 weights and AdamW moments of every parameter are assembled from
the ZeRO partitions with DeepSpeed's public ``safe_get_full_*`` calls (collectives) and
written by rank 0; loading sets them back with ``safe_set_full_*``. So a ZeRO run
resumes on another number of ranks, another stage or another engine, and nothing is
ever unpickled.
"""

from __future__ import annotations

import contextlib
import copy
import math

import deepspeed
import torch
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

from ..checkpoint.state import MOMENTS, read_model, read_optimizer, slots, write_model, write_optimizer
from ..errors import CheckpointError
from ..models.loss import has_targets
from ..models.moe import set_aux_loss_scale
from ..runtime.distributed import quiet_on_other_ranks
from .base import StepResult, Topology, WholeModelEngine
from .optim import adam_step_count, build_optimizer, build_scheduler, set_schedule


def _base_optimizer(engine):
    """The torch optimizer that holds AdamW's state (ZeRO wraps it; stage 0 fp32 is it)."""
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    if isinstance(opt, torch.optim.Optimizer) and not opt.state and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def _relink_optimizer_fragments(engine) -> None:
    """DeepSpeed 0.19.8's ZeRO-1/2 links each parameter to its slice of AdamW's state once,
    right after stepping the *first* parameter group, so parameters of later groups
    (molds has two: with and without weight decay) are linked to an empty state and
    ``safe_get_full_optimizer_state`` fails for them. Link again once every group has
    its state."""
    zero = engine.optimizer
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state") and hasattr(zero, "_hp_optimizer_states_linked"):
        base = _base_optimizer(engine)
        if all(p in base.state for g in base.param_groups for p in g["params"]):
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()


class ZeroEngine(WholeModelEngine):
    name = "zero"

    def __init__(self, recipe, model: torch.nn.Module, loss_fn, dist, plan):
        self.recipe, self.dist, self.loss_fn, self.plan = recipe, dist, loss_fn, plan
        self.dtype = plan.dtype
        cfg = copy.deepcopy(plan.ds_config)  # DeepSpeed writes into its config
        if recipe.parallel.offload_optimizer:
            cfg.setdefault("zero_force_ds_cpu_optimizer", False)
        self.stage = recipe.parallel.zero_stage
        optimizer = build_optimizer(model, recipe.optim)
        scheduler = build_scheduler(optimizer, recipe.optim, plan.horizon)
        with quiet_on_other_ranks(dist):
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg, dist_init_required=False)
        self.model = self.engine.module
        self.ds_config = cfg
        set_aux_loss_scale(self.model, 1.0 / cfg["gradient_accumulation_steps"])
        self.topology = Topology(world_size=dist.world_size, rank=dist.rank, dp_size=dist.world_size,
                                 dp_rank=dist.rank)

    def autocast(self):
        return contextlib.nullcontext()  # DeepSpeed casts the module itself (bf16 config)

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        total = 0.0
        lr = self.scheduler.get_last_lr()[0]
        skipped_before = self.engine.skipped_steps
        for mb in micro_batches:
            loss = self.loss_fn(self.engine(**mb), mb)
            self.engine.backward(loss)
            self.engine.step()
            total += float(loss.detach())
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        skipped = self.engine.skipped_steps > skipped_before or not math.isfinite(norm)
        return StepResult(loss=total / len(micro_batches), grad_norm=norm, lr=lr, skipped=skipped,
                          extras={"train/skipped_steps_deepspeed": float(self.engine.skipped_steps)})

    @torch.no_grad()
    def eval_forward(self, batch: dict) -> dict:
        out = self.engine(**batch)
        if has_targets(batch):
            out["loss"] = self.loss_fn(out, batch)
        return out

    # ------------------------------------------------------------ canonical state
    def save(self, directory: str) -> None:
        weights, moments = full_state(self.engine, slots(self.model), keep=self.dist.is_main)
        if self.dist.is_main:
            write_model(directory, weights)
            write_optimizer(directory, moments, {"optimizer_step": adam_step_count(_base_optimizer(self.engine)),
                                                 "scheduler_step": self.scheduler.last_epoch})

    def load(self, directory: str, *, optimizer: bool = True, weights: dict | None = None) -> None:
        weights = read_model(directory) if weights is None else weights
        model_slots = slots(self.model)
        wanted = {k for slot in model_slots for k in slot.keys()}
        missing, unexpected = sorted(wanted - weights.keys()), sorted(weights.keys() - wanted)
        if missing or unexpected:
            raise CheckpointError(f"{directory} does not fit this model: missing {missing[:8]}, unexpected "
                                  f"{unexpected[:8]}")
        moments, meta = read_optimizer(directory) if optimizer else ({}, {})
        set_full_state(self.engine, model_slots, weights, moments if optimizer else None, meta, stage=self.stage,
                       device=self.dist.device, where=directory)
        if optimizer:
            set_schedule(self.scheduler, self.recipe.optim, self.plan.horizon, int(meta["scheduler_step"]))
            self.engine.global_steps = int(meta["scheduler_step"])


def _zero_managed(p) -> bool:
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def full_state(ds_engine, model_slots, keep: bool) -> tuple[dict, dict]:
    """The full fp32 weights and AdamW moments of these slots, by canonical name, from a
    DeepSpeed engine (ZeRO partitions assembled with ``safe_get_full_*``: collectives over
    each parameter's data-parallel group, so every rank of the group calls this in the
    same order). Only a rank with ``keep`` builds the dicts."""
    weights, moments = {}, {k: {} for k in MOMENTS}
    base = _base_optimizer(ds_engine)
    _relink_optimizer_fragments(ds_engine)
    for slot in model_slots:
        t = slot.tensor
        if isinstance(t, torch.nn.Parameter) and _zero_managed(t):
            full = safe_get_full_fp32_param(t)
            per = {k: safe_get_full_optimizer_state(t, k) for k in MOMENTS} if base.state else {}
        else:
            full = t.detach()
            st = base.state.get(t, {})
            per = {k: st[k] for k in MOMENTS if k in st}
        if keep:
            weights.update({k: v.float().cpu() for k, v in slot.split(full.detach()).items()})
            if per and all(v is not None for v in per.values()):
                for kind, value in per.items():
                    moments[kind].update({k: v.float().cpu() for k, v in slot.split(value.detach()).items()})
    return weights, moments


def set_full_state(ds_engine, model_slots, weights: dict, moments: dict | None, meta: dict, *, stage: int, device,
                   where: str) -> None:
    """Load canonical weights (and moments, unless None) into the slots of a DeepSpeed
    engine: the module's parameters, ZeRO's fp32 master partitions and AdamW's state."""
    if moments is not None:
        _materialize_optimizer_state(ds_engine)
    base = _base_optimizer(ds_engine)
    values = {slot.name: slot.join(weights, where) for slot in model_slots}
    for slot in model_slots:
        shape = tuple(getattr(slot.tensor, "ds_shape", slot.tensor.shape))
        if tuple(values[slot.name].shape) != shape:
            raise CheckpointError(f"{where}: {slot.name} has shape {tuple(values[slot.name].shape)}, the model {shape}")
    params = [s for s in model_slots if isinstance(s.tensor, torch.nn.Parameter)]
    if stage == 3:
        with deepspeed.zero.GatheredParameters([s.tensor for s in params], modifier_rank=0):
            for slot in params:
                slot.tensor.data.copy_(values[slot.name].to(slot.tensor.device, slot.tensor.dtype))
    with torch.no_grad():
        for slot in model_slots:
            t, value = slot.tensor, values[slot.name]
            if isinstance(t, torch.nn.Parameter) and _zero_managed(t):
                if stage != 3:
                    t.data.copy_(value.to(t.device, t.dtype))  # the low-precision copy the forward uses
                safe_set_full_fp32_param(t, value.to(device))  # the fp32 master partition
                if moments is not None:
                    for kind in MOMENTS:
                        safe_set_full_optimizer_state(t, slot.join(moments[kind], where).to(device), kind)
            else:
                t.data.copy_(value.to(t.device, t.dtype))
                if moments is not None and isinstance(t, torch.nn.Parameter):
                    st = base.state.setdefault(t, {})
                    for kind in MOMENTS:
                        st[kind] = slot.join(moments[kind], where).to(t.device, t.dtype).clone()
                    st.setdefault("step", torch.zeros(()))
    if moments is not None:
        step = int(meta["optimizer_step"])
        for st in base.state.values():
            if "step" in st:
                if torch.is_tensor(st["step"]):
                    st["step"].fill_(float(step))
                else:
                    st["step"] = step


def _materialize_optimizer_state(ds_engine) -> None:
    """AdamW creates its state at the first step; a resume sets it before that, so
    create it (zeros) the way torch does, then let ZeRO link its fragments."""
    base = _base_optimizer(ds_engine)
    if base.state:
        return
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    fused = bool(base.defaults.get("fused"))
    # ZeRO-3 puts each flat fp32 partition in its param group only while stepping it
    flats = getattr(ds_engine.optimizer, "fp32_partitioned_groups_flat", None)
    params = list(flats) if flats else [p for g in base.param_groups for p in g["params"]]
    for p in params:
        base.state[p] = {"step": torch.zeros((), dtype=scalar, device=p.device if fused else "cpu"),
                         "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                         "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    _relink_optimizer_fragments(ds_engine)

