"""``molds-export CHECKPOINT OUT``: a checkpoint as a HuggingFace model directory.

Writes safetensors weights, ``config.json`` and the manifest's tokenizer, so that
``AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)``
load it with no molds installed. The decoder's parameter names are those of
``LlamaForCausalLM``; ZeRO checkpoints are consolidated to fp32 first
(DeepSpeed's ``zero_to_fp32``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys


def _state_dict(checkpoint: str, engine: str) -> dict:
    if engine == "zero":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(checkpoint, tag="deepspeed")
    from safetensors.torch import load_file

    return load_file(os.path.join(checkpoint, "model.safetensors"))


def llama_config(recipe: dict, vocab: dict, specials: dict):
    from transformers import LlamaConfig

    from molds.models.decoder import DecoderConfig

    m = recipe["model"]
    cfg = DecoderConfig(vocab_size=len(vocab), hidden_size=m["hidden_size"], num_layers=m["num_layers"],
                        num_heads=m["num_heads"], num_kv_heads=m["num_kv_heads"],
                        intermediate_size=m["intermediate_size"], max_position_embeddings=m["max_position_embeddings"],
                        rope_theta=m["rope_theta"])
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, hidden_act="silu", attention_bias=False, mlp_bias=False,
        head_dim=cfg.head_dim, bos_token_id=vocab[specials["bos_token"]], eos_token_id=vocab[specials["eos_token"]],
        pad_token_id=vocab[specials["pad_token"]])


def export(checkpoint: str, out: str) -> str:
    from molds.data.manifest import Manifest

    with open(os.path.join(checkpoint, "lineage.json")) as fh:
        lineage = json.load(fh)
    recipe = lineage["recipe"]
    if recipe["model"]["family"] != "decoder":
        raise ValueError(f"export of model.family={recipe['model']['family']!r} is not built yet")
    manifest = Manifest.load(recipe["data"]["manifest"])
    vocab = manifest.check_tokenizer()
    if manifest.data["tokenizer"]["vocab_hash"] != lineage["vocab_hash"]:
        raise ValueError(f"{checkpoint} was trained with another tokenizer than {manifest.path} now holds")
    from transformers import LlamaForCausalLM

    config = llama_config(recipe, vocab, manifest.data["tokenizer"]["special_tokens"])
    state = _state_dict(checkpoint, lineage.get("engine", "ddp"))
    if config.tie_word_embeddings:  # safetensors keeps one name of a tied pair
        tied = state.get("model.embed_tokens.weight", state.get("lm_head.weight"))
        state["model.embed_tokens.weight"] = tied
        state.pop("lm_head.weight", None)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint and LlamaForCausalLM disagree: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok_src = manifest.tokenizer_path
    for name in os.listdir(tok_src):
        shutil.copy(os.path.join(tok_src, name), os.path.join(tmp, name))
    with open(os.path.join(tmp, "molds_lineage.json"), "w") as fh:
        json.dump(lineage, fh, indent=2)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="molds-export", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a checkpoint directory (runs/NAME/checkpoints/step-N)")
    ap.add_argument("out", help="output directory for the HuggingFace model")
    args = ap.parse_args(argv)
    print(export(args.checkpoint, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
