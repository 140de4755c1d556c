"""``parallel.engine=pipeline``: DeepSpeed's pipeline engine, with expert parallelism.

What is DeepSpeed's and reused as is: ``PipelineModule`` (stage partitioning by
``parallel.partition_method``, activation checkpointing, tied embeddings through
``TiedLayerSpec``), ``PipelineEngine`` with its 1F1B ``TrainSchedule``, ZeRO stage 0/1,
and the expert-parallel process groups of ``deepspeed.utils.groups`` (expert and
expert-data-parallel groups) with its MoE gradient reduction and MoE optimizer groups.

What molds adds around it, and why:
- The model is the single-device decoder (``molds.models``), cut into stages here, as the
  layers of ``molds.engines.stages``: each takes and returns one fixed-shape tuple, so any
  block can sit on any stage.
- The loss (``molds.models.loss``) runs on the last stage only (``loss_fn``).
- MoE auxiliary losses reach the gradient inside each block (``AuxLossToGradient``):
  DeepSpeed's pipeline does not route them; nothing but hidden states crosses stages.
  Their gradient is scaled by 1 / micro-batches, as DeepSpeed scales the loss.
- DeepSpeed recognizes MoE parameters only around its own ``deepspeed.moe.layer.MoE``:
  ``_ExpertParallelMarker`` (a parameter-free subclass) tells its engine that this model
  has expert parameters (marked ``allreduce=False`` with their group name, DeepSpeed's
  convention), so their gradients are reduced over the expert-data-parallel group.
  molds' own MoE block replaces DeepSpeed's layer: dropless, sort + grouped GEMM instead
  of capacity padding and a GEMM per expert, softmax or sigmoid routing, shared experts.
- Checkpoints are the canonical state (``molds.checkpoint.state``) under the single-device
  names, gathered to rank 0: a run saved with pp = 2, ep = 2 resumes with pp = 1, ep = 1.
- ZeRO-0 has no overflow check in DeepSpeed (its plain optimizer steps on NaN
  gradients); molds skips such a step itself.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import time

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.utils import groups
from torch import nn

from ..checkpoint.state import read_model, read_optimizer, slots, write_model, write_optimizer
from ..errors import CheckpointError
from ..models.loss import has_targets
from ..models.moe import Experts, collect_stats, moe_layers, set_aux_loss_scale
from ..runtime.distributed import gather_objects, quiet_on_other_ranks
from .base import ScheduledEngine, StepResult, Topology
from .optim import adam_step_count, adamw, build_scheduler, param_groups, set_schedule
from .stages import BlockPipe, EmbedPipe, HeadPipe, NormPipe, head_forward, head_in_loss_forward, materializing
from .zero import _base_optimizer, full_state, set_full_state


def _rename(num_blocks: int, tied: bool):
    """PipelineModule parameter names -> the single-device model's (canonical) names."""
    def rename(name: str) -> str:
        head, _, rest = name.partition(".")
        if head == "molds_expert_parallel":  # the marker's placeholder: no model state, no canonical name
            return name
        if head == "tied_modules":  # tied_modules.embed.weight
            return "model.embed_tokens.weight"
        index = int(head)
        if index == 0:
            return "model.embed_tokens.weight"
        if index <= num_blocks:
            return f"model.layers.{index - 1}." + rest.removeprefix("block.")
        if index == num_blocks + 1:
            return "model.norm." + rest.removeprefix("norm.")
        return "lm_head.weight"

    return rename


def _ExpertParallelMarker(num_experts: int, ep_size: int, placeholder: bool = False):
    """A ``deepspeed.moe.layer.MoE`` without a layer: its presence makes DeepSpeed's engine
    reduce expert gradients over the expert-data-parallel groups and split the optimizer's
    MoE groups; its expert groups already exist (created before the model is cut).

    ``placeholder``: this rank's stages hold no expert (DualPipeV's first and last stages on
    rank 0 may not), yet DeepSpeed's ZeRO-1 all-reduces each parameter group's norm across
    the pipeline stages, group by group, so every stage needs the same groups: a (1, 1)
    expert parameter (decayed, as the experts' matrices are) that never gets a gradient.
    It is not model state: the marker leaves it out of ``state_dict``."""
    class Marker(MoE):
        def __init__(self):
            nn.Module.__init__(self)
            self.num_experts, self.ep_size = num_experts, ep_size
            self.expert_group_name = f"ep_size_{ep_size}"
            self.num_local_experts = num_experts // ep_size
            self.enable_expert_tensor_parallelism = False
            self.use_residual = False
            if placeholder:
                self.placeholder = nn.Parameter(torch.zeros(1, 1))
                self.placeholder.allreduce = False
                self.placeholder.group_name = self.expert_group_name

        def _save_to_state_dict(self, destination, prefix, keep_vars):
            pass  # no model state

        def _load_from_state_dict(self, *args, **kwargs):
            pass

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass  # the groups exist already

        def forward(self, *args, **kwargs):
            raise RuntimeError("the expert-parallel marker is not a layer")

    return Marker()


# ---------------------------------------------------------------- the engine

class PipelineEngine(ScheduledEngine):
    name = "pipeline"

    def __init__(self, recipe, model: nn.Module, loss_fn, dist, plan):
        self.recipe, self.dist, self.loss_fn, self.plan = recipe, dist, loss_fn, plan
        with quiet_on_other_ranks(dist):  # DeepSpeed's communication layer over molds' process group
            deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), dist_init_required=False)
        p = recipe.parallel
        self.pp, self.ep = p.pp_size, p.ep_size
        self.stage_zero = p.zero_stage
        self.dtype = plan.dtype
        cfg = model.config
        self.expected_keys = set(_canonical_keys(model))
        # expert parallelism: DeepSpeed's groups, then each MoE block keeps its own experts
        self.ep_group, self.ep_rank = None, 0
        num_experts = cfg.moe.num_experts if cfg.moe is not None else 0
        if num_experts and self.ep > 1:
            name = f"ep_size_{self.ep}"
            if name not in groups._get_expert_parallel_group_dict():
                groups._create_expert_and_data_parallel(self.ep, pp_size=self.pp)
            self.ep_group = groups._get_expert_parallel_group(name)
            self.ep_rank = torch.distributed.get_rank(self.ep_group)
            for layer in moe_layers(model):
                _shard_experts(layer, self.ep, self.ep_rank, self.ep_group, name)
        # the model as a sequence of stage modules (DeepSpeed builds the local ones)
        body = model.model
        tied = cfg.tie_word_embeddings
        specs = [TiedLayerSpec("embed", EmbedPipe, body.embed_tokens.weight) if tied
                 else LayerSpec(EmbedPipe, body.embed_tokens.weight)]
        specs += [LayerSpec(BlockPipe, block, cfg.head_dim, cfg.rope_theta, i) for i, block in enumerate(body.layers)]
        specs.append(LayerSpec(NormPipe, body.norm))
        in_loss = getattr(model, "head_in_loss", False)  # kernels.triton: the LM head runs in the loss
        linear = getattr(model.lm_head, "linear", F.linear)  # kernels.fp8_lm_head: its FP8 product
        head = head_in_loss_forward if in_loss else functools.partial(head_forward, linear=linear)
        specs.append(TiedLayerSpec("embed", EmbedPipe, body.embed_tokens.weight, forward_fn=head) if tied
                     else LayerSpec(HeadPipe, model.lm_head.weight, in_loss, linear))
        self.num_blocks = len(body.layers)
        self.rename = _rename(self.num_blocks, tied)

        def pipe_loss(outputs, targets):
            labels, document_ids = targets
            outputs = outputs if isinstance(outputs, dict) else {"logits": outputs}
            return loss_fn(outputs, {"labels": labels, "document_ids": document_ids})

        # a model built on the meta device (train.setup does for this engine) gets storage for
        # this rank's stages only, as DeepSpeed builds them
        module_class = materializing(self.module_class(), cfg.initializer_range, getattr(model, "init_seed", 0))
        with quiet_on_other_ranks(dist), torch.no_grad():  # (its tied-weight broadcast is no training op)
            self.module = module_class(layers=specs, num_stages=self.pp, loss_fn=pipe_loss,
                                       partition_method=p.partition_method,
                                       activation_checkpoint_interval=p.activation_checkpoint_interval)
        self.moe_layers = moe_layers(self.module)
        expert_parallel = bool(num_experts and self.ep > 1)
        if expert_parallel:
            self.module.molds_expert_parallel = _ExpertParallelMarker(num_experts, self.ep,
                                                                      placeholder=not self.moe_layers)
        self.model = None  # no rank holds the whole single-device model (sampling gathers it: gather_weights)
        set_aux_loss_scale(self.module, 1.0 / plan.micro_batches)
        # a stage holds some blocks: its parameters' depths count the model's (layer-wise rates)
        groups_ = param_groups(self.module.named_parameters(), recipe.optim.weight_decay,
                               layer_decay=recipe.optim.layer_decay, blocks={"model": self.num_blocks},
                               rename=self.rename, module=self.module)
        if expert_parallel:
            groups_ = split_params_into_different_moe_groups_for_optimizer(groups_)
        optimizer = adamw(groups_, recipe.optim)
        scheduler = build_scheduler(optimizer, recipe.optim, plan.horizon)
        ds_cfg = copy.deepcopy(plan.ds_config)  # DeepSpeed writes into its config; clipping changes below
        self.clip = recipe.optim.grad_clip
        if self.stage_zero == 0:
            # DeepSpeed's ZeRO-0 pipeline counts only the first stage's gradients in the norm it
            # clips by (the others are not "model parallel" parameters to it): molds clips by
            # the norm of every stage's gradients itself (_guard_non_finite_steps)
            ds_cfg["gradient_clipping"] = 0.0
        with quiet_on_other_ranks(dist):
            self.engine, self.optimizer, _, self.scheduler = self.initialize_deepspeed(
                model=self.module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_cfg,
                dist_init_required=False)
        grid = self.module._grid
        self.topology = Topology(world_size=dist.world_size, rank=dist.rank, dp_size=grid.get_data_parallel_world_size(),
                                 dp_rank=grid.get_data_parallel_id(), pp_size=self.pp, pp_rank=grid.get_stage_id(),
                                 ep_size=self.ep, ep_rank=self.ep_rank)
        self._skipped, self._norm = False, None
        if self.stage_zero == 0:
            self._guard_non_finite_steps()
        self._stage_seconds, self._windows = [], []  # per step: seconds; (busy, schedule) seconds
        self._clock = time_instructions(self.engine) if type(self) is PipelineEngine else None

    # the two seams a schedule changes (molds.engines.dualpipev)
    @staticmethod
    def module_class():
        return PipelineModule

    @staticmethod
    def initialize_deepspeed(**kwargs):
        return deepspeed.initialize(**kwargs)

    # ------------------------------------------------------------ steps
    @staticmethod
    def _as_pipe(batch: dict):
        return ((batch["input_ids"], batch["position_ids"], batch["document_ids"]),
                (batch["labels"], batch["document_ids"]))

    def autocast(self):
        return contextlib.nullcontext()  # DeepSpeed casts the module itself (bf16 config)

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        lr = self.scheduler.get_last_lr()[0]
        skipped_before = self.engine.skipped_steps
        self._skipped = False
        start = time.perf_counter()
        self._norm = None
        self._clock.update(busy=0.0, start=start, end=None)
        self.engine.train_batch(iter([self._as_pipe(b) for b in micro_batches]))
        self._stage_seconds.append(time.perf_counter() - start)
        self._windows.append((self._clock["busy"], (self._clock["end"] or time.perf_counter()) - start))
        norm = self._norm if self._norm is not None else self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        loss = float(self.engine.dp_group_loss)
        skipped = self._skipped or self.engine.skipped_steps > skipped_before
        return StepResult(loss=loss, grad_norm=norm, lr=lr, skipped=skipped)

    @torch.no_grad()
    def eval_forward(self, batch: dict) -> dict:
        if not has_targets(batch):
            raise RuntimeError("the pipeline engine evaluates losses only")
        loss = self.engine.eval_batch(iter([self._as_pipe(batch)]), num_micro_batches=1, bcast_loss=True)
        return {"loss": loss}

    def extras(self) -> dict:
        """``moe/*`` of every MoE block and ``pipeline/*`` stage times since the last call,
        gathered from all stages (a collective: every rank calls it)."""
        dp_group = self.module._grid.get_data_parallel_group() if self.topology.dp_size > 1 else None
        mine = collect_stats(self.moe_layers, group=dp_group)
        mean_s = sum(self._stage_seconds) / max(1, len(self._stage_seconds))
        parts = gather_objects((self.topology.pp_rank, mine, mean_s, self._windows), self.dist)
        self._stage_seconds, self._windows = [], []
        out, per_stage = {}, {}
        for stage, stats, seconds, _ in parts:
            out.update(stats)
            per_stage.setdefault(stage, []).append(seconds)
        for stage, secs in sorted(per_stage.items()):
            out[f"pipeline/step_s/stage{stage}"] = sum(secs) / len(secs)
        fractions = bubble_fractions([w for *_, w in parts])
        if fractions:  # measured idle over the step's schedule time, mean over ranks and steps
            out["pipeline/bubble_fraction"] = sum(fractions) / len(fractions)
        merged = [v for k, v in out.items() if k.startswith("moe/load_max_over_mean/layer")]
        if merged:
            out["moe/load_max_over_mean"] = sum(merged) / len(merged)
        aux = [s.get("moe/aux_loss") for _, s, *_ in parts if s.get("moe/aux_loss") is not None]
        if aux:
            out["moe/aux_loss"] = sum(aux) / len(aux)
        z = [s.get("moe/z_loss") for _, s, *_ in parts if s.get("moe/z_loss") is not None]
        if z:
            out["moe/z_loss"] = sum(z) / len(z)
        return out

    def _global_grad_norm(self) -> float:
        """The norm of the whole model's gradient: every stage's parameters, each dense
        parameter once (not once per data-parallel replica), each expert once (not once
        per expert-data-parallel replica), a tied embedding once."""
        dense = expert = 0.0
        for p in self.engine.module.parameters():
            if p.grad is None or getattr(p, "ds_pipe_replicated", False):
                continue
            sq = float(p.grad.detach().float().pow(2).sum())
            if getattr(p, "allreduce", True) is False:
                expert += sq
            else:
                dense += sq
        dp, ep = self.topology.dp_size, self.ep
        t = torch.tensor([dense / dp + expert / max(1, dp // ep)], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return math.sqrt(float(t)) if math.isfinite(float(t)) else float("nan")

    def _guard_non_finite_steps(self) -> None:
        """ZeRO-0: DeepSpeed's plain optimizer steps whatever the gradients hold, and clips
        by a partial norm; here the whole model's gradient norm is taken, a non-finite one
        skips the step (counted), a finite one clips as torch.nn.utils.clip_grad_norm_ does."""
        engine, original = self.engine, self.engine._take_model_step

        def guarded(*args, **kwargs):
            norm = self._global_grad_norm()
            self._norm = norm
            if not math.isfinite(norm):
                engine.optimizer.zero_grad(set_to_none=True)
                engine.skipped_steps += 1
                self._skipped = True
                return None
            if self.clip > 0:
                coef = self.clip / (norm + 1e-6)
                if coef < 1.0:
                    for p in engine.module.parameters():
                        if p.grad is not None:
                            p.grad.mul_(coef)
            return original(*args, **kwargs)

        engine._take_model_step = guarded

    # ------------------------------------------------------------ canonical state
    def _slots(self):
        return slots(self.module, self.rename)

    def save(self, directory: str) -> None:
        local = [s for s in self._slots() if not s.name.startswith("molds_expert_parallel")]
        weights, moments = full_state(self.engine, local, keep=True)
        step = adam_step_count(_base_optimizer(self.engine))
        parts = [None] * self.dist.world_size if self.dist.is_main else None
        torch.distributed.gather_object((weights, moments, step), parts, dst=0)  # every stage's part, to rank 0
        if not self.dist.is_main:
            return
        all_weights, all_moments = {}, {"exp_avg": {}, "exp_avg_sq": {}}
        for w, m, _ in parts:
            for k, v in w.items():
                all_weights.setdefault(k, v)
            for kind in all_moments:
                for k, v in m.get(kind, {}).items():
                    all_moments[kind].setdefault(k, v)
        missing = self.expected_keys - all_weights.keys()
        if missing:
            raise RuntimeError(f"pipeline checkpoint misses {sorted(missing)[:5]}")
        write_model(directory, all_weights)
        write_optimizer(directory, all_moments, {"optimizer_step": max(s for _, _, s in parts),
                                                 "scheduler_step": self.scheduler.last_epoch})

    def gather_weights(self) -> dict:
        """Every stage's weights by canonical name, on every rank (a collective): what
        sampling during training builds a whole single-device model from."""
        local = [s for s in self._slots() if not s.name.startswith("molds_expert_parallel")]
        weights, _ = full_state(self.engine, local, keep=True)
        parts = [None] * self.dist.world_size
        torch.distributed.all_gather_object(parts, weights)
        merged = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
        missing = self.expected_keys - merged.keys()
        if missing:
            raise RuntimeError(f"the pipeline's gathered weights miss {sorted(missing)[:5]}")
        return merged

    def load(self, directory: str, *, optimizer: bool = True, weights: dict | None = None) -> None:
        weights = read_model(directory) if weights is None else weights
        if weights.keys() != self.expected_keys:
            missing, unexpected = sorted(self.expected_keys - weights.keys()), sorted(weights.keys() - self.expected_keys)
            raise CheckpointError(f"{directory} does not fit this model: missing {missing[:8]}, unexpected "
                                  f"{unexpected[:8]}")
        moments, meta = read_optimizer(directory) if optimizer else (None, {})
        set_full_state(self.engine, self._slots(), weights, moments, meta, stage=self.stage_zero,
                       device=self.dist.device, where=directory)
        if optimizer:
            set_schedule(self.scheduler, self.recipe.optim, self.plan.horizon, int(meta["scheduler_step"]))
            self.engine.global_steps = int(meta["scheduler_step"])
        with torch.no_grad():
            self.module._synchronize_tied_weights()


def time_instructions(ds_engine) -> dict:
    """Time a DeepSpeed pipeline engine's schedule: ``busy`` counts the seconds inside its
    forward and backward instructions, ``end`` is when its gradient reduction begins (the
    schedule is over on this rank). The caller sets ``start`` and resets them per step."""
    counters = {"busy": 0.0, "start": 0.0, "end": None}
    table = dict(ds_engine._INSTRUCTION_MAP)  # the instance's own copy, looked up first

    def busy(method):
        def run(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                counters["busy"] += time.perf_counter() - start
        return run

    def ends(method):
        def run(self, *args, **kwargs):
            if counters["end"] is None:
                counters["end"] = time.perf_counter()
            return method(self, *args, **kwargs)
        return run

    for kind in (ds.ForwardPass, ds.BackwardPass):
        table[kind] = busy(table[kind])
    for kind in (ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep):
        table[kind] = ends(table[kind])
    ds_engine._INSTRUCTION_MAP = table
    return counters


def bubble_fractions(windows: list[list[tuple[float, float]]]) -> list[float]:
    """Each rank's idle share of each step, as the simulator counts it: ``windows[rank]``
    holds (busy seconds, schedule seconds) per step; the ranks start a step together (a
    collective precedes it), so the step's span is the slowest rank's schedule, and a rank
    that finished early was idle until then (in DeepSpeed it waits inside the reduction)."""
    out = []
    for step in zip(*windows):
        span = max(d for _, d in step)
        out += [max(0.0, 1.0 - b / span) for b, _ in step if span > 0]
    return out


def _canonical_keys(model: nn.Module) -> list[str]:
    return [k for s in slots(model) for k in s.keys()]


def _shard_experts(layer, ep_size: int, ep_rank: int, group, group_name: str) -> None:
    """Keep this rank's experts of an MoE block (the block was built with all of them, so
    every expert's initialization is the same whatever the layout); mark their parameters
    the way DeepSpeed's MoE does, so its engine reduces them over the expert-data-parallel
    group."""
    full = layer.mlp.experts
    with torch.device(full.gate.device):  # meta stays meta: the stage that holds it draws its experts
        local = Experts(full.hidden, full.width, full.num_experts, ep_size, ep_rank)
    if not full.gate.is_meta:
        with torch.no_grad():
            sl = slice(local.offset, local.offset + local.num_local)
            for name in ("gate", "up", "down"):
                getattr(local, name).copy_(getattr(full, name)[sl])
    local.act, local.grouped_mm = full.act, full.grouped_mm
    for p in local.parameters():
        p.allreduce = False
        p.group_name = group_name
    layer.mlp.experts = local
    layer.ep_group, layer.ep_size, layer.ep_rank = group, ep_size, ep_rank
