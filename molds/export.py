"""``molds-export CHECKPOINT OUT``: a checkpoint as a HuggingFace model directory.

Writes safetensors weights, ``config.json`` and the manifest's tokenizer, so that
``AutoModelForCausalLM`` (decoder), ``AutoModelForMaskedLM`` (encoder) or
``AutoModelForSequenceClassification`` (encoder with property heads) and
``AutoTokenizer`` load it with no molds installed. Parameter names already match those
classes; ZeRO checkpoints are consolidated to fp32 first (DeepSpeed's ``zero_to_fp32``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys


def checkpoint_state_dict(checkpoint: str, engine: str) -> dict:
    """The weights of a checkpoint (ZeRO ones consolidated to fp32), by parameter name."""
    if engine == "zero":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(checkpoint, tag="deepspeed")
    from safetensors.torch import load_file

    return load_file(os.path.join(checkpoint, "model.safetensors"))


def special_ids(vocab: dict, special_tokens: dict) -> dict:
    return {k: vocab[special_tokens[f"{k}_token"]] for k in ("pad", "bos", "eos")}


def llama_config(recipe: dict, vocab: dict, special_tokens: dict):
    from transformers import LlamaConfig

    from molds.models import family_config

    sp = special_ids(vocab, special_tokens)
    cfg = family_config(recipe["model"], len(vocab), sp)
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, hidden_act="silu", attention_bias=False, mlp_bias=False,
        head_dim=cfg.head_dim, bos_token_id=sp["bos"], eos_token_id=sp["eos"], pad_token_id=sp["pad"])


def _load_strict(model, state: dict, allowed_missing=()):
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in allowed_missing]
    if missing or unexpected:
        raise ValueError(f"checkpoint and {type(model).__name__} disagree: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


def _decoder_model(recipe, vocab, manifest, state):
    from transformers import LlamaForCausalLM

    config = llama_config(recipe, vocab, manifest.data["tokenizer"]["special_tokens"])
    if config.tie_word_embeddings:  # safetensors keeps one name of a tied pair
        state["model.embed_tokens.weight"] = state.get("model.embed_tokens.weight", state.get("lm_head.weight"))
        state.pop("lm_head.weight", None)
    return _load_strict(LlamaForCausalLM(config), state, ("lm_head.weight",))


def _encoder_model(recipe, vocab, manifest, state):
    """RobertaForSequenceClassification when the model has property heads, else
    RobertaForMaskedLM."""
    from transformers import RobertaForMaskedLM, RobertaForSequenceClassification

    from molds.models import family_config

    m = recipe["model"]
    cfg = family_config(m, len(vocab), special_ids(vocab, manifest.data["tokenizer"]["special_tokens"]))
    pair = ("mlm.lm_head.decoder.weight", "mlm.roberta.embeddings.word_embeddings.weight")
    shared = state.get(pair[0], state.get(pair[1]))  # tied: safetensors keeps one of the two names
    for name in pair:
        state[name] = shared
    if m["num_tasks"]:
        wanted = {k[len("mlm."):]: v for k, v in state.items() if k.startswith("mlm.roberta.")}
        wanted.update({k: v for k, v in state.items() if k.startswith("classifier.")})
        return _load_strict(RobertaForSequenceClassification(cfg.hf_config()), wanted)
    wanted = {k[len("mlm."):]: v for k, v in state.items() if k.startswith("mlm.")}
    return _load_strict(RobertaForMaskedLM(cfg.hf_config()), wanted, ("lm_head.decoder.bias",))


def export(checkpoint: str, out: str) -> str:
    from molds.data.manifest import Manifest

    with open(os.path.join(checkpoint, "lineage.json")) as fh:
        lineage = json.load(fh)
    recipe = lineage["recipe"]
    manifest = Manifest.load(recipe["data"]["manifest"])
    vocab = manifest.check_tokenizer()
    if manifest.data["tokenizer"]["vocab_hash"] != lineage["vocab_hash"]:
        raise ValueError(f"{checkpoint} was trained with another tokenizer than {manifest.path} now holds")
    state = {k: v.float() for k, v in checkpoint_state_dict(checkpoint, lineage.get("engine", "ddp")).items()}
    if recipe["model"]["family"] == "decoder":
        model = _decoder_model(recipe, vocab, manifest, state)
    else:
        model = _encoder_model(recipe, vocab, manifest, state)
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
