"""Causal decoder for SMILES generation (Llama-style: RMSNorm, RoPE, SwiGLU, GQA).

Single-device code that knows nothing of parallelism, kernels or the loss. Parameter
names and the math match ``transformers.LlamaForCausalLM``, so a checkpoint exports to
it as is (``molds.export``). The forward returns logits; ``molds.models.loss`` computes
the objective. The blocks are a plain ``ModuleList`` so a pipeline engine can cut the
model into stages between them; a block needs only (hidden, position_ids,
document_ids) to rebuild its attention layout (``PackedLayout``), so it can sit on any
stage. Elementwise regions (RoPE, SwiGLU, RMSNorm) are module attributes that a kernel
converter (``molds.kernels``) may swap for fused versions.

Packed rows: pass ``position_ids`` (restarting per molecule) and ``document_ids`` (-1
on padding): attention is causal *within* each molecule only (``PackedLayout``), so a
packed row computes exactly what each molecule alone would.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DecoderConfig:
    vocab_size: int = 0
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 0  # 0: 8/3 x hidden, rounded up to a multiple of 64
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    moe: object = None  # molds.models.moe.MoEConfig: some blocks are mixture-of-experts
    qk_norm: bool = False  # RMSNorm on each head's queries and keys before RoPE (Qwen3; the MoE decoder)

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size {self.hidden_size} is not a multiple of model.num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads {self.num_heads} is not a multiple of model.num_kv_heads "
                             f"{self.num_kv_heads}")
        if not self.intermediate_size:
            self.intermediate_size = -(-int(self.hidden_size * 8 / 3) // 64) * 64

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's math: normalise in fp32, scale in the input dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps
        self.norm = rms_norm  # an elementwise region (molds.kernels may fuse it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.variance_epsilon)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of shape [*position_ids.shape, 1, head_dim] (broadcast over heads)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[..., None, :], emb.sin().to(dtype)[..., None, :]


def causal_attention(q, k, v, is_causal: bool = True):
    """Scaled dot-product attention over [N, heads, S, D] with grouped KV heads.

    On a CPU, half-precision inputs (bf16 autocast) run in float32 and come back in
    their dtype: torch 2.13's CPU flash-attention kernel is slower in bf16 than in fp32
    (its backward about 8x on a 2-core AVX-512 machine, for a decoder whose attention
    is a few percent of the FLOPs), while the bf16 GEMMs around it are about 4x faster.
    GPUs keep the half-precision kernel."""
    if q.device.type == "cpu" and (q.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled("cpu")):
        with torch.autocast("cpu", enabled=False):  # CPU autocast would cast it back to bf16
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=is_causal,
                                                 enable_gqa=True)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rope = apply_rope  # an elementwise region (molds.kernels may fuse it)

    def forward(self, x, cos, sin, layout, cache=None):
        """x: [B, S, hidden] (one sequence per row), or [T, hidden] real tokens with ``layout``.

        ``cache`` (generation): a dict holding this layer's keys and values so far; the
        new keys and values are appended, and the new queries attend to all of them. An
        object with ``attend(q, k, v)`` (q [B, S, heads, D], k and v [B, S, kv heads, D];
        returns [B, S, heads, D]) keeps them its own way instead (``molds.eval.beam``)."""
        cfg = self.cfg
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(*lead, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(*lead, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if cache is not None and hasattr(cache, "attend"):  # a cache that keeps and attends (a beam search's)
            out = cache.attend(q, k, v)
        elif cache is not None:
            past = "k" in cache
            if past:
                k, v = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
            cache["k"], cache["v"] = k, v
            if past and q.shape[1] != 1:
                raise ValueError("with a filled cache, decode one token at a time")
            out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   is_causal=not past).transpose(1, 2)
        elif layout is None:
            out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        else:
            out = layout.attend(q, k, v)
        return self.o_proj(out.reshape(*lead, -1))


class PackedLayout:
    """Packed rows as one flat sequence of their real tokens, molecule after molecule.

    Everything but attention (embeddings, projections, MLPs, norms, the loss) runs on
    the real tokens only: no padding reaches a matrix multiply. For attention the
    molecules, sorted by length, are cut into a few groups; each group is gathered into
    [molecules, longest in the group] (right-padded) and runs plain causal SDPA, so no
    molecule sees another and the cost follows the molecules' own lengths (not seq_len
    squared). Every real token gets exactly the block-diagonal causal attention of
    ``molds.data.packing.block_causal_mask``; padded slots are never read back.

    ``row_multiple`` > 1 rounds the flat sequence up to a multiple of it with filler rows
    (they read packed row 0, sit at position 0, and are never read back: ``to_packed``
    and attention skip them, so they get no gradient). A CPU under bf16 wants it: its
    bf16 GEMMs go through oneDNN, which builds and caches a kernel per distinct matrix
    shape, and a flat length that changes every step makes a new one each step (three
    times slower than a repeated shape, and resident memory that grows by ~1.5 MB per
    shape: 4 GB per rank after 8,000 steps of ``recipes/cpu_moses.json``).

    Under ``torch.compile`` (``parallel.compile``) the layout's construction and its grouped
    attention run eagerly: both follow the batch's values (how many molecules, how long),
    and compiled they would be guarded on them and compiled anew for every batch. The
    layers around them compile once for every token count.
    """

    GROUPS = 4

    def __init__(self, document_ids: torch.Tensor, position_ids: torch.Tensor, row_multiple: int = 1):
        b, s = document_ids.shape
        dev = document_ids.device
        flat_doc = document_ids.reshape(-1)
        valid = flat_doc >= 0
        docs_per_row = (document_ids.max(dim=1).values + 1).clamp(min=0)
        first_doc = torch.cumsum(docs_per_row, 0) - docs_per_row
        num_docs = int(docs_per_row.sum())
        token = torch.nonzero(valid).squeeze(1)  # packed-row index of every real token
        doc = first_doc[token // s] + flat_doc[token]
        pos = position_ids.reshape(-1)[token]
        doc_len = torch.zeros(num_docs, dtype=torch.long, device=dev).scatter_reduce(
            0, doc, pos + 1, reduce="amax", include_self=True)
        by_len = torch.argsort(doc_len, stable=True)
        rank = torch.empty_like(by_len)
        rank[by_len] = torch.arange(num_docs, device=dev)
        # flat order: molecules by length, each molecule's tokens by position
        doc_start = torch.zeros(num_docs, dtype=torch.long, device=dev)
        doc_start[by_len] = torch.cumsum(doc_len[by_len], 0) - doc_len[by_len]
        flat_index = doc_start[doc] + pos
        t = len(token)
        rows = -(-t // row_multiple) * row_multiple  # flat rows: the real tokens, then fillers
        self.tokens, self.rows = t, rows
        self.packed_source = torch.zeros(rows, dtype=torch.long, device=dev)  # flat -> packed row index
        self.packed_source[flat_index] = token
        self.positions = pos.new_zeros(rows)
        self.positions[flat_index] = pos
        # where each packed-row token went (``rows``: a padding token, reads a zero row)
        self.token_source = torch.full((b * s,), rows, dtype=torch.long, device=dev)
        self.token_source[token] = flat_index
        # attention groups over molecules in length order
        self.groups = []  # (molecules, longest) per group
        slot_of = torch.zeros(rows, dtype=torch.long, device=dev)  # fillers read slot 0, never read back
        base = 0
        for g in (g for g in torch.tensor_split(by_len, min(self.GROUPS, max(1, num_docs))) if len(g)):
            longest = int(doc_len[g[-1]])
            self.groups.append((len(g), longest))
            in_group = (rank[doc] >= rank[g[0]]) & (rank[doc] <= rank[g[-1]])
            slot_of[flat_index[in_group]] = base + (rank[doc[in_group]] - rank[g[0]]) * longest + pos[in_group]
            base += len(g) * longest
        self.slots = base
        # slot -> flat token; a padded slot (after its molecule's end) reads token 0, and
        # causal attention keeps every real token clear of it
        self.slot_source = torch.zeros(base, dtype=torch.long, device=dev)
        self.slot_source[slot_of[:t]] = torch.arange(t, device=dev)
        self.slot_of = slot_of
        self.shape = (b, s)
        self.doc_lengths = doc_len

    @classmethod
    @torch.compiler.disable
    def of(cls, document_ids: torch.Tensor, position_ids: torch.Tensor, row_multiple: int = 1) -> "PackedLayout":
        """The layout of these packed rows, built once per pair of tensors: the layers of
        one pipeline stage receive the same (position_ids, document_ids) and share it."""
        key = (id(document_ids), document_ids._version, id(position_ids), position_ids._version, row_multiple)
        cached = getattr(document_ids, "_molds_layout", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        layout = cls(document_ids, position_ids, row_multiple)
        try:
            document_ids._molds_layout = (key, layout)
        except (AttributeError, RuntimeError):
            pass
        return layout

    def to_flat(self, t: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] in packed rows -> [T, ...] real tokens in flat order."""
        return t.reshape(self.shape[0] * self.shape[1], *t.shape[2:]).index_select(0, self.packed_source)

    def to_packed(self, t: torch.Tensor) -> torch.Tensor:
        """[T, ...] flat -> [B, S, ...] in packed rows (padding tokens get zeros)."""
        pad = t.new_zeros((1, *t.shape[1:]))
        return torch.cat([t, pad]).index_select(0, self.token_source).view(*self.shape, *t.shape[1:])

    @torch.compiler.disable
    def attend(self, q, k, v):
        """q [T, H, D], k and v [T, KV, D] -> [T, H, D], causal within each molecule."""
        if not self.groups:  # no real token at all
            return torch.zeros_like(q)
        sizes = [n * longest for n, longest in self.groups]
        # one gather per tensor for all groups (its backward is one scatter, not one per group)
        per_group = [t.index_select(0, self.slot_source).split(sizes) for t in (q, k, v)]
        outs = []
        for (n, longest), gq, gk, gv in zip(self.groups, *per_group):
            def per_molecule(t):  # [n, heads, longest, D]
                return t.view(n, longest, *t.shape[1:]).transpose(1, 2)

            o = causal_attention(per_molecule(gq), per_molecule(gk), per_molecule(gv))
            outs.append(o.transpose(1, 2).reshape(n * longest, o.shape[1], o.shape[3]))
        return torch.cat(outs).index_select(0, self.slot_of)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, intermediate_size: int | None = None):
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)
        self.act = swiglu  # an elementwise region (molds.kernels may fuse it)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Attention and an MLP, each pre-normed with a residual. ``layer_id`` is the block's
    global index (the name it has in checkpoints, whatever stage it runs on)."""

    def __init__(self, cfg: DecoderConfig, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, layout, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layout, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """``model.*`` of the HF layout: embeddings, blocks, final norm. ``make_layer(cfg, i)``
    builds block i (default: ``DecoderLayer``; ``molds.models.moe`` passes its own)."""

    def __init__(self, cfg: DecoderConfig, make_layer=None):
        super().__init__()
        make_layer = make_layer or DecoderLayer
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def part_seed(base: int, *key) -> int:
    """The seed of one part of a model (the embeddings, block i, the head): each part's
    initialization depends on the run's seed and the part's name only, so a model built
    whole and one built stage by stage (a pipeline) start from the same weights."""
    return int.from_bytes(hashlib.sha256(repr((base, *key)).encode()).digest()[:8], "little") % (2**63 - 1)


def init_part(module: nn.Module, std: float, base: int, *key) -> None:
    """Normal(0, std) for linear and embedding weights (RMSNorm weights stay 1), drawn from
    a generator seeded by ``part_seed(base, *key)``; a module with its own
    ``init_weights(std, base, key)`` (the experts) does it itself."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(part_seed(base, *key))
        for m in module.modules():
            if hasattr(m, "init_weights"):
                m.init_weights(std, base, key)
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)


def _to_empty(module: nn.Module, device) -> None:
    """``module.to_empty(device)``, keeping what engines attached to its parameters (the
    expert marks DeepSpeed reads: ``allreduce``, ``group_name``); ``to_empty`` makes new
    Parameter objects without them."""
    marks = {name: dict(p.__dict__) for name, p in module.named_parameters() if p.__dict__}
    module.to_empty(device=device)
    for name, p in module.named_parameters():
        p.__dict__.update(marks.get(name, {}))


def materialize_part(module: nn.Module, std: float, base: int, *key, device="cpu") -> bool:
    """Give a part built on the meta device (weights without storage) its storage on
    ``device`` and the weights the whole model would have given it: norms at one, the rest
    as ``init_part(module, std, base, *key)`` draws them (an empty ``key``: norms only).
    So a pipeline rank materializes its own stages only, and starts from the same weights
    as a model built whole. False (and nothing done) when nothing in it is on meta."""
    if not any(t.is_meta for t in module.parameters()):
        return False
    _to_empty(module, device)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
    if key:
        init_part(module, std, base, *key)
    return True


def materialize_weight(module: nn.Module, std: float, base: int, *key, device="cpu") -> bool:
    """``materialize_part`` for a module holding one bare ``weight`` (a pipeline stage's
    embedding or LM head): drawn as ``init_part`` draws the weight of the ``nn.Embedding``
    or ``nn.Linear`` with that key."""
    if not module.weight.is_meta:
        return False
    _to_empty(module, device)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(part_seed(base, *key))
        nn.init.normal_(module.weight, std=std)
    return True


class CausalDecoder(nn.Module):
    """The decoder. Built under ``torch.device("meta")`` (``build_model(device="meta")``)
    it holds no storage and draws nothing: each part is initialized when it is given
    storage (``materialize_part`` with its ``parts()`` key)."""

    def __init__(self, cfg: DecoderConfig, make_layer=None):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (the trainer takes it from the manifest's tokenizer)")
        self.config = cfg
        self.model = DecoderBody(cfg, make_layer)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.init_seed = base = torch.initial_seed()
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if self.lm_head.weight.is_meta:
            return  # nothing to draw: the parts are initialized as they are materialized
        for module, key in self.parts():
            init_part(module, cfg.initializer_range, base, *key)

    def parts(self):
        """(module, key) of every part with weights to draw, in the order they are drawn:
        the embeddings, each block, the LM head when it is not tied (the final norm is one)."""
        yield self.model.embed_tokens, ("embed",)
        for i, layer in enumerate(self.model.layers):
            yield layer, ("layer", i)
        if not self.config.tie_word_embeddings:
            yield self.lm_head, ("head",)

    def forward(self, input_ids, position_ids=None, document_ids=None, **_):
        """Logits [B, S, vocab]. Packed rows (``document_ids`` given) run on their real
        tokens only; padding positions get zero logits."""
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        layout = None
        if document_ids is not None:  # packed rows: run on the real tokens only
            layout = PackedLayout.of(document_ids, position_ids, self._row_multiple(input_ids.device))
            input_ids, position_ids = layout.to_flat(input_ids), layout.positions
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, layout)
        x = self.model.norm(x)
        if self.head_in_loss:
            return self.hidden_for_loss(x, layout)
        logits = self.lm_head(x)
        if layout is not None:
            logits = layout.to_packed(logits)
        return {"logits": logits}

    #: set by ``molds.kernels`` (``kernels.triton``): the forward returns what a loss with
    #: the LM head fused into it takes (``hidden_for_loss``) instead of logits
    head_in_loss = False

    def hidden_for_loss(self, x: torch.Tensor, layout) -> dict:
        """The final hidden states of the real tokens [T, H], where each sits in the
        flattened [B x S] positions (``token_index``), and the LM head's weight."""
        if layout is None:
            x = x.reshape(-1, x.shape[-1])
            index = torch.arange(x.shape[0], device=x.device)
        else:
            x, index = x[:layout.tokens], layout.packed_source[:layout.tokens]
        return {"hidden": x, "token_index": index, "lm_head_weight": self.lm_head.weight}

    CPU_BF16_ROW_MULTIPLE = 64

    def _row_multiple(self, device: torch.device) -> int:
        """Flat rows rounded up to a multiple of 64 on a CPU in bf16 (autocast, or
        weights cast by DeepSpeed), so its GEMM shapes repeat (see ``PackedLayout``); at
        most 63 filler rows, ~1.5 % of a 4,096-token micro-batch. MoE decoders keep the
        exact rows: their routing and load statistics must see real tokens only, and their
        expert GEMMs change shape with the routing anyway."""
        if device.type != "cpu" or self.config.moe is not None:
            return 1
        half = torch.is_autocast_enabled("cpu") or self.lm_head.weight.dtype in (torch.bfloat16, torch.float16)
        return self.CPU_BF16_ROW_MULTIPLE if half else 1

    def decode(self, input_ids: torch.Tensor, cache: list, start: int,
               offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Generation step with a key/value cache: ``input_ids`` [B, S] sit at positions
        ``start ..``, each row's moved back by its ``offsets`` [B] where given (a left-padded
        prompt: its first real token at position 0); returns the logits of the last position
        [B, vocab]. ``cache`` is a list with one dict per layer (empty dicts to start), or
        one object per layer that keeps and attends (``Attention``)."""
        b, s = input_ids.shape
        position_ids = torch.arange(start, start + s, device=input_ids.device).expand(b, s)
        if offsets is not None:
            position_ids = position_ids - offsets[:, None]
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer, layer_cache in zip(self.model.layers, cache):
            x = layer(x, cos, sin, None, layer_cache)
        return self.lm_head(self.model.norm(x[:, -1]))

    def flops_coefficients(self) -> dict[str, float]:
        """Training FLOPs (forward + backward) of a batch = the sum over its statistics of
        coefficient x statistic (the matrix products; norms and other elementwise work are
        left out): ``real_tokens`` x 6 x the weight matrices a token passes through (the
        embedding lookup excluded, the LM head included; an MoE layer counts its router, its
        shared expert and its top-k routed experts), ``length_sq_sum`` (the sum of squared
        molecule lengths) x 12 x layers x hidden (attention within each molecule).
        ``tests/test_flops.py`` holds them to ``torch.utils.flop_counter.FlopCounterMode``."""
        cfg = self.config
        active = sum(p.numel() for n, p in self.named_parameters()
                     if p.dim() >= 2 and "embed_tokens" not in n and ".experts." not in n)
        if cfg.tie_word_embeddings:
            active += self.lm_head.weight.numel()
        for layer in self.model.layers:
            if hasattr(layer, "routed_expert_params"):
                active += layer.routed_expert_params()
        return {"real_tokens": 6.0 * active, "length_sq_sum": 12.0 * cfg.num_layers * cfg.hidden_size}
