"""Model families, one file each, single-device code; parallelism is applied from outside."""

from __future__ import annotations

import dataclasses


def family_config(model: dict, vocab_size: int, specials: dict | None = None):
    """The family's own config from the recipe's ``model`` section (a dict, as stored in
    checkpoint lineage): the one mapping that training and export share."""
    sp = specials or {"pad": 0, "bos": 2, "eos": 3}
    common = dict(vocab_size=vocab_size, hidden_size=model["hidden_size"], num_layers=model["num_layers"],
                  num_heads=model["num_heads"], intermediate_size=model["intermediate_size"],
                  max_position_embeddings=model["max_position_embeddings"])
    if model["family"] == "decoder":
        from .decoder import DecoderConfig

        return DecoderConfig(num_kv_heads=model["num_kv_heads"], rope_theta=model["rope_theta"], **common)
    if model["family"] == "encoder":
        from .encoder import EncoderConfig

        return EncoderConfig(dropout=model["dropout"], num_tasks=model["num_tasks"], task_type=model["task_type"],
                             pad_token_id=sp["pad"], bos_token_id=sp["bos"], eos_token_id=sp["eos"], **common)
    raise ValueError(f"unknown model.family {model['family']!r}")


def build_model(recipe, vocab_size: int, specials: dict | None = None):
    """The network a recipe describes, freshly initialized from ``run.seed``."""
    import torch

    cfg = family_config(dataclasses.asdict(recipe.model), vocab_size, specials)
    torch.manual_seed(recipe.run.seed)
    if recipe.model.family == "decoder":
        from .decoder import CausalDecoder

        cfg.compile_regions = recipe.kernels.compile_regions
        return CausalDecoder(cfg)
    from .encoder import MoleculeEncoder

    return MoleculeEncoder(cfg)
