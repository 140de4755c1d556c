"""Mixture-of-experts blocks for the decoder, in the Qwen3-MoE layout.

Single-device code: a block holds ``num_experts / ep_size`` experts (all of them unless
an engine shards it with ``shard_experts``) and talks to the other expert-parallel
ranks only through the group an engine hands it. One block runs as five stages, cut at
the expert-parallel communication boundaries, each a method on the same state:

    1. attention_and_route  attention + residual, post-norm, router, top-k, aux losses,
                            tokens sorted by expert
    2. dispatch             all-to-all of the sorted tokens to the ranks owning their
                            experts (variable splits: dropless)
    3. run_experts          SwiGLU experts as two grouped GEMMs over the tokens sorted by
                            local expert (``torch.nn.functional.grouped_mm``)
    4. combine              the all-to-all back
    5. aggregate            weighted sum over each token's k experts, shared expert,
                            residual

``forward`` runs them in order; a schedule that overlaps two micro-batches (DualPipeV)
can interleave them. ``reference_forward`` is the plain definition (every expert on
every token, masked), used by the tests as ground truth. The token permute into expert
order and the weighted sum back (``permute_tokens`` / ``unpermute_tokens``) and the
experts' products (``Experts.grouped_mm``) are attributes a kernel converter may swap
(``molds.kernels``: fused Triton ops, FP8 grouped GEMMs).

Router: softmax (Mixtral / Qwen3) or sigmoid (DeepSeek-V3) scores, top-k (1-4), the k
weights renormalized to sum to one. Load-balancing loss (Switch Transformer,
normalized to 1 when balanced): ``E/k x sum_i f_i P_i`` with f_i the share of the
(token, slot) pairs routed to expert i times k and P_i its mean routing probability;
router z-loss: mean squared log-sum-exp of the logits. Both reach the gradient inside
the block (``AuxLossToGradient``, as Megatron-Core does), scaled by the block's
``aux_loss_scale`` (set by the engine to 1 / micro-batches per step), never through
the block's outputs: a pipeline stage carries only hidden states. Dropless by default;
with ``capacity_factor > 0`` each expert takes at most ceil(cf x tokens x k / E)
(token, slot) pairs, the rest are dropped and counted.

Checkpoints name every expert on its own, by global id, as Hugging Face's per-expert
Qwen3-MoE keys do (``mlp.experts.{e}.gate_proj.weight`` ...): ``canonical_split`` /
``canonical_join`` map the stacked local weights to and from those names, whatever
the expert-parallel layout.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from .decoder import Attention, DecoderConfig, DecoderLayer, RMSNorm, part_seed, swiglu


@dataclass
class MoEConfig:
    num_experts: int
    top_k: int = 2
    score: str = "softmax"
    expert_size: int = 0  # SwiGLU width of each expert (0: the decoder's intermediate_size)
    shared_expert_size: int = 0
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    capacity_factor: float = 0.0  # 0: dropless
    first_dense_layers: int = 0
    layer_interval: int = 1

    @classmethod
    def from_model_section(cls, m: dict) -> "MoEConfig":
        return cls(num_experts=m["num_experts"], top_k=m["moe_top_k"], score=m["moe_score"],
                   expert_size=m["moe_expert_size"], shared_expert_size=m["moe_shared_expert_size"],
                   aux_loss_coef=m["moe_aux_loss_coef"], z_loss_coef=m["moe_z_loss_coef"],
                   capacity_factor=m["moe_capacity_factor"], first_dense_layers=m["moe_first_dense_layers"],
                   layer_interval=m["moe_layer_interval"])

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_dense_layers and (layer_id - self.first_dense_layers) % self.layer_interval == 0


def permute_tokens(y: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
    """The rows the experts take: token ``token_of[i]``'s row for each (token, slot) pair i,
    in expert order."""
    return y.index_select(0, token_of)


def unpermute_tokens(x: torch.Tensor, token_of: torch.Tensor, weight_of: torch.Tensor, num_tokens: int):
    """Each token's routing-weighted sum of its experts' output rows (``x`` in expert order)."""
    src = x * weight_of[:, None]
    return src.new_zeros(num_tokens, src.shape[1]).index_add(0, token_of, src)


def make_moe_layer(cfg: DecoderConfig, layer_id: int, ep_size: int = 1, ep_rank: int = 0) -> nn.Module:
    """Block ``layer_id`` of an MoE decoder: mixture-of-experts where the config says, dense otherwise."""
    if cfg.moe.is_moe_layer(layer_id):
        return MoEDecoderLayer(cfg, layer_id, ep_size=ep_size, ep_rank=ep_rank)
    return DecoderLayer(cfg, layer_id)


class AuxLossToGradient(torch.autograd.Function):
    """Identity on ``hidden``; in backward, d(scale x aux)/d(aux) = scale flows into the
    router through ``aux``: the auxiliary loss joins the gradient where it is computed."""

    @staticmethod
    def forward(ctx, hidden, aux, scale: float):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class _ContiguousGrad(torch.autograd.Function):
    """Identity; the gradient handed back is made contiguous (grouped_mm's backward needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.linear = F.linear  # molds.models.wgrad may make its weight gradient deferrable

    def init_weights(self, std: float, base: int, key: tuple) -> None:
        with torch.no_grad():
            nn.init.normal_(self.weight, std=std)

    def forward(self, y):
        return self.linear(y, self.weight)


class Experts(nn.Module):
    """``num_local`` SwiGLU experts, global ids ``offset .. offset + num_local - 1``,
    stacked for grouped GEMMs: ``gate`` and ``up`` [E, hidden, width], ``down``
    [E, width, hidden] (gate and up apart: their products stay contiguous, which the
    elementwise SwiGLU needs to be fast)."""

    def __init__(self, hidden: int, width: int, num_experts: int, ep_size: int = 1, ep_rank: int = 0):
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not split over {ep_size} expert-parallel ranks")
        self.hidden, self.width, self.num_experts = hidden, width, num_experts
        self.num_local = num_experts // ep_size
        self.offset = ep_rank * self.num_local
        self.gate = nn.Parameter(torch.empty(self.num_local, hidden, width))
        self.up = nn.Parameter(torch.empty(self.num_local, hidden, width))
        self.down = nn.Parameter(torch.empty(self.num_local, width, hidden))
        self.act = swiglu  # an elementwise region (molds.kernels may fuse it)
        self.grouped_mm = F.grouped_mm  # molds.models.wgrad may make its weight gradient deferrable

    def init_weights(self, std: float, base: int, key: tuple) -> None:
        """Expert g's weights depend on (seed, layer, g) only: the same whatever the
        expert-parallel layout that holds it."""
        with torch.no_grad():
            for e in range(self.num_local):
                gen = torch.Generator().manual_seed(part_seed(base, *key, "expert", self.offset + e))
                for w in (self.gate, self.up, self.down):
                    w[e].copy_(torch.randn(w[e].shape, generator=gen, device="cpu") * std)  # a CPU generator, whatever the default device

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [M, hidden] sorted by local expert, ``counts`` [num_local] tokens per expert."""
        mm = self.grouped_mm
        if getattr(mm, "any_shape", False) or (x.dtype in (torch.float32, torch.bfloat16, torch.float16)
                                               and self.hidden % 8 == 0 and self.width % 8 == 0):
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = self.act(mm(x, self.gate, offs=offs), mm(x, self.up, offs=offs))
            return _ContiguousGrad.apply(mm(h, self.down, offs=offs))
        # F.grouped_mm has no float64 kernel (and wants 16-byte strides): one GEMM per expert
        out, start = [], 0
        for e, n in enumerate(counts.tolist()):
            out.append(self.expert(e, x[start:start + n]))
            start += n
        return torch.cat(out) if out else x.new_zeros(0, self.hidden)

    def expert(self, e: int, y: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` on every row of ``y`` (the reference path)."""
        return self.act(y @ self.gate[e], y @ self.up[e]) @ self.down[e]

    # the canonical (checkpoint) names: one entry per expert, by global id
    _NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

    def canonical_split(self, prefix: str, attr: str, t: torch.Tensor) -> dict:
        return {f"{prefix}.{self.offset + e}.{self._NAMES[attr]}.weight": t[e].t() for e in range(self.num_local)}

    def canonical_join(self, prefix: str, attr: str, tensors: dict) -> torch.Tensor:
        return torch.stack([tensors[f"{prefix}.{self.offset + e}.{self._NAMES[attr]}.weight"].t()
                            for e in range(self.num_local)])


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.act = swiglu

    def forward(self, y):
        return self.down_proj(self.act(self.gate_proj(y), self.up_proj(y)))


class SparseMoeBlock(nn.Module):
    """``mlp`` of an MoE block: ``gate`` (the router), ``experts``, optional ``shared_expert``."""

    def __init__(self, cfg: DecoderConfig, ep_size: int = 1, ep_rank: int = 0):
        super().__init__()
        moe = cfg.moe
        self.gate = Router(cfg.hidden_size, moe.num_experts)
        self.experts = Experts(cfg.hidden_size, moe.expert_size or cfg.intermediate_size, moe.num_experts, ep_size,
                               ep_rank)
        self.shared_expert = SharedExpert(cfg.hidden_size, moe.shared_expert_size) if moe.shared_expert_size else None


@dataclass
class RoutingState:
    """What passes between the five stages of one MoE block for one micro-batch."""

    shape: tuple  # of the block's input
    h: torch.Tensor  # residual stream after attention [N, hidden]
    y: torch.Tensor  # post-attention-normed tokens [N, hidden]
    token_of: torch.Tensor  # [M] token of each kept (token, slot) pair, in expert order
    weight_of: torch.Tensor  # [M] its routing weight
    counts: torch.Tensor  # [E] kept pairs per global expert (this rank's tokens)
    x: torch.Tensor | None = None  # the rows travelling through dispatch -> experts -> combine
    local_counts: torch.Tensor | None = None  # [E_local] rows per local expert after dispatch
    recv_counts: torch.Tensor | None = None  # [ep, E_local] rows received from each rank per local expert
    stats: dict = field(default_factory=dict)


class MoEDecoderLayer(nn.Module):
    """Attention + a sparse mixture-of-experts MLP (Qwen3-MoE's decoder layer)."""

    def __init__(self, cfg: DecoderConfig, layer_id: int = 0, ep_size: int = 1, ep_rank: int = 0):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg, ep_size, ep_rank)
        self.ep_group, self.ep_size, self.ep_rank = None, ep_size, ep_rank
        self.permute, self.unpermute = permute_tokens, unpermute_tokens  # molds.kernels may fuse them
        self.aux_loss_scale = 1.0  # set by the engine: 1 / micro-batches per optimizer step
        self.reference = False  # run reference_forward (tests)
        self.reset_stats()

    # ------------------------------------------------------------ bookkeeping
    def reset_stats(self) -> None:
        e = self.cfg.moe.num_experts
        self.stats = {"aux_loss": 0.0, "z_loss": 0.0, "micro_batches": 0, "dropped": 0, "pairs": 0,
                      "tokens_per_expert": torch.zeros(e, dtype=torch.float64, device="cpu")}  # (a meta-built model too)

    def routed_expert_params(self) -> int:
        """Routed expert parameters a token passes through: its top-k experts (the shared
        expert's are the layer's own parameters, counted with the rest)."""
        moe, h = self.cfg.moe, self.cfg.hidden_size
        return moe.top_k * 3 * h * (moe.expert_size or self.cfg.intermediate_size)

    # ------------------------------------------------------------ the five stages
    def attention_and_route(self, x, cos, sin, layout, cache=None) -> RoutingState:
        return self.route(x + self.self_attn(self.input_layernorm(x), cos, sin, layout, cache))

    def route(self, h: torch.Tensor) -> RoutingState:
        """Post-attention norm, router, top-k, auxiliary losses, tokens sorted by expert
        (the second half of stage 1; ``benchmarks/moe_layer.py`` times the MoE part alone)."""
        moe = self.cfg.moe
        shape = h.shape
        h = h.reshape(-1, shape[-1])
        y = self.post_attention_layernorm(h)
        n, e, k = y.shape[0], moe.num_experts, moe.top_k
        logits = self.mlp.gate(y).float()
        scores = torch.softmax(logits, -1) if moe.score == "softmax" else torch.sigmoid(logits)
        top_w, top_i = torch.topk(scores, k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True).clamp(min=1e-20)
        flat_e = top_i.reshape(-1)
        keep = torch.ones_like(flat_e, dtype=torch.bool)
        if moe.capacity_factor > 0:  # each expert takes its first C (token, slot) pairs in token order
            cap = max(1, int(-(-moe.capacity_factor * n * k // e)))
            onehot = F.one_hot(flat_e, e)
            position = (torch.cumsum(onehot, 0) - onehot)[torch.arange(len(flat_e), device=flat_e.device), flat_e]
            keep = position < cap
        counts_all = torch.bincount(flat_e, minlength=e)
        order = torch.argsort(torch.where(keep, flat_e, e), stable=True)[: int(keep.sum())]
        token_of = order // k
        weight_of = top_w.reshape(-1)[order].to(h.dtype)
        counts = torch.bincount(flat_e[order], minlength=e)
        # auxiliary losses: computed here, they join the gradient here
        probs = scores / scores.sum(-1, keepdim=True) if moe.score == "sigmoid" else scores
        frac = counts_all.to(probs.dtype) / max(1, n)  # (token, slot) pairs per token routed to each expert
        aux = (e / k) * (frac.detach() * probs.mean(0)).sum() if n else probs.sum() * 0
        z = torch.logsumexp(logits, -1).pow(2).mean() if n and moe.z_loss_coef else logits.sum() * 0
        total = moe.aux_loss_coef * aux + moe.z_loss_coef * z
        if self.training and torch.is_grad_enabled() and (moe.aux_loss_coef or moe.z_loss_coef):
            h = AuxLossToGradient.apply(h, total, self.aux_loss_scale)
        st = RoutingState(shape, h, y, token_of, weight_of, counts, x=self.permute(y, token_of))
        st.stats = {"aux_loss": float(aux.detach()), "z_loss": float(z.detach()), "counts": counts_all.detach(),
                    "dropped": int((~keep).sum()), "pairs": int(len(flat_e))}
        return st

    def dispatch(self, st: RoutingState) -> RoutingState:
        """Rows to the ranks that own their experts (all-to-all, variable splits)."""
        if self.ep_size == 1:
            st.local_counts = st.counts
            return st
        self.exchange_counts(st)
        st.x = _differentiable_all_to_all()(st.x, *self.dispatch_splits(st), group=self.ep_group)
        return self.arrange_received(st)

    def run_experts(self, st: RoutingState) -> RoutingState:
        st.x = self.mlp.experts(st.x, st.local_counts)
        return st

    def combine(self, st: RoutingState) -> RoutingState:
        """The expert outputs back to the ranks their tokens came from."""
        if self.ep_size == 1:
            return st
        self.arrange_for_return(st)
        st.x = _differentiable_all_to_all()(st.x, *self.combine_splits(st), group=self.ep_group)
        return st

    # the parts of dispatch and combine (a schedule that overlaps two micro-batches runs the
    # all-to-alls itself, asynchronously: molds.engines.chunks)
    def exchange_counts(self, st: RoutingState) -> None:
        """How many rows each rank sends each of this rank's experts (a small all-to-all)."""
        send = st.counts.view(self.ep_size, self.mlp.experts.num_local)  # per destination rank, per its expert
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv.view(-1), send.reshape(-1).contiguous(), group=self.ep_group)
        st.recv_counts = recv

    def dispatch_splits(self, st: RoutingState) -> tuple[list[int], list[int]]:
        """(rows received from each rank, rows sent to each rank) of the dispatch."""
        return st.recv_counts.sum(1).tolist(), st.counts.view(self.ep_size, -1).sum(1).tolist()

    def combine_splits(self, st: RoutingState) -> tuple[list[int], list[int]]:
        out_splits, in_splits = self.dispatch_splits(st)
        return in_splits, out_splits

    def arrange_received(self, st: RoutingState) -> RoutingState:
        """Rows received as (source rank, local expert) blocks, reordered by local expert."""
        st.x = st.x.index_select(0, _block_transpose(st.recv_counts))
        st.local_counts = st.recv_counts.sum(0)
        return st

    def arrange_for_return(self, st: RoutingState) -> RoutingState:
        """The experts' output rows back in (source rank, local expert) blocks."""
        st.x = st.x.index_select(0, _block_transpose(st.recv_counts.t().contiguous()))
        return st

    def aggregate(self, st: RoutingState) -> torch.Tensor:
        out = self.unpermute(st.x, st.token_of, st.weight_of, st.y.shape[0])
        if self.mlp.shared_expert is not None:
            out = out + self.mlp.shared_expert(st.y)
        self._record(st.stats)
        return (st.h + out).view(st.shape)

    def forward(self, x, cos, sin, layout, cache=None):
        if self.reference:
            return self.reference_forward(x, cos, sin, layout, cache)
        st = self.attention_and_route(x, cos, sin, layout, cache)
        return self.aggregate(self.combine(self.run_experts(self.dispatch(st))))

    # ------------------------------------------------------------ ground truth
    def reference_forward(self, x, cos, sin, layout, cache=None):
        """Every expert on every token, weighted by the (dropless) top-k routing: the
        definition, with no sorting, no grouped GEMM, no communication."""
        moe = self.cfg.moe
        if self.mlp.experts.num_local != moe.num_experts:
            raise RuntimeError("reference_forward needs every expert on this rank (ep_size 1)")
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, layout, cache)
        shape = h.shape
        h = h.reshape(-1, shape[-1])
        y = self.post_attention_layernorm(h)
        logits = self.mlp.gate(y).float()
        scores = torch.softmax(logits, -1) if moe.score == "softmax" else torch.sigmoid(logits)
        top_w, top_i = torch.topk(scores, moe.top_k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True).clamp(min=1e-20)
        dense = torch.zeros_like(scores).scatter(1, top_i, top_w).to(y.dtype)  # [N, E] routing weights
        out = sum(dense[:, e:e + 1] * self.mlp.experts.expert(e, y) for e in range(moe.num_experts))
        if self.mlp.shared_expert is not None:
            out = out + self.mlp.shared_expert(y)
        n, e, k = y.shape[0], moe.num_experts, moe.top_k
        probs = scores / scores.sum(-1, keepdim=True) if moe.score == "sigmoid" else scores
        frac = torch.bincount(top_i.reshape(-1), minlength=e).to(probs.dtype) / max(1, n)
        aux = (e / k) * (frac * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        if self.training and torch.is_grad_enabled() and (moe.aux_loss_coef or moe.z_loss_coef):
            h = AuxLossToGradient.apply(h, moe.aux_loss_coef * aux + moe.z_loss_coef * z, self.aux_loss_scale)
        return (h + out).view(shape)

    def _record(self, stats: dict) -> None:
        if not self.training:
            return
        s = self.stats
        s["aux_loss"] += stats["aux_loss"]
        s["z_loss"] += stats["z_loss"]
        s["micro_batches"] += 1
        s["dropped"] += stats["dropped"]
        s["pairs"] += stats["pairs"]
        s["tokens_per_expert"] += stats["counts"].to("cpu", torch.float64)


def _differentiable_all_to_all():
    """torch's autograd-aware ``all_to_all_single`` (its backward is the reverse exchange)
    as ``(x, output_split_sizes, input_split_sizes, group=)``; torch 2.13 marks the public
    module deprecated in favour of a private one, so the warning is silenced here, once."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
    exchange = _quiet(all_to_all_single)

    def rows(x, out_splits, in_splits, group=None):
        return exchange(x.new_empty((sum(out_splits),) + tuple(x.shape[1:])), x.contiguous(),
                        output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)

    return rows


def _quiet(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return fn(*args, **kwargs)

    return call


def _block_transpose(counts: torch.Tensor) -> torch.Tensor:
    """Row order that turns rows laid out as blocks [a][b] (block sizes ``counts`` [A, B],
    a-major) into b-major order [b][a]."""
    a, b = counts.shape
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # where each block begins now
    target = torch.arange(a * b, device=counts.device).view(a, b).t().reshape(-1)  # blocks in the new order
    sizes = flat[target]
    total = int(flat.sum())
    new_starts = torch.cumsum(sizes, 0) - sizes
    return (torch.arange(total, device=counts.device) - torch.repeat_interleave(new_starts, sizes, output_size=total)
            + torch.repeat_interleave(starts[target], sizes, output_size=total))


# ---------------------------------------------------------------- helpers for engines and tools

def moe_layers(model: nn.Module) -> list[MoEDecoderLayer]:
    return [m for m in model.modules() if isinstance(m, MoEDecoderLayer)]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The auxiliary losses' gradient scale: 1 / micro-batches per optimizer step, as the
    language-model loss is averaged over them."""
    for layer in moe_layers(model):
        layer.aux_loss_scale = scale


def use_reference_forward(model: nn.Module, on: bool = True) -> nn.Module:
    for layer in moe_layers(model):
        layer.reference = on
    return model


def collect_stats(layers, group=None) -> dict:
    """The ``moe/*`` scalars of the micro-batches since the last call (summed over the
    ranks of ``group``), and reset. Per layer: tokens per expert (a histogram), and
    max / mean load; over layers: the auxiliary and z losses, the dropped fraction."""
    out = {}
    if not layers:
        return out
    counts = torch.stack([l.stats["tokens_per_expert"] for l in layers])  # [L, E]
    scalars = torch.tensor([[l.stats["aux_loss"], l.stats["z_loss"], l.stats["micro_batches"], l.stats["dropped"],
                             l.stats["pairs"]] for l in layers], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(counts, group=group)
        dist.all_reduce(scalars, group=group)
    n = scalars[:, 2].clamp(min=1)
    out["moe/aux_loss"] = float((scalars[:, 0] / n).mean())
    out["moe/z_loss"] = float((scalars[:, 1] / n).mean())
    load = counts / counts.sum(1, keepdim=True).clamp(min=1) * counts.shape[1]  # 1.0 = perfectly balanced
    out["moe/load_max_over_mean"] = float(load.max(1).values.mean())
    if any(l.cfg.moe.capacity_factor > 0 for l in layers):
        out["moe/dropped_fraction"] = float(scalars[:, 3].sum() / scalars[:, 4].sum().clamp(min=1))
    for layer, row in zip(layers, counts):
        out[f"moe/tokens_per_expert/layer{layer.layer_id:02d}"] = row.tolist()
        out[f"moe/load_max_over_mean/layer{layer.layer_id:02d}"] = float((row / row.sum().clamp(min=1)).max()
                                                                        * len(row))
    for layer in layers:
        layer.reset_stats()
    return out
