"""Model families, one file each, single-device code; parallelism is applied from outside."""


def build_model(recipe, vocab_size: int):
    """The network a recipe describes, freshly initialized from ``run.seed``."""
    import torch

    m = recipe.model
    torch.manual_seed(recipe.run.seed)
    if m.family == "decoder":
        from .decoder import CausalDecoder, DecoderConfig

        return CausalDecoder(DecoderConfig(
            vocab_size=vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads, intermediate_size=m.intermediate_size,
            max_position_embeddings=m.max_position_embeddings, rope_theta=m.rope_theta))
    raise ValueError(f"model.family={m.family!r} is not built yet (the encoder lands with its issue)")
