"""Causal decoder for SMILES generation (Llama-style: RMSNorm, RoPE, SwiGLU, GQA).

Single-device code that knows nothing of parallelism. Parameter names and the math
match ``transformers.LlamaForCausalLM``, so a checkpoint exports to it as is
(``molds.export``). The blocks are a plain ``ModuleList`` so a pipeline engine can cut
the model into stages between them.

Packed rows: pass ``position_ids`` (restarting per molecule) and ``document_ids`` (-1
on padding): attention is causal *within* each molecule only (``PackedLayout``), so a
packed row computes exactly what each molecule alone would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..data.packing import IGNORE_INDEX


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    freqs = position_ids[..., None].float() * inv_freq  # [B, S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, S, D]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, layout):
        b, s, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(b, s, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        groups = cfg.num_heads // cfg.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if layout is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        else:
            out = layout.attend(q, k, v)
        return self.o_proj(out.reshape(b, s, -1))


class PackedLayout:
    """Packed rows rearranged so that every molecule is its own sequence.

    Molecules are sorted by length and cut into a few groups; the model runs on a flat
    "slot" sequence, group after group, each group [molecules, longest in the group]
    right-padded. Embeddings are gathered into slots once, the loss is taken in slots,
    and logits are gathered back once: the layers themselves never gather. Attention
    is plain causal SDPA per group, so no molecule sees another, its cost follows the
    molecules' own lengths (not seq_len squared), and every real token gets exactly
    the block-diagonal causal attention of ``molds.data.packing.block_causal_mask``.
    Padded slots carry no loss and nobody attends to them.
    """

    GROUPS = 4

    def __init__(self, document_ids: torch.Tensor, position_ids: torch.Tensor):
        b, s = document_ids.shape
        dev = document_ids.device
        valid = (document_ids >= 0).reshape(-1)
        docs_per_row = (document_ids.max(dim=1).values + 1).clamp(min=0)
        first_doc = torch.cumsum(docs_per_row, 0) - docs_per_row
        num_docs = int(docs_per_row.sum())
        token = torch.nonzero(valid).squeeze(1)  # flat index of every real token
        doc = first_doc[token // s] + document_ids.reshape(-1)[token]
        pos = position_ids.reshape(-1)[token]
        doc_len = torch.zeros(num_docs, dtype=torch.long, device=dev).scatter_reduce(
            0, doc, pos + 1, reduce="amax", include_self=True)
        order = torch.argsort(doc_len, stable=True)
        groups = [g for g in torch.tensor_split(order, min(self.GROUPS, max(1, num_docs))) if len(g)]
        self.groups = []  # (molecules, longest) per group, in slot order
        doc_base = torch.zeros(num_docs, dtype=torch.long, device=dev)
        positions = []
        base = 0
        for g in groups:
            longest = int(doc_len[g].max())
            doc_base[g] = base + torch.arange(len(g), device=dev) * longest
            self.groups.append((len(g), longest))
            positions.append(torch.arange(longest, device=dev).repeat(len(g)))
            base += len(g) * longest
        slot = doc_base[doc] + pos
        self.slots = base
        self.slot_positions = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long, device=dev)
        # gathers with one extra row standing for "nothing here": padded slots read it
        # going in, padding tokens coming out
        self.slot_source = torch.full((base,), b * s, dtype=torch.long, device=dev)
        self.slot_source[slot] = token
        self.token_source = torch.full((b * s,), base, dtype=torch.long, device=dev)
        self.token_source[token] = slot
        self.shape = (b, s)

    def to_slots(self, t: torch.Tensor, fill) -> torch.Tensor:
        """[B, S, ...] in packed rows -> [slots, ...]; padded slots get ``fill``."""
        flat = t.reshape(self.shape[0] * self.shape[1], *t.shape[2:])
        pad = flat.new_full((1, *flat.shape[1:]), fill)
        return torch.cat([flat, pad]).index_select(0, self.slot_source)

    def to_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """[slots, ...] -> [B, S, ...] in packed rows (padding tokens get zeros)."""
        pad = t.new_zeros((1, *t.shape[1:]))
        return torch.cat([t, pad]).index_select(0, self.token_source).view(*self.shape, *t.shape[1:])

    def attend(self, q, k, v):
        """q, k, v: [1, H, slots, D] -> [1, slots, H, D], causal within each molecule."""
        h, d = q.shape[1], q.shape[3]
        sizes = [n * longest for n, longest in self.groups]
        outs = []
        for (n, longest), gq, gk, gv in zip(self.groups, *(t[0].split(sizes, dim=1) for t in (q, k, v))):
            def per_molecule(t):
                return t.reshape(h, n, longest, d).transpose(0, 1)

            o = F.scaled_dot_product_attention(per_molecule(gq), per_molecule(gk), per_molecule(gv), is_causal=True)
            outs.append(o.permute(0, 2, 1, 3).reshape(n * longest, h, d))
        return torch.cat(outs)[None]


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, layout):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layout)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """``model.*`` of the HF layout: embeddings, blocks, final norm."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalDecoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (the trainer takes it from the manifest's tokenizer)")
        self.config = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _init(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)

    def forward(self, input_ids, position_ids=None, document_ids=None, labels=None, **_):
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        layout = None
        if document_ids is not None:  # packed rows: run on one molecule-per-sequence slot layout
            layout = PackedLayout(document_ids, position_ids)
            input_ids, position_ids = layout.to_slots(input_ids, 0)[None], layout.slot_positions[None]
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, layout)
        logits = self.lm_head(self.model.norm(x))
        loss = None
        if labels is not None:
            # the same (prediction, target) pairs in either layout: targets across a
            # molecule boundary and on padding are IGNORE_INDEX
            loss = causal_lm_loss(logits, labels if layout is None else layout.to_slots(labels, IGNORE_INDEX)[None])
        if layout is not None:
            logits = layout.to_tokens(logits[0])
        return {"logits": logits, "loss": loss}

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x parameters (embeddings excluded) + attention."""
        cfg = self.config
        params = sum(p.numel() for n, p in self.named_parameters() if "embed_tokens" not in n)
        if cfg.tie_word_embeddings:
            params += self.lm_head.weight.numel()
        return 6 * params + 12 * cfg.num_layers * cfg.hidden_size * seq_len


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, HF convention: position i predicts labels[i + 1]."""
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    shift_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX)
