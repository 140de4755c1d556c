"""Model families, one file each, single-device code; parallelism is applied from outside.

``build_model`` is the one model factory: training, evaluation, sampling, export and
the checkpoint opener all build a network from (the recipe's ``model`` section, the
tokenizer artifact) through it; ``molds.checkpoint.open_checkpoint`` then loads a
checkpoint's canonical weights into it. Kernel converters (``molds.kernels``) are
applied by the caller that wants them, after construction.

May import the packages below it in molds' stack: ``errors``, ``runtime``, ``chemistry``,
``recipe``, ``data``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..chemistry.features import feature_set
from ..recipe.sections import ModelConfig
from .decoder import CausalDecoder, DecoderConfig
from .moe import MoEConfig, make_moe_layer
from .seq2seq import Seq2SeqConfig, Seq2SeqModel


def _as_dict(model) -> dict:
    if dataclasses.is_dataclass(model):
        return dataclasses.asdict(model)
    # a recipe stored by an older molds may lack newer keys: their defaults apply
    return {**dataclasses.asdict(ModelConfig()), **model}


def family_config(model, tokenizer):
    """The family's own config from the recipe's ``model`` section (a dataclass or its
    dict, as stored in checkpoint lineage) and the tokenizer (``TokenizerInfo``)."""
    m = _as_dict(model)
    common = dict(vocab_size=tokenizer.vocab_size, hidden_size=m["hidden_size"], num_layers=m["num_layers"],
                  num_heads=m["num_heads"], intermediate_size=m["intermediate_size"],
                  max_position_embeddings=m["max_position_embeddings"])
    if m["family"] == "decoder":
        moe = None
        if m.get("num_experts"):
            moe = MoEConfig.from_model_section(m)
        return DecoderConfig(num_kv_heads=m["num_kv_heads"], rope_theta=m["rope_theta"],
                             tie_word_embeddings=m.get("tie_embeddings", True), moe=moe, qk_norm=moe is not None,
                             **common)
    if m["family"] == "encoder":
        from .encoder import EncoderConfig  # here: a rank that only trains loads no transformers or SciPy

        return EncoderConfig(dropout=m["dropout"], num_tasks=m["num_tasks"], task_type=m["task_type"],
                             pooling=pooling_of(m),
                             molecule_features=feature_set(m.get("molecule_features")),
                             num_features=_feature_width(feature_set(m.get("molecule_features"))),
                             pad_token_id=tokenizer.pad, bos_token_id=tokenizer.bos, eos_token_id=tokenizer.eos,
                             **common)
    if m["family"] == "seq2seq":
        return Seq2SeqConfig(vocab_size=tokenizer.vocab_size, hidden_size=m["hidden_size"],
                             encoder_layers=m["num_layers"], decoder_layers=m.get("decoder_layers") or m["num_layers"],
                             num_heads=m["num_heads"], intermediate_size=m["intermediate_size"] or 4 * m["hidden_size"],
                             max_position_embeddings=m["max_position_embeddings"], dropout=m["dropout"],
                             pad_token_id=tokenizer.pad)
    raise ValueError(f"unknown model.family {m['family']!r}")


def pooling_of(model) -> str:
    """What an encoder's property heads read, ``bos`` or ``mean``: ``model.pooling``, with
    ``auto`` resolved by the task (the mean of the tokens for regression heads that also read
    molecule features, the first token otherwise)."""
    m = _as_dict(model)
    pooling = m.get("pooling", "bos")  # checkpoints written before it: the first token
    if pooling != "auto":
        return pooling
    return "mean" if m["task_type"] == "regression" and feature_set(m.get("molecule_features")) else "bos"


def _feature_width(kind: str) -> int:
    if not kind:
        return 0
    from ..chemistry.features import feature_names  # here: a model without features loads no RDKit

    return len(feature_names(kind))


def build_model(model, tokenizer, *, seed: int = 0, device=None):
    """The network a recipe's ``model`` section describes, initialized from ``seed``
    (the same on every rank: replicas start equal). ``device="meta"`` (decoders): the
    structure without storage, for an engine that materializes only its own part of it
    (the pipeline's stages, ``molds.models.decoder.materialize_part``)."""
    cfg = family_config(model, tokenizer)
    torch.manual_seed(seed)
    if isinstance(cfg, _decoder_config()):
        with torch.device(device) if device is not None else contextlib.nullcontext():
            if cfg.moe is not None:
                return CausalDecoder(cfg, make_layer=make_moe_layer)
            return CausalDecoder(cfg)
    if device is not None and str(device) != "cpu":
        raise ValueError(f"the {cfg.__class__.__name__} is built on the CPU only (asked: {device})")
    if isinstance(cfg, Seq2SeqConfig):
        return Seq2SeqModel(cfg)
    from .encoder import MoleculeEncoder  # here: a rank that only trains loads no transformers or SciPy

    return MoleculeEncoder(cfg)


def _decoder_config():
    return DecoderConfig


def count_parameters(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
