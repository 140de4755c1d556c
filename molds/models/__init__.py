"""Model families, one file each, single-device code; parallelism is applied from outside."""


def build_model(recipe, vocab_size: int, specials: dict | None = None):
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
    if m.family == "encoder":
        from .encoder import EncoderConfig, MoleculeEncoder

        sp = specials or {"pad": 0, "bos": 2, "eos": 3}
        return MoleculeEncoder(EncoderConfig(
            vocab_size=vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
            intermediate_size=m.intermediate_size, max_position_embeddings=m.max_position_embeddings,
            dropout=m.dropout, num_tasks=m.num_tasks, task_type=m.task_type, pad_token_id=sp["pad"],
            bos_token_id=sp["bos"], eos_token_id=sp["eos"]))
    raise ValueError(f"unknown model.family {m.family!r}")
