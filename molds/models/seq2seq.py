"""The encoder-decoder family (BART's architecture), for pair tasks: a bidirectional encoder
reads the source, a causal decoder writes the target while attending to it.

Why BART's exact architecture: Chemformer is a BART, and a model a user can load as
transformers' ``BartForConditionalGeneration`` (and decode with its ``generate``) should
give the logits molds gives. So the layers are BART's, named as transformers names them
(the export copies the weights one to one): learned absolute positions (offset by 2),
LayerNorm after each residual block (post-LN), a LayerNorm on the embeddings, GELU MLPs,
biased projections, the output tied to the shared embeddings plus a bias that stays zero.

Single-device code; parallelism and the loss are applied from outside. Batches are right
padded: ``attention_mask`` marks the source's real tokens; the decoder input is
``<bos> target`` and predicts ``target <eos>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Seq2SeqConfig:
    vocab_size: int
    hidden_size: int = 256
    encoder_layers: int = 4
    decoder_layers: int = 4
    num_heads: int = 8
    intermediate_size: int = 1024
    max_position_embeddings: int = 512
    dropout: float = 0.1
    scale_embedding: bool = False
    pad_token_id: int = 0
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size {self.hidden_size} is not a multiple of model.num_heads "
                             f"{self.num_heads}")


class Attention(nn.Module):
    """Multi-head attention with biased projections; keys and values from ``memory`` when
    given (cross-attention), with an optional cache for generation."""

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        d = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_heads, d // cfg.num_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x, mask=None, memory=None, cache: dict | None = None, causal: bool = False):
        q = self._split(self.q_proj(x))
        if memory is not None and cache is not None and "k" in cache:  # cross-attention: keys computed once
            k, v = cache["k"], cache["v"]
        else:
            src = x if memory is None else memory
            k, v = self._split(self.k_proj(src)), self._split(self.v_proj(src))
            if cache is not None:
                if memory is None and "k" in cache:  # self-attention: append this step's keys
                    k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
                cache["k"], cache["v"] = k, v
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
        b, _, s, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, s, -1))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = Attention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc1, self.fc2 = nn.Linear(d, cfg.intermediate_size), nn.Linear(cfg.intermediate_size, d)
        self.final_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.dropout = cfg.dropout

    def forward(self, x, mask):
        x = self.self_attn_layer_norm(x + F.dropout(self.self_attn(x, mask), self.dropout, self.training))
        h = self.fc2(F.gelu(self.fc1(x)))
        return self.final_layer_norm(x + F.dropout(h, self.dropout, self.training))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        d = cfg.hidden_size
        self.self_attn, self.encoder_attn = Attention(cfg), Attention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.encoder_attn_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc1, self.fc2 = nn.Linear(d, cfg.intermediate_size), nn.Linear(cfg.intermediate_size, d)
        self.final_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.dropout = cfg.dropout

    def forward(self, x, self_mask, memory, memory_mask, cache: dict | None = None):
        drop = self.dropout if self.training else 0.0
        own = None if cache is None else cache.setdefault("self", {})
        cross = None if cache is None else cache.setdefault("cross", {})
        causal = self_mask is None and (cache is None or "k" not in own)
        x = self.self_attn_layer_norm(x + F.dropout(self.self_attn(x, self_mask, cache=own, causal=causal), drop))
        x = self.encoder_attn_layer_norm(x + F.dropout(self.encoder_attn(x, memory_mask, memory, cross), drop))
        h = self.fc2(F.gelu(self.fc1(x)))
        return self.final_layer_norm(x + F.dropout(h, drop))


class Stack(nn.Module):
    """BART's encoder or decoder: embeddings (shared), positions, a LayerNorm, the layers."""

    def __init__(self, cfg: Seq2SeqConfig, shared: nn.Embedding, layer, count: int):
        super().__init__()
        self.embed_tokens = shared
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + 2, cfg.hidden_size)
        self.layernorm_embedding = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(layer(cfg) for _ in range(count))
        self.scale = math.sqrt(cfg.hidden_size) if cfg.scale_embedding else 1.0
        self.dropout = cfg.dropout

    def embed(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        positions = torch.arange(start, start + ids.shape[1], device=ids.device) + 2  # BART's offset
        x = self.embed_tokens(ids) * self.scale + self.embed_positions(positions)[None]
        return F.dropout(self.layernorm_embedding(x), self.dropout, self.training)


class Body(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.shared = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.encoder = Stack(cfg, self.shared, EncoderLayer, cfg.encoder_layers)
        self.decoder = Stack(cfg, self.shared, DecoderLayer, cfg.decoder_layers)


def _key_mask(attention_mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """[B, S] (1: a real token) -> an additive mask [B, 1, 1, S] over the keys."""
    if attention_mask is None:
        return None
    return torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device).masked_fill(
        attention_mask == 0, torch.finfo(dtype).min)[:, None, None, :]


class Seq2SeqModel(nn.Module):
    """``forward(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask)`` ->
    ``{"logits": [B, T, vocab]}``; ``encode`` and ``decode`` step by step for generation."""

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.model.shared.weight  # tied, as BART ties them
        self.register_buffer("final_logits_bias", torch.zeros(1, cfg.vocab_size))
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self, std: float | None = None) -> None:
        """BART's scheme at a width-aware scale: normal weights for the projections, the
        embeddings and positions, zero biases and a zero padding row; LayerNorms at one and
        zero. The standard deviation is 1/sqrt(hidden) (LeCun's), not BART's fixed
        ``init_std`` 0.02, which suits its width of 1024 (1/sqrt = 0.031) but starves a narrow
        model: at width 128, BART's 0.02 (transformers' own model as much as this one) had
        not begun to learn to copy a 30-token sequence after 400 steps, where 1/sqrt(128)
        learned it in 110 and the decoder family in 80 (``benchmarks/copy_probe.py``), and
        reaction prediction, mostly copying, lagged the decoder far behind. PyTorch's defaults
        (unit-variance embeddings, tied to the output) would start the loss far above the
        vocabulary's log-size."""
        std = self.config.hidden_size ** -0.5 if std is None else std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
                if module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        enc = self.model.encoder
        x = enc.embed(input_ids)
        mask = _key_mask(attention_mask, x.dtype)
        for layer in enc.layers:
            x = layer(x, mask)
        return x

    def _decode(self, ids, memory, memory_mask, self_mask=None, cache=None, start=0):
        dec = self.model.decoder
        x = dec.embed(ids, start)
        for i, layer in enumerate(dec.layers):
            x = layer(x, self_mask, memory, memory_mask, None if cache is None else cache[i])
        return self.lm_head(x) + self.final_logits_bias

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None, **_):
        memory = self.encode(input_ids, attention_mask)
        self_mask = None
        if decoder_attention_mask is not None:  # causal and over the target's real tokens
            t = decoder_input_ids.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool, device=memory.device).tril()
            keep = causal[None, None] & (decoder_attention_mask[:, None, None, :] != 0)
            self_mask = torch.zeros(keep.shape, dtype=memory.dtype, device=memory.device).masked_fill(
                ~keep, torch.finfo(memory.dtype).min)
        return {"logits": self._decode(decoder_input_ids, memory, _key_mask(attention_mask, memory.dtype),
                                       self_mask)}

    def flops_coefficients(self) -> dict[str, float]:
        """Training FLOPs of a batch = the sum over its statistics of coefficient x statistic
        (the matrix products), for rows of source length s and target length t:
        ``source_tokens`` (the sum of s) x 6 x the weight matrices a source token passes
        through (the encoder's, and the keys and values of each decoder layer's
        cross-attention), ``target_tokens`` (the sum of t) x 6 x the decoder's other weight
        matrices and the LM head (tied to the embeddings), ``source_sq_sum`` (the sum of s^2)
        x 12 x hidden x encoder layers (self-attention), ``decoder_sq_sum`` (the sum of
        t^2 + t s) x 12 x hidden x decoder layers (self- and cross-attention)."""
        cfg = self.config

        def matrices(module, keep=lambda n: True) -> int:
            return sum(p.numel() for n, p in module.named_parameters() if p.dim() >= 2 and "embed" not in n
                       and keep(n))

        def cross_kv(n: str) -> bool:
            return ".encoder_attn.k_proj." in f".{n}" or ".encoder_attn.v_proj." in f".{n}"

        source = matrices(self.model.encoder) + matrices(self.model.decoder, cross_kv)
        target = matrices(self.model.decoder, lambda n: not cross_kv(n)) + self.lm_head.weight.numel()
        return {"source_tokens": 6.0 * source, "target_tokens": 6.0 * target,
                "source_sq_sum": 12.0 * cfg.hidden_size * cfg.encoder_layers,
                "decoder_sq_sum": 12.0 * cfg.hidden_size * cfg.decoder_layers}

    def new_cache(self) -> list[dict]:
        return [{} for _ in self.model.decoder.layers]

    def decode(self, ids: torch.Tensor, memory: torch.Tensor, memory_mask, cache: list[dict], start: int):
        """Generation: ``ids`` [B, S] at target positions ``start ..``, keys and values kept in
        ``cache``; the logits of the last position [B, vocab]."""
        return self._decode(ids, memory, memory_mask, None, cache, start)[:, -1]
